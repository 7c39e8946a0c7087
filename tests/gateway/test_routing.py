"""Rendezvous routing (unit) and failover / reconnect with two scripted engines (live)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest

from deepwell.gateway.routing import NoHealthyEngine, Router, rank
from deepwell.gateway.session import namespaced, raw_session_id, session_key
from tests.gateway.fake_engine import FakeEngine, start_gateway


@dataclass
class E:
    address: str
    healthy: bool = True


def test_rendezvous_is_stable_and_minimally_disruptive():
    engines = [E(f"10.0.0.{i}:50051") for i in range(5)]
    router = Router(engines)
    keys = [f"tenant/session-{i}" for i in range(400)]
    before = {k: router.pick(k).address for k in keys}
    assert before == {k: Router(list(reversed(engines))).pick(k).address for k in keys}  # order-independent
    assert len(set(before.values())) == 5  # spreads
    engines[2].healthy = False
    after = {k: router.pick(k).address for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "10.0.0.2:50051" for k in moved)  # only its sessions move
    assert all(after[k] == rank(k, engines)[1].address for k in moved)  # to their second choice
    engines[2].healthy = True
    assert {k: router.pick(k).address for k in keys} == before  # and come back


def test_no_healthy_engine_and_exclude():
    engines = [E("a:1", healthy=False), E("b:1", healthy=False)]
    router = Router(engines, retry_after_s=9)
    with pytest.raises(NoHealthyEngine) as e:
        router.pick("k")
    assert e.value.retry_after_s == 9
    engines[1].healthy = True
    assert router.pick("k").address == "b:1"
    with pytest.raises(NoHealthyEngine):
        router.pick("k", exclude=["b:1"])


def test_session_key_sources_and_namespacing():
    h = {"X-Claude-Code-Session-Id": "cc", "X-Session-Id": "xs"}
    assert raw_session_id(h, "anth", "oai") == "xs"  # deepwell's own header first
    assert raw_session_id({"X-Claude-Code-Session-Id": "cc", "session_id": "codex"}, "anth", "oai") == "cc"
    assert raw_session_id({"session_id": "codex"}, "anth", "oai") == "codex"
    assert raw_session_id({"Conversation_Id": "conv"}, None, "oai", "pck") == "conv"
    assert raw_session_id({}, None, "oai", "pck") == "pck"  # prompt_cache_key before user
    claude = '{"device_id":"00","account_uuid":"","session_id":"e9e2-session"}'
    assert raw_session_id({}, claude, "oai") == "e9e2-session"
    assert raw_session_id({}, '{"device_id":"00"}', None) == '{"device_id":"00"}'  # no session in it: the string
    assert raw_session_id({}, "{not json", None) == "{not json"
    assert raw_session_id({}, "anth", "oai") == "anth"
    assert raw_session_id({}, None, "oai") == "oai"
    assert raw_session_id({"x-session-id": "  "}, None, None) is None
    assert session_key({}, "t1", openai_user="u") == "t1/u"
    assert namespaced("t1", None) is None


def _wait(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_session_affinity_failover_and_reconnect(tmp_path):
    a, b = FakeEngine(model_id="m").start(), FakeEngine(model_id="m").start()
    gw = start_gateway([a.address, b.address], str(tmp_path))
    try:
        assert _wait(lambda: len(httpx.get(gw.url + "/health").json()["engines"]) == 2 and all(
            e["healthy"] for e in httpx.get(gw.url + "/health").json()["engines"]))
        # find a session that lands on a, and check it sticks
        sessions = [f"s{i}" for i in range(40)]
        home = {}
        for s in sessions:
            httpx.post(gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"x-session-id": s})
            home[s] = "a" if a.requests and a.requests[-1].session_key == f"default/{s}" else "b"
        assert set(home.values()) == {"a", "b"}
        s_a = next(s for s in sessions if home[s] == "a")
        for _ in range(3):
            n = len(a.requests)
            httpx.post(gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"x-session-id": s_a})
            assert len(a.requests) == n + 1
        # engine a goes away: its session fails over to b (no error for the client)
        a.stop()
        n_b = len(b.requests)
        r = httpx.post(gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"x-session-id": s_a})
        assert r.status_code == 200 and len(b.requests) == n_b + 1
        assert _wait(lambda: not httpx.get(gw.url + "/health").json()["engines"][0]["healthy"])
        # a comes back (new engine id, same port): the gateway reconnects and the session returns
        a.restart()
        assert _wait(lambda: httpx.get(gw.url + "/health").json()["engines"][0]["healthy"])
        n = len(a.requests)
        r = httpx.post(gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"x-session-id": s_a})
        assert r.status_code == 200 and len(a.requests) == n + 1
        b.stop()
        a.stop()
        assert _wait(lambda: httpx.get(gw.url + "/health").status_code == 503)
        r = httpx.post(gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "retry-after" in r.headers
        assert gw.alive()
    finally:
        gw.stop()
        a.stop()
        b.stop()
