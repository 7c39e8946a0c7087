"""The async gRPC servicer: decodes requests, calls the synchronous ``Core``, encodes replies.

Every core call runs on the event loop without awaiting, so the core needs no locks.
Malformed requests fail with INVALID_ARGUMENT (nothing changed); domain failures are typed
``Error``s in an OK reply; an unexpected exception becomes ERROR_CODE_INTERNAL and is
logged: a client can never crash the daemon. The Attach stream is the client's liveness:
when it closes, the client's holdings are reclaimed ``grace_s`` later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np

from deepwell import logs
from deepwell.kvcache.v1 import kvcache_pb2 as pb
from deepwell.kvcache.v1 import kvcache_pb2_grpc as pbg

from .config import DaemonConfig
from .core import Core
from .journal import FileJournal
from .metrics import Metrics
from .model import BadRequest, Committed, Done, Extent, Failure, Handle, Match, Reserved, Taken

log = logs.get_logger(__name__)
MAX_TOKENS = 1 << 28  # 1 GiB of token bytes: far above any context, bounds memory per call
MAX_CHUNK_BYTES = 4 * 1024 * 1024


def _h(h: pb.Handle) -> Handle:
    return (h.epoch, h.id, h.generation)


def _pbh(h: Handle | None) -> pb.Handle | None:
    return None if h is None else pb.Handle(epoch=h[0], id=h[1], generation=h[2])


def _ext(extents: list[Extent]) -> list[pb.Extent]:
    return [pb.Extent(offset=o, length=n) for o, n in extents]


def _err(f: Failure | None) -> pb.Error | None:
    return None if f is None else pb.Error(code=f.code, message=f.message)


class KVCacheServicer(pbg.KVCacheServicer):
    def __init__(self, core: Core, cfg: DaemonConfig, metrics: Metrics, arena_path: str,
                 journal: FileJournal | None = None) -> None:
        self.core = core
        self.cfg = cfg
        self.metrics = metrics
        self.arena_path = arena_path
        self.journal = journal
        self.closing = asyncio.Event()
        self._timers: dict[str, asyncio.TimerHandle] = {}

    # -- plumbing ----------------------------------------------------------------------
    async def _call(self, method: str, context: grpc.aio.ServicerContext, fn: Callable[[], Any],
                    reply_cls: type) -> Any:
        t0 = time.perf_counter()
        code = "OK"
        try:
            reply = fn()
            err = getattr(reply, "error", None)
            if err is not None and reply.HasField("error"):
                code = pb.ErrorCode.Name(err.code)
            return reply
        except BadRequest as exc:
            code = "INVALID_ARGUMENT"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # a bug: answer INTERNAL (a miss to the engine), keep serving
            code = "INTERNAL"
            log.exception("rpc_internal_error", method=method)
            return reply_cls(epoch=self.core.epoch, error=pb.Error(code=pb.ERROR_CODE_INTERNAL, message=repr(exc)))
        finally:
            self.metrics.rpcs.labels(method, code).inc()
            self.metrics.latency.labels(method).observe(time.perf_counter() - t0)
            self._maybe_rewrite_journal()

    def _maybe_rewrite_journal(self) -> None:
        j = self.journal
        if j is not None and j.records > 4 * len(self.core.entries) + 1024:
            live = [e for e in self.core.entries.values() if e.state.value in ("committed", "taken")]
            j.rewrite(sorted(live, key=lambda e: e.id), self.core.epoch)

    async def _gather(self, it: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                      count: Callable[[Any], int]) -> tuple[Any, np.ndarray]:
        header = None
        blocks: list[bytes] = []
        total = 0
        async for chunk in it:
            kind = chunk.WhichOneof("kind")
            if kind == "header":
                if header is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "second header in stream")
                header = chunk.header
                if count(header) > MAX_TOKENS:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_tokens > {MAX_TOKENS}")
            elif kind == "tokens":
                if header is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokens before the header")
                data = chunk.tokens.tokens_le32
                if len(data) % 4 or len(data) > MAX_CHUNK_BYTES:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "token chunk must be a multiple of 4 bytes and at most 4 MiB")
                total += len(data) // 4
                if total > count(header):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "more tokens than num_tokens")
                blocks.append(data)
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty chunk")
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream without a header")
        if total != count(header):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"num_tokens={count(header)} but {total} tokens were sent")
        return header, np.frombuffer(b"".join(blocks), dtype="<u4")

    # -- sessions ----------------------------------------------------------------------
    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AttachEvent]:
        cid = self.core.attach(request.client_name, request.pid)
        log.info("client_attached", client_id=cid, name=request.client_name, pid=request.pid)
        try:
            yield pb.AttachEvent(epoch=self.core.epoch, client_id=cid,
                                 arena=pb.ArenaInfo(path=self.arena_path, size=self.core.arena_bytes,
                                                    granule_size=self.core.G),
                                 budget_bytes=self.core.budget_g * self.core.G,
                                 pin_quota_bytes=self.cfg.pin_quota_bytes, grace_s=self.cfg.grace_s)
            await self.closing.wait()
        finally:
            self.core.detach(cid)
            log.info("client_detached", client_id=cid, grace_s=self.cfg.grace_s)
            loop = asyncio.get_running_loop()
            self._timers[cid] = loop.call_later(self.cfg.grace_s, self._reclaim, cid)

    def _reclaim(self, cid: str) -> None:
        self._timers.pop(cid, None)
        if self.core.reclaim(cid):
            self.metrics.reclaims.inc()
            log.info("client_reclaimed", client_id=cid)

    def cancel_timers(self) -> None:
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()

    # -- entries -----------------------------------------------------------------------
    async def Reserve(self, request_iterator: AsyncIterator[pb.ReserveChunk], context: grpc.aio.ServicerContext) -> pb.ReserveReply:
        header, tokens = await self._gather(request_iterator, context, lambda h: h.identity.num_tokens)

        def run() -> pb.ReserveReply:
            r = self.core.reserve(header.client_id, header.op_id, header.identity, header.layout, tokens)
            if isinstance(r, Failure):
                return pb.ReserveReply(epoch=self.core.epoch, error=_err(r))
            assert isinstance(r, Reserved)
            return pb.ReserveReply(epoch=self.core.epoch, reservation=_pbh(r.reservation), extents=_ext(r.extents),
                                   evicted_entries=r.evicted)
        return await self._call("Reserve", context, run, pb.ReserveReply)

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitReply:
        def run() -> pb.CommitReply:
            r = self.core.commit(request.client_id, request.op_id, _h(request.reservation), request.success,
                                 list(request.written_parts))
            if isinstance(r, Failure):
                return pb.CommitReply(epoch=self.core.epoch, error=_err(r))
            if isinstance(r, Committed):
                return pb.CommitReply(epoch=self.core.epoch, entry=_pbh(r.entry),
                                      superseded=[_pbh(h) for h in r.superseded])
            return pb.CommitReply(epoch=self.core.epoch)
        return await self._call("Commit", context, run, pb.CommitReply)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortReply:
        return await self._call("Abort", context, lambda: self._done(
            pb.AbortReply, self.core.abort(request.client_id, request.op_id, _h(request.reservation))), pb.AbortReply)

    def _done(self, cls: type, r: Done | Failure) -> Any:
        return cls(epoch=self.core.epoch, error=_err(r) if isinstance(r, Failure) else None)

    async def Lookup(self, request_iterator: AsyncIterator[pb.LookupChunk], context: grpc.aio.ServicerContext) -> pb.LookupReply:
        header, tokens = await self._gather(request_iterator, context, lambda h: h.num_tokens)

        def run() -> pb.LookupReply:
            r = self.core.lookup(header.client_id, header.op_id, header.tenant, header.model_fingerprint,
                                 header.metadata_digest, header.session_key, tokens, header.pin)
            if r is None:
                return pb.LookupReply(epoch=self.core.epoch, hit=False)
            if isinstance(r, Failure):
                return pb.LookupReply(epoch=self.core.epoch, error=_err(r))
            assert isinstance(r, Match)
            if r.refused is not None:
                return pb.LookupReply(epoch=self.core.epoch, hit=False, error=_err(r.refused))
            source = pb.MATCH_SOURCE_SESSION if r.via_session else pb.MATCH_SOURCE_DIGEST
            return pb.LookupReply(epoch=self.core.epoch, hit=True, entry=_pbh(r.entry), matched_tokens=r.matched_tokens,
                                  identity=r.identity, layout=r.layout, lease=_pbh(r.lease), extents=_ext(r.extents),
                                  source=source)
        return await self._call("Lookup", context, run, pb.LookupReply)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseReply:
        def run() -> pb.ReleaseReply:
            if request.outcome == pb.RELEASE_OUTCOME_UNSPECIFIED:
                raise BadRequest("outcome must be OK or FAILED")
            return self._done(pb.ReleaseReply, self.core.release(
                request.client_id, request.op_id, _h(request.lease), request.outcome == pb.RELEASE_OUTCOME_OK))
        return await self._call("Release", context, run, pb.ReleaseReply)

    async def Take(self, request: pb.TakeRequest, context: grpc.aio.ServicerContext) -> pb.TakeReply:
        def run() -> pb.TakeReply:
            r = self.core.take(request.client_id, request.op_id, _h(request.lease))
            if isinstance(r, Failure):
                return pb.TakeReply(epoch=self.core.epoch, error=_err(r))
            assert isinstance(r, Taken)
            return pb.TakeReply(epoch=self.core.epoch, take=_pbh(r.take), extents=_ext(r.extents))
        return await self._call("Take", context, run, pb.TakeReply)

    async def ReAdd(self, request: pb.ReAddRequest, context: grpc.aio.ServicerContext) -> pb.ReAddReply:
        def run() -> pb.ReAddReply:
            r = self.core.readd(request.client_id, request.op_id, _h(request.take))
            if isinstance(r, Failure):
                return pb.ReAddReply(epoch=self.core.epoch, error=_err(r))
            return pb.ReAddReply(epoch=self.core.epoch, entry=_pbh(r.entry))
        return await self._call("ReAdd", context, run, pb.ReAddReply)

    async def Drop(self, request: pb.DropRequest, context: grpc.aio.ServicerContext) -> pb.DropReply:
        return await self._call("Drop", context, lambda: self._done(
            pb.DropReply, self.core.drop(request.client_id, request.op_id, _h(request.take))), pb.DropReply)

    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteReply:
        return await self._call("Delete", context, lambda: self._done(
            pb.DeleteReply, self.core.delete(request.client_id, request.op_id, _h(request.entry))), pb.DeleteReply)

    # -- admin -------------------------------------------------------------------------
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        return await self._call("Stats", context, lambda: stats_reply(self.core), pb.StatsReply)

    async def SetBudget(self, request: pb.SetBudgetRequest, context: grpc.aio.ServicerContext) -> pb.SetBudgetReply:
        def run() -> pb.SetBudgetReply:
            r = self.core.set_budget(request.budget_bytes)
            if isinstance(r, Failure):
                return pb.SetBudgetReply(epoch=self.core.epoch, error=_err(r))
            return pb.SetBudgetReply(epoch=self.core.epoch, evicted_entries=r)
        return await self._call("SetBudget", context, run, pb.SetBudgetReply)

    async def Compact(self, request: pb.CompactRequest, context: grpc.aio.ServicerContext) -> pb.CompactReply:
        def run() -> pb.CompactReply:
            r = self.core.compact(float(request.max_ms))
            return pb.CompactReply(epoch=self.core.epoch, entries_moved=r.entries_moved, bytes_moved=r.bytes_moved,
                                   elapsed_ms=r.elapsed_ms, largest_free_run_bytes=r.largest_free_run_bytes)
        return await self._call("Compact", context, run, pb.CompactReply)


def stats_reply(core: Core) -> pb.StatsReply:
    s = core.stats()
    clients = [pb.ClientHoldings(client_id=h.client_id, client_name=h.client_name, leases=h.leases,
                                 reservations=h.reservations, takes=h.takes, pinned_bytes=h.pinned_bytes,
                                 oldest_lease_age_s=h.oldest_lease_age_s, attached=h.attached) for h in s.clients]
    return pb.StatsReply(
        epoch=s.epoch, arena_bytes=s.arena_bytes, budget_bytes=s.budget_bytes, committed_bytes=s.committed_bytes,
        reserved_bytes=s.reserved_bytes, taken_bytes=s.taken_bytes, free_bytes=s.free_bytes,
        largest_free_run_bytes=s.largest_free_run_bytes, fragmentation=s.fragmentation, entries=s.entries,
        evictions=s.evictions, compactions=s.compactions, compaction_bytes_moved=s.compaction_bytes_moved,
        leases=s.leases, oldest_lease_age_s=s.oldest_lease_age_s, clients=clients, lookups=s.lookups, hits=s.hits)
