"""Structural invariants of the core, checked after every step of the model-based fuzz.

No two entries share a granule; free runs and owned granules partition the arena;
every entry's charged bytes cover its layout; only COMMITTED entries are matchable and in
the LRU; leases, reservations and takes are consistent with their owners; charged
granules never exceed the budget (DESIGN invariants 1, 2, 5).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model import State

if TYPE_CHECKING:
    from .core import Core


def check(core: Core) -> None:
    core.alloc.check()
    owner = [0] * core.alloc.num_granules
    for e in core.entries.values():
        assert sum(n for _, n in e.runs) * core.G == e.nbytes >= e.layout.total_bytes
        for s, n in e.runs:
            for g in range(s, s + n):
                assert owner[g] == 0, f"granule {g} owned twice"
                owner[g] = e.id
        assert (e.id in core.index) == (e.state is State.COMMITTED)
        assert (e.id in core.lru) == (e.state is State.COMMITTED)
        for lid in e.leases:
            assert core.leases[lid].entry_id == e.id
    for s, n in core.alloc.free_runs():
        assert all(owner[g] == 0 for g in range(s, s + n)), "free run overlaps an entry"
    assert sum(1 for o in owner if o) == core._used_g(), "granules neither free nor owned"
    assert core._used_g() <= core.budget_g, "charged granules exceed the budget"
    for lease in core.leases.values():
        assert lease.id in core.clients[lease.client].leases
    for c in core.clients.values():
        for rid in c.reservations:
            assert core.entries[rid].state is State.RESERVED and core.entries[rid].owner == c.id
        for tid, eid in c.takes.items():
            assert core.entries[eid].state is State.TAKEN and core.entries[eid].take_id == tid
