"""Prefix reuse: the cache of sequences between the scheduler and the block manager.

- ``index``: token ledgers, chained page digests (shortlist) and exact matching;
- ``types``: reuse levels, entry kinds, entries, hits, restores, counters;
- ``resident``: ``PrefixCache``, the entries kept on the device (levels 1, 2 and 5 of
  docs/architecture.md "Prefix reuse"), their lookup, adoption, retention and eviction;
- ``host``: ``HostTier``, spill to and restore from the KV-cache daemon (levels 3 and 4), the
  only module that talks to the daemon, on its own worker thread and copy stream;
- ``identity``: the model / layout fingerprint and the layout of an entry's bytes.

The scheduler asks the cache for a reuse plan when it admits a request (``lookup`` +
``adopt``: the request then starts at ``num_computed = r`` and catches up like any other),
hands it every sequence that ends (``retire``) and every checkpoint a step takes
(``checkpoint``), and asks it for room (``room``: LRU eviction) when pages or state slots
run short. Nothing here touches tensors: the engine performs the copies a ``Restore`` names.
"""
