"""``HostTier``: prefix-cache entries spilled to the KV-cache daemon and restored from it
(levels 3 ``host_entry`` and 4 ``session_lookup``). The only module that talks to the daemon.

Spill (an entry the device is about to drop for memory, or every entry at shutdown):
``Reserve(identity, layout, tokens)`` -> the runner writes the entry's pages and state image
into the reserved arena extents -> ``Commit`` once the copy is complete (on CUDA after the
device is synchronized). Only a committed entry can ever match; a spill that fails anywhere
is aborted (or never committed) and the entry is simply dropped.

Restore (a request whose prompt the daemon matches further than the device cache does):
``Lookup(pin)`` -> the runner reads the matched prefix's pages (and the image) into the
request's own pages and slot -> ``Release(ok)``; only when the daemon confirms the release
(same epoch: the bytes were leased the whole time) are the bytes used, otherwise the request
is computed from scratch. Every daemon trouble (down, slow, restarted: STALE, full, refused)
is a miss: ``KVClient`` never raises, times out fast and reconnects in the background.

Identity: tenant, the model / layout fingerprint (``cache.identity``), per-token metadata
digest, session key, exact tokens; the frontier kind is ``EXEC`` for an ended sequence and
``CHECKPOINT`` for a turn / shared-prefix checkpoint.

Asynchronous: ``spill_async`` / ``restore_async`` run the whole exchange (RPCs and copies) on
one worker thread and, on CUDA, on a copy stream of their own that first waits for what the
compute stream had queued when the job was made (an event), so decode steps of other sequences
go on meanwhile. The caller keeps the memory involved allocated until the job's future is done
(``cache.resident`` keeps a spilling entry's pages; the scheduler keeps a restoring request out
of steps). ``spill`` / ``restore`` are the same exchange on the calling thread (shutdown, tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from deepwell.kvcache.v1 import kvcache_pb2 as pb
from deepwell.kvclient.arena import ArenaMap, as_extents
from deepwell.kvclient.client import KVClient
from deepwell.logs import get_logger
from deepwell.engine_service.cache import pinning
from deepwell.engine_service.cache.identity import EntryShape
from deepwell.engine_service.cache.types import Level
from deepwell.engine_service.kv.pool import Region

log = get_logger(__name__)

LOCK_WAIT_S = 30.0  # how long the background page-locking waits for the daemon at attach


class EntryBytes(Protocol):
    """The runner's side: an entry's bytes in and out of the pools (``TorchModelRunner``)."""

    @property
    def device(self) -> torch.device: ...

    def entry_nbytes(self, num_pages: int, with_state: bool) -> int: ...

    def export_kv(self, pages: Sequence[int], slot: int, out: Region) -> None: ...

    def import_kv(self, pages: Sequence[int], slot: int, position: int, src: Region, entry_pages: int) -> None: ...


@dataclass(frozen=True)
class HostLease:
    """A pinned host entry matching ``tokens`` positions of a prompt."""

    lease: Any  # pb.Handle
    extents: list[tuple[int, int]]
    shape: EntryShape
    tokens: int
    level: Level
    arena: ArenaMap


@dataclass
class HostCounters:
    spills: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    restores: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    spilled_bytes: int = 0
    restored_bytes: int = 0
    lookups: int = 0
    hits: int = 0


Observer = Callable[[str, float, int, bool], None]  # (spill | restore, seconds, bytes, ok)


class HostTier:
    def __init__(self, client: KVClient, runner: EntryBytes, *, fingerprint: bytes, page_size: int, hybrid: bool,
                 observer: Observer | None = None) -> None:
        self.client = client
        self.runner = runner
        self.fingerprint = fingerprint
        self.page_size = page_size
        self.hybrid = hybrid
        self.observer = observer
        self.counters = HostCounters()
        self.page_nbytes = runner.entry_nbytes(1, False)
        self.state_nbytes = runner.entry_nbytes(0, True) if hybrid else 0
        # test seam: called after a copy, before the daemon confirms it ("spill" / "restore")
        self.after_copy: Callable[[str], None] | None = None
        self._arena: tuple[ArenaMap, torch.Tensor] | None = None
        self._pin: pinning.Pin | None = None  # the arena's page-locking (CUDA), released before it is dropped
        self._arena_lock = threading.Lock()  # the worker's first lock and a caller's spill may race
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-tier")
        self._closing = threading.Event()
        cuda = runner.device.type == "cuda"
        self._stream = torch.cuda.Stream(runner.device) if cuda else None
        if cuda:  # page-lock the arena now, not in the first spill (seconds for a large arena)
            self._worker.submit(self._lock_arena)

    def _lock_arena(self) -> None:
        """Page-lock the arena once the client attaches (up to ``LOCK_WAIT_S``; else the first
        spill does it); ``close`` cuts the wait short."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while not self._closing.is_set() and time.monotonic() < deadline:
            if self.client.wait_attached(0.25):
                if self.client.arena is not None:
                    self._region(self.client.arena, [], 0)
                return

    def close(self) -> None:
        """Finish the jobs in flight, then stop the worker (the client is the caller's)."""
        self._closing.set()
        self._worker.shutdown(wait=True)
        with self._arena_lock:
            self._unregister()

    def _unregister(self) -> None:
        """Drop the arena's page-locking (before its mapping can go away)."""
        if self._pin is not None:
            self._pin.release()
        self._arena, self._pin = None, None

    # -- asynchronous jobs -----------------------------------------------------------------
    def _submit(self, fn: Callable[[], bool]) -> Future[bool]:
        ready = None
        if self._stream is not None:  # the copy stream starts after what the compute stream queued so far
            ready = torch.cuda.Event()
            ready.record()

        def job() -> bool:
            ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
            with ctx:
                if ready is not None:
                    self._stream.wait_event(ready)  # type: ignore[union-attr]
                return fn()
        return self._worker.submit(job)

    def spill_async(self, **kw: Any) -> Future[bool]:
        """``spill`` on the worker; the entry's pages and slot must stay allocated until it is done."""
        return self._submit(lambda: self.spill(**kw))

    def restore_async(self, lease: HostLease, pages: Sequence[int], slot: int) -> Future[bool]:
        """``restore`` on the worker; the pages and slot must stay out of steps until it is done."""
        pages = list(pages)
        return self._submit(lambda: self.restore(lease, pages, slot))

    @property
    def available(self) -> bool:
        return self.client.available

    # -- arena -----------------------------------------------------------------------------
    def _region(self, arena: ArenaMap, extents: list[tuple[int, int]], nbytes: int) -> Region:
        with self._arena_lock:
            if self._arena is None or self._arena[0] is not arena:  # first use, or a restarted daemon's arena
                self._unregister()
                whole = torch.frombuffer(arena.map, dtype=torch.uint8, count=arena.size)
                if self.runner.device.type == "cuda":  # page-locked: device copies at full speed, async
                    self._pin = pinning.Pin(whole, whole.data_ptr(), arena.size)
                self._arena = (arena, whole)
            whole = self._arena[1]
        segments, need = [], nbytes
        for off, length in extents:
            if need <= 0:
                break
            take = min(length, need)
            segments.append(whole[off:off + take])
            need -= take
        if need > 0:
            raise ValueError(f"extents hold {nbytes - need} bytes, the entry needs {nbytes}")
        return Region(segments)

    def _sync(self) -> None:
        """Wait for this thread's copies (the copy stream on the worker, else the current one)."""
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()

    # -- spill -----------------------------------------------------------------------------
    def spill(self, *, tokens: np.ndarray, pages: Sequence[int], slot: int, tenant: str, metadata_digest: bytes,
              session: str, checkpoint: bool) -> bool:
        """Write an entry (``tokens``, its ``pages`` and state image ``slot``) to the daemon; True
        once the daemon has committed it."""
        if not self.available:
            return False
        t0 = time.monotonic()
        shape = EntryShape(len(pages), self.page_nbytes, self.state_nbytes)
        ident = pb.Identity(tenant=tenant, model_fingerprint=self.fingerprint, session_key=session,
                            metadata_digest=metadata_digest,
                            frontier_kind=pb.FRONTIER_KIND_CHECKPOINT if checkpoint else pb.FRONTIER_KIND_EXEC,
                            frontier_position=len(tokens), num_tokens=len(tokens), page_size=self.page_size,
                            requires_state=self.hybrid)
        res = self.client.reserve(ident, shape.layout(), tokens)
        arena = self.client.arena
        if not res.ok or res.reply is None or arena is None:
            return self._spilled(t0, 0, False, f"reserve: {res.code.name} {res.message}")
        handle = res.reply.reservation
        try:
            region = self._region(arena, as_extents(res.reply.extents), shape.total)
            self.runner.export_kv(pages, slot if self.hybrid else -1, region)
            self._sync()
            if self.after_copy is not None:
                self.after_copy("spill")
        except Exception as exc:  # the copy failed: publish nothing
            self.client.commit(handle, [], success=False)
            return self._spilled(t0, 0, False, f"copy: {exc}")
        done = self.client.commit(handle, shape.part_names)
        return self._spilled(t0, shape.total, done.ok, "" if done.ok else f"commit: {done.code.name} {done.message}")

    def _spilled(self, t0: float, nbytes: int, ok: bool, why: str) -> bool:
        self.counters.spills["ok" if ok else "failed"] += 1
        self.counters.spilled_bytes += nbytes if ok else 0
        if not ok:
            log.info("host_spill_failed", reason=why)
        if self.observer is not None:
            self.observer("spill", time.monotonic() - t0, nbytes, ok)
        return ok

    # -- lookup / restore ------------------------------------------------------------------
    def lookup(self, tokens: np.ndarray, *, tenant: str, metadata_digest: bytes, session: str) -> HostLease | None:
        """The daemon's longest usable entry for a prompt, pinned; None on a miss or any trouble."""
        if not self.available:
            return None
        self.counters.lookups += 1
        res = self.client.lookup(tenant, self.fingerprint, tokens, metadata_digest=metadata_digest,
                                 session_key=session, pin=True)
        reply, arena = res.reply, self.client.arena
        if not res.ok or reply is None or not reply.hit or not reply.HasField("lease") or arena is None:
            return None
        shape = EntryShape.parse(reply.layout, self.page_nbytes, self.state_nbytes)
        n = int(reply.matched_tokens)
        if shape is None or not 0 < n < len(tokens) or -(-n // self.page_size) > shape.pages:
            log.warning("host_entry_unreadable", matched=n, descriptor=reply.layout.descriptor[:200].decode(errors="replace"))
            self.client.release(reply.lease, ok=False)
            return None
        self.counters.hits += 1
        level = Level.SESSION_LOOKUP if reply.source == pb.MATCH_SOURCE_SESSION else Level.HOST_ENTRY
        return HostLease(reply.lease, as_extents(reply.extents), shape, n, level, arena)

    def restore(self, lease: HostLease, pages: Sequence[int], slot: int) -> bool:
        """Read the lease's first ``lease.tokens`` positions into ``pages`` (and the image into
        ``slot``), then release the lease; True only when the daemon confirms the bytes were
        leased the whole time (then they are used)."""
        t0 = time.monotonic()
        need = -(-lease.tokens // self.page_size)
        try:
            region = self._region(lease.arena, lease.extents, lease.shape.total)
            self.runner.import_kv(pages[:need], slot if self.hybrid else -1, lease.tokens, region, lease.shape.pages)
            self._sync()
            if self.after_copy is not None:
                self.after_copy("restore")
        except Exception as exc:
            self.client.release(lease.lease, ok=False)
            return self._restored(t0, 0, False, f"copy: {exc}")
        done = self.client.release(lease.lease, ok=True)
        nbytes = need * self.page_nbytes + self.state_nbytes
        return self._restored(t0, nbytes, done.ok, "" if done.ok else f"release: {done.code.name} {done.message}")

    def release(self, lease: HostLease) -> None:
        """Give back a lease that was not used (recency unchanged)."""
        self.client.release(lease.lease, ok=False)

    def _restored(self, t0: float, nbytes: int, ok: bool, why: str) -> bool:
        self.counters.restores["ok" if ok else "failed"] += 1
        self.counters.restored_bytes += nbytes if ok else 0
        if not ok:
            log.info("host_restore_failed", reason=why)
        if self.observer is not None:
            self.observer("restore", time.monotonic() - t0, nbytes, ok)
        return ok
