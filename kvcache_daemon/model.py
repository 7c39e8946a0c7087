"""Records and typed results of the daemon core (no I/O, no gRPC).

Object states (one entry)::

    Reserve ─▶ RESERVED ─Commit(ok, all parts)─▶ COMMITTED ─Take(lease)─▶ TAKEN
                  │  └─Commit(fail)/Abort/INCOMPLETE/reclaim─▶ freed      │  ├─ReAdd─▶ COMMITTED
                  │                                                       │  └─Drop─▶ freed
    COMMITTED ─Delete/evict/supersede─▶ freed (or DOOMED while leased, freed at last Release)

Only COMMITTED entries are in the match index. RESERVED, TAKEN, DOOMED and leased entries
are never moved, evicted or written by the daemon.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from deepwell.kvcache.v1 import kvcache_pb2 as pb

from .allocator import Run

Code = int  # a deepwell.kvcache.v1.ErrorCode value
OK: Code = pb.ERROR_CODE_OK
STALE: Code = pb.ERROR_CODE_STALE
NOT_FOUND: Code = pb.ERROR_CODE_NOT_FOUND
EXHAUSTED: Code = pb.ERROR_CODE_RESOURCE_EXHAUSTED
QUOTA: Code = pb.ERROR_CODE_QUOTA_EXCEEDED
INVALID: Code = pb.ERROR_CODE_INVALID
INCOMPLETE: Code = pb.ERROR_CODE_INCOMPLETE
UNKNOWN_CLIENT: Code = pb.ERROR_CODE_UNKNOWN_CLIENT

Handle = tuple[int, int, int]  # (epoch, id, generation)
Extent = tuple[int, int]  # (byte offset, byte length)

STATE_ROLES = (pb.PART_ROLE_RECURRENT_STATE,)


class BadRequest(ValueError):
    """A malformed request (maps to gRPC INVALID_ARGUMENT); the state is unchanged."""


class State(enum.Enum):
    RESERVED = "reserved"
    COMMITTED = "committed"
    TAKEN = "taken"
    DOOMED = "doomed"  # deleted/superseded while leased: freed when the last lease ends


@dataclass
class Entry:
    id: int
    generation: int
    state: State
    owner: str  # reserving or taking client ("" when committed)
    identity: pb.Identity  # page_digests cleared; num_tokens = len(tokens)
    layout: pb.Layout
    tokens: np.ndarray
    scope: bytes
    runs: list[Run]
    nbytes: int  # charged bytes (whole granules)
    leases: set[int] = field(default_factory=set)
    take_id: int = 0


@dataclass
class Lease:
    id: int
    entry_id: int
    generation: int
    client: str
    created: float
    nbytes: int


@dataclass
class Client:
    id: str
    name: str
    pid: int
    attached: bool = True
    detached_at: float = 0.0
    leases: set[int] = field(default_factory=set)
    reservations: set[int] = field(default_factory=set)
    takes: dict[int, int] = field(default_factory=dict)  # take id -> entry id
    ops: OrderedDict[str, object] = field(default_factory=OrderedDict)


@dataclass(frozen=True)
class Failure:
    code: Code
    message: str


@dataclass(frozen=True)
class Reserved:
    reservation: Handle
    extents: list[Extent]
    evicted: int


@dataclass(frozen=True)
class Committed:
    entry: Handle
    superseded: list[Handle]


@dataclass(frozen=True)
class Match:
    entry: Handle
    matched_tokens: int
    identity: pb.Identity
    layout: pb.Layout
    via_session: bool
    lease: Handle | None
    extents: list[Extent]
    refused: Failure | None = None  # a pin asked for and refused (quota): the match is still reported


@dataclass(frozen=True)
class Taken:
    take: Handle
    extents: list[Extent]


@dataclass(frozen=True)
class Done:
    """Success with nothing to return (Abort, Release, Drop, Delete); ``noop`` marks a repeat."""

    noop: bool = False
    entry: Handle | None = None


@dataclass(frozen=True)
class Compacted:
    entries_moved: int
    bytes_moved: int
    elapsed_ms: float
    largest_free_run_bytes: int


@dataclass(frozen=True)
class Holdings:
    client_id: str
    client_name: str
    leases: int
    reservations: int
    takes: int
    pinned_bytes: int
    oldest_lease_age_s: float
    attached: bool


@dataclass(frozen=True)
class Snapshot:
    epoch: int
    arena_bytes: int
    budget_bytes: int
    committed_bytes: int
    reserved_bytes: int
    taken_bytes: int
    free_bytes: int
    largest_free_run_bytes: int
    fragmentation: float
    entries: int
    evictions: int
    compactions: int
    compaction_bytes_moved: int
    leases: int
    oldest_lease_age_s: float
    clients: list[Holdings]
    lookups: int
    hits: int
