"""Synchronous, thread-safe client of the KV-cache daemon for the engine (no torch).

Lifecycle: ``start()`` launches a background session thread that opens the ``Attach``
stream, maps the arena and keeps the stream open (it is the client's liveness). When the
stream breaks the circuit opens: every call returns ``Code.UNAVAILABLE`` at once (a miss)
while the thread reconnects with backoff; a new attach gives a new client id and epoch
(handles from before answer STALE). An RPC failing with a transport error is retried with
the *same op id* (the daemon makes the repeat idempotent); after ``retries`` the call is
a miss and ``breaker_failures`` consecutive such failures open the circuit too.

Nothing here raises on daemon trouble: results are ``Result(code, message, reply)``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from deepwell import grpcx, logs
from deepwell.kvcache.v1 import kvcache_pb2 as pb
from deepwell.kvcache.v1 import kvcache_pb2_grpc as pbg

from .arena import ArenaMap
from .types import Code, Result

log = logs.get_logger(__name__)
CHUNK_TOKENS = 256 * 1024  # 1 MiB of token bytes per stream message
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return np.ascontiguousarray(arr, dtype="<u4")


def _chunks(arr: np.ndarray) -> Iterator[pb.TokenBlock]:
    for i in range(0, len(arr), CHUNK_TOKENS):
        yield pb.TokenBlock(tokens_le32=arr[i:i + CHUNK_TOKENS].tobytes())


class KVClient:
    def __init__(self, address: str, name: str = "engine", *, rpc_timeout_s: float = 5.0, retries: int = 2,
                 breaker_failures: int = 3, reconnect_min_s: float = 0.05, reconnect_max_s: float = 1.0,
                 token: str = "") -> None:
        self.address = address
        self.token = token  # the internal token (deepwell.auth), sent on every call when set
        self.name = name
        self.rpc_timeout_s = rpc_timeout_s
        self.retries = retries
        self.breaker_failures = breaker_failures
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self._lock = threading.Lock()
        self._attached = threading.Event()
        self._closed = threading.Event()
        self._stub: pbg.KVCacheStub | None = None
        self._call: Any = None
        self._failures = 0
        self._ops = itertools.count(1)
        self.client_id = ""
        self.epoch = 0
        self.arena: ArenaMap | None = None
        self.session: pb.AttachEvent | None = None
        self.attaches = 0
        self._thread: threading.Thread | None = None

    # -- session -------------------------------------------------------------------------
    def start(self, wait_s: float = 5.0) -> bool:
        """Start the session thread; True when attached within ``wait_s``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._session_loop, name=f"kvclient-{self.name}", daemon=True)
            self._thread.start()
        return self._attached.wait(wait_s)

    def wait_attached(self, timeout_s: float) -> bool:
        return self._attached.wait(timeout_s)

    @property
    def available(self) -> bool:
        return self._attached.is_set()

    def close(self) -> None:
        self._closed.set()
        self._open_circuit("closing")
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> KVClient:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _session_loop(self) -> None:
        delay = self.reconnect_min_s
        while not self._closed.is_set():
            channel = grpcx.sync_channel(self.address, self.token)
            try:
                call = pbg.KVCacheStub(channel).Attach(pb.AttachRequest(client_name=self.name, pid=os.getpid()))
                with self._lock:
                    self._call = call
                first = next(call)
                self._on_attached(first, pbg.KVCacheStub(channel))
                delay = self.reconnect_min_s
                for _ in call:  # blocks while the session lives
                    pass
            except (grpc.RpcError, StopIteration, OSError, ValueError) as exc:
                if not self._closed.is_set():
                    log.debug("kvclient_session_lost", error=str(exc)[:200])
            finally:
                self._open_circuit("session closed")
                channel.close()
            if self._closed.wait(delay):
                break
            delay = min(delay * 2, self.reconnect_max_s)

    def _on_attached(self, ev: pb.AttachEvent, stub: pbg.KVCacheStub) -> None:
        arena = self.arena
        if arena is None or not arena.same_file(ev.arena.path, ev.arena.size):
            arena = ArenaMap(ev.arena.path, ev.arena.size)  # the old map stays valid for copies in flight
        with self._lock:
            self.arena, self.session, self.client_id, self.epoch = arena, ev, ev.client_id, ev.epoch
            self._stub, self._failures = stub, 0
            self.attaches += 1
        self._attached.set()
        log.info("kvclient_attached", client_id=ev.client_id, epoch=ev.epoch, arena=ev.arena.path)

    def _open_circuit(self, why: str) -> None:
        with self._lock:
            was = self._attached.is_set()
            self._attached.clear()
            self._stub = None
            call, self._call = self._call, None
        if call is not None:
            call.cancel()
        if was:
            log.info("kvclient_circuit_open", reason=why)

    # -- rpc core ------------------------------------------------------------------------
    def _invoke(self, method: str, make: Callable[[str, str], Any]) -> Result[Any]:
        """Call ``method`` with the request built by ``make(client_id, op_id)``; retries
        transport errors with the same op id; maps the reply's typed error."""
        with self._lock:
            stub, cid = self._stub, self.client_id
        if stub is None:
            return Result(Code.UNAVAILABLE, "kvcache daemon unavailable (circuit open)")
        op_id = f"{cid}:{next(self._ops)}"
        delay = 0.01
        for attempt in range(self.retries + 1):
            try:
                reply = getattr(stub, method)(make(cid, op_id), timeout=self.rpc_timeout_s)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    return Result(Code.REJECTED, exc.details() or "rejected")
                if code not in _RETRYABLE or attempt == self.retries or self._closed.is_set():
                    self._count_failure(f"{method}: {code.name}")
                    return Result(Code.UNAVAILABLE, f"{method} failed: {code.name} {exc.details()}")
                time.sleep(delay)
                delay *= 4
                continue
            except ValueError as exc:  # the session closed this channel while the call started
                return Result(Code.UNAVAILABLE, f"{method} failed: {exc}")
            with self._lock:
                self._failures = 0
            has_error = "error" in reply.DESCRIPTOR.fields_by_name and reply.HasField("error")
            if has_error and reply.error.code != pb.ERROR_CODE_OK:
                if reply.error.code == pb.ERROR_CODE_UNKNOWN_CLIENT:
                    self._open_circuit("daemon forgot this client")
                return Result(Code(reply.error.code), reply.error.message, reply)
            return Result(Code.OK, "", reply)
        raise AssertionError("unreachable")

    def _count_failure(self, why: str) -> None:
        with self._lock:
            self._failures += 1
            trip = self._failures >= self.breaker_failures
        if trip:
            self._open_circuit(why)

    # -- API -----------------------------------------------------------------------------
    def reserve(self, identity: pb.Identity, layout: pb.Layout, tokens: Sequence[int] | np.ndarray) -> Result[pb.ReserveReply]:
        arr = encode_tokens(tokens)
        ident = pb.Identity()
        ident.CopyFrom(identity)
        ident.num_tokens = len(arr)

        def make(cid: str, op: str) -> Iterator[pb.ReserveChunk]:
            yield pb.ReserveChunk(header=pb.ReserveHeader(client_id=cid, op_id=op, identity=ident, layout=layout))
            for block in _chunks(arr):
                yield pb.ReserveChunk(tokens=block)
        return self._invoke("Reserve", make)

    def commit(self, reservation: pb.Handle, written_parts: Sequence[str], success: bool = True) -> Result[pb.CommitReply]:
        return self._invoke("Commit", lambda cid, op: pb.CommitRequest(
            client_id=cid, op_id=op, reservation=reservation, success=success, written_parts=list(written_parts)))

    def abort(self, reservation: pb.Handle) -> Result[pb.AbortReply]:
        return self._invoke("Abort", lambda cid, op: pb.AbortRequest(client_id=cid, op_id=op, reservation=reservation))

    def lookup(self, tenant: str, model_fingerprint: bytes, tokens: Sequence[int] | np.ndarray, *,
               metadata_digest: bytes = b"", session_key: str = "", pin: bool = True) -> Result[pb.LookupReply]:
        """OK with ``reply.hit`` False is a plain miss; any non-OK code is a miss too."""
        arr = encode_tokens(tokens)

        def make(cid: str, op: str) -> Iterator[pb.LookupChunk]:
            yield pb.LookupChunk(header=pb.LookupHeader(
                client_id=cid, op_id=op, tenant=tenant, model_fingerprint=model_fingerprint,
                metadata_digest=metadata_digest, session_key=session_key, num_tokens=len(arr), pin=pin))
            for block in _chunks(arr):
                yield pb.LookupChunk(tokens=block)
        return self._invoke("Lookup", make)

    def release(self, lease: pb.Handle, ok: bool = True) -> Result[pb.ReleaseReply]:
        outcome = pb.RELEASE_OUTCOME_OK if ok else pb.RELEASE_OUTCOME_FAILED
        return self._invoke("Release", lambda cid, op: pb.ReleaseRequest(
            client_id=cid, op_id=op, lease=lease, outcome=outcome))

    def take(self, lease: pb.Handle) -> Result[pb.TakeReply]:
        return self._invoke("Take", lambda cid, op: pb.TakeRequest(client_id=cid, op_id=op, lease=lease))

    def readd(self, take: pb.Handle) -> Result[pb.ReAddReply]:
        return self._invoke("ReAdd", lambda cid, op: pb.ReAddRequest(client_id=cid, op_id=op, take=take))

    def drop(self, take: pb.Handle) -> Result[pb.DropReply]:
        return self._invoke("Drop", lambda cid, op: pb.DropRequest(client_id=cid, op_id=op, take=take))

    def delete(self, entry: pb.Handle) -> Result[pb.DeleteReply]:
        return self._invoke("Delete", lambda cid, op: pb.DeleteRequest(client_id=cid, op_id=op, entry=entry))

    def stats(self) -> Result[pb.StatsReply]:
        return self._invoke("Stats", lambda cid, op: pb.StatsRequest())

    def set_budget(self, budget_bytes: int) -> Result[pb.SetBudgetReply]:
        return self._invoke("SetBudget", lambda cid, op: pb.SetBudgetRequest(budget_bytes=budget_bytes))

    def compact(self, max_ms: int) -> Result[pb.CompactReply]:
        return self._invoke("Compact", lambda cid, op: pb.CompactRequest(max_ms=max_ms))
