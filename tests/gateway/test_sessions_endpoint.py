"""``GET /v1/deepwell/sessions``: the engines' ``Sessions`` lists merged (each row with its engine),
open without API keys, admin keys only (``--admin-keys``) with them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from deepwell.configs import ConfigError
from deepwell.engine.v1 import engine_pb2
from deepwell.gateway.config import GatewayConfig
from deepwell.gateway.http.app import create_app
from tests.gateway import fake_engine
from tests.gateway.fake_engine import FakeEngine


def _info(key: str, *, idle: float | None, placement: int, cached: int, **kw) -> engine_pb2.SessionInfo:
    tenant = key.split("/", 1)[0]
    info = engine_pb2.SessionInfo(tenant=tenant, session_key=key, placement=placement, cached_tokens=cached, **kw)
    if idle is not None:
        info.idle_s, info.age_s = idle, idle + 10
    return info


class SessionsFake(FakeEngine):
    """A fake engine whose ``Sessions`` answers ``sessions`` (and records the requests)."""

    def __init__(self, sessions: list[engine_pb2.SessionInfo], **kw) -> None:
        super().__init__(**kw)
        self.sessions = sessions
        self.session_requests: list[engine_pb2.SessionsRequest] = []


class _Servicer(fake_engine._Servicer):
    def Sessions(self, request, context):  # noqa: N802
        fake = self.fake
        fake.session_requests.append(request)
        rows = [s for s in fake.sessions if not request.tenant or s.tenant == request.tenant]
        return engine_pb2.SessionsReply(sessions=rows, engine_id=fake.engine_id, ledger_capacity=1000, total=len(rows))


@pytest.fixture
def engines(monkeypatch) -> Iterator[tuple[SessionsFake, SessionsFake, FakeEngine]]:
    monkeypatch.setattr(fake_engine, "_Servicer", _Servicer)
    turn = engine_pb2.SessionTurn(prompt_tokens=200, cached=engine_pb2.CacheHits(resident_frontier=150),
                                  cached_tokens=150, cached_fraction=0.75, ttft_ms=42.5, completion_tokens=7,
                                  reason=engine_pb2.FINISH_REASON_STOP)
    one = SessionsFake([
        _info("alice/s1", idle=5.0, placement=engine_pb2.CACHE_PLACEMENT_RESIDENT, cached=300, resident_tokens=300,
              resident_bytes=4096, last_turn=turn, requests=3),
        _info("bob/s2", idle=None, placement=engine_pb2.CACHE_PLACEMENT_HOST, cached=80, host_tokens=80,
              host_bytes=1000)])
    two = SessionsFake([
        _info("alice/s3", idle=1.0, placement=engine_pb2.CACHE_PLACEMENT_BOTH, cached=500, resident_tokens=400,
              host_tokens=500, resident_bytes=10, host_bytes=20, requests_running=1)])
    with one, two:
        monkeypatch.setattr(fake_engine, "_Servicer", _Servicer.__base__)
        with FakeEngine() as old:  # an engine without the RPC (UNIMPLEMENTED)
            yield one, two, old


def _client(engines_: list[str], **kw) -> TestClient:
    return TestClient(create_app(GatewayConfig(engines=tuple(engines_), grpc_listen="", **kw)))


def test_open_without_api_keys_and_rows_merged(engines) -> None:
    one, two, old = engines
    with _client([one.address, two.address, old.address]) as client:
        r = client.get("/v1/deepwell/sessions")
        assert r.status_code == 200, r.text
        body = r.json()
        rows = body["data"]
        # most recently active first; a session only entries name (no idle time) last
        assert [(x["session_key"], x["engine"]) for x in rows] == [
            ("alice/s3", two.address), ("alice/s1", one.address), ("bob/s2", one.address)]
        s3, s1, s2 = rows
        assert (s3["placement"], s3["bytes"], s3["requests_running"], s3["session"]) == ("both", 30, 1, "s3")
        assert s1["last_turn"] == {"prompt_tokens": 200, "cached_tokens": 150, "cached_fraction": 0.75,
                                   "cached": {"resident_frontier": 150}, "ttft_ms": 42.5, "completion_tokens": 7,
                                   "finish_reason": "stop"}
        assert (s1["placement"], s1["cached_tokens"], s1["resident_bytes"], s1["age_s"], s1["idle_s"]) == (
            "resident", 300, 4096, 15.0, 5.0)
        assert (s2["placement"], s2["tenant"], s2["last_turn"], s2["idle_s"], s2["host_bytes"]) == (
            "host", "bob", None, None, 1000)
        assert s1["engine_id"] == one.engine_id
        status = {e["address"]: e for e in body["engines"]}
        assert status[one.address]["ok"] and status[one.address]["sessions"] == 2
        assert not status[old.address]["ok"] and "UNIMPLEMENTED" in status[old.address]["error"]
        # a tenant narrows every engine's list
        r = client.get("/v1/deepwell/sessions", params={"tenant": "bob"})
        assert [x["session_key"] for x in r.json()["data"]] == ["bob/s2"]
        assert one.session_requests[-1].tenant == "bob" and two.session_requests[-1].tenant == "bob"
        metrics = client.get("/metrics").text
        assert 'deepwell_gateway_requests_total{endpoint="deepwell.sessions",status="200"} 2.0' in metrics


def test_admin_keys_when_api_keys_are_on(engines) -> None:
    one, _, _ = engines
    keys = ("alice:sk-alice", "ops:sk-ops")
    with _client([one.address], api_keys=keys) as client:  # keys on, no admin key set
        assert client.get("/v1/deepwell/sessions").status_code == 401
        r = client.get("/v1/deepwell/sessions", headers={"Authorization": "Bearer sk-ops"})
        assert r.status_code == 403 and "--admin-keys" in r.json()["error"]["message"]
    with _client([one.address], api_keys=keys, admin_keys=("ops",)) as client:
        assert client.get("/v1/deepwell/sessions").status_code == 401
        assert client.get("/v1/deepwell/sessions", headers={"x-api-key": "sk-wrong"}).status_code == 401
        r = client.get("/v1/deepwell/sessions", headers={"Authorization": "Bearer sk-alice"})
        assert r.status_code == 403 and "'alice' is not an admin key" in r.json()["error"]["message"]
        r = client.get("/v1/deepwell/sessions", headers={"x-api-key": "sk-ops"})
        assert r.status_code == 200
        # an admin sees every tenant
        assert {x["tenant"] for x in r.json()["data"]} == {"alice", "bob"}


def test_admin_keys_config() -> None:
    assert GatewayConfig(admin_keys=("ops, root", "ops")).admin_keys == ("ops", "root")
    with pytest.raises(ConfigError, match="key ids") as err:
        GatewayConfig(admin_keys=("ops:sk-secret",))
    assert "sk-secret" not in str(err.value)  # a secret given by mistake is not echoed
