"""The prefix cache's value types: reuse levels, entry kinds, entries, hits, restores, counters."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum

from deepwell.engine_service.cache.index import Ledger, Owner


class Level(Enum):
    """Where reused tokens came from; the values are ``CacheHits`` field names."""

    RESIDENT_FRONTIER = "resident_frontier"
    RESIDENT_CHECKPOINT = "resident_checkpoint"
    HOST_ENTRY = "host_entry"
    SESSION_LOOKUP = "session_lookup"
    SHARED_PREFIX = "shared_prefix"


class Kind(Enum):
    EXEC = "exec"
    TURN = "turn"
    PREFIX = "prefix"


@dataclass(eq=False)
class Entry:
    id: int
    owner: Owner
    ledger: Ledger
    kind: Kind
    anchor: bool = False
    cheap: bool = False  # EXEC with its own turn checkpoint close below: losing it costs little
    spilling: bool = False  # evicted, its spill in flight: still matched until the copy is done

    @property
    def keep_rank(self) -> int:
        """Eviction takes the lowest rank first (LRU within a rank): 0 ended sequences covered by
        a checkpoint of their own, 1 the rest, 2 anchors and shared prefixes (what new user
        turns and new sessions resume from)."""
        if self.kind is Kind.PREFIX or (self.kind is Kind.TURN and self.anchor):
            return 2
        return 0 if self.cheap else 1

    @property
    def scope(self) -> bytes:
        return self.owner.scope

    @property
    def holder(self) -> Hashable:
        """Its id in the block manager."""
        return ("entry", self.id)

    def __len__(self) -> int:
        return len(self.ledger)


@dataclass(frozen=True)
class Hit:
    entry: Entry
    tokens: int  # positions reused: the request starts at num_computed = tokens
    level: Level
    branch: bool  # a TURN entry agreed with the prompt beyond the reuse point


@dataclass(frozen=True)
class Restore:
    """What the engine does before a reusing request's first step (outside the lock)."""

    image_slot: int = -1  # copy this state image into the request's slot (-1: none, attention-only)
    copy_page: tuple[int, int] | None = None  # (source page, the request's page): copy-on-write
    state_ready: bool = False  # the slot already holds the state (restored from the host): no reset


@dataclass
class CacheCounters:
    lookups: int = 0
    hits: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {lv.value: 0 for lv in Level})
    inserted: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in Kind})
    evictions: dict[str, int] = field(default_factory=lambda: {c: 0 for c in EVICTION_CAUSES})
    checkpoints_skipped: int = 0  # no state slot could be had for the image


EVICTION_CAUSES = ("pressure", "superseded", "chain")
CHEAP_GAP = 4096  # an ended sequence within this many tokens (or a quarter) of a checkpoint is cheap
SHADOW_ENTRIES = 4096  # spilled entries remembered for host_hint
