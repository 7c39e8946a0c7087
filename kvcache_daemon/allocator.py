"""Granule allocator: the arena is ``num_granules`` granules; free space is a sorted list of runs.

An allocation is a scatter-gather list of runs (``(start, length)`` in granules), so a fit
never fails while enough granules are free. Policy: one best-fit run when a single run is
long enough (smallest run that fits, lowest start on ties); otherwise the longest runs
first, the last piece best-fit. Invariants (checked by ``check``): free runs are sorted,
disjoint, non-adjacent (always coalesced) and inside the arena; ``free_granules`` equals
their sum.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

Run = tuple[int, int]  # (start granule, length in granules)


class AllocatorError(RuntimeError):
    """Internal inconsistency (double free, overlapping mark): a bug, never client input."""


class GranuleAllocator:
    def __init__(self, num_granules: int) -> None:
        if num_granules <= 0:
            raise ValueError("num_granules must be > 0")
        self.num_granules = num_granules
        self._starts: list[int] = [0]
        self._lens: list[int] = [num_granules]
        self.free_granules = num_granules

    # -- queries ---------------------------------------------------------------------
    def free_runs(self) -> list[Run]:
        return list(zip(self._starts, self._lens))

    def largest_free_run(self) -> int:
        return max(self._lens, default=0)

    # -- allocation ------------------------------------------------------------------
    def plan(self, n: int) -> list[Run] | None:
        """The runs ``allocate(n)`` would take (without taking them); None if n > free."""
        if n <= 0:
            raise ValueError("allocation must be > 0 granules")
        if n > self.free_granules:
            return None
        best = self._best_fit(n, exclude=())
        if best is not None:
            return [(self._starts[best], n)]
        order = sorted(range(len(self._starts)), key=lambda i: (-self._lens[i], self._starts[i]))
        runs: list[Run] = []
        left = n
        used: set[int] = set()
        for i in order:
            if left == 0:
                break
            if self._lens[i] >= left:
                j = self._best_fit(left, exclude=used)
                i = j if j is not None else i
                runs.append((self._starts[i], left))
                left = 0
                break
            runs.append((self._starts[i], self._lens[i]))
            used.add(i)
            left -= self._lens[i]
        return runs

    def allocate(self, n: int) -> list[Run] | None:
        runs = self.plan(n)
        if runs is None:
            return None
        for start, length in runs:
            self.mark_used(start, length)
        return runs

    def first_fit_below(self, n: int, limit: int) -> int | None:
        """Lowest start of a free run holding n granules that ends at or below ``limit``."""
        for s, ln in zip(self._starts, self._lens):
            if s + n > limit:
                return None
            if ln >= n:
                return s
        return None

    def _best_fit(self, n: int, exclude: Iterable[int]) -> int | None:
        ex = set(exclude)
        best: int | None = None
        for i, ln in enumerate(self._lens):
            if ln >= n and i not in ex and (best is None or ln < self._lens[best]):
                best = i
        return best

    def mark_used(self, start: int, length: int) -> None:
        """Take [start, start+length), which must lie inside one free run."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or length <= 0 or start + length > self._starts[i] + self._lens[i]:
            raise AllocatorError(f"granules [{start}, {start + length}) are not free")
        s, ln = self._starts[i], self._lens[i]
        del self._starts[i], self._lens[i]
        tail = (s + ln) - (start + length)
        if tail > 0:
            self._starts.insert(i, start + length)
            self._lens.insert(i, tail)
        if start > s:
            self._starts.insert(i, s)
            self._lens.insert(i, start - s)
        self.free_granules -= length

    def free(self, runs: Sequence[Run]) -> None:
        for start, length in runs:
            self._free_one(start, length)

    def _free_one(self, start: int, length: int) -> None:
        if length <= 0 or start < 0 or start + length > self.num_granules:
            raise AllocatorError(f"bad run ({start}, {length})")
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < start + length:
            raise AllocatorError(f"double free of granules [{start}, {start + length})")
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] > start:
            raise AllocatorError(f"double free of granules [{start}, {start + length})")
        merge_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == start
        merge_next = i < len(self._starts) and self._starts[i] == start + length
        if merge_prev and merge_next:
            self._lens[i - 1] += length + self._lens[i]
            del self._starts[i], self._lens[i]
        elif merge_prev:
            self._lens[i - 1] += length
        elif merge_next:
            self._starts[i] = start
            self._lens[i] += length
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, length)
        self.free_granules += length

    def check(self) -> None:
        """Raise AllocatorError unless the free list is sorted, disjoint, coalesced, in range."""
        prev_end = -1
        total = 0
        for s, ln in zip(self._starts, self._lens):
            if ln <= 0 or s < 0 or s + ln > self.num_granules or s <= prev_end:
                raise AllocatorError(f"free list corrupt at ({s}, {ln})")
            prev_end = s + ln
            total += ln
        if total != self.free_granules:
            raise AllocatorError(f"free count {self.free_granules} != sum of runs {total}")
