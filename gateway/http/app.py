"""The FastAPI application: routes, error mapping, lifespan of the engine clients.

Routes: ``GET /health`` (200 when at least one engine is healthy, else 503 +
Retry-After), ``GET /v1/models`` and ``/v1/models/{id}``, ``POST /v1/chat/completions``,
``/v1/completions``, ``/v1/messages``, ``/v1/messages/count_tokens`` (also
``?beta=true``), ``/v1/responses``, ``GET /metrics``, and the operator endpoint
``GET /v1/deepwell/sessions`` (``http.sessions_api``: admin keys when API keys are on), its companion
``GET /v1/deepwell/stats`` (``http.stats_api``: engine and gateway counters, same rule) and the status
page ``GET /deepwell/status`` (``http.status_page``: HTML + JS reading those two).

Errors: ``GatewayError`` -> the API's error shape (Anthropic envelope under
``/v1/messages``, OpenAI error object elsewhere); unknown routes/methods likewise (404/405);
anything else is a gateway bug -> 500 with a generic message (logged with the request id).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepwell import __version__, grpcx, logs
from deepwell.gateway.accounting import RequestLog
from deepwell.gateway.auth import ApiKeys
from deepwell.gateway.config import GatewayConfig
from deepwell.gateway.engine_client import EngineClient
from deepwell.gateway.errors import GatewayError
from deepwell.gateway.http import (
    anthropic_api,
    openai_api,
    openapi,
    responses_api,
    schemas_anthropic,
    schemas_openai,
    sessions_api,
    stats_api,
    status_page,
)
from deepwell.gateway.http.common import api_for_path, context, error_response, read_json
from deepwell.gateway.http.middleware import RequestMetricsMiddleware
from deepwell.gateway.metrics import GatewayMetrics
from deepwell.gateway.pipeline import ChatService
from deepwell.gateway.routing import Router

log = logs.get_logger("deepwell.gateway.http")

Handler = Callable[[Any, Request, Any, dict[str, Any]], Awaitable[Response]]


@dataclass
class AppState:
    config: GatewayConfig
    keys: ApiKeys
    engines: list[EngineClient]
    router: Router
    metrics: GatewayMetrics
    request_log: RequestLog
    service: ChatService
    started_at: float


def internal_token(path: str) -> str:
    """The internal token the engines require ('' without a file); ``ConfigError`` if unreadable."""
    from deepwell.auth import TokenError, read_token_file
    from deepwell.configs import ConfigError

    try:
        return read_token_file(path) if path else ""
    except TokenError as exc:
        raise ConfigError(f"invalid internal_token_file={path!r}: {exc}") from None


def build_state(config: GatewayConfig) -> AppState:
    keys = ApiKeys.load(config.api_keys, config.api_keys_file)
    token = internal_token(config.internal_token_file)
    engines = [EngineClient(a, config.health_interval_s, config.tool_parser, token) for a in config.engines]
    router = Router(engines, config.retry_after_s)
    metrics = GatewayMetrics()
    request_log = RequestLog(config.request_log)
    service = ChatService(config, router, metrics, request_log)
    return AppState(config, keys, engines, router, metrics, request_log, service, time.time())


def create_app(config: GatewayConfig, state: AppState | None = None) -> FastAPI:
    st = state or build_state(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for engine in st.engines:
            await engine.start()
        try:
            yield
        finally:
            await asyncio.gather(*(e.close() for e in st.engines), return_exceptions=True)
            st.request_log.close()

    app = FastAPI(title="deepwell gateway", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gw = st
    app.add_middleware(RequestMetricsMiddleware, metrics=st.metrics)  # every status, every route

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(exc, api_for_path(request.url.path), request.headers.get("x-request-id"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found", 413: "too_large", 401: "authentication"}.get(exc.status_code, "invalid_request")
        err = GatewayError(kind, f"{request.method} {request.url.path}: {exc.detail}")
        resp = error_response(err, api_for_path(request.url.path))
        resp.status_code = exc.status_code if exc.status_code < 500 else 400
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(GatewayError("invalid_request", f"invalid request: {exc.errors()[:3]}"),
                              api_for_path(request.url.path))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.error("unhandled_error", path=request.url.path, error=repr(exc), exc_info=exc)
        return error_response(GatewayError("internal", "internal gateway error"), api_for_path(request.url.path))

    async def root() -> Response:
        # clients probe the server before their first request (Claude Code: HEAD /api/hello)
        return JSONResponse({"name": "deepwell gateway", "version": __version__, "endpoints": list(ENDPOINTS)})

    for path, op in (("/", "root"), ("/api/hello", "hello")):  # one operation id each; HEAD stays out of the schema
        app.add_api_route(path, root, methods=["GET"], operation_id=op)
        app.add_api_route(path, root, methods=["HEAD"], include_in_schema=False)

    @app.get("/health")
    async def health() -> Response:
        healthy = [e for e in st.engines if e.healthy]
        st.metrics.engines_healthy.set(len(healthy))
        body = {"status": "ok" if healthy else "unavailable", "engines": [
            {"address": e.address, "healthy": e.healthy, "model": e.bundle.model_id if e.bundle else None,
             "error": None if e.healthy else (e.last_error or "not ready")} for e in st.engines]}
        headers = {} if healthy else {"Retry-After": str(st.config.retry_after_s)}
        return JSONResponse(body, status_code=200 if healthy else 503, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        st.metrics.engines_healthy.set(sum(e.healthy for e in st.engines))
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/deepwell/sessions")
    async def deepwell_sessions(request: Request) -> Response:
        return await sessions_api.sessions(st, request)

    @app.get("/v1/deepwell/stats")
    async def deepwell_stats(request: Request) -> Response:
        return await stats_api.stats(st, request)

    def status_asset(path: str) -> Callable[[], Awaitable[Response]]:
        async def asset() -> Response:
            return status_page.serve(path)
        return asset

    for path in status_page.ASSETS:  # the page and its script and style sheet (no data, no auth: see status_page)
        app.add_api_route(path, status_asset(path), methods=["GET"], include_in_schema=False)

    def model_card(bundle: Any) -> dict[str, Any]:
        return {"id": bundle.model_id, "object": "model", "created": int(st.started_at), "owned_by": "deepwell",
                "max_model_len": bundle.max_context, "type": "model", "display_name": bundle.model_id,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.started_at))}

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        context(request, st.keys)
        cards = [model_card(b) for b in st.service.served_models()]
        return JSONResponse({"object": "list", "data": cards, "models": cards, "has_more": False,
                             "first_id": cards[0]["id"] if cards else None, "last_id": cards[-1]["id"] if cards else None})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        context(request, st.keys)
        for b in st.service.served_models():
            if b.model_id == model_id:
                return JSONResponse(model_card(b))
        raise GatewayError("not_found", f"model {model_id!r} is not served here")

    def post(path: str, handler: Handler, endpoint: str, body: type[BaseModel], doc: str) -> None:
        async def route(request: Request) -> Response:
            ctx = context(request, st.keys)
            grpcx.set_request_id(ctx.request_id)  # logged, and forwarded to engines as x-request-id
            data = await read_json(request, st.config.max_body_bytes)
            return await handler(st, request, ctx, data)

        route.__name__ = endpoint.replace(".", "_")
        app.add_api_route(path, route, methods=["POST"], name=endpoint, summary=doc,
                          openapi_extra=openapi.request_body(body, doc))

    post("/v1/chat/completions", openai_api.chat_completions, "chat.completions", schemas_openai.ChatCompletionRequest,
         "OpenAI chat completion")
    post("/v1/completions", openai_api.completions, "completions", schemas_openai.CompletionRequest,
         "OpenAI text completion (raw prompt)")
    post("/v1/messages", anthropic_api.messages, "messages", schemas_anthropic.MessagesRequest, "Anthropic message")
    post("/v1/messages/count_tokens", anthropic_api.count_tokens, "messages.count_tokens",
         schemas_anthropic.CountTokensRequest, "Anthropic token count of a prompt")
    post("/v1/responses", responses_api.responses, "responses", responses_api.ResponsesRequest, "OpenAI response")
    openapi.install(app)
    return app


ENDPOINTS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions", "/v1/messages": "messages",
             "/v1/messages/count_tokens": "messages.count_tokens", "/v1/responses": "responses"}

