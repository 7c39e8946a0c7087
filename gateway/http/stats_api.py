"""``GET /v1/deepwell/stats``: every engine's ``Stats`` counters and the gateway's own, in one JSON
document (an operator endpoint, read by the status page ``GET /deepwell/status``).

- ``engines``: one item per engine, ``{"address", "ok": true, "healthy", "model", "stats": {...}}``
  with every field of its ``EngineStats`` reply (fields the proto gains later appear by
  themselves), or ``{"address", "ok": false, "error"}`` when it cannot answer; the others
  still count.
- ``totals``: the answering engines' counters summed: prompt tokens served from each reuse
  level (``cache_hits``), tokens prefilled / decoded, requests running / waiting / finished.
- ``gateway``: its uptime, engines healthy, requests by status class, tokens by kind (prompt /
  completion / cached) and open streams, read from its Prometheus registry.

Counters only, no rates: a client derives throughput from two samples (the engine's
``uptime_s`` is the clock that goes with its counters; it falls when the engine restarted).

Access: the sessions view's rule (``sessions_api.admin_denied``): open without API keys, an
admin key (``--admin-keys``) with them (401 without a valid key, 403 with another one).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from deepwell import logs
from deepwell.engine.v1 import engine_pb2
from deepwell.gateway.engine_client import RPC_TIMEOUT_S, EngineClient, EngineError, map_rpc_error
from deepwell.gateway.http.sessions_api import LEVELS, admin_denied

log = logs.get_logger("deepwell.gateway.http.stats")

SUMMED = ("tokens_prefilled", "tokens_decoded", "requests_running", "requests_waiting", "requests_finished")


def plain(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` (unset ones with their default, unset optional ones as None):
    integers stay integers (``MessageToDict`` would quote 64-bit ones), enums by name."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = {k: plain(v) if isinstance(v, Message) else v for k, v in value.items()}
        elif f.is_repeated:
            out[f.name] = [plain(v) if isinstance(v, Message) else _scalar(f, v) for v in value]
        elif f.has_presence and not msg.HasField(f.name):
            out[f.name] = None
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            out[f.name] = plain(value)
        else:
            out[f.name] = _scalar(f, value)
    return out


def _scalar(f: FieldDescriptor, value: Any) -> Any:
    if f.type == FieldDescriptor.TYPE_ENUM:
        named = f.enum_type.values_by_number.get(value)
        return named.name if named is not None else value
    if isinstance(value, float):
        return round(value, 6)
    return value


async def engine_stats(engine: EngineClient) -> engine_pb2.EngineStats:
    """The engine's ``Stats`` reply; ``EngineError`` when it cannot answer."""
    try:
        return await engine.stub.Stats(engine_pb2.StatsRequest(), timeout=RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        raise map_rpc_error(exc) from None


def gateway_figures(st: Any) -> dict[str, Any]:
    registry = st.metrics.registry
    classes = {"2xx": 0, "4xx": 0, "5xx": 0}
    for metric in st.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = f"{sample.labels['status'][:1]}xx"
                classes[key] = classes.get(key, 0) + int(sample.value)
    tokens = {kind: int(registry.get_sample_value("deepwell_gateway_tokens_total", {"kind": kind}) or 0)
              for kind in ("prompt", "completion", "cached")}
    streams = sum(int(s.value) for m in st.metrics.active_streams.collect() for s in m.samples)
    return {"uptime_s": round(time.time() - st.started_at, 3), "engines": len(st.engines),
            "engines_healthy": sum(e.healthy for e in st.engines), "requests": classes, "tokens": tokens,
            "streams_open": streams}


def totals(replies: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {name: 0 for name in SUMMED}
    hits = {level: 0 for level in LEVELS}
    for stats in replies:
        for name in SUMMED:
            out[name] += stats.get(name) or 0
        for level in LEVELS:
            hits[level] += (stats.get("cached_total") or {}).get(level, 0)
    out["cache_hits"] = hits
    out["cached_tokens"] = sum(hits.values())
    return out


async def stats(st: Any, request: Request) -> Response:
    denied = admin_denied(request, st)
    if denied is not None:
        return denied
    replies = await asyncio.gather(*(engine_stats(e) for e in st.engines), return_exceptions=True)
    engines: list[dict[str, Any]] = []
    answered: list[dict[str, Any]] = []
    for engine, reply in zip(st.engines, replies):
        if isinstance(reply, BaseException):
            if not isinstance(reply, EngineError):
                log.warning("engine_stats_failed", engine=engine.address, error=repr(reply))
            engines.append({"address": engine.address, "ok": False, "healthy": engine.healthy,
                            "error": str(reply) or type(reply).__name__})
            continue
        figures = plain(reply)
        answered.append(figures)
        engines.append({"address": engine.address, "ok": True, "healthy": engine.healthy,
                        "model": engine.bundle.model_id if engine.bundle else None, "stats": figures})
    return JSONResponse({"object": "deepwell.stats", "time": round(time.time(), 3), "engines": engines,
                         "totals": totals(answered), "gateway": gateway_figures(st)},
                        headers={"Cache-Control": "no-store"})
