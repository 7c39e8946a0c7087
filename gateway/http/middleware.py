"""Request metrics for every HTTP response: one ``deepwell_gateway_requests_total``
increment per request, labelled with its endpoint and final status (see
``gateway.metrics.RequestSlot``), whatever produced the response — a handler, an error
handler, routing (404/405) or an unhandled exception (500)."""

from __future__ import annotations

from typing import Any

from deepwell.gateway.metrics import CURRENT_REQUEST, GatewayMetrics, RequestSlot

ENDPOINTS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions", "/v1/messages": "messages",
             "/v1/messages/count_tokens": "messages.count_tokens", "/v1/responses": "responses",
             "/health": "health", "/metrics": "metrics", "/": "hello", "/api/hello": "hello",
             "/v1/deepwell/sessions": "deepwell.sessions"}


def endpoint_for(path: str) -> str:
    name = ENDPOINTS.get(path.rstrip("/") or "/")
    if name is not None:
        return name
    if path.startswith("/v1/models"):
        return "models"
    return "other"


class RequestMetricsMiddleware:
    """Pure ASGI (so streaming bodies and context variables pass through untouched)."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        slot = RequestSlot(endpoint_for(scope.get("path", "")))
        token = CURRENT_REQUEST.set(slot)
        status = 500  # unless a response starts: an exception escaped to the server error handler

        async def send_wrapper(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            CURRENT_REQUEST.reset(token)
            self.metrics.requests.labels(slot.endpoint, str(slot.final_status(status))).inc()
