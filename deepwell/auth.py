"""The internal credential: a shared secret between deepwell's own processes.

The engine's and the KV-cache daemon's gRPC services are internal: only the gateway may call
the engine (it has authenticated the HTTP client and asserts the tenant), and only an engine
may call the daemon. With a token configured (``--internal-token-file``), a server built by
``deepwell.grpcx.build_server`` refuses every call that does not carry it in the
``x-deepwell-internal-token`` metadata key with ``UNAUTHENTICATED`` (the health service stays
open: it tells nothing and orchestrators probe it). Clients built with a token send it on
every call (``deepwell.grpcx.aio_channel`` / ``sync_channel``). ``deepwell up`` generates one into a 0600 file of its 0700 run directory; the
compose stack's ``token`` service writes one into a volume only the stack mounts.

The token is a file, never a flag value (flags show in ``ps``). A token file readable by group
or others is refused: whoever can read it can act as the gateway.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

TOKEN_KEY = "x-deepwell-internal-token"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # callable without the token
UNAUTHENTICATED_DETAIL = ("this is an internal deepwell service: calls must carry the internal token "
                          "(the gateway and engine read it from --internal-token-file)")


class TokenError(ValueError):
    """A token file that is missing, empty, or readable by others."""


def generate_token_file(path: str | Path) -> str:
    """Write a fresh random token to ``path`` (created 0600, never overwriting); return it."""
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    return token


def read_token_file(path: str | Path) -> str:
    """The token in ``path``; ``TokenError`` saying what to fix."""
    try:
        st = os.stat(path)
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise TokenError(f"cannot read the internal token file {path}: {exc.strerror or exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(f"internal token file {path} is accessible by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    if len(text) < 16:
        raise TokenError(f"internal token file {path} holds no token of at least 16 characters")
    return text


def _matches(metadata: Any, token: str) -> bool:
    for k, v in metadata or ():
        if k == TOKEN_KEY:
            got = v.decode() if isinstance(v, bytes) else v
            return hmac.compare_digest(got.encode(), token.encode())
    return False


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAIL)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAIL)
        yield  # pragma: no cover  (makes this an async generator)

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    return grpc.stream_stream_rpc_method_handler(stream, des, ser)


class TokenServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the token (``UNAUTHENTICATED``), except to ``OPEN_SERVICES``."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        if _matches(details.invocation_metadata, self._token):
            return handler
        return _refusing(handler)


def with_token(metadata: Any, token: str) -> list[tuple[str, str]]:
    md = [(k, v) for k, v in (metadata or ()) if k != TOKEN_KEY]
    return [*md, (TOKEN_KEY, token)]


class _SyncDetails:
    def __init__(self, d: Any, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials = d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class SyncTokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a synchronous channel (``grpc.intercept_channel``)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: Any) -> Any:
        return _SyncDetails(d, with_token(d.metadata, self._token))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


# ----------------------------------------------------------------------------- `deepwell internal-token`
HELP = "create the internal token file the services share (if absent) and check its mode"
DESCRIPTION = ("Create FILE with a fresh internal token (mode 0600) unless it exists, then check it; "
               "the compose stack runs this once before the services start. deepwell up makes its own.")


def configure(parser: Any) -> None:
    parser.add_argument("file", nargs="?", default=os.environ.get("DEEPWELL_INTERNAL_TOKEN_FILE", ""),
                        help="token file to create (kept if present); env DEEPWELL_INTERNAL_TOKEN_FILE")


def run(args: Any) -> int:
    import sys

    if not args.file:
        print("deepwell internal-token: name the token file (or set DEEPWELL_INTERNAL_TOKEN_FILE)", file=sys.stderr)
        return 2
    try:
        generate_token_file(args.file)
        print(f"deepwell internal-token: created {args.file}")
    except FileExistsError:
        pass
    except OSError as exc:
        print(f"deepwell internal-token: cannot create {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        read_token_file(args.file)
    except TokenError as exc:
        print(f"deepwell internal-token: {exc}", file=sys.stderr)
        return 1
    return 0
