"""``GET /v1/deepwell/sessions``: the engines' live sessions, merged (an operator endpoint).

Each engine answers its ``Sessions`` RPC (``engine_service.sessions``); the gateway merges the
lists, adds each row's engine address, and orders them most recently active first. An engine
that cannot answer is reported under ``engines`` with its error; the others still count.

Access: without API keys the endpoint is open (the gateway listens on loopback by default).
With API keys it needs a key whose id is in ``--admin-keys`` (401 without a valid key, 403
with another key, or with none listed). An admin sees every tenant (``?tenant=`` narrows it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepwell.engine.v1 import engine_pb2
from deepwell.gateway.http.common import context
from deepwell.gateway.pipeline import ENGINE_FINISH, ENGINE_STOPPED

PLACEMENTS = {engine_pb2.CACHE_PLACEMENT_NONE: "none", engine_pb2.CACHE_PLACEMENT_RESIDENT: "resident",
              engine_pb2.CACHE_PLACEMENT_HOST: "host", engine_pb2.CACHE_PLACEMENT_BOTH: "both"}
REASONS = {**ENGINE_FINISH, **ENGINE_STOPPED}  # the engine's finish reasons by name
LEVELS = ("resident_frontier", "resident_checkpoint", "host_entry", "session_lookup", "shared_prefix")


def forbidden(message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "permission_error", "param": None,
                                   "code": "admin_key_required"}}, status_code=403)


def admin_denied(request: Request, st: Any) -> Response | None:
    """None when the caller may use the operator endpoints; raises 401 (``GatewayError``) for a
    missing or wrong key, answers 403 for a key that is not an admin key."""
    if not st.keys.enabled:
        return None
    tenant = context(request, st.keys).tenant
    admins = st.config.admin_keys
    if not admins:
        return forbidden("this endpoint needs an admin key: API keys are on and no admin key is set; "
                         "start the gateway with --admin-keys KEY_ID,... (DEEPWELL_GATEWAY_ADMIN_KEYS)")
    if tenant not in admins:
        return forbidden(f"API key {tenant!r} is not an admin key (--admin-keys)")
    return None


def session_row(address: str, engine_id: str, s: engine_pb2.SessionInfo) -> dict[str, Any]:
    prefix = f"{s.tenant}/"
    turn = None
    if s.HasField("last_turn"):
        t = s.last_turn
        turn = {"prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                "cached_fraction": round(t.cached_fraction, 6),
                "cached": {lv: getattr(t.cached, lv) for lv in LEVELS if getattr(t.cached, lv)},
                "ttft_ms": round(t.ttft_ms, 3), "completion_tokens": t.completion_tokens,
                "finish_reason": REASONS.get(t.reason)}
    return {
        "engine": address, "engine_id": engine_id, "tenant": s.tenant, "session_key": s.session_key,
        "session": s.session_key[len(prefix):] if s.session_key.startswith(prefix) else s.session_key,
        "placement": PLACEMENTS.get(s.placement, "none"), "cached_tokens": s.cached_tokens,
        "resident_tokens": s.resident_tokens, "host_tokens": s.host_tokens,
        "resident_entries": s.resident_entries, "host_entries": s.host_entries,
        "resident_bytes": s.resident_bytes, "host_bytes": s.host_bytes, "bytes": s.resident_bytes + s.host_bytes,
        "last_turn": turn,
        "age_s": round(s.age_s, 3) if s.HasField("age_s") else None,
        "idle_s": round(s.idle_s, 3) if s.HasField("idle_s") else None,
        "requests_running": s.requests_running, "requests": s.requests,
    }


async def sessions(st: Any, request: Request) -> Response:
    denied = admin_denied(request, st)
    if denied is not None:
        return denied
    tenant = request.query_params.get("tenant", "")
    replies = await asyncio.gather(*(e.sessions(tenant) for e in st.engines), return_exceptions=True)
    rows: list[dict[str, Any]] = []
    engines: list[dict[str, Any]] = []
    for engine, reply in zip(st.engines, replies):
        if isinstance(reply, BaseException):
            engines.append({"address": engine.address, "ok": False, "error": str(reply) or type(reply).__name__})
            continue
        engines.append({"address": engine.address, "ok": True, "engine_id": reply.engine_id,
                        "sessions": reply.total, "ledger_capacity": reply.ledger_capacity})
        rows += [session_row(engine.address, reply.engine_id, s) for s in reply.sessions]
    # most recently active first (running: idle 0); sessions only cache entries still name, last
    rows.sort(key=lambda r: (r["idle_s"] is None, r["idle_s"] or 0.0, -r["cached_tokens"]))
    return JSONResponse({"object": "list", "data": rows, "engines": engines})
