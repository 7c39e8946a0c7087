"""Shared HTTP plumbing: bounded body reading, request context, SSE framing, error bodies.

Invariants: a client error is always a 4xx with a reason in the API's own error shape
(OpenAI ``{"error": {...}}`` or the Anthropic envelope); a body over ``max_body_bytes`` is
413 before it is fully read; malformed JSON and schema violations are 400 (never 422/5xx),
and so is a lone UTF-16 surrogate anywhere in the body (``gateway.surrogates``: the
message names the field).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from deepwell.gateway.auth import ApiKeys, AuthError
from deepwell.gateway.errors import ContextLengthError, GatewayError
from deepwell.gateway.surrogates import find_lone_surrogate, may_contain_surrogate

OPENAI = "openai"
ANTHROPIC = "anthropic"

KEEPALIVE_COMMENT = b": keep-alive\n\n"


@dataclass
class RequestContext:
    request_id: str
    tenant: str
    headers: dict[str, str]


class SSEResponse(StreamingResponse):
    """``text/event-stream`` whose body generator is always closed when the response ends.

    Starlette leaves the iterator to the garbage collector when the client disconnects
    (a send error); closing it here runs the generator's ``finally`` at once, which
    cancels the engine request and writes the accounting record."""

    def __init__(self, content: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


DISCONNECT_POLL_S = 1.0


async def collect_until_disconnect(gen: Any, request: Request) -> list[Any]:
    """Non-streaming: all events of ``gen``; a client that hangs up cancels the engine
    request (checked every ``DISCONNECT_POLL_S``). Always closes ``gen``."""
    task = asyncio.create_task(gen.collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await gen.aclose(499)
                gone = GatewayError("invalid_request", "the client disconnected")
                gone.accounted = True  # type: ignore[attr-defined]  # recorded as 499 by aclose
                raise gone
    finally:
        if not task.done():
            task.cancel()
        await gen.aclose()


def sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


async def read_json(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise GatewayError("too_large", f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes")
        except ValueError:
            raise GatewayError("invalid_request", "invalid Content-Length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise GatewayError("too_large", f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise GatewayError("invalid_request", "the request body is empty; expected a JSON object")
    encoding = json.detect_encoding(body)  # UTF-8 (RFC 8259), or UTF-16/32 as Python's json reads them
    try:
        text = body.decode(encoding)  # strict: json.loads(bytes) would let encoded surrogates through
    except UnicodeDecodeError as exc:
        raise GatewayError("invalid_request", f"the request body is not valid {encoding.upper()} (byte {exc.start}: "
                                              f"{exc.reason}); send UTF-8 encoded JSON") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise GatewayError("invalid_request", f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise GatewayError("invalid_request", "the request body must be a JSON object")
    if may_contain_surrogate(text):
        found = find_lone_surrogate(data)
        if found is not None:  # valid JSON, but no tokenizer, hash or protobuf can take it
            raise GatewayError("invalid_request", found.message(), param=found.path or None)
    return data


def validate(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise GatewayError("invalid_request", format_validation_error(exc)) from None
    except RecursionError:
        raise GatewayError("invalid_request", "the request body is nested too deeply") from None


def format_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid")))
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def context(request: Request, keys: ApiKeys) -> RequestContext:
    headers = {k.lower(): v for k, v in request.headers.items()}
    try:
        tenant = keys.tenant_for(headers)
    except AuthError as exc:
        raise GatewayError("authentication", str(exc)) from None
    rid = headers.get("x-request-id") or uuid.uuid4().hex
    return RequestContext(request_id=rid[:128], tenant=tenant, headers=headers)


_OPENAI_TYPES = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("authentication_error", "invalid_api_key"),
    "not_found": ("not_found_error", "model_not_found"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "context_length": ("invalid_request_error", "context_length_exceeded"),
    "overloaded": ("rate_limit_error", "engine_overloaded"),
    "unavailable": ("service_unavailable", "no_healthy_engine"),
    "internal": ("server_error", None),
}
_ANTHROPIC_TYPES = {
    "invalid_request": ("invalid_request_error", 400),
    "authentication": ("authentication_error", 401),
    "not_found": ("not_found_error", 404),
    "too_large": ("request_too_large", 413),
    "context_length": ("invalid_request_error", 400),
    "overloaded": ("overloaded_error", 529),
    "unavailable": ("api_error", 503),
    "internal": ("api_error", 500),
}


def openai_error_body(err: GatewayError) -> dict[str, Any]:
    etype, code = _OPENAI_TYPES[err.kind]
    body: dict[str, Any] = {"message": err.message, "type": etype, "param": err.param, "code": code}
    if isinstance(err, ContextLengthError):
        body["prompt_tokens"] = err.prompt_tokens
        body["max_context_tokens"] = err.max_context
    return {"error": body}


def anthropic_error_body(err: GatewayError) -> dict[str, Any]:
    etype, _ = _ANTHROPIC_TYPES[err.kind]
    message = err.message
    if isinstance(err, ContextLengthError):
        # Anthropic's wording: Claude Code matches "prompt is too long" to compact the conversation
        message = f"prompt is too long: {err.prompt_tokens} tokens > {err.max_context - 1} maximum. {message}"
    return {"type": "error", "error": {"type": etype, "message": message}}


def status_for(err: GatewayError, api: str) -> int:
    if api == ANTHROPIC:
        return _ANTHROPIC_TYPES[err.kind][1]
    return err.status


def error_response(err: GatewayError, api: str, request_id: str | None = None) -> Response:
    body = anthropic_error_body(err) if api == ANTHROPIC else openai_error_body(err)
    if api == ANTHROPIC and request_id:
        body["request_id"] = request_id
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    if request_id:
        headers["x-request-id"] = request_id
    if err.kind == "authentication":
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status_for(err, api), headers=headers)


def api_for_path(path: str) -> str:
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI
