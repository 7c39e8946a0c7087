"""The daemon core state machine, driven directly (exact, fast, no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest_helpers import MiB, identity, layout, make_core, pattern, put, read_extents, toks, write_extents

from deepwell.kvcache.v1 import kvcache_pb2 as pb
from deepwell.kvcache_daemon.allocator import GranuleAllocator
from deepwell.kvcache_daemon.model import (EXHAUSTED, INCOMPLETE, NOT_FOUND, QUOTA, STALE, UNKNOWN_CLIENT, BadRequest,
                                  Committed, Done, Failure, Match, Reserved, Taken)


def lookup(core, cid, tokens, pin=True, **kw) -> Match | None:
    r = core.lookup(cid, "", kw.get("tenant", "t"), kw.get("fp", b"model-a"), kw.get("md", b""),
                    kw.get("session", ""), tokens, pin)
    assert not isinstance(r, Failure), r
    return r


def test_allocator_best_fit_and_scatter():
    a = GranuleAllocator(10)
    assert a.allocate(3) == [(0, 3)]
    assert a.allocate(2) == [(3, 2)]
    a.free([(0, 3)])
    assert a.allocate(2) == [(0, 2)]  # best fit: the 3-run, not the 5-run
    assert a.allocate(6) == [(5, 5), (2, 1)]  # longest first, then best fit
    assert a.free_granules == 0 and a.allocate(1) is None
    a.free([(5, 5), (0, 2)])
    a.check()
    assert a.free_runs() == [(0, 2), (5, 5)]
    with pytest.raises(Exception):
        a.free([(6, 1)])


def test_commit_then_lookup_pins_exact_bytes(core):
    cid = core.attach("eng", 1)
    t = toks(1, 300)
    entry, ext = put(core, cid, t, 3 * MiB, seed=5)
    prompt = np.concatenate([t, toks(2, 10)])
    m = lookup(core, cid, prompt)
    assert m.entry == entry and m.matched_tokens == 300 and m.lease is not None and not m.via_session
    assert read_extents(core.arena, m.extents, 3 * MiB) == pattern(5, 3 * MiB)
    assert isinstance(core.release(cid, "", m.lease, True), Done)
    # the prompt equal to the ledger: reuse == prompt length is never offered (state entry)
    assert lookup(core, cid, t) is None
    core.check_invariants()


def test_attention_only_entry_cuts_below_prompt(core):
    cid = core.attach("eng", 1)
    t = toks(1, 200)
    put(core, cid, t, MiB, seed=1, requires_state=False)
    m = lookup(core, cid, t, pin=False)
    assert m.matched_tokens == 199  # strictly shorter than the prompt
    diverging = t.copy()
    diverging[150] += 1
    assert lookup(core, cid, diverging, pin=False).matched_tokens == 150


def test_identity_isolation(core):
    cid = core.attach("eng", 1)
    t = toks(3, 256)
    put(core, cid, t, MiB, seed=1, tenant="alice", fp=b"fp1", md=b"m1")
    prompt = np.concatenate([t, toks(4, 5)])
    assert lookup(core, cid, prompt, tenant="alice", fp=b"fp1", md=b"m1") is not None
    assert lookup(core, cid, prompt, tenant="bob", fp=b"fp1", md=b"m1") is None
    assert lookup(core, cid, prompt, tenant="alice", fp=b"fp2", md=b"m1") is None
    assert lookup(core, cid, prompt, tenant="alice", fp=b"fp1", md=b"m2") is None
    # one token different inside the ledger: never a match (digests only shortlist)
    other = prompt.copy()
    other[17] ^= 1
    assert lookup(core, cid, other, tenant="alice", fp=b"fp1", md=b"m1") is None


def test_sibling_branches_with_filler():
    core = make_core(arena_mib=32)
    cid = core.attach("eng", 1)
    prefix = toks(10, 256)
    branches = {}
    for b in range(4):
        t = np.concatenate([prefix, toks(100 + b, 70 + b)])
        branches[b] = (put(core, cid, t, MiB, seed=b)[0], t)
        put(core, cid, toks(1000 + b, 130), MiB, seed=50 + b)  # filler traffic
    for b, (entry, t) in branches.items():
        m = lookup(core, cid, np.concatenate([t, toks(7, 3)]))
        assert m.entry == entry and m.matched_tokens == len(t)
        assert read_extents(core.arena, m.extents, MiB) == pattern(b, MiB)
        core.release(cid, "", m.lease, True)
    core.check_invariants()


def test_session_key_lookup_when_digests_miss(core):
    cid = core.attach("eng", 1)
    t = toks(1, 300)
    entry, _ = put(core, cid, t, MiB, seed=1, session="s1", frontier=128)
    rewritten = t.copy()
    rewritten[200:] = toks(9, 100)  # history rewritten after the checkpoint at 128
    rewritten[64] = t[64]  # unchanged before it
    m = lookup(core, cid, rewritten, pin=False, session="s1")
    assert m.entry == entry and m.matched_tokens == 128
    # digest shortlist also finds it (the first two pages are intact)
    assert not m.via_session
    short = rewritten.copy()
    short[10] += 1  # first page differs: digests miss; the session cannot help (prefix < frontier)
    assert lookup(core, cid, short, pin=False, session="s1") is None


def test_session_lookup_finds_short_ledger(core):
    cid = core.attach("eng", 1)
    t = toks(1, 40)  # shorter than an index page: no digest at all
    entry, _ = put(core, cid, t, MiB, seed=1, session="s", requires_state=False)
    m = lookup(core, cid, np.concatenate([t, toks(2, 100)]), pin=False, session="s")
    assert m.entry == entry and m.matched_tokens == 40


def test_supersede_replaces_prefix_entry_of_session(core):
    """A longer entry of the same session replaces an ended sequence's entry (EXEC) or an
    attention-only one; a hybrid checkpoint stays: its state image exists nowhere else."""
    cid = core.attach("eng", 1)
    t1 = toks(1, 200)
    e1, _ = put(core, cid, t1, MiB, seed=1, session="s", kind=pb.FRONTIER_KIND_EXEC)
    cp, _ = put(core, cid, t1[:150], MiB, seed=3, session="s")  # a hybrid checkpoint at 150
    flat, _ = put(core, cid, t1[:120], MiB, seed=4, session="s", requires_state=False)
    t2 = np.concatenate([t1, toks(2, 50)])
    r = core.reserve(cid, "", identity(t2, session="s"), layout(MiB), t2)
    c = core.commit(cid, "", r.reservation, True, ["kv", "state"])
    assert isinstance(c, Committed) and sorted(c.superseded) == sorted([e1, flat])
    assert isinstance(core.delete(cid, "", e1), Failure)
    assert core.stats().entries == 2  # the new entry and the checkpoint


def test_missing_part_rejected_and_state_part_required(core):
    cid = core.attach("eng", 1)
    t = toks(1, 100)
    r = core.reserve(cid, "", identity(t), layout(MiB), t)
    c = core.commit(cid, "", r.reservation, True, ["kv"])
    assert isinstance(c, Failure) and c.code == INCOMPLETE
    assert lookup(core, cid, np.concatenate([t, t]), pin=False) is None
    bad = core.reserve(cid, "", identity(t, requires_state=True), layout(MiB, state=False), t)
    assert isinstance(bad, Failure) and bad.code == INCOMPLETE
    s = core.stats()
    assert s.reserved_bytes == s.committed_bytes == 0


def test_failed_commit_and_release_change_nothing():
    core = make_core(arena_mib=4)
    cid = core.attach("eng", 1)
    a, b = toks(1, 100), toks(2, 100)
    ea, _ = put(core, cid, a, MiB, seed=1)
    eb, _ = put(core, cid, b, MiB, seed=2)
    r = core.reserve(cid, "", identity(toks(3, 100)), layout(MiB), toks(3, 100))
    assert isinstance(core.commit(cid, "", r.reservation, False, []), Done)
    assert lookup(core, cid, np.concatenate([toks(3, 100), a]), pin=False) is None
    m = lookup(core, cid, np.concatenate([a, b]))  # A is the LRU victim; a failed restore keeps it so
    core.release(cid, "", m.lease, False)
    recency = dict(core.recency)
    put(core, cid, toks(4, 100), MiB, seed=4)
    put(core, cid, toks(5, 100), 2 * MiB, seed=5)  # evicts exactly the oldest: A
    assert core.recency[eb[1]] == recency[eb[1]]
    assert lookup(core, cid, np.concatenate([a, b]), pin=False) is None
    assert lookup(core, cid, np.concatenate([b, a]), pin=False).entry == eb
    m = lookup(core, cid, np.concatenate([b, a]))
    core.release(cid, "", m.lease, True)  # a successful restore refreshes B
    assert core.recency[eb[1]] > recency[eb[1]]


def test_pin_survives_flood_and_stale_without_pin():
    core = make_core(arena_mib=8)
    cid = core.attach("eng", 1)
    t = toks(1, 100)
    entry, _ = put(core, cid, t, 2 * MiB, seed=9)
    prompt = np.concatenate([t, toks(2, 3)])
    m = lookup(core, cid, prompt)
    for i in range(20):  # flood: every reservation must evict, never A
        r = core.reserve(cid, "", identity(toks(100 + i, 80)), layout(3 * MiB), toks(100 + i, 80))
        assert isinstance(r, Reserved)
        write_extents(core.arena, r.extents, pattern(i, 3 * MiB))
        core.commit(cid, "", r.reservation, True, ["kv", "state"])
        assert read_extents(core.arena, m.extents, 2 * MiB) == pattern(9, 2 * MiB)
    assert isinstance(core.release(cid, "", m.lease, True), Done)
    # without a pin the entry is evicted; its old handle answers STALE/NOT_FOUND, never bytes
    unpinned = lookup(core, cid, prompt, pin=False)
    for i in range(6):
        put(core, cid, toks(200 + i, 80), 3 * MiB, seed=200 + i)
    assert lookup(core, cid, prompt, pin=False) is None
    d = core.delete(cid, "", unpinned.entry)
    assert isinstance(d, Failure) and d.code == STALE
    assert core.delete(cid, "", (7, 10_000, 1)).code == NOT_FOUND
    stale = core.delete(cid, "", (6, unpinned.entry[1], unpinned.entry[2]))
    assert isinstance(stale, Failure) and stale.code == STALE
    core.check_invariants()


def test_eviction_mixed_sizes_and_exhaustion():
    core = make_core(arena_mib=16)
    cid = core.attach("eng", 1)
    for i, mib in enumerate([1, 2, 3, 1, 4, 2, 3]):
        put(core, cid, toks(i, 70), mib * MiB, seed=i)
    r = core.reserve(cid, "", identity(toks(99, 70)), layout(12 * MiB), toks(99, 70))
    assert isinstance(r, Reserved) and r.evicted == 6  # 1+2+3+1+4 = 11 < 12: one more (2)
    core.check_invariants()
    core.commit(cid, "", r.reservation, True, ["kv", "state"])
    # pin everything left: a reserve fails at once, nothing evicted
    assert lookup(core, cid, np.concatenate([toks(5, 70), [1]]), pin=False) is None
    held = lookup(core, cid, np.concatenate([toks(6, 70), [1]]))
    assert held.lease and read_extents(core.arena, held.extents, 3 * MiB) == pattern(6, 3 * MiB)
    m = lookup(core, cid, np.concatenate([toks(99, 70), [1]]))
    before = core.stats()
    f = core.reserve(cid, "", identity(toks(98, 70)), layout(2 * MiB), toks(98, 70))
    assert isinstance(f, Failure) and f.code == EXHAUSTED
    after = core.stats()
    assert (after.entries, after.evictions, after.committed_bytes) == (before.entries, before.evictions,
                                                                       before.committed_bytes)
    assert m.lease


def test_fragmentation_compaction_moves_unpinned_only():
    core = make_core(arena_mib=16, max_extents=1, compaction_ms=1000)
    cid = core.attach("eng", 1)
    entries = [put(core, cid, toks(i, 70), MiB, seed=i) for i in range(16)]
    for i in range(0, 16, 2):
        core.delete(cid, "", entries[i][0])
    pinned = lookup(core, cid, np.concatenate([toks(7, 70), [1]]))
    pinned_ext = list(pinned.extents)
    s = core.stats()
    assert s.free_bytes == 8 * MiB and s.largest_free_run_bytes == MiB
    r = core.reserve(cid, "", identity(toks(50, 70)), layout(4 * MiB), toks(50, 70))
    assert isinstance(r, Reserved) and len(r.extents) == 1 and r.evicted == 0
    assert core.stats().compactions == 1
    assert read_extents(core.arena, pinned_ext, MiB) == pattern(7, MiB)
    for i in range(1, 16, 2):
        old = entries[i][0]
        m = lookup(core, cid, np.concatenate([toks(i, 70), [1]]))
        assert read_extents(core.arena, m.extents, MiB) == pattern(i, MiB)
        if i != 7 and m.entry[2] != old[2]:  # moved: the old handle is stale
            assert core.delete(cid, "", old).code == STALE
        if i == 7:
            assert m.extents == pinned_ext and m.entry == old
    core.check_invariants()


def test_scatter_gather_when_compaction_cannot_help():
    core = make_core(arena_mib=8, max_extents=1, compaction_ms=1000)
    cid = core.attach("eng", 1)
    entries = [put(core, cid, toks(i, 70), MiB, seed=i) for i in range(8)]
    for i in range(0, 8, 2):
        core.delete(cid, "", entries[i][0])
    leases = [lookup(core, cid, np.concatenate([toks(i, 70), [1]])) for i in range(1, 8, 2)]
    r = core.reserve(cid, "", identity(toks(50, 70)), layout(4 * MiB), toks(50, 70))
    assert isinstance(r, Reserved) and len(r.extents) == 4  # all pinned: no move, still fits
    assert all(lz.lease for lz in leases)
    core.check_invariants()


def test_take_readd_drop_and_double_release(core):
    cid = core.attach("eng", 1)
    t = toks(1, 100)
    entry, _ = put(core, cid, t, MiB, seed=1)
    prompt = np.concatenate([t, [5]])
    m = lookup(core, cid, prompt)
    tk = core.take(cid, "", m.lease)
    assert isinstance(tk, Taken) and core.stats().taken_bytes == MiB
    assert lookup(core, cid, prompt, pin=False) is None
    assert isinstance(core.release(cid, "", m.lease, True), Done)  # lease already ended: no-op
    r = core.readd(cid, "", tk.take)
    assert isinstance(r, Done) and r.entry == entry
    m2 = lookup(core, cid, prompt)
    assert isinstance(core.release(cid, "", m2.lease, True), Done)
    assert core.release(cid, "", m2.lease, True) == Done(noop=True)
    tk2 = core.take(cid, "", lookup(core, cid, prompt).lease)
    assert isinstance(core.drop(cid, "", tk2.take), Done)
    s = core.stats()
    assert (s.committed_bytes, s.taken_bytes, s.entries, s.free_bytes) == (0, 0, 0, 16 * MiB)


def test_reclaim_after_detach(core):
    a, b = core.attach("a", 1), core.attach("b", 2)
    ta, tb = toks(1, 100), toks(2, 100)
    ea, _ = put(core, a, ta, MiB, seed=1)
    put(core, a, tb, MiB, seed=2)
    baseline = core.stats()
    m = lookup(core, b, np.concatenate([ta, [1]]))
    core.take(b, "", lookup(core, b, np.concatenate([tb, [1]])).lease)
    core.reserve(b, "", identity(toks(3, 50)), layout(2 * MiB), toks(3, 50))
    held = {h.client_id: h for h in core.stats().clients}[b]
    assert (held.leases, held.takes, held.reservations, held.pinned_bytes) == (1, 1, 1, 2 * MiB)
    assert not core.reclaim(b)  # attached: never revoked
    core.detach(b)
    assert core.reclaim(b)
    s = core.stats()
    assert (s.committed_bytes, s.reserved_bytes, s.taken_bytes, s.leases, s.entries) == (
        baseline.committed_bytes, 0, 0, 0, baseline.entries)
    assert lookup(core, a, np.concatenate([ta, [1]]), pin=False).entry == ea
    assert core.release(b, "", m.lease, True).code == UNKNOWN_CLIENT
    core.check_invariants()


def test_pin_quota_refuses_new_pins_only():
    core = make_core(arena_mib=8, pin_quota_bytes=2 * MiB)
    cid = core.attach("eng", 1)
    ts = [toks(i, 100) for i in range(3)]
    for i, t in enumerate(ts):
        put(core, cid, t, MiB, seed=i)
    l1 = lookup(core, cid, np.concatenate([ts[0], [1]]))
    l2 = lookup(core, cid, np.concatenate([ts[1], [1]]))
    refused = lookup(core, cid, np.concatenate([ts[2], [1]]))
    assert l1.lease and l2.lease and refused.lease is None and refused.refused.code == QUOTA
    core.release(cid, "", l1.lease, True)
    assert lookup(core, cid, np.concatenate([ts[2], [1]])).lease


def test_op_ids_make_retries_idempotent(core):
    cid = core.attach("eng", 1)
    t = toks(1, 100)
    r1 = core.reserve(cid, "op1", identity(t), layout(MiB), t)
    r2 = core.reserve(cid, "op1", identity(t), layout(MiB), t)
    assert r1 == r2 and core.stats().reserved_bytes == MiB
    c1 = core.commit(cid, "op2", r1.reservation, True, ["kv", "state"])
    assert core.commit(cid, "op2", r1.reservation, True, ["kv", "state"]) == c1
    assert core.commit(cid, "op3", r1.reservation, True, ["kv", "state"]).code == NOT_FOUND


def test_budget_and_bad_requests(core):
    cid = core.attach("eng", 1)
    for i in range(4):
        put(core, cid, toks(i, 100), 2 * MiB, seed=i)
    assert core.set_budget(4 * MiB) == 2
    assert core.stats().committed_bytes == 4 * MiB
    f = core.reserve(cid, "", identity(toks(9, 100)), layout(5 * MiB), toks(9, 100))
    assert f.code == EXHAUSTED
    t = toks(1, 10)
    with pytest.raises(BadRequest):
        core.reserve(cid, "", identity(t, frontier=11), layout(MiB), t)
    with pytest.raises(BadRequest):
        core.reserve(cid, "", identity(t, fp=b""), layout(MiB), t)
    lay = layout(MiB)
    lay.parts[0].length = 2 * MiB
    with pytest.raises(BadRequest):
        core.reserve(cid, "", identity(t), lay, t)
    with pytest.raises(BadRequest):
        core.set_budget(0)
    assert core.reserve("nobody", "", identity(t), layout(MiB), t).code == UNKNOWN_CLIENT
    core.check_invariants()
    assert pb.ERROR_CODE_OK == 0
