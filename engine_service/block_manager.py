"""BlockManager: KV page and recurrent-state slot bookkeeping (pure Python, no torch).

The runner owns the memory (page tensors, state pool); this module owns *who uses which
part of it*. It never touches tensors, so every decision is testable with exact asserts.

Pages
-----
- ``num_pages`` pages of ``page_size`` tokens, ids ``0 .. num_pages-1``. Each page has a
  reference count; a page is free iff its count is 0, and the free list holds exactly the
  free pages (lowest ids handed out first, freed pages go to the back).
- A sequence's block table maps its token position ``t`` to page ``table[t // page_size]``.
  ``ensure(seq, n)`` grows the table to cover ``n`` tokens; ``truncate(seq, n)`` drops the
  pages wholly beyond ``n`` (the page holding position ``n-1`` stays); ``free(seq)`` drops
  the whole table. Dropping a page decrements its count; it returns to the free list only
  when nobody else holds it, so pages shared by ``share_prefix`` survive their first owner.
- Shared pages are read-only by convention: ``share_prefix`` shares whole pages only, and
  the sharer writes its own positions into pages it owns alone.

State slots
-----------
- ``num_state_slots`` slots for recurrent (GDN) state, ids ``0 .. num_state_slots-1``; a
  sequence holds at most one. Attention-only models run with zero slots and every
  sequence's slot is ``-1``.

Snapshots
---------
- ``set_checkpoint(seq, position, snapshot)`` records the sequence's snapshot at a turn
  boundary (the opaque object the runner returned). ``rewind_to_checkpoint(seq)``
  truncates the block table to the checkpoint position and hands the snapshot back so the
  caller restores it into the slot; KV of positions ``< position`` is untouched by later
  steps, so the sequence resumes exactly as if it had stopped there.

Invariant (``check()``): for every page, refcount == number of block tables holding
it; free list == pages with refcount 0; each slot held by at most one
sequence; free slots + held slots == all slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

SeqId = Hashable


class OutOfPages(RuntimeError):
    """Not enough free pages for the request; nothing was allocated."""


class OutOfSlots(RuntimeError):
    """No free state slot; nothing was allocated."""


@dataclass
class SeqAlloc:
    """What one sequence holds."""

    block_table: list[int] = field(default_factory=list)
    state_slot: int = -1
    checkpoint_position: int | None = None
    checkpoint: Any = None  # runner's StateSnapshot (None for attention-only models)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // page_size)


class BlockManager:
    """Refcounted page pool + state-slot pool + per-sequence block tables."""

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
        self._refcount = [0] * num_pages
        self._free_pages: deque[int] = deque(range(num_pages))
        self._free_slots: deque[int] = deque(range(num_state_slots))
        self._seqs: dict[SeqId, SeqAlloc] = {}

    # -- queries -------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def used_slots(self) -> int:
        return self.num_state_slots - len(self._free_slots)

    @property
    def uses_slots(self) -> bool:
        return self.num_state_slots > 0

    def has(self, seq: SeqId) -> bool:
        return seq in self._seqs

    def seq(self, seq: SeqId) -> SeqAlloc:
        return self._seqs[seq]

    def block_table(self, seq: SeqId) -> list[int]:
        return self._seqs[seq].block_table

    def state_slot(self, seq: SeqId) -> int:
        return self._seqs[seq].state_slot

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def extra_pages_needed(self, seq: SeqId | None, num_tokens: int) -> int:
        """New pages ``seq`` (or a new sequence when None/unknown) needs to hold ``num_tokens``."""
        held = len(self._seqs[seq].block_table) if seq is not None and seq in self._seqs else 0
        return max(0, pages_for(num_tokens, self.page_size) - held)

    def can_admit(self, num_tokens: int) -> bool:
        """Would a new sequence of ``num_tokens`` tokens (plus a slot if used) fit now?"""
        if self.uses_slots and not self._free_slots:
            return False
        return pages_for(num_tokens, self.page_size) <= len(self._free_pages)

    # -- sequence lifecycle --------------------------------------------------------------
    def add(self, seq: SeqId) -> SeqAlloc:
        """Register ``seq`` with an empty table and (if slots are used) a state slot."""
        if seq in self._seqs:
            raise KeyError(f"sequence {seq!r} already allocated")
        slot = -1
        if self.uses_slots:
            if not self._free_slots:
                raise OutOfSlots(f"all {self.num_state_slots} state slots are in use")
            slot = self._free_slots.popleft()
        alloc = SeqAlloc(state_slot=slot)
        self._seqs[seq] = alloc
        return alloc

    def ensure(self, seq: SeqId, num_tokens: int) -> list[int]:
        """Grow ``seq``'s table to cover ``num_tokens`` positions; returns the new pages.

        All-or-nothing: raises OutOfPages (allocating nothing) if the pool is short.
        """
        alloc = self._seqs[seq]
        need = self.extra_pages_needed(seq, num_tokens)
        if need > len(self._free_pages):
            raise OutOfPages(f"need {need} more pages, {len(self._free_pages)} free of {self.num_pages}")
        new = [self._free_pages.popleft() for _ in range(need)]
        for p in new:
            self._refcount[p] = 1
        alloc.block_table.extend(new)
        return new

    def truncate(self, seq: SeqId, num_tokens: int) -> list[int]:
        """Drop the pages wholly beyond position ``num_tokens - 1``; returns the dropped ids."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        alloc = self._seqs[seq]
        keep = pages_for(num_tokens, self.page_size)
        dropped = alloc.block_table[keep:]
        del alloc.block_table[keep:]
        self._release_pages(dropped)
        return dropped

    def free(self, seq: SeqId) -> None:
        """Release everything ``seq`` holds (pages, slot, checkpoint) at once."""
        alloc = self._seqs.pop(seq)
        self._release_pages(alloc.block_table)
        alloc.block_table = []
        if alloc.state_slot >= 0:
            self._free_slots.append(alloc.state_slot)
        alloc.state_slot = -1
        alloc.checkpoint = None
        alloc.checkpoint_position = None

    def share_prefix(self, src: SeqId, dst: SeqId, num_tokens: int) -> list[int]:
        """Give ``dst`` (new, empty table) ``src``'s pages for the first ``num_tokens`` tokens.

        Only whole pages are shared (``num_tokens`` must be a multiple of ``page_size``), so
        neither sequence ever writes into a page the other reads.
        """
        if num_tokens % self.page_size:
            raise ValueError(f"can share whole pages only: {num_tokens} % {self.page_size} != 0")
        src_table = self._seqs[src].block_table
        n = num_tokens // self.page_size
        if n > len(src_table):
            raise ValueError(f"source holds {len(src_table)} pages, asked to share {n}")
        dst_alloc = self._seqs[dst]
        if dst_alloc.block_table:
            raise ValueError("destination sequence must start with an empty block table")
        shared = src_table[:n]
        for p in shared:
            self._refcount[p] += 1
        dst_alloc.block_table.extend(shared)
        return list(shared)

    # -- snapshots -----------------------------------------------------------------------
    def set_checkpoint(self, seq: SeqId, position: int, snapshot: Any) -> None:
        """Record ``seq``'s state snapshot taken after exactly ``position`` tokens."""
        alloc = self._seqs[seq]
        if position < 1 or position > len(alloc.block_table) * self.page_size:
            raise ValueError(f"checkpoint position {position} outside the sequence's pages")
        alloc.checkpoint_position = position
        alloc.checkpoint = snapshot

    def rewind_to_checkpoint(self, seq: SeqId) -> tuple[int, Any]:
        """Truncate ``seq`` to its checkpoint; return ``(position, snapshot)`` to restore."""
        alloc = self._seqs[seq]
        if alloc.checkpoint_position is None:
            raise ValueError(f"sequence {seq!r} has no checkpoint")
        self.truncate(seq, alloc.checkpoint_position)
        return alloc.checkpoint_position, alloc.checkpoint

    # -- internals -----------------------------------------------------------------------
    def _release_pages(self, pages: Sequence[int]) -> None:
        for p in pages:
            rc = self._refcount[p]
            if rc <= 0:
                raise AssertionError(f"page {p} released with refcount {rc}")
            self._refcount[p] = rc - 1
            if rc == 1:
                self._free_pages.append(p)

    def check(self) -> None:
        """Assert the invariants in the module docstring (tests call this after each op)."""
        counts = [0] * self.num_pages
        slots: list[int] = []
        for alloc in self._seqs.values():
            for p in alloc.block_table:
                counts[p] += 1
            if alloc.state_slot >= 0:
                slots.append(alloc.state_slot)
        assert counts == self._refcount, "refcounts differ from block-table holdings"
        free = sorted(self._free_pages)
        assert free == [p for p in range(self.num_pages) if counts[p] == 0], "free list mismatch"
        assert len(set(slots)) == len(slots), "a state slot is held twice"
        assert sorted(slots + list(self._free_slots)) == list(range(self.num_state_slots)), "slot leak"
