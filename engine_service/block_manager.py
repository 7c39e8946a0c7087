"""BlockManager: KV page and recurrent-state slot bookkeeping (pure Python, no torch).

The runner owns the memory (page tensors, state pool); this module owns *who holds which
part of it*. It never touches tensors, so every decision is testable with exact asserts.

Holders
-------
A holder is a running sequence (``add(seq)``) or a prefix-cache entry (``add(key,
cached=True)``); both hold a block table and at most one state slot, and may *pin* extra
pages and slots for a while (the sources of copies a step is about to make). The two kinds
differ only in what eviction may take: everything held by cached holders alone is what
evicting every cache entry could free (``cached_only_pages`` / ``cached_only_slots``).

Pages
-----
- ``num_pages`` pages of ``page_size`` tokens, ids ``0 .. num_pages-1``. Each page has a
  reference count (block tables + pins); a page is free iff its count is 0, and the free
  list holds exactly the free pages (lowest ids handed out first, freed pages go to the back).
- A holder's block table maps position ``t`` to page ``table[t // page_size]``.
  ``ensure(seq, n)`` grows the table to cover ``n`` tokens with fresh pages;
  ``truncate(seq, n)`` drops the pages wholly beyond ``n`` (the page holding position ``n-1``
  stays); ``free(seq)`` drops everything. A page returns to the free list only when nobody
  else holds it.
- ``share(src, dst, n)`` gives ``dst`` (an empty table) ``src``'s pages for positions
  ``[0, n)``. A page shared by several holders is written only at positions none of the
  others reads: a cache entry reads below its length, and a sequence resuming from a cut
  inside a page gets its own copy of that page (``copy_last``: the source page is pinned
  for the copy, the caller's ``ensure`` adds the destination). So two writers never share
  a page.

State slots
-----------
- ``num_state_slots`` slots for recurrent (GDN) state, refcounted like pages: a running
  sequence's slot (written every step), a cache entry's state image, or a pin (an image being
  copied into a sequence, or a fresh slot about to receive an image: ``take_slot``).
  Attention-only models run with zero slots and every holder's slot is ``-1``.

Invariant (``check()``): every page's and slot's refcount equals the number of holders
referencing it (tables, slots, pins), the free lists hold exactly the unreferenced ones, the
cached-only counters equal a recount, and no slot is the running slot of two holders.
"""

from __future__ import annotations

from array import array

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

SeqId = Hashable


class OutOfPages(RuntimeError):
    """Not enough free pages for the request; nothing was allocated."""


class OutOfSlots(RuntimeError):
    """No free state slot; nothing was allocated."""


@dataclass
class SeqAlloc:
    """What one holder holds."""

    block_table: list[int] = field(default_factory=list)
    # the same page ids as an ``array('i')`` (kept equal to ``block_table`` by every method
    # here): the runner turns a slice of it into a tensor by one memory copy
    table_array: array = field(default_factory=lambda: array("i"))
    state_slot: int = -1
    cached: bool = False  # a prefix-cache entry (evictable), not a running sequence
    pinned_pages: list[int] = field(default_factory=list)
    pinned_slots: list[int] = field(default_factory=list)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // page_size)


class _Counted:
    """Refcounted ids with a free list and a count of ids held by cached holders only."""

    def __init__(self, n: int) -> None:
        self.ref = [0] * n
        self.live = [0] * n  # references from running holders
        self.free: deque[int] = deque(range(n))
        self.cached_only = 0

    def take(self, live: bool) -> int:
        i = self.free.popleft()
        self.ref[i] = 1
        self.live[i] = int(live)
        if not live:
            self.cached_only += 1
        return i

    def hold(self, i: int, live: bool) -> None:
        if self.ref[i] <= 0:
            raise AssertionError(f"id {i} referenced while free")
        was = self.ref[i] > 0 and self.live[i] == 0
        self.ref[i] += 1
        self.live[i] += int(live)
        self.cached_only += int(self.live[i] == 0) - int(was)

    def drop(self, i: int, live: bool) -> None:
        rc = self.ref[i]
        if rc <= 0 or (live and self.live[i] <= 0):
            raise AssertionError(f"id {i} released with refcount {rc}")
        was = self.live[i] == 0
        self.ref[i] = rc - 1
        self.live[i] -= int(live)
        now = self.ref[i] > 0 and self.live[i] == 0
        self.cached_only += int(now) - int(was)
        if rc == 1:
            self.free.append(i)

    def relabel(self, i: int, live_before: bool) -> None:
        """One reference of ``i`` changes kind (running <-> cached)."""
        was = self.live[i] == 0
        self.live[i] += -1 if live_before else 1
        self.cached_only += int(self.live[i] == 0) - int(was)


class BlockManager:
    """Refcounted page pool + state-slot pool + the holders' block tables."""

    def __init__(self, num_pages: int, page_size: int, num_state_slots: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {num_state_slots}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_state_slots = num_state_slots
        self._pages = _Counted(num_pages)
        self._slots = _Counted(num_state_slots)
        self._seqs: dict[SeqId, SeqAlloc] = {}

    # -- queries -------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._pages.free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._pages.free)

    @property
    def free_slots(self) -> int:
        return len(self._slots.free)

    @property
    def used_slots(self) -> int:
        return self.num_state_slots - len(self._slots.free)

    @property
    def cached_only_pages(self) -> int:
        """Pages held by cache entries alone: what evicting every entry would free."""
        return self._pages.cached_only

    @property
    def cached_only_slots(self) -> int:
        return self._slots.cached_only

    @property
    def uses_slots(self) -> bool:
        return self.num_state_slots > 0

    def has(self, seq: SeqId) -> bool:
        return seq in self._seqs

    def seq(self, seq: SeqId) -> SeqAlloc:
        return self._seqs[seq]

    def block_table(self, seq: SeqId) -> list[int]:
        return self._seqs[seq].block_table

    def table_array(self, seq: SeqId) -> array:
        """``block_table(seq)`` as an ``array('i')`` (the live one: slice it to keep a copy)."""
        return self._seqs[seq].table_array

    def state_slot(self, seq: SeqId) -> int:
        return self._seqs[seq].state_slot

    def refcount(self, page: int) -> int:
        return self._pages.ref[page]

    def slot_refcount(self, slot: int) -> int:
        return self._slots.ref[slot]

    def extra_pages_needed(self, seq: SeqId | None, num_tokens: int) -> int:
        """New pages ``seq`` (or a new sequence when None/unknown) needs to hold ``num_tokens``."""
        held = len(self._seqs[seq].block_table) if seq is not None and seq in self._seqs else 0
        return max(0, pages_for(num_tokens, self.page_size) - held)

    def can_admit(self, num_tokens: int) -> bool:
        """Would a new sequence of ``num_tokens`` tokens (plus a slot if used) fit now?"""
        if self.uses_slots and not self._slots.free:
            return False
        return pages_for(num_tokens, self.page_size) <= len(self._pages.free)

    # -- holder lifecycle ----------------------------------------------------------------
    def add(self, seq: SeqId, *, slot: bool = True, cached: bool = False) -> SeqAlloc:
        """Register ``seq`` with an empty table and, if slots are used and ``slot``, a fresh slot."""
        if seq in self._seqs:
            raise KeyError(f"sequence {seq!r} already allocated")
        state = -1
        if self.uses_slots and slot:
            if not self._slots.free:
                raise OutOfSlots(f"all {self.num_state_slots} state slots are in use")
            state = self._slots.take(not cached)
        alloc = SeqAlloc(state_slot=state, cached=cached)
        self._seqs[seq] = alloc
        return alloc

    def ensure(self, seq: SeqId, num_tokens: int) -> list[int]:
        """Grow ``seq``'s table to cover ``num_tokens`` positions; returns the new pages.

        All-or-nothing: raises OutOfPages (allocating nothing) if the pool is short.
        """
        alloc = self._seqs[seq]
        need = self.extra_pages_needed(seq, num_tokens)
        if need > len(self._pages.free):
            raise OutOfPages(f"need {need} more pages, {len(self._pages.free)} free of {self.num_pages}")
        new = [self._pages.take(not alloc.cached) for _ in range(need)]
        alloc.block_table.extend(new)
        alloc.table_array.extend(new)
        return new

    def truncate(self, seq: SeqId, num_tokens: int) -> list[int]:
        """Drop the pages wholly beyond position ``num_tokens - 1``; returns the dropped ids."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        alloc = self._seqs[seq]
        keep = pages_for(num_tokens, self.page_size)
        dropped = alloc.block_table[keep:]
        del alloc.block_table[keep:]
        del alloc.table_array[keep:]
        for p in dropped:
            self._pages.drop(p, not alloc.cached)
        return dropped

    def free(self, seq: SeqId) -> None:
        """Release everything ``seq`` holds (pages, slot, pins) at once."""
        alloc = self._seqs.pop(seq)
        live = not alloc.cached
        for p in (*alloc.block_table, *alloc.pinned_pages):
            self._pages.drop(p, live)
        for s in (*(() if alloc.state_slot < 0 else (alloc.state_slot,)), *alloc.pinned_slots):
            self._slots.drop(s, live)
        alloc.block_table, alloc.pinned_pages, alloc.pinned_slots, alloc.state_slot = [], [], [], -1
        alloc.table_array = array("i")

    def share(self, src: SeqId, dst: SeqId, num_tokens: int, *, copy_last: bool) -> int | None:
        """Give ``dst`` (an empty table) ``src``'s pages for positions ``[0, num_tokens)``.

        Whole pages are shared by reference. A last page cut inside (``num_tokens % page_size``)
        is shared too when ``copy_last`` is False (``dst`` only reads below the cut: a cache
        entry); when True (``dst`` will write there) it is pinned for ``dst`` and returned, and
        the caller gives ``dst`` its own page (``ensure``) and copies the source's bytes into it.
        """
        src_table = self._seqs[src].block_table
        whole, rest = divmod(num_tokens, self.page_size)
        if pages_for(num_tokens, self.page_size) > len(src_table):
            raise ValueError(f"source holds {len(src_table)} pages, asked to share {num_tokens} tokens")
        dst_alloc = self._seqs[dst]
        if dst_alloc.block_table:
            raise ValueError("destination sequence must start with an empty block table")
        live = not dst_alloc.cached
        shared = src_table[:whole + (1 if rest and not copy_last else 0)]
        for p in shared:
            self._pages.hold(p, live)
        dst_alloc.block_table.extend(shared)
        dst_alloc.table_array.extend(shared)
        if rest and copy_last:
            page = src_table[whole]
            self._pages.hold(page, live)
            dst_alloc.pinned_pages.append(page)
            return page
        return None

    def pin_slot(self, seq: SeqId, slot: int) -> None:
        """``seq`` holds another holder's ``slot`` (the state image it is about to copy)."""
        alloc = self._seqs[seq]
        self._slots.hold(slot, not alloc.cached)
        alloc.pinned_slots.append(slot)

    def take_slot(self, seq: SeqId) -> int | None:
        """A fresh slot pinned by ``seq`` (for a state image); None when none is free."""
        if not self._slots.free:
            return None
        alloc = self._seqs[seq]
        slot = self._slots.take(not alloc.cached)
        alloc.pinned_slots.append(slot)
        return slot

    def give_slot(self, src: SeqId, slot: int, dst: SeqId) -> None:
        """Move ``src``'s pin of ``slot`` to become ``dst``'s state slot (an image handed to an entry)."""
        a, b = self._seqs[src], self._seqs[dst]
        if b.state_slot >= 0:
            raise ValueError(f"holder {dst!r} already has state slot {b.state_slot}")
        a.pinned_slots.remove(slot)
        if a.cached != b.cached:
            self._slots.relabel(slot, live_before=not a.cached)
        b.state_slot = slot

    def unpin(self, seq: SeqId) -> None:
        """Drop every pin ``seq`` holds (its copies are done)."""
        alloc = self._seqs[seq]
        live = not alloc.cached
        for p in alloc.pinned_pages:
            self._pages.drop(p, live)
        for s in alloc.pinned_slots:
            self._slots.drop(s, live)
        alloc.pinned_pages, alloc.pinned_slots = [], []

    def convert(self, seq: SeqId, new_id: SeqId, num_tokens: int, *, keep_slot: bool) -> SeqAlloc:
        """A running sequence becomes the cache entry ``new_id`` of its first ``num_tokens``
        positions: pages beyond dropped, pins dropped, its slot kept as the entry's state image
        (``keep_slot``) or freed."""
        if new_id in self._seqs:
            raise KeyError(f"sequence {new_id!r} already allocated")
        alloc = self._seqs[seq]
        if alloc.cached:
            raise ValueError(f"{seq!r} is already a cache entry")
        self.truncate(seq, num_tokens)
        self.unpin(seq)
        if alloc.state_slot >= 0 and not keep_slot:
            self._slots.drop(alloc.state_slot, True)
            alloc.state_slot = -1
        for p in alloc.block_table:
            self._pages.relabel(p, live_before=True)
        if alloc.state_slot >= 0:
            self._slots.relabel(alloc.state_slot, live_before=True)
        alloc.cached = True
        del self._seqs[seq]
        self._seqs[new_id] = alloc
        return alloc

    # -- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariants in the module docstring (tests call this after each op)."""
        self._check_counted(self._pages, self.num_pages,
                            ((a.cached, (*a.block_table, *a.pinned_pages)) for a in self._seqs.values()), "page")
        self._check_counted(self._slots, self.num_state_slots,
                            ((a.cached, (*([a.state_slot] if a.state_slot >= 0 else []), *a.pinned_slots))
                             for a in self._seqs.values()), "slot")
        assert all(list(a.table_array) == a.block_table for a in self._seqs.values()), "table_array != block_table"
        running = [a.state_slot for a in self._seqs.values() if a.state_slot >= 0]
        assert len(set(running)) == len(running), "a state slot is the slot of two holders"

    @staticmethod
    def _check_counted(c: _Counted, n: int, holdings: Iterable[tuple[bool, tuple[int, ...]]], what: str) -> None:
        ref, live = [0] * n, [0] * n
        for cached, ids in holdings:
            for i in ids:
                ref[i] += 1
                live[i] += int(not cached)
        assert ref == c.ref, f"{what} refcounts differ from holdings"
        assert live == c.live, f"{what} running refcounts differ from holdings"
        assert sorted(c.free) == [i for i in range(n) if ref[i] == 0], f"{what} free list mismatch"
        assert c.cached_only == sum(1 for i in range(n) if ref[i] > 0 and live[i] == 0), f"{what} cached-only count"
