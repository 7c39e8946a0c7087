"""Bounded, time-sliced compaction: coalesce free runs by moving unleased entries down.

One step moves the movable entry (COMMITTED, no lease) that ends highest into the lowest
free run that holds it whole and lies entirely below its current first granule: copy the
bytes, publish the new runs, bump the entry's generation (old handles answer STALE), free
the old runs. Entries only move down, so a pass terminates; it also stops at the deadline
(checked between moves) or once ``target_run`` granules are contiguous. Leased, reserved,
taken and doomed entries never move (DESIGN invariant 2).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .model import Compacted, Entry, State

if TYPE_CHECKING:
    from .core import Core


def compact(core: Core, max_ms: float, target_run: int | None) -> Compacted:
    """Move unleased committed entries into single low runs; stops at the deadline,
    when ``target_run`` granules are contiguous, or when nothing can move down."""
    t0 = time.perf_counter()
    deadline = t0 + max_ms / 1000.0
    moved = moved_bytes = 0
    progress = True
    while progress and time.perf_counter() < deadline:
        if target_run is not None and core.alloc.largest_free_run() >= target_run:
            break
        progress = False
        movable = [e for e in core.entries.values() if e.state is State.COMMITTED and not e.leases]
        movable.sort(key=lambda e: -max(s + n for s, n in e.runs))
        for e in movable:
            n = sum(ln for _, ln in e.runs)
            dest = core.alloc.first_fit_below(n, min(s for s, _ in e.runs))
            if dest is None:
                continue
            moved_bytes += _move(core, e, dest, n)
            moved += 1
            progress = True
            break
    if moved:
        core.compactions += 1
        core.compaction_bytes += moved_bytes
    return Compacted(moved, moved_bytes, (time.perf_counter() - t0) * 1000.0,
                     core.alloc.largest_free_run() * core.G)


def _move(core: Core, e: Entry, dest: int, n: int) -> int:
    """Copy e's bytes to granules [dest, dest+n) (all below its old runs), then publish."""
    core.alloc.mark_used(dest, n)
    length = int(e.layout.total_bytes)
    if core.arena is not None:
        pos = dest * core.G
        left = length
        for s, ln in e.runs:
            k = min(ln * core.G, left)
            if k <= 0:
                break
            core.arena[pos:pos + k] = core.arena[s * core.G:s * core.G + k]
            pos += k
            left -= k
    core.alloc.free(e.runs)
    e.runs = [(dest, n)]
    e.generation += 1
    if core.journal is not None:
        core.journal.move(e)
    return length
