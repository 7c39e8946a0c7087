"""``PrefixCache``: sequences kept on the GPU after they end, and the lookup that reuses them.

Entries
-------
An entry is a token ledger (its tokens, exact), the KV pages covering them (shared by
reference with whoever else holds them: ``BlockManager.share``), and for hybrid models one
state image: a state slot holding the recurrent + conv state after exactly ``len(ledger)``
tokens. Entries never change; they are created, used and dropped. Kinds:

- ``EXEC``: a sequence that ended (finished, cancelled between steps, preempted): its computed
  tokens (prompt + generated but the last sampled token) and its running slot as the image;
- ``TURN``: a checkpoint at a request's ``turn_boundary`` (where the last turn's prompt ends,
  before the generation prologue), taken while the request runs;
- ``PREFIX``: a checkpoint at a request's ``prefix_boundary`` (the end of the system-and-tools
  block several sessions share).

Lookup (``lookup``)
-------------------
For a prompt, the longest usable reuse among entries of the same scope (tenant + metadata
digest): for a hybrid model an entry whose whole ledger is a prefix of the prompt (its state
image is the only point its recurrent state exists at); for an attention-only model any
entry, cut at its longest common prefix with the prompt. Reuse is always shorter than the
prompt (one token at least is computed, so logits exist). Candidates come from the page
digest index (``cache.index``); the winner is confirmed on exact tokens. The level it is
counted under (``CacheHits``):

- ``shared_prefix``: a ``PREFIX`` entry, or an entry of another session key;
- ``resident_frontier``: an ``EXEC`` entry reused whole (the conversation simply continues);
- ``resident_checkpoint``: a ``TURN`` entry, or an attention-only cut inside a ledger.

``adopt`` then gives the request the entry's whole pages by reference, pins the page cut
inside (the engine copies it into the request's own page: copy-on-write) and the state image
(the engine copies it into the request's slot); the request starts at ``num_computed = r``.

Retention and eviction
----------------------
- A new entry whose exact ledger already exists is not kept (the old one is touched).
- A new entry supersedes the ``EXEC`` entries whose ledger is a strict prefix of its own.
- Checkpoint chains: a ``TURN`` entry drops its ``TURN`` ancestors (entries whose ledger is a
  prefix of its own) except *anchors*, of which the newest ``anchors_kept`` stay. A checkpoint
  is an anchor when the request that took it did not continue its conversation's latest
  checkpoint: no reuse, a shared prefix, or a *branch* (some ``TURN`` entry agreed with its
  prompt beyond the reuse point). This keeps what Qwen3.5-style templates need: they drop the
  empty ``<think></think>`` of the assistant turns after the last user query once a new user
  message arrives, so across a new user turn the prompt diverges right after the previous user
  query, and only the checkpoint taken by the first request after it (an anchor) still matches;
  within a tool loop each request extends the previous checkpoint (not an anchor, replaced).
- Eviction takes whole entries when a request needs pages or slots (``room``), by rank then
  LRU (``Entry.keep_rank``): first ended sequences a checkpoint of their own covers (losing one
  costs at most its generated tokens; with thinking stripped from the history they are never
  reused at all), then the rest, last the anchors and shared prefixes. With a host tier each
  is spilled first. An entry is never taken from a running request, which holds its own
  references (pages, pinned image).

- With a host tier (``cache.host``) an evicted entry is *spilling*: still allocated and
  matchable until its spill is done (``poll`` then frees it and remembers it in a shadow index,
  ``host_hint``); ``room`` counts what spills in flight free and waits for them; ``keep_free``
  spills ahead to keep a few slots and pages free; ``trim`` keeps entries within the resident
  budget (``max_pages``).

The whole state machine, with the host tier's edges, is drawn in docs/architecture.md
("The resident cache"). A failed step's sequences are never retained (their pages and state
may be half written).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from deepwell.logs import get_logger
from deepwell.engine_service.block_manager import BlockManager, pages_for
from deepwell.engine_service.cache.index import Ledger, MatchIndex, Owner, common_prefix, is_prefix
from deepwell.engine_service.cache.types import (
    CHEAP_GAP,
    SHADOW_ENTRIES,
    CacheCounters,
    Entry,
    Hit,
    Kind,
    Level,
    Restore,
)

if TYPE_CHECKING:
    from deepwell.engine_service.cache.host import HostTier

log = get_logger(__name__)


@dataclass
class _Spilling:
    """An evicted entry whose spill is in flight: its memory is freed when ``future`` is done."""

    entry: Entry
    future: Future[bool]
    pages: int  # pages only it held: free then
    slots: int


class PrefixCache:
    def __init__(self, blocks: BlockManager, *, hybrid: bool, anchors_kept: int = 4,
                 host: HostTier | None = None, max_pages: int | None = None) -> None:
        if anchors_kept < 1:
            raise ValueError(f"anchors_kept must be >= 1, got {anchors_kept}")
        self.blocks = blocks
        self.max_pages = blocks.num_pages if max_pages is None else max_pages  # the resident budget
        self.host = host  # spill-before-evict and restores (levels 3 and 4); None: device only
        self.page_size = blocks.page_size
        self.hybrid = hybrid
        self.anchors_kept = anchors_kept
        self.entries: dict[int, Entry] = {}
        self.counters = CacheCounters()
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._index = MatchIndex()
        self._exact: dict[bytes, int] = {}
        self._by_kind: dict[tuple[bytes, Kind], set[int]] = {}
        self._ids = itertools.count(1)
        self._rank: dict[int, int] = {}  # entry id -> recency tick
        self._tick = 0
        self._spilling: list[_Spilling] = []
        # what this engine spilled (the daemon may have evicted some since): admission asks the
        # daemon only when these reach further than the device (host_hint)
        self._shadow: dict[int, Entry] = {}
        self._shadow_index = MatchIndex()

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, ledger: Ledger, owner: Owner) -> Hit | None:
        """The longest usable reuse of ``ledger`` (a prompt) among ``owner``'s scope, or None."""
        self.counters.lookups += 1
        found = self._search(self._index, self.entries, ledger, owner)
        if found is None:
            return None
        r, e, turn_agrees = found
        if common_prefix(e.ledger.tokens[:r], ledger.tokens[:r]) != r:  # digests shortlist, tokens decide
            log.error("prefix_cache_digest_collision", entry=e.id, tokens=r)
            return None
        return Hit(e, r, self._level(e, r, owner.session), branch=turn_agrees > r)

    def host_hint(self, ledger: Ledger, owner: Owner) -> int:
        """How far the entries this engine spilled (and the daemon may still hold) would reach for
        ``ledger``: worth a Lookup at admission when it beats the device (0: none)."""
        found = self._search(self._shadow_index, self._shadow, ledger, owner)
        return found[0] if found is not None else 0

    def _search(self, index: MatchIndex, entries: dict[int, Entry], ledger: Ledger,
                owner: Owner) -> tuple[int, Entry, int] | None:
        """(reuse, entry, longest agreement of a TURN entry) of the best entry in ``index``."""
        prompt, limit, ps = ledger.tokens, len(ledger) - 1, self.page_size
        scope, session = owner.scope, owner.session
        best: tuple[tuple[int, int, int], Entry] | None = None
        turn_agrees = 0  # longest common prefix of any TURN entry with the prompt
        for pages, ids in index.candidates(scope, ledger.digests):
            if best is not None and best[0][0] >= (pages + 1) * ps:
                break  # the rest share fewer pages: none reaches further
            for eid in ids:
                e = entries[eid]
                if e.scope != scope:
                    continue
                lo = pages * ps  # digests agree on these; compare the next page's tokens
                agree = lo + common_prefix(e.ledger.tokens[lo:lo + ps], prompt[lo:lo + ps])
                if e.kind is Kind.TURN:
                    turn_agrees = max(turn_agrees, agree)
                r = self._usable(e, agree, limit)
                if r <= 0:
                    continue
                key = (r, int(e.owner.session == session), self._recency(e))
                if best is None or key > best[0]:
                    best = (key, e)
        return None if best is None else (best[0][0], best[1], turn_agrees)

    def _usable(self, e: Entry, agree: int, limit: int) -> int:
        if self.hybrid:  # the state exists at the end of the ledger only
            return len(e) if agree >= len(e) and len(e) <= limit else 0
        return min(agree, limit, len(e))

    @staticmethod
    def _level(e: Entry, r: int, session: str) -> Level:
        if e.kind is Kind.PREFIX or e.owner.session != session:
            return Level.SHARED_PREFIX
        if e.kind is Kind.EXEC and r == len(e):
            return Level.RESIDENT_FRONTIER
        return Level.RESIDENT_CHECKPOINT

    # -- admission -------------------------------------------------------------------------
    def room(self, pages: int, slots: int, protect: Entry | None = None) -> bool:
        """Make ``pages`` pages and ``slots`` slots free by evicting LRU entries (never ``protect``),
        each spilled to the host tier first when there is one. False when they are not free *now*:
        spills in flight will free them (evicting nothing more meanwhile), or even evicting every
        entry could not (evicting nothing)."""
        self.poll(keep=protect)  # a request is about to adopt ``protect``: keep it until it has
        b = self.blocks
        while b.free_pages < pages or b.free_slots < slots:
            if b.free_pages + b.cached_only_pages < pages or b.free_slots + b.cached_only_slots < slots:
                return False
            if b.free_pages + self.pending_pages >= pages and b.free_slots + self.pending_slots >= slots:
                return False  # the spills in flight free enough
            victim = self._victim(protect)
            if victim is None:
                return False
            self.evict(victim)
        return True

    def _victim(self, protect: Entry | None) -> Entry | None:
        """The entry to evict next: lowest ``keep_rank``, least recently used within it."""
        best: tuple[int, int] | None = None
        found = None
        for eid in self._lru:  # oldest first
            e = self.entries[eid]
            if (protect is not None and e is protect) or e.spilling:
                continue
            key = (e.keep_rank, self._recency(e))
            if best is None or key < best:
                best, found = key, e
                if key[0] == 0:
                    break  # the oldest of the lowest rank
        return found

    def trim(self) -> None:
        """Keep the pages only entries hold within the resident budget (``max_pages``): evict
        (spilling first, with a host tier) the lowest-ranked, least recently used beyond it."""
        while self.blocks.cached_only_pages - self.pending_pages > self.max_pages:
            victim = self._victim(None)
            if victim is None:
                return
            self.evict(victim)

    def keep_free(self, pages: int, slots: int) -> None:
        """With a host tier: start spilling LRU entries (by rank) while fewer than ``pages`` pages
        and ``slots`` slots are free or about to be, so that checkpoints and admissions find room
        without waiting for a copy. Without one nothing is evicted early (it would be lost)."""
        if self.host is None or not self.host.available:
            return
        self.poll()
        b = self.blocks
        while (b.free_pages + self.pending_pages < pages or b.free_slots + self.pending_slots < slots):
            victim = self._victim(None)
            if victim is None:
                return
            self.evict(victim)

    def evict(self, e: Entry) -> None:
        """Drop ``e`` for memory: with a host tier, spill it first (asynchronously: its pages and
        image stay allocated, matched by nobody, until the copy is done; ``poll`` frees them)."""
        if self.host is None or not self.host.available:
            self.drop(e, "pressure")
            return
        b = self.blocks
        table = b.block_table(e.holder)
        slot = b.state_slot(e.holder)
        own_pages = sum(1 for p in table if b.refcount(p) == 1)
        own_slots = int(slot >= 0 and b.slot_refcount(slot) == 1)
        o = e.owner
        future = self.host.spill_async(tokens=e.ledger.tokens, pages=table[:pages_for(len(e), self.page_size)],
                                       slot=slot, tenant=o.tenant, metadata_digest=o.metadata_digest,
                                       session=o.session, checkpoint=e.kind is not Kind.EXEC)
        e.spilling = True  # requests may still adopt it meanwhile (they take their own references)
        self.counters.evictions["pressure"] += 1
        self._spilling.append(_Spilling(e, future, own_pages, own_slots))

    def spilled_entries(self) -> list[Entry]:
        """The entries this engine spilled to the host tier that the daemon may still hold (the
        shadow index's view: the daemon can have evicted some since)."""
        return list(self._shadow.values())

    @property
    def pending_pages(self) -> int:
        """Pages spills in flight will free."""
        return sum(s.pages for s in self._spilling)

    @property
    def pending_slots(self) -> int:
        return sum(s.slots for s in self._spilling)

    def poll(self, keep: Entry | None = None) -> None:
        """Free the memory of every spill that is done (committed or not), but ``keep``'s: an
        entry a request matched while its spill was in flight stays until it has adopted it."""
        done = [s for s in self._spilling if s.entry is not keep and s.future.done()]
        for s in done:
            self._spilling.remove(s)
            if s.entry.id in self.entries:
                self._forget(s.entry, None)
            self.blocks.free(s.entry.holder)
            if s.future.exception() is None and s.future.result():
                self._remember_spilled(s.entry)

    def _remember_spilled(self, e: Entry) -> None:
        if e.id in self._shadow:
            return
        while len(self._shadow) >= SHADOW_ENTRIES:
            old = next(iter(self._shadow))
            del self._shadow[old]
            self._shadow_index.remove(old)
        self._shadow[e.id] = e
        self._shadow_index.add(e.id, e.scope, e.ledger.digests)


    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait for the spills in flight, then free their memory."""
        for s in list(self._spilling):
            s.future.exception(timeout=timeout_s)  # waits; never raises the spill's own error
        self.poll()

    def spill(self, e: Entry) -> bool:
        """Offer ``e`` to the host tier now, on this thread (True once the daemon committed it)."""
        if self.host is None or not self.host.available:
            return False
        pages = self.blocks.block_table(e.holder)[:pages_for(len(e), self.page_size)]
        o = e.owner
        ok = self.host.spill(tokens=e.ledger.tokens, pages=pages, slot=self.blocks.state_slot(e.holder),
                             tenant=o.tenant, metadata_digest=o.metadata_digest, session=o.session,
                             checkpoint=e.kind is not Kind.EXEC)
        if ok:
            self._remember_spilled(e)
        return ok

    def spill_all(self, budget_s: float) -> int:
        """At shutdown: spill entries, most recently used first, for at most ``budget_s`` seconds;
        returns how many the daemon committed."""
        end, done = time.monotonic() + budget_s, 0
        for eid in reversed(list(self._lru)):
            if time.monotonic() >= end or self.host is None or not self.host.available:
                break
            done += int(self.spill(self.entries[eid]))
        return done

    def count_host_hit(self, level: Level, tokens: int) -> None:
        """A request resumed from the host tier (its own lookup and restore: ``cache.host``)."""
        self.counters.hits += 1
        self.counters.hit_tokens[level.value] += tokens

    def adopt(self, hit: Hit, seq: Hashable) -> Restore:
        """Give ``seq`` (a new holder with its own slot and an empty table) the reuse of ``hit``:
        whole pages by reference; the page cut inside and the state image pinned for the copies
        the engine makes before the first step. The caller's ``ensure`` then adds the request's
        own pages (the copy-on-write destination first)."""
        e, r = hit.entry, hit.tokens
        src = self.blocks.share(e.holder, seq, r, copy_last=True)
        image = self.blocks.state_slot(e.holder)
        if image >= 0:
            self.blocks.pin_slot(seq, image)
        self._touch(e)
        self.counters.hits += 1
        self.counters.hit_tokens[hit.level.value] += r
        return Restore(image_slot=image, copy_page=None if src is None else (src, -1))

    # -- entries from running sequences ----------------------------------------------------
    def checkpoint(self, seq: Hashable, ledger: Ledger, kind: Kind, owner: Owner, image_slot: int,
                   anchor: bool) -> Entry | None:
        """Keep ``seq``'s first ``len(ledger)`` positions as an entry (its pages shared, the state
        image in ``image_slot``, a slot ``seq`` pinned and the engine filled). None when an equal
        entry exists already (then ``seq`` keeps the pin, freed with its pins) or, hybrid, without
        an image."""
        if self.hybrid and image_slot < 0:
            self.counters.checkpoints_skipped += 1
            return None
        dup = self._exact.get(self._exact_key(owner.scope, ledger))
        if dup is not None:
            self._touch(self.entries[dup])
            return None
        e = Entry(next(self._ids), owner, ledger, kind, anchor)
        self.blocks.add(e.holder, slot=False, cached=True)
        self.blocks.share(seq, e.holder, len(ledger), copy_last=False)
        if image_slot >= 0:
            self.blocks.give_slot(seq, image_slot, e.holder)
        return self._insert(e)

    def retire(self, seq: Hashable, ledger: Ledger, owner: Owner) -> Entry | None:
        """The running sequence ``seq`` ended with ``len(ledger)`` computed tokens (its slot's
        state at exactly that position): keep it as an ``EXEC`` entry, or free it."""
        dup = self._exact.get(self._exact_key(owner.scope, ledger)) if len(ledger) else None
        if not len(ledger) or dup is not None:
            self.blocks.free(seq)
            if dup is not None:
                self._touch(self.entries[dup])
            return None
        e = Entry(next(self._ids), owner, ledger, Kind.EXEC)
        self.blocks.convert(seq, e.holder, len(ledger), keep_slot=self.hybrid)
        return self._insert(e)

    def _insert(self, e: Entry) -> Entry:
        self.entries[e.id] = e
        self._index.add(e.id, e.scope, e.ledger.digests)
        self._exact[self._exact_key(e.scope, e.ledger)] = e.id
        self._by_kind.setdefault((e.scope, e.kind), set()).add(e.id)
        self._touch(e)
        self.counters.inserted[e.kind.value] += 1
        for old in self._prefixes_of(e, Kind.EXEC):
            self.drop(old, "superseded")
        if e.kind is Kind.EXEC:  # covered by its own turn checkpoint: evicted before what is not
            reach = max((len(t) for t in self._prefixes_of(e, Kind.TURN)), default=0)
            e.cheap = reach >= len(e) - max(CHEAP_GAP, len(e) // 4)
        if e.kind is Kind.TURN:
            ancestors = self._prefixes_of(e, Kind.TURN)  # oldest first
            anchors = [a for a in ancestors if a.anchor]
            for a in [a for a in ancestors if not a.anchor] + anchors[:max(0, len(anchors) - self.anchors_kept
                                                                          + int(e.anchor))]:
                self.drop(a, "chain")
        return e

    def _prefixes_of(self, e: Entry, kind: Kind) -> list[Entry]:
        """Entries of ``kind`` in ``e``'s scope whose ledger is a strict prefix of ``e``'s, oldest first."""
        out = [self.entries[i] for i in self._by_kind.get((e.scope, kind), ())
               if i != e.id and len(self.entries[i]) < len(e)]
        out = [o for o in out if is_prefix(o.ledger.tokens, o.ledger.digests, e.ledger.tokens, e.ledger.digests)]
        return sorted(out, key=self._recency)

    # -- eviction --------------------------------------------------------------------------
    def drop(self, e: Entry, cause: str | None) -> None:
        """Forget ``e`` and release its pages and image (those others hold stay); ``cause``
        (one of ``EVICTION_CAUSES``) is counted, None is not (``clear``). A spilling entry's
        memory is released when its copy is done (``poll``)."""
        self._forget(e, cause)
        if not e.spilling:
            self.blocks.free(e.holder)

    def _forget(self, e: Entry, cause: str | None) -> None:
        """``e`` stops matching (its memory is the caller's to free)."""
        del self.entries[e.id]
        self._lru.pop(e.id, None)
        self._rank.pop(e.id, None)
        self._index.remove(e.id)
        self._exact.pop(self._exact_key(e.scope, e.ledger), None)
        self._by_kind[(e.scope, e.kind)].discard(e.id)
        if cause is not None:
            self.counters.evictions[cause] += 1

    def clear(self) -> None:
        """Drop every entry (tests, shutdown), after the spills in flight."""
        self.settle()
        for e in list(self.entries.values()):
            self.drop(e, None)

    # -- recency and identity --------------------------------------------------------------
    def _recency(self, e: Entry) -> int:
        return self._rank.get(e.id, 0)

    def _touch(self, e: Entry) -> None:
        self._tick += 1
        self._rank[e.id] = self._tick
        self._lru[e.id] = None
        self._lru.move_to_end(e.id)

    def _exact_key(self, scope: bytes, ledger: Ledger) -> bytes:
        """A digest of (scope, exact tokens): the chain over full pages, then the tail."""
        h = hashlib.blake2b(ledger.digests[-1] if ledger.digests else scope, digest_size=16)
        h.update(np.ascontiguousarray(ledger.tokens[len(ledger.digests) * self.page_size:], dtype="<u4").tobytes())
        h.update(len(ledger).to_bytes(8, "little"))
        return h.digest()
