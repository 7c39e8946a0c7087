"""Prometheus metrics of the gateway, on a registry of its own (served at ``/metrics``).

- ``deepwell_gateway_requests_total{endpoint,status}``: finished HTTP/gRPC requests, each
  counted exactly once with its final status (HTTP: by ``http.middleware``, for every
  route and every status, 500 included; a stream that started with 200 is counted with
  what it ended as: 499 when the client went away, 500 on an engine failure).
- ``deepwell_gateway_ttft_seconds{endpoint}``: request arrival to first generated token.
- ``deepwell_gateway_tokens_total{kind}``: prompt / completion / cached tokens.
- ``deepwell_gateway_tool_parse_total{outcome}``: ok / failure / none per response.
- ``deepwell_gateway_tool_parse_failures_total{reason}``: unrecoverable markup, by reason.
- ``deepwell_gateway_active_streams{endpoint}``: streams open now.
- ``deepwell_gateway_engines_healthy``: engines answering health checks.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("deepwell_gateway_requests", "Finished requests", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("deepwell_gateway_ttft_seconds", "Time to first token", ["endpoint"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.tokens = Counter("deepwell_gateway_tokens", "Tokens by kind", ["kind"], registry=r)
        self.tool_parse = Counter("deepwell_gateway_tool_parse", "Tool-call parse outcomes", ["outcome"], registry=r)
        self.tool_parse_failures = Counter("deepwell_gateway_tool_parse_failures", "Tool-call parse failures",
                                           ["reason"], registry=r)
        self.active_streams = Gauge("deepwell_gateway_active_streams", "Open streams", ["endpoint"], registry=r)
        self.engines_healthy = Gauge("deepwell_gateway_engines_healthy", "Healthy engines", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def finished(self, endpoint: str, status: int) -> None:
        """A generation's final status: handed to the HTTP request being served (which
        counts it once, see ``RequestSlot``), else (gRPC) counted here."""
        slot = CURRENT_REQUEST.get()
        if slot is None:
            self.requests.labels(endpoint, str(status)).inc()
        else:
            slot.generation_status = status


@dataclass
class RequestSlot:
    """The HTTP request in flight (a context variable set by the metrics middleware)."""

    endpoint: str
    generation_status: int | None = None  # set by a generation when it is closed

    def final_status(self, http_status: int) -> int:
        """A generation's status wins when the HTTP status was a success it could not
        reflect (a stream that failed or was abandoned after its 200), and 499 (the
        client went away) always does; otherwise the HTTP status stands."""
        g = self.generation_status
        if g is not None and (http_status < 300 or g == 499):
            return g
        return http_status


CURRENT_REQUEST: ContextVar[RequestSlot | None] = ContextVar("deepwell_gateway_request", default=None)
