"""BlockManager: exact page ids, refcounts, slots, checkpoints; random ops keep the invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepwell.engine_service.block_manager import BlockManager, OutOfPages, OutOfSlots, pages_for


def test_pages_for() -> None:
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grow_truncate_free_exact_ids() -> None:
    bm = BlockManager(num_pages=6, page_size=4, num_state_slots=2)
    a = bm.add("a")
    assert a.state_slot == 0
    assert bm.ensure("a", 5) == [0, 1]
    assert bm.ensure("a", 8) == []
    bm.add("b")
    assert bm.state_slot("b") == 1
    assert bm.ensure("b", 1) == [2]
    assert bm.ensure("a", 9) == [3]
    assert bm.block_table("a") == [0, 1, 3]
    assert (bm.used_pages, bm.free_pages, bm.used_slots) == (4, 2, 2)
    assert bm.truncate("a", 5) == [3]  # position 4 lives in page 1, which stays
    assert bm.block_table("a") == [0, 1]
    bm.free("a")
    assert (bm.used_pages, bm.free_slots) == (1, 1)
    bm.check()
    # freed pages go to the back of the free list: 4, 5 first, then 3, 0, 1
    bm.add("c")
    assert bm.state_slot("c") == 0
    assert bm.ensure("c", 20) == [4, 5, 3, 0, 1]
    bm.check()


def test_out_of_pages_is_all_or_nothing() -> None:
    bm = BlockManager(num_pages=3, page_size=2, num_state_slots=0)
    bm.add("a")
    bm.ensure("a", 3)
    with pytest.raises(OutOfPages, match="need 2 more pages, 1 free of 3"):
        bm.ensure("a", 8)
    assert bm.block_table("a") == [0, 1] and bm.free_pages == 1
    assert bm.state_slot("a") == -1  # attention-only: no slots
    assert bm.can_admit(2) and not bm.can_admit(3)
    bm.check()


def test_slots_exhaust() -> None:
    bm = BlockManager(num_pages=4, page_size=2, num_state_slots=1)
    bm.add("a")
    assert not bm.can_admit(1)
    with pytest.raises(OutOfSlots):
        bm.add("b")
    assert not bm.has("b")
    bm.free("a")
    assert bm.can_admit(8) and not bm.can_admit(9)


def test_shared_pages_survive_first_owner() -> None:
    bm = BlockManager(num_pages=6, page_size=2, num_state_slots=0)
    bm.add("a")
    bm.ensure("a", 5)  # pages 0 1 2
    bm.add("b")
    assert bm.share("a", "b", 4, copy_last=True) is None  # whole pages only
    assert bm.block_table("b") == [0, 1]
    assert [bm.refcount(p) for p in range(3)] == [2, 2, 1]
    assert bm.ensure("b", 6) == [3]
    bm.free("a")
    assert [bm.refcount(p) for p in range(4)] == [1, 1, 0, 1]
    assert bm.free_pages == 3
    bm.check()
    bm.free("b")
    assert bm.free_pages == 6
    bm.check()


def test_share_cut_inside_a_page_copies_or_shares_it() -> None:
    bm = BlockManager(num_pages=8, page_size=4, num_state_slots=0)
    bm.add("a")
    bm.ensure("a", 10)  # pages 0 1 2; position 9 in page 2
    bm.add("reader", cached=True)
    assert bm.share("a", "reader", 10, copy_last=False) is None  # reads below 10 only: page 2 shared
    assert bm.block_table("reader") == [0, 1, 2] and bm.refcount(2) == 2
    bm.add("writer")
    assert bm.share("a", "writer", 10, copy_last=True) == 2  # pinned for the copy
    assert bm.block_table("writer") == [0, 1] and bm.refcount(2) == 3
    assert bm.ensure("writer", 12) == [3]  # its own page for positions 8..11
    bm.unpin("writer")
    assert bm.refcount(2) == 2
    with pytest.raises(ValueError, match="empty block table"):
        bm.share("a", "writer", 4, copy_last=True)
    with pytest.raises(ValueError, match="asked to share 13 tokens"):
        bm.add("c")
        bm.share("a", "c", 13, copy_last=True)
    bm.check()


def test_cached_only_counts_what_eviction_frees() -> None:
    bm = BlockManager(num_pages=8, page_size=4, num_state_slots=3)
    bm.add("run")
    bm.ensure("run", 12)  # pages 0 1 2, slot 0
    assert (bm.cached_only_pages, bm.cached_only_slots) == (0, 0)
    image = bm.take_slot("run")  # a fresh slot pinned for a state image
    assert image == 1
    bm.add("cp", slot=False, cached=True)
    bm.share("run", "cp", 6, copy_last=False)  # pages 0 1, shared with the running sequence
    bm.give_slot("run", image, "cp")
    assert bm.state_slot("cp") == 1 and (bm.cached_only_pages, bm.cached_only_slots) == (0, 1)
    bm.check()
    entry = bm.convert("run", "exec", 9, keep_slot=True)  # positions 0..8: pages 0 1 2
    assert entry.cached and bm.block_table("exec") == [0, 1, 2] and not bm.has("run")
    assert (bm.cached_only_pages, bm.cached_only_slots) == (3, 2)
    bm.check()
    bm.add("next")
    bm.share("exec", "next", 9, copy_last=True)
    bm.pin_slot("next", bm.state_slot("exec"))
    assert (bm.cached_only_pages, bm.cached_only_slots) == (0, 1)  # the adopter holds them now
    bm.free("exec")
    bm.free("cp")
    bm.check()
    bm.free("next")
    assert bm.free_pages == 8 and bm.free_slots == 3
    bm.check()


def test_duplicate_and_bad_sizes() -> None:
    bm = BlockManager(num_pages=2, page_size=2, num_state_slots=0)
    bm.add("a")
    with pytest.raises(KeyError):
        bm.add("a")
    for args in ((0, 2, 0), (2, 0, 0), (2, 2, -1)):
        with pytest.raises(ValueError):
            BlockManager(*args)


ops = st.lists(st.tuples(st.sampled_from(["add", "ensure", "truncate", "free", "share", "retire", "image",
                                          "unpin"]),
                         st.integers(0, 4), st.integers(0, 4), st.integers(0, 30)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(seq_ops: list[tuple[str, int, int, int]]) -> None:
    bm = BlockManager(num_pages=10, page_size=3, num_state_slots=4)
    lengths: dict[object, int] = {}
    entries = 0
    for op, a, b, n in seq_ops:
        try:
            if op == "add":
                bm.add(a)
                lengths[a] = 0
            elif op == "ensure" and a in lengths:
                bm.ensure(a, n)
                lengths[a] = max(lengths[a], n)
            elif op == "truncate" and a in lengths:
                bm.truncate(a, min(n, lengths[a]))
                lengths[a] = min(n, lengths[a])
            elif op == "free" and a in lengths:
                bm.free(a)
                del lengths[a]
            elif op == "share" and a in lengths and b in lengths and a != b and not bm.block_table(b):
                k = min(n, lengths[a])
                bm.share(a, b, k, copy_last=bool(n % 2))
                lengths[b] = k - (k % 3 if n % 2 else 0)
            elif op == "retire" and a in lengths:
                entries += 1
                bm.convert(a, ("entry", entries), min(n, lengths[a]), keep_slot=bool(n % 2))
                lengths[("entry", entries)] = min(n, lengths.pop(a))
            elif op == "image" and a in lengths and not bm.seq(a).cached:
                slot = bm.take_slot(a)
                if slot is not None and n % 2:
                    entries += 1
                    bm.add(("entry", entries), slot=False, cached=True)
                    k = min(n, lengths[a])
                    bm.share(a, ("entry", entries), k, copy_last=False)
                    bm.give_slot(a, slot, ("entry", entries))
                    lengths[("entry", entries)] = k
            elif op == "unpin" and a in lengths:
                bm.unpin(a)
        except (OutOfPages, OutOfSlots, KeyError):
            pass
        bm.check()
        for s, length in lengths.items():
            assert len(bm.block_table(s)) >= pages_for(length, 3)
    for s in list(lengths):
        bm.free(s)
    bm.check()
    assert bm.free_pages == 10 and bm.free_slots == 4 and bm.cached_only_pages == 0
