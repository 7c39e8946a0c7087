"""Prometheus metrics of the gateway, on a registry of its own (served at ``/metrics``).

- ``deepwell_gateway_requests_total{endpoint,status}``: finished HTTP/gRPC requests.
- ``deepwell_gateway_ttft_seconds{endpoint}``: request arrival to first generated token.
- ``deepwell_gateway_tokens_total{kind}``: prompt / completion / cached tokens.
- ``deepwell_gateway_tool_parse_total{outcome}``: ok / failure / none per response.
- ``deepwell_gateway_tool_parse_failures_total{reason}``: unrecoverable markup, by reason.
- ``deepwell_gateway_active_streams{endpoint}``: streams open now.
- ``deepwell_gateway_engines_healthy``: engines answering health checks.
"""

from __future__ import annotations

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
