"""gRPC helpers shared by every deepwell server and client.

- Every server gets the standard ``grpc.health.v1`` health service and server
  reflection (``build_server``).
- Message limits: the default 4 MiB is too small for 1M-token prompts, so servers and
  channels built here accept up to ``MAX_MESSAGE_BYTES``.
- Request ids travel in the ``x-request-id`` metadata key: ``RequestIdServerInterceptor``
  binds the incoming id (or a new one) into the structlog context of the RPC, and channels
  from ``aio_channel`` forward the id bound in the caller's context (``add_request_id``).
- The internal token (``deepwell.auth``): ``build_server(token=...)`` requires it,
  ``aio_channel(token=...)`` / ``sync_channel(address, token)`` send it.
"""

from __future__ import annotations

import contextvars
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deepwell import logs
from deepwell.configs import ConfigError

REQUEST_ID_KEY = "x-request-id"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("deepwell_request_id", default=None)


def current_request_id() -> str | None:
    return _request_id.get()


def set_request_id(request_id: str) -> contextvars.Token[str | None]:
    logs.bind_context(request_id=request_id)
    return _request_id.set(request_id)


def new_request_id() -> str:
    return uuid.uuid4().hex


def message_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
    ]


KEEPALIVE_TIME_MS = 30_000  # our clients ping an idle connection this often (dead peers are noticed)


def channel_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        *message_options(max_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Message limits, and a ping policy that accepts our clients' keep-alive pings on idle
    connections (gRPC's default allows one per 5 minutes without calls and answers more with
    GOAWAY ``too_many_pings``, dropping the connection)."""
    return [
        *message_options(max_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else v
    return None


class RequestIdServerInterceptor(grpc.aio.ServerInterceptor):
    """Binds ``x-request-id`` (or a fresh id) into the RPC's logging context."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        rid = metadata_value(handler_call_details.invocation_metadata, REQUEST_ID_KEY) or new_request_id()
        set_request_id(rid)
        logs.bind_context(rpc=handler_call_details.method)
        return await continuation(handler_call_details)


def _with_metadata(details: Any, md: list[tuple[str, str]]) -> Any:
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials, details.wait_for_ready)


def add_request_id(details: Any) -> Any:
    """``details`` with the caller's bound request id in its metadata (unless it has one)."""
    rid = current_request_id()
    if rid is None or metadata_value(details.metadata, REQUEST_ID_KEY) is not None:
        return details
    return _with_metadata(details, [*(details.metadata or ()), (REQUEST_ID_KEY, rid)])


Edit = Callable[[Any], Any]  # ClientCallDetails -> ClientCallDetails


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, edit: Edit) -> None:
        self._edit = edit

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._edit(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, edit: Edit) -> None:
        self._edit = edit

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._edit(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, edit: Edit) -> None:
        self._edit = edit

    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._edit(details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, edit: Edit) -> None:
        self._edit = edit

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._edit(details), request_iterator)


def metadata_interceptors(edit: Edit) -> list[Any]:
    """aio client interceptors applying ``edit`` to every call's details, one per call kind: an aio
    channel files an interceptor under the first kind it is an instance of, so one object
    implementing all four would see unary-unary calls only."""
    return [_UnaryUnary(edit), _UnaryStream(edit), _StreamUnary(edit), _StreamStream(edit)]


def aio_channel(address: str, max_bytes: int = MAX_MESSAGE_BYTES, token: str = "") -> grpc.aio.Channel:
    """An insecure aio channel with deepwell's limits and request-id forwarding (and the
    internal token on every call, ``deepwell.auth``, when ``token`` is set)."""
    from deepwell.auth import with_token

    edits: list[Edit] = [add_request_id]
    if token:
        edits.append(lambda d: _with_metadata(d, with_token(d.metadata, token)))
    interceptors = [i for edit in edits for i in metadata_interceptors(edit)]
    return grpc.aio.insecure_channel(address, options=channel_options(max_bytes), interceptors=interceptors)


def sync_channel(address: str, token: str = "") -> grpc.Channel:
    """A synchronous channel with deepwell's limits (and the internal token when set)."""
    from deepwell.auth import SyncTokenClientInterceptor

    channel = grpc.insecure_channel(address, options=channel_options())
    return grpc.intercept_channel(channel, SyncTokenClientInterceptor(token)) if token else channel


@dataclass
class ServerHandle:
    server: grpc.aio.Server
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    bound_port: int
    address: str

    async def set_serving(self, service: str = "", serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await _maybe_await(self.health.set(service, status))

    async def stop(self, grace_s: float = 2.0) -> None:
        await _maybe_await(self.health.enter_graceful_shutdown())
        await self.server.stop(grace_s)


async def _maybe_await(value: Any) -> Any:
    if hasattr(value, "__await__"):
        return await value
    return value


class BindError(ConfigError, OSError):
    """A gRPC server could not listen on its address: a usage error (the CLIs print it and exit 2)."""


def build_server(
    address: str,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    max_bytes: int = MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    token: str = "",
) -> ServerHandle:
    """Create (not start) an aio server with health + reflection on ``address``.

    ``address`` is ``host:port`` (port 0 picks a free one) or ``unix:/path`` (the socket is
    created with mode 0600: the umask is 077 while it binds). With ``token`` every call but
    health checks must carry it (``deepwell.auth``).
    ``register`` are callables adding the servicers; ``service_names`` their full names
    (e.g. ``engine_pb2.DESCRIPTOR.services_by_name['Engine'].full_name``). All named
    services start NOT_SERVING; call ``set_serving`` when ready.
    """
    from deepwell.auth import TokenServerInterceptor

    auth = [TokenServerInterceptor(token)] if token else []
    server = grpc.aio.server(
        options=server_options(max_bytes), interceptors=[RequestIdServerInterceptor(), *auth, *interceptors]
    )
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names) + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    old_umask = os.umask(0o077) if address.startswith("unix:") else None
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio's "Failed to bind to address ..."
        port = 0
    finally:
        if old_umask is not None:
            os.umask(old_umask)
    if port == 0:
        where = ("is another process serving on that socket, and does its directory exist and allow writing?"
                 if address.startswith("unix:") else "is the port in use, or the host not an address of this machine?")
        raise BindError(f"invalid listen address {address!r}: cannot serve on it ({where})")
    return ServerHandle(server=server, health=health_servicer, bound_port=port, address=address)


async def wait_healthy(address: str, service: str = "", timeout_s: float = 30.0) -> bool:
    """Poll ``grpc.health.v1`` on ``address`` until SERVING or ``timeout_s`` passes."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    return False
