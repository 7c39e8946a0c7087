"""The live sessions view: what the engine holds for each session key, and its last turn.

Two sources, both already the engine's own:

- ``SessionLedger``: a small, bounded (LRU, ``DEFAULT_CAPACITY`` sessions) record per session of
  when it was first and last seen, how many of its requests run, and its last finished request
  (prompt tokens, cached tokens by level, engine-side TTFT). ``EngineCore`` feeds it where a
  request is queued (``started``) and where it finishes (``finished``: every request gets exactly
  one ``Finished``, whatever ends it). It has its own lock: the step loop writes it on its own
  thread while the gRPC service reads it from the asyncio loop's executor.
- The prefix cache (``cache.resident``): the resident entries (owner tenant / session, tokens,
  pages, state image) and the shadow index of the entries this engine spilled to the host tier.

``collect`` joins them under the engine lock into ``SessionRow``s (the ``Sessions`` RPC's
``SessionInfo``). Requests without a session key are not listed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from deepwell.engine_service.block_manager import pages_for
from deepwell.engine_service.cache.index import is_prefix
from deepwell.engine_service.cache.types import Entry, Kind

DEFAULT_CAPACITY = 1000  # sessions whose requests the ledger remembers (least recently seen forgotten)


@dataclass(frozen=True)
class Turn:
    """A session's last finished request."""

    prompt_tokens: int
    cached: dict[str, int]  # prompt tokens reused, by CacheHits level
    ttft_ms: float  # arrival to first generated token (0: none was generated)
    completion_tokens: int = 0
    reason: str = ""  # scheduler.Finish value

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class SessionRecord:
    tenant: str
    session_key: str
    first_seen: float  # clock() values
    last_seen: float
    running: int = 0  # requests queued or running now
    requests: int = 0  # requests seen
    last_turn: Turn | None = None


class SessionLedger:
    """The most recently seen ``capacity`` sessions, keyed by (tenant, session key). Thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        self._lock = threading.Lock()
        self._records: OrderedDict[tuple[str, str], SessionRecord] = OrderedDict()  # least recently seen first

    def _touch(self, tenant: str, session_key: str, now: float) -> SessionRecord:
        key = (tenant, session_key)
        rec = self._records.get(key)
        if rec is None:
            rec = self._records[key] = SessionRecord(tenant, session_key, now, now)
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(key)
        rec.last_seen = now
        return rec

    def started(self, tenant: str, session_key: str) -> None:
        """A request of the session was queued."""
        if not session_key:
            return
        with self._lock:
            rec = self._touch(tenant, session_key, self.clock())
            rec.running += 1
            rec.requests += 1

    def finished(self, tenant: str, session_key: str, turn: Turn) -> None:
        """A request of the session finished (any reason)."""
        if not session_key:
            return
        with self._lock:
            rec = self._touch(tenant, session_key, self.clock())
            rec.running = max(0, rec.running - 1)  # (0 when the record was forgotten meanwhile)
            rec.last_turn = turn

    def records(self) -> list[SessionRecord]:
        """Copies, most recently seen first."""
        with self._lock:
            return [replace(r) for r in reversed(self._records.values())]

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


@dataclass
class SessionRow:
    """One session as the ``Sessions`` RPC reports it."""

    tenant: str
    session_key: str
    resident_tokens: int = 0
    host_tokens: int = 0
    resident_entries: int = 0
    host_entries: int = 0
    resident_bytes: int = 0
    host_bytes: int = 0
    last_turn: Turn | None = None
    age_s: float | None = None  # None: the ledger no longer remembers its requests
    idle_s: float | None = None
    running: int = 0
    requests: int = 0
    _pages: set[int] = field(default_factory=set, repr=False)
    _slots: set[int] = field(default_factory=set, repr=False)

    @property
    def cached_tokens(self) -> int:
        return max(self.resident_tokens, self.host_tokens)

    @property
    def placement(self) -> str:
        """none | resident | host | both"""
        return {(False, False): "none", (True, False): "resident", (False, True): "host",
                (True, True): "both"}[(self.resident_entries > 0, self.host_entries > 0)]


def live_host_entries(spilled: Iterable[Entry], hybrid: bool) -> list[Entry]:
    """Of one session's spilled entries (oldest spill first), those the daemon keeps by its own
    supersede rule: a committed entry replaces the session's entries whose tokens are a prefix of
    its own, except (hybrid) checkpoints, whose state image exists nowhere else. (The daemon may
    still have evicted some of them for room: the engine does not know.)"""
    live: list[Entry] = []
    for new in spilled:
        keep = []
        for old in live:
            same = len(old) == len(new) and is_prefix(old.ledger.tokens, old.ledger.digests,
                                                      new.ledger.tokens, new.ledger.digests)
            image = hybrid and old.kind is not Kind.EXEC
            shorter = len(old) < len(new) and is_prefix(old.ledger.tokens, old.ledger.digests,
                                                        new.ledger.tokens, new.ledger.digests)
            if not same and not (shorter and not image):
                keep.append(old)
        live = keep + [new]
    return live


def collect(core: Any, tenant: str = "", limit: int = 0) -> list[SessionRow]:
    """Every known session of ``core`` (an ``EngineCore``), most recently active first: the
    ledger's sessions, then those only cache entries still name (longest cached first)."""
    ledger: SessionLedger = core.sessions
    records = ledger.records()
    now = ledger.clock()
    rows: dict[tuple[str, str], SessionRow] = {}

    def row(t: str, key: str) -> SessionRow:
        r = rows.get((t, key))
        if r is None:
            r = rows[(t, key)] = SessionRow(t, key)
        return r

    with core.lock:
        cache = core.cache
        if cache is not None:
            blocks, spec = core.blocks, core.spec
            for e in cache.entries.values():
                o = e.owner
                if not o.session or (tenant and o.tenant != tenant):
                    continue
                r = row(o.tenant, o.session)
                r.resident_entries += 1
                r.resident_tokens = max(r.resident_tokens, len(e))
                r._pages.update(blocks.block_table(e.holder))
                slot = blocks.state_slot(e.holder)
                if slot >= 0:
                    r._slots.add(slot)
            for r in rows.values():
                r.resident_bytes = len(r._pages) * spec.bytes_per_page + len(r._slots) * spec.bytes_per_state_slot
                r._pages, r._slots = set(), set()
            host = cache.host
            spilled: dict[tuple[str, str], list[Entry]] = {}
            # the shadow index: the entries this engine spilled (and the daemon may still hold)
            for e in cache.spilled_entries():
                o = e.owner
                if o.session and (not tenant or o.tenant == tenant):
                    spilled.setdefault((o.tenant, o.session), []).append(e)
            for (t, key), entries in spilled.items():
                live = live_host_entries(entries, cache.hybrid)
                r = row(t, key)
                r.host_entries = len(live)
                r.host_tokens = max(len(e) for e in live)
                if host is not None:
                    r.host_bytes = sum(pages_for(len(e), cache.page_size) * host.page_nbytes + host.state_nbytes
                                       for e in live)
    ordered: list[SessionRow] = []
    for rec in records:
        if tenant and rec.tenant != tenant:
            continue
        r = rows.pop((rec.tenant, rec.session_key), None) or SessionRow(rec.tenant, rec.session_key)
        r.last_turn = rec.last_turn
        r.age_s = max(0.0, now - rec.first_seen)
        r.idle_s = 0.0 if rec.running else max(0.0, now - rec.last_seen)
        r.running, r.requests = rec.running, rec.requests
        ordered.append(r)
    ordered += sorted(rows.values(), key=lambda r: (-r.cached_tokens, r.tenant, r.session_key))
    return ordered[:limit] if limit else ordered
