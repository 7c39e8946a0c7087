"""deepwell.kvclient — the engine's client of the KV-cache daemon (no torch, no server code).

- ``KVClient``: attach (session stream = liveness), reserve/commit/abort, lookup(+pin),
  release, take/readd/drop, delete, stats; retries with op ids; circuit breaker.
- ``ArenaMap``: the mmap'd arena and ``copy_in``/``copy_out`` over extent lists.
- ``Result``/``Code``: every call's typed outcome; any non-OK code means "miss".
"""

from .arena import ArenaMap, as_extents
from .client import KVClient, encode_tokens
from .types import Code, Result

__all__ = ["ArenaMap", "Code", "KVClient", "Result", "as_extents", "encode_tokens"]
