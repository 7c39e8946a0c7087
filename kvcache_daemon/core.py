"""The daemon's single-threaded state machine: entries, reservations, leases, takes, clients.

Pure and synchronous: every method runs to completion, returns a typed result
(``model.Failure`` or a success record) and raises ``BadRequest`` only for malformed input
(nothing changed). The gRPC layer calls it from one event loop, so there is no locking.

Invariants (DESIGN.md, daemon section; ``check_invariants`` verifies them):
 1. only COMMITTED entries (every declared part written) are in the match index;
 2. leased, reserved, taken or doomed entries are never moved, evicted or written;
 3. a client's holdings are reclaimed only by ``reclaim`` (its session closed + grace);
 4. handles are (epoch, id, generation): any mismatch answers STALE;
 5. committed + reserved + taken == charged granules <= budget;
 6. eviction is LRU over whole evictable entries; one Reserve evicts until it fits or
    fails at once with RESOURCE_EXHAUSTED (nothing evicted then);
 7/8. matching lives in ``index`` (scope + exact tokens; reuse < prompt, on a state image);
 9. recency changes only on Release(OK) and ReAdd (and a new Commit enters as newest).
Mutating calls with an op id are idempotent: a repeat returns the first result.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from deepwell.kvcache.v1 import kvcache_pb2 as pb

from . import compaction, invariants
from . import index as ix
from .allocator import AllocatorError, GranuleAllocator, Run
from .journal import Recovered
from .validate import validate_reserve
from .model import (EXHAUSTED, INCOMPLETE, INVALID, NOT_FOUND, QUOTA, STALE, STATE_ROLES, UNKNOWN_CLIENT,
                    BadRequest, Client, Compacted, Committed, Done, Entry, Extent, Failure, Handle, Holdings,
                    Lease, Match, Reserved, Snapshot, State, Taken)


class Journal(Protocol):
    def commit(self, entry: Entry) -> None: ...
    def remove(self, entry_id: int) -> None: ...
    def move(self, entry: Entry) -> None: ...


Clock = Callable[[], float]


class Core:
    def __init__(self, *, epoch: int, arena: memoryview | None, arena_bytes: int, granule_bytes: int,
                 budget_bytes: int, max_extents: int = 16, compaction_ms: float = 50.0,
                 pin_quota_bytes: int = 0, page_tokens: int = 64, op_cache: int = 4096,
                 journal: Journal | None = None, clock: Clock = time.monotonic) -> None:
        if arena_bytes % granule_bytes:
            raise ValueError("arena_bytes must be a multiple of granule_bytes")
        self.epoch = epoch
        self.arena = arena
        self.arena_bytes = arena_bytes
        self.G = granule_bytes
        self.alloc = GranuleAllocator(arena_bytes // granule_bytes)
        self.budget_g = budget_bytes // granule_bytes
        self.max_extents = max_extents
        self.compaction_ms = compaction_ms
        self.pin_quota = pin_quota_bytes
        self.op_cache = op_cache
        self.journal = journal
        self.clock = clock
        self.index = ix.MatchIndex(page_tokens)
        self.entries: dict[int, Entry] = {}
        self.leases: dict[int, Lease] = {}
        self.clients: dict[str, Client] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # COMMITTED entries, oldest first
        self.recency: dict[int, int] = {}
        self._tick = 0
        self._next_id = 1
        self._next_client = 1
        self.evictions = self.compactions = self.compaction_bytes = self.lookups = self.hits = 0

    # -- helpers ---------------------------------------------------------------------
    def _new_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def _extents(self, runs: Sequence[Run]) -> list[Extent]:
        return [(s * self.G, n * self.G) for s, n in runs]

    def _used_g(self) -> int:
        return self.alloc.num_granules - self.alloc.free_granules

    def _touch(self, e: Entry) -> None:
        self._tick += 1
        self.recency[e.id] = self._tick
        self.lru[e.id] = None
        self.lru.move_to_end(e.id)

    def _publish(self, e: Entry, touch: bool) -> None:
        e.state, e.owner = State.COMMITTED, ""
        self.index.add(ix.Indexed(e.id, e.scope, e.identity.session_key,
                                  ix.page_digests(e.scope, e.tokens, self.index.page_tokens), e.tokens,
                                  int(e.identity.frontier_position), e.identity.requires_state))
        if touch or e.id not in self.recency:
            self._touch(e)
        else:
            self.lru[e.id] = None  # keeps its old recency: re-inserted by recency order
            self._reorder_lru()

    def _reorder_lru(self) -> None:
        order = sorted(self.lru, key=lambda i: self.recency.get(i, 0))
        self.lru = OrderedDict((i, None) for i in order)

    def _unpublish(self, e: Entry) -> None:
        self.index.remove(e.id)
        self.lru.pop(e.id, None)

    def _free(self, e: Entry) -> None:
        """Release an entry's granules (it must hold no lease) and forget it."""
        assert not e.leases, "freeing a leased entry"
        self._unpublish(e)
        self.alloc.free(e.runs)
        del self.entries[e.id]
        self.recency.pop(e.id, None)
        if self.journal is not None and e.state in (State.COMMITTED, State.TAKEN, State.DOOMED):
            self.journal.remove(e.id)

    def _remove_committed(self, e: Entry) -> None:
        """Delete a committed entry now, or doom it until its last lease ends."""
        if e.leases:
            self._unpublish(e)
            e.state = State.DOOMED
        else:
            self._free(e)

    def _client(self, client_id: str) -> Client | Failure:
        c = self.clients.get(client_id)
        return c if c is not None else Failure(UNKNOWN_CLIENT, f"client {client_id!r} is not attached")

    def _check_handle(self, h: Handle) -> Failure | None:
        if h[0] != self.epoch:
            return Failure(STALE, f"handle from epoch {h[0]}, daemon epoch is {self.epoch}")
        return None

    def _idempotent(self, client_id: str, op_id: str, fn: Callable[[Client], object]) -> object:
        c = self._client(client_id)
        if isinstance(c, Failure):
            return c
        if op_id and op_id in c.ops:
            return c.ops[op_id]
        result = fn(c)
        if op_id:
            c.ops[op_id] = result
            while len(c.ops) > self.op_cache:
                c.ops.popitem(last=False)
        return result

    # -- clients ---------------------------------------------------------------------
    def attach(self, name: str, pid: int) -> str:
        cid = f"c{self.epoch:x}-{self._next_client}"
        self._next_client += 1
        self.clients[cid] = Client(cid, name, pid)
        return cid

    def detach(self, client_id: str) -> None:
        c = self.clients.get(client_id)
        if c is not None and c.attached:
            c.attached, c.detached_at = False, self.clock()

    def reclaim(self, client_id: str) -> bool:
        """Reclaim everything a detached client holds: leases end without recency change,
        reservations are freed, takes are re-published. Returns False if nothing to do."""
        c = self.clients.get(client_id)
        if c is None or c.attached:
            return False
        for lease_id in sorted(c.leases):
            self._end_lease(self.leases[lease_id])
        for rid in sorted(c.reservations):
            self._free(self.entries[rid])
        for take_id, eid in sorted(c.takes.items()):
            e = self.entries[eid]
            if e.state is State.TAKEN:
                e.take_id = 0
                self._publish(e, touch=False)
        del self.clients[client_id]
        return True

    # -- reserve / commit / abort ----------------------------------------------------
    def reserve(self, client_id: str, op_id: str, identity: pb.Identity, layout: pb.Layout,
                tokens: np.ndarray) -> Reserved | Failure:
        validate_reserve(identity, layout, tokens)
        return self._idempotent(client_id, op_id, lambda c: self._reserve(c, identity, layout, tokens))  # type: ignore[return-value]

    def _reserve(self, c: Client, identity: pb.Identity, layout: pb.Layout, tokens: np.ndarray) -> Reserved | Failure:
        if identity.requires_state and not any(p.role in STATE_ROLES for p in layout.parts):
            return Failure(INCOMPLETE, "requires_state is set but the layout declares no recurrent-state part")
        n = -(-int(layout.total_bytes) // self.G)
        evicted = self._make_room(n)
        if isinstance(evicted, Failure):
            return evicted
        runs = self.alloc.plan(n)
        assert runs is not None
        if len(runs) > self.max_extents:
            self._compact(self.compaction_ms, target_run=n)
            runs = self.alloc.plan(n)
            assert runs is not None
        for s, ln in runs:
            self.alloc.mark_used(s, ln)
        ident = pb.Identity()
        ident.CopyFrom(identity)
        del ident.page_digests[:]
        ident.num_tokens = len(tokens)
        lay = pb.Layout()
        lay.CopyFrom(layout)
        scope = ix.scope_key(identity.tenant, identity.model_fingerprint, identity.metadata_digest)
        e = Entry(self._new_id(), 1, State.RESERVED, c.id, ident, lay, np.array(tokens, dtype=np.uint32),
                  scope, runs, n * self.G)
        self.entries[e.id] = e
        c.reservations.add(e.id)
        return Reserved((self.epoch, e.id, e.generation), self._extents(runs), evicted)

    def _make_room(self, n: int) -> int | Failure:
        """Evict LRU entries until n granules fit the budget; all-or-nothing."""
        room = self.budget_g - self._used_g()
        if room >= n:
            return 0
        victims: list[Entry] = []
        for eid in self.lru:
            e = self.entries[eid]
            if e.leases:
                continue
            victims.append(e)
            room += sum(ln for _, ln in e.runs)
            if room >= n:
                break
        if room < n:
            return Failure(EXHAUSTED, f"need {n} granules; only {room} free or evictable within the budget")
        for e in victims:
            self._free(e)
        self.evictions += len(victims)
        return len(victims)

    def commit(self, client_id: str, op_id: str, reservation: Handle, success: bool,
               written_parts: Sequence[str]) -> Committed | Done | Failure:
        return self._idempotent(client_id, op_id,  # type: ignore[return-value]
                                lambda c: self._commit(c, reservation, success, written_parts))

    def _reservation(self, c: Client, h: Handle) -> Entry | Failure:
        bad = self._check_handle(h)
        if bad:
            return bad
        e = self.entries.get(h[1])
        if e is None or e.state is not State.RESERVED or e.id not in c.reservations:
            return Failure(NOT_FOUND, f"no reservation {h[1]} held by this client")
        if e.generation != h[2]:
            return Failure(STALE, "reservation generation mismatch")
        return e

    def _commit(self, c: Client, h: Handle, success: bool, written: Sequence[str]) -> Committed | Done | Failure:
        e = self._reservation(c, h)
        if isinstance(e, Failure):
            return e
        c.reservations.discard(e.id)
        if not success:
            self._free(e)
            return Done()
        missing = sorted({p.name for p in e.layout.parts} - set(written))
        if missing:
            self._free(e)
            return Failure(INCOMPLETE, f"parts not written: {', '.join(missing)}; reservation discarded")
        superseded = self._supersede(e)
        self._publish(e, touch=True)
        if self.journal is not None:
            self.journal.commit(e)
        return Committed((self.epoch, e.id, e.generation), superseded)

    def _supersede(self, new: Entry) -> list[Handle]:
        session = new.identity.session_key
        if not session:
            return []
        out: list[Handle] = []
        for eid in self.index.session_entries(new.scope, session):
            old = self.entries[eid]
            n = len(old.tokens)
            if old.identity.requires_state and old.identity.frontier_kind != pb.FRONTIER_KIND_EXEC:
                continue  # a state image at a checkpoint: the longer entry has none there
            if n < len(new.tokens) and ix.common_prefix(old.tokens, new.tokens[:n]) == n:
                out.append((self.epoch, old.id, old.generation))
                self._remove_committed(old)
        return out

    def abort(self, client_id: str, op_id: str, reservation: Handle) -> Done | Failure:
        def run(c: Client) -> Done | Failure:
            e = self._reservation(c, reservation)
            if isinstance(e, Failure):
                return e
            c.reservations.discard(e.id)
            self._free(e)
            return Done()
        return self._idempotent(client_id, op_id, run)  # type: ignore[return-value]

    # -- lookup / release / take -----------------------------------------------------
    def lookup(self, client_id: str, op_id: str, tenant: str, fingerprint: bytes, metadata_digest: bytes,
               session_key: str, tokens: np.ndarray, pin: bool) -> Match | None | Failure:
        if not fingerprint:
            raise BadRequest("model_fingerprint must not be empty")
        return self._idempotent(client_id, op_id,  # type: ignore[return-value]
                                lambda c: self._lookup(c, tenant, fingerprint, metadata_digest, session_key, tokens, pin))

    def _lookup(self, c: Client, tenant: str, fp: bytes, md: bytes, session: str, tokens: np.ndarray,
                pin: bool) -> Match | None | Failure:
        self.lookups += 1
        scope = ix.scope_key(tenant, fp, md)
        found = self.index.find(scope, session, np.asarray(tokens, dtype=np.uint32), self.recency)
        if found is None:
            return None
        eid, matched, via_session = found
        e = self.entries[eid]
        handle = (self.epoch, e.id, e.generation)
        lease_h: Handle | None = None
        extents: list[Extent] = []
        refused: Failure | None = None
        if pin:
            if self.pin_quota and self._pinned(c) + e.nbytes > self.pin_quota:
                refused = Failure(QUOTA, f"pinning {e.nbytes} bytes would exceed the quota of {self.pin_quota}")
            else:
                lease = Lease(self._new_id(), e.id, e.generation, c.id, self.clock(), e.nbytes)
                self.leases[lease.id] = lease
                e.leases.add(lease.id)
                c.leases.add(lease.id)
                lease_h = (self.epoch, lease.id, e.generation)
                extents = self._extents(e.runs)
        if refused is None:
            self.hits += 1
        return Match(handle, matched, e.identity, e.layout, via_session, lease_h, extents, refused)

    def _pinned(self, c: Client) -> int:
        return (sum(self.leases[i].nbytes for i in c.leases)
                + sum(self.entries[e].nbytes for e in c.takes.values()))

    def _lease(self, c: Client, h: Handle) -> Lease | Done | Failure:
        bad = self._check_handle(h)
        if bad:
            return bad
        lease = self.leases.get(h[1])
        if lease is None:
            if 0 < h[1] < self._next_id and h[1] not in self.entries:
                return Done(noop=True)  # already ended: double release is a no-op
            return Failure(NOT_FOUND, f"no lease {h[1]}")
        if lease.client != c.id:
            return Failure(INVALID, "lease belongs to another client")
        if lease.generation != h[2]:
            return Failure(STALE, "lease generation mismatch")
        return lease

    def _end_lease(self, lease: Lease) -> Entry:
        del self.leases[lease.id]
        self.clients[lease.client].leases.discard(lease.id)
        e = self.entries[lease.entry_id]
        e.leases.discard(lease.id)
        if e.state is State.DOOMED and not e.leases:
            self._free(e)
        return e

    def release(self, client_id: str, op_id: str, lease: Handle, ok: bool) -> Done | Failure:
        def run(c: Client) -> Done | Failure:
            got = self._lease(c, lease)
            if not isinstance(got, Lease):
                return got
            e = self._end_lease(got)
            if ok and e.state is State.COMMITTED:
                self._touch(e)
            return Done()
        return self._idempotent(client_id, op_id, run)  # type: ignore[return-value]

    def take(self, client_id: str, op_id: str, lease: Handle) -> Taken | Failure:
        def run(c: Client) -> Taken | Failure:
            got = self._lease(c, lease)
            if isinstance(got, Done):
                return Failure(NOT_FOUND, "lease already ended")
            if isinstance(got, Failure):
                return got
            e = self.entries[got.entry_id]
            if e.state is not State.COMMITTED:
                return Failure(INVALID, f"entry is {e.state.value}, not takeable")
            self._end_lease(got)
            self._unpublish(e)
            e.state, e.owner, e.take_id = State.TAKEN, c.id, self._new_id()
            c.takes[e.take_id] = e.id
            return Taken((self.epoch, e.take_id, e.generation), self._extents(e.runs))
        return self._idempotent(client_id, op_id, run)  # type: ignore[return-value]

    def _take(self, c: Client, h: Handle) -> Entry | Failure:
        bad = self._check_handle(h)
        if bad:
            return bad
        eid = c.takes.get(h[1])
        if eid is None:
            return Failure(NOT_FOUND, f"no take {h[1]} held by this client")
        e = self.entries[eid]
        if e.generation != h[2]:
            return Failure(STALE, "take generation mismatch")
        del c.takes[h[1]]
        e.take_id = 0
        return e

    def readd(self, client_id: str, op_id: str, take: Handle) -> Done | Failure:
        def run(c: Client) -> Done | Failure:
            e = self._take(c, take)
            if isinstance(e, Failure):
                return e
            self._publish(e, touch=True)
            return Done(entry=(self.epoch, e.id, e.generation))
        return self._idempotent(client_id, op_id, run)  # type: ignore[return-value]

    def drop(self, client_id: str, op_id: str, take: Handle) -> Done | Failure:
        def run(c: Client) -> Done | Failure:
            e = self._take(c, take)
            if isinstance(e, Failure):
                return e
            e.state = State.DOOMED
            self._remove_committed(e)
            return Done()
        return self._idempotent(client_id, op_id, run)  # type: ignore[return-value]

    def delete(self, client_id: str, op_id: str, entry: Handle) -> Done | Failure:
        def run(c: Client) -> Done | Failure:
            bad = self._check_handle(entry)
            if bad:
                return bad
            e = self.entries.get(entry[1])
            if e is None or e.state is State.DOOMED:
                if 0 < entry[1] < self._next_id:  # existed in this epoch: evicted, deleted or superseded
                    return Failure(STALE, f"entry {entry[1]} no longer exists")
                return Failure(NOT_FOUND, f"no entry {entry[1]}")
            if e.generation != entry[2]:
                return Failure(STALE, "entry generation mismatch")
            if e.state is not State.COMMITTED:
                return Failure(INVALID, f"entry is {e.state.value}")
            self._remove_committed(e)
            return Done()
        return self._idempotent(client_id, op_id, run)  # type: ignore[return-value]

    # -- budget / compaction ---------------------------------------------------------
    def set_budget(self, budget_bytes: int) -> int | Failure:
        """Change the budget, evicting LRU entries down to it (all-or-nothing)."""
        new_g = budget_bytes // self.G
        if new_g <= 0 or budget_bytes > self.arena_bytes:
            raise BadRequest(f"budget_bytes must be in [{self.G}, {self.arena_bytes}]")
        old, self.budget_g = self.budget_g, new_g
        got = self._make_room(0)
        if isinstance(got, Failure):
            self.budget_g = old
        return got

    def compact(self, max_ms: float) -> Compacted:
        return compaction.compact(self, max_ms, target_run=None)

    def _compact(self, max_ms: float, target_run: int | None) -> Compacted:
        return compaction.compact(self, max_ms, target_run)

    def recover(self, rec: Recovered) -> bool:
        """Re-publish a journaled entry at startup; False (entry dropped) if inconsistent."""
        nbytes = sum(n for _, n in rec.runs) * self.G
        if not rec.runs or nbytes < rec.layout.total_bytes or rec.id in self.entries:
            return False
        taken: list[Run] = []
        try:
            for s, n in rec.runs:
                self.alloc.mark_used(s, n)
                taken.append((s, n))
        except AllocatorError:
            self.alloc.free(taken)
            return False
        if self._used_g() > self.budget_g:
            self.alloc.free(taken)
            return False
        scope = ix.scope_key(rec.identity.tenant, rec.identity.model_fingerprint, rec.identity.metadata_digest)
        e = Entry(rec.id, rec.generation, State.RESERVED, "", rec.identity, rec.layout, rec.tokens, scope,
                  list(rec.runs), nbytes)
        self.entries[e.id] = e
        self._publish(e, touch=True)
        self._next_id = max(self._next_id, rec.id + 1)
        return True

    # -- introspection ---------------------------------------------------------------
    def stats(self) -> Snapshot:
        now = self.clock()
        by_state = {s: 0 for s in State}
        for e in self.entries.values():
            by_state[e.state] += e.nbytes
        holdings = []
        for c in self.clients.values():
            ages = [now - self.leases[i].created for i in c.leases]
            holdings.append(Holdings(c.id, c.name, len(c.leases), len(c.reservations), len(c.takes),
                                     self._pinned(c), max(ages, default=0.0), c.attached))
        free = self.alloc.free_granules * self.G
        largest = self.alloc.largest_free_run() * self.G
        return Snapshot(
            epoch=self.epoch, arena_bytes=self.arena_bytes, budget_bytes=self.budget_g * self.G,
            committed_bytes=by_state[State.COMMITTED] + by_state[State.DOOMED],
            reserved_bytes=by_state[State.RESERVED], taken_bytes=by_state[State.TAKEN],
            free_bytes=free, largest_free_run_bytes=largest,
            fragmentation=(1.0 - largest / free) if free else 0.0,
            entries=len(self.index), evictions=self.evictions, compactions=self.compactions,
            compaction_bytes_moved=self.compaction_bytes, leases=len(self.leases),
            oldest_lease_age_s=max((now - lease.created for lease in self.leases.values()), default=0.0),
            clients=holdings, lookups=self.lookups, hits=self.hits)

    def check_invariants(self) -> None:
        """Raise AssertionError when any structural invariant is broken (used by tests)."""
        invariants.check(self)
