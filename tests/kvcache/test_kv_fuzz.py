"""Model-based fuzz: a hypothesis state machine drives every core operation against a tiny
reference model (dicts + an LRU list) and checks DESIGN invariants 1-10 after every step:
exact match results, exact eviction counts, accounting, no overlapping extents, leased
extents never moving, and every live entry's bytes still equal the pattern written."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule
from kvtest_helpers import identity, layout, pattern, read_extents, write_extents

from deepwell.kvcache.v1 import kvcache_pb2 as pb

from deepwell.kvcache_daemon.core import Core
from deepwell.kvcache_daemon.model import (EXHAUSTED, INCOMPLETE, QUOTA, Committed, Done, Failure, Match, Reserved, State,
                                  Taken)

G = 64 * 1024  # small granules keep every step's byte checks cheap
ARENA_G = 12
PAGE = 8
PREFIXES = [np.arange(100 + 50 * k, 100 + 50 * k + 40, dtype=np.uint32) for k in range(3)]


def ledger(prefix: int, extra: int, salt: int) -> np.ndarray:
    tail = np.arange(extra, dtype=np.uint32) * 7 + salt * 1000 + 5
    return np.concatenate([PREFIXES[prefix][: 4 + 12 * prefix], tail]).astype(np.uint32)


@dataclass
class MEntry:
    handle: tuple
    tokens: np.ndarray
    tenant: str
    session: str
    seed: int
    size: int
    granules: int
    state: str = "committed"  # committed | taken | doomed
    leases: int = 0
    checkpoint: bool = False  # a state image at a checkpoint: never superseded


class KVMachine(RuleBasedStateMachine):
    reservations = Bundle("reservations")
    leases = Bundle("leases")
    takes = Bundle("takes")

    def __init__(self) -> None:
        super().__init__()
        self.core = Core(epoch=7, arena=memoryview(bytearray(ARENA_G * G)), arena_bytes=ARENA_G * G,
                         granule_bytes=G, budget_bytes=ARENA_G * G, max_extents=2, compaction_ms=1000,
                         page_tokens=PAGE, pin_quota_bytes=6 * G)
        self.clients = [self.core.attach("a", 1), self.core.attach("b", 2)]
        self.entries: dict[int, MEntry] = {}  # committed, taken or doomed (model)
        self.reserved: dict[int, tuple] = {}  # id -> (client, granules, seed, size, tokens, tenant, session)
        self.lru: list[int] = []  # committed entry ids, oldest first
        self.lease_ext: dict[int, list] = {}
        self.lease_owner: dict[int, tuple[str, int]] = {}
        self.seed = 0
        self.budget = ARENA_G

    # -- helpers --------------------------------------------------------------------------
    def used(self) -> int:
        return sum(e.granules for e in self.entries.values()) + sum(r[1] for r in self.reserved.values())

    def touch(self, eid: int) -> None:
        if eid in self.lru:
            self.lru.remove(eid)
        self.lru.append(eid)

    def free_entry(self, eid: int) -> None:
        e = self.entries[eid]
        if e.leases:
            e.state = "doomed"
            if eid in self.lru:
                self.lru.remove(eid)
        else:
            del self.entries[eid]
            if eid in self.lru:
                self.lru.remove(eid)

    def expected_evictions(self, n: int) -> int | None:
        room = self.budget - self.used()
        if room >= n:
            return 0
        victims = 0
        for eid in self.lru:
            if self.entries[eid].leases:
                continue
            victims += 1
            room += self.entries[eid].granules
            if room >= n:
                return victims
        return None

    # -- rules ----------------------------------------------------------------------------
    @rule(target=reservations, client=st.integers(0, 1), granules=st.integers(1, 4), prefix=st.integers(0, 2),
          extra=st.integers(0, 20), salt=st.integers(0, 2), tenant=st.sampled_from(["t", "u"]),
          session=st.sampled_from(["", "s1"]), checkpoint=st.booleans())
    def reserve(self, client, granules, prefix, extra, salt, tenant, session, checkpoint=False):
        t = ledger(prefix, extra, salt)
        size = granules * G - (self.seed % 3) * 1000
        self.seed += 1
        want = self.expected_evictions(granules)
        kind = pb.FRONTIER_KIND_CHECKPOINT if checkpoint else pb.FRONTIER_KIND_EXEC
        r = self.core.reserve(self.clients[client], "", identity(t, tenant=tenant, session=session, kind=kind),
                              layout(size), t)
        if want is None:
            assert isinstance(r, Failure) and r.code == EXHAUSTED
            return None
        assert isinstance(r, Reserved) and r.evicted == want
        evicted = 0
        for eid in list(self.lru):
            if evicted == want:
                break
            if not self.entries[eid].leases:
                self.free_entry(eid)
                evicted += 1
        self.sync_generations()
        write_extents(self.core.arena, r.extents, pattern(self.seed, size))
        self.reserved[r.reservation[1]] = (self.clients[client], granules, self.seed, size, t, tenant, session,
                                           checkpoint)
        return r.reservation

    @rule(client=st.integers(0, 1), granules=st.integers(1, 3), prefix=st.integers(0, 2), extra=st.integers(0, 20),
          salt=st.integers(0, 2), tenant=st.sampled_from(["t", "u"]), session=st.sampled_from(["", "s1"]),
          checkpoint=st.booleans())
    def put(self, client, granules, prefix, extra, salt, tenant, session, checkpoint):
        h = self.reserve(client, granules, prefix, extra, salt, tenant, session, checkpoint)
        self.finish(h, "ok")

    @rule(h=consumes(reservations), how=st.sampled_from(["ok", "fail", "missing", "abort"]))
    def finish(self, h, how):
        if h is None or h[1] not in self.reserved:
            return
        client, granules, seed, size, t, tenant, session, checkpoint = self.reserved.pop(h[1])
        if how == "abort":
            assert isinstance(self.core.abort(client, "", h), Done)
            return
        parts = ["kv"] if how == "missing" else ["kv", "state"]
        r = self.core.commit(client, "", h, how != "fail", parts)
        if how == "fail":
            assert isinstance(r, Done)
            return
        if how == "missing":
            assert isinstance(r, Failure) and r.code == INCOMPLETE
            return
        assert isinstance(r, Committed)
        expect_sup = []
        if session:
            for eid, e in list(self.entries.items()):
                if (e.state == "committed" and e.session == session and e.tenant == tenant and len(e.tokens) < len(t)
                        and not e.checkpoint and np.array_equal(e.tokens, t[: len(e.tokens)])):
                    expect_sup.append(eid)
                    self.free_entry(eid)
        assert sorted(x[1] for x in r.superseded) == sorted(expect_sup)
        self.entries[h[1]] = MEntry(r.entry, t, tenant, session, seed, size, granules, checkpoint=checkpoint)
        self.touch(h[1])

    @rule(target=leases, client=st.integers(0, 1), prefix=st.integers(0, 2), extra=st.integers(0, 24),
          salt=st.integers(0, 2), tenant=st.sampled_from(["t", "t", "t", "u"]), pin=st.sampled_from([True, True, False]),
          session=st.sampled_from(["", "s1"]), data=st.data())
    def lookup(self, client, prefix, extra, salt, tenant, pin, session, data):
        prompt = ledger(prefix, extra, salt)
        live = sorted(k for k, e in self.entries.items() if e.state == "committed")
        if live and data.draw(st.integers(0, 4)) > 0:  # mostly: extend a live ledger (hits)
            picked = self.entries[data.draw(st.sampled_from(live))]
            prompt = np.concatenate([picked.tokens, np.arange(data.draw(st.integers(0, 10)), dtype=np.uint32)])
            tenant = picked.tenant if data.draw(st.integers(0, 3)) else tenant
        best = 0
        for e in self.entries.values():
            n = len(e.tokens)
            if e.state == "committed" and e.tenant == tenant and n < len(prompt) and np.array_equal(e.tokens, prompt[:n]):
                best = max(best, n)
        cid = self.clients[client]
        r = self.core.lookup(cid, "", tenant, b"model-a", b"", session, prompt, pin)
        if best == 0:
            assert r is None
            return None
        assert isinstance(r, Match) and r.matched_tokens == best < len(prompt)
        e = self.entries[r.entry[1]]
        assert e.state == "committed" and len(e.tokens) == best and r.entry == e.handle
        if not pin:
            return None
        if r.refused is not None:
            assert r.refused.code == QUOTA
            return None
        assert read_extents(self.core.arena, r.extents, e.size) == pattern(e.seed, e.size)
        e.leases += 1
        self.lease_ext[r.lease[1]] = list(r.extents)
        self.lease_owner[r.lease[1]] = (cid, r.entry[1])
        return r.lease

    @precondition(lambda self: any(e.state == "committed" for e in self.entries.values()))
    @rule(target=leases, client=st.integers(0, 1), pin=st.sampled_from([True, True, False]), data=st.data())
    def lookup_live(self, client, pin, data):
        return self.lookup(client, 0, 0, 0, "t", pin, "", data)

    @rule(h=consumes(leases), ok=st.booleans(), twice=st.booleans())
    def release(self, h, ok, twice):
        if h is None or h[1] not in self.lease_owner:
            return
        cid, eid = self.lease_owner.pop(h[1])
        self.lease_ext.pop(h[1])
        assert isinstance(self.core.release(cid, "", h, ok), Done)
        if twice:
            assert self.core.release(cid, "", h, ok) == Done(noop=True)
        e = self.entries[eid]
        e.leases -= 1
        if e.state == "doomed" and e.leases == 0:
            del self.entries[eid]
        elif ok and e.state == "committed":
            self.touch(eid)

    @rule(target=takes, h=consumes(leases))
    def take(self, h):
        if h is None or h[1] not in self.lease_owner:
            return None
        cid, eid = self.lease_owner[h[1]]
        e = self.entries[eid]
        r = self.core.take(cid, "", h)
        if e.state != "committed":
            assert isinstance(r, Failure)
            return None
        assert isinstance(r, Taken)
        self.lease_owner.pop(h[1])
        self.lease_ext.pop(h[1])
        e.leases -= 1
        e.state = "taken"
        self.lru.remove(eid)
        return (cid, eid, r.take)

    @rule(t=consumes(takes), readd=st.booleans())
    def finish_take(self, t, readd):
        if t is None or t[1] not in self.entries or self.entries[t[1]].state != "taken":
            return
        cid, eid, h = t
        e = self.entries[eid]
        if readd:
            assert isinstance(self.core.readd(cid, "", h), Done)
            e.state = "committed"
            self.touch(eid)
        else:
            assert isinstance(self.core.drop(cid, "", h), Done)
            self.free_entry(eid)

    @rule(data=st.data())
    def delete(self, data):
        live = sorted(k for k, e in self.entries.items() if e.state == "committed")
        if not live:
            return
        eid = data.draw(st.sampled_from(live))
        r = self.core.delete(self.clients[0], "", self.entries[eid].handle)
        assert isinstance(r, Done)
        self.free_entry(eid)

    @rule(granules=st.integers(6, ARENA_G))
    def set_budget(self, granules):
        old, self.budget = self.budget, granules
        want = self.expected_evictions(0)
        r = self.core.set_budget(granules * G)
        if want is None:
            assert isinstance(r, Failure) and r.code == EXHAUSTED
            self.budget = old
            return
        assert r == want
        evicted = 0
        for eid in list(self.lru):
            if evicted == want:
                break
            if not self.entries[eid].leases:
                self.free_entry(eid)
                evicted += 1

    @rule(max_ms=st.sampled_from([0, 1000]))
    def compact(self, max_ms):
        self.core.compact(max_ms)
        self.sync_generations()

    def sync_generations(self) -> None:
        """Compaction (own rule, or inside a Reserve) moves unleased committed entries:
        their generation goes up by one per move, and leased/taken ones never move."""
        for eid, e in self.entries.items():
            gen = self.core.entries[eid].generation
            if e.state != "committed" or e.leases:
                assert gen == e.handle[2], "a leased, taken or doomed entry moved"
            assert gen >= e.handle[2]
            e.handle = (self.core.epoch, eid, gen)

    @rule(client=st.integers(0, 1), dice=st.integers(0, 7))
    def client_dies(self, client, dice):
        if dice:
            return  # rare: a client death wipes much of the interesting state
        cid = self.clients[client]
        self.core.detach(cid)
        assert self.core.reclaim(cid)
        for lid, (owner, eid) in list(self.lease_owner.items()):
            if owner == cid:
                del self.lease_owner[lid], self.lease_ext[lid]
                e = self.entries[eid]
                e.leases -= 1
                if e.state == "doomed" and e.leases == 0:
                    del self.entries[eid]
        for rid, r in list(self.reserved.items()):
            if r[0] == cid:
                del self.reserved[rid]
        for eid, e in self.entries.items():
            if e.state == "taken" and self.core.entries[eid].state is State.COMMITTED:
                e.state = "committed"  # re-published, recency unchanged
                self.lru.append(eid)
                self.lru.sort(key=lambda i: self.core.recency.get(i, 0))
        self.clients[client] = self.core.attach("new", 3)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def consistent(self):
        core = self.core
        core.check_invariants()
        s = core.stats()
        g = {"committed": 0, "taken": 0, "doomed": 0}
        for e in self.entries.values():
            g[e.state] += e.granules
        assert s.committed_bytes == (g["committed"] + g["doomed"]) * G
        assert s.taken_bytes == g["taken"] * G
        assert s.reserved_bytes == sum(r[1] for r in self.reserved.values()) * G
        assert s.committed_bytes + s.reserved_bytes + s.taken_bytes + s.free_bytes == ARENA_G * G
        assert s.committed_bytes + s.reserved_bytes + s.taken_bytes <= s.budget_bytes == self.budget * G
        assert s.entries == sum(1 for e in self.entries.values() if e.state == "committed")
        assert [i for i in core.lru] == self.lru
        for eid, e in self.entries.items():
            ce = core.entries[eid]
            assert read_extents(core.arena, [(a * G, n * G) for a, n in ce.runs], e.size) == pattern(e.seed, e.size)
        for lid, ext in self.lease_ext.items():
            eid = self.lease_owner[lid][1]
            assert [(a * G, n * G) for a, n in core.entries[eid].runs] == ext


KVMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("DEEPWELL_KV_FUZZ_EXAMPLES", "150")), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestKVFuzz = KVMachine.TestCase
