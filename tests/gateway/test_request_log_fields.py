"""The request log's session and restore fields, over live gateway processes and the scripted
engine: ``session_hash`` on every line (the session key itself only with
``--request-log-session-keys``), the engine's ``restore_ms`` in ``timings``, and the log read
back by ``deepwell log summarize``."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import httpx
import pytest

from deepwell import log_cli
from tests.gateway.fake_engine import FakeEngine, Script, _Servicer, start_gateway

RESTORE_MS = 7.25  # what the scripted engine reports in Finished.timings


@pytest.fixture(scope="module")
def engine():
    """The scripted engine, reporting a host-tier restore time in every Finished."""
    plain = _Servicer._generate

    def generate(self, request, rid, context):
        for resp in plain(self, request, rid, context):
            if resp.WhichOneof("event") == "finished":
                resp.finished.timings.restore_ms = RESTORE_MS
            yield resp

    mp = pytest.MonkeyPatch()
    mp.setattr(_Servicer, "_generate", generate)
    fake = FakeEngine(scripts=[Script(trigger="second turn", text="Again.", cached=6)]).start()
    yield fake
    fake.stop()
    mp.undo()


@pytest.fixture(scope="module")
def gateways(engine, tmp_path_factory):
    """(default gateway, its log), (gateway with --request-log-session-keys, its log), each
    after the same three requests (two turns of a session, one request without a session)."""
    tmp = tmp_path_factory.mktemp("gw-log")
    hashed_log, clear_log = tmp / "hashed.jsonl", tmp / "clear.jsonl"
    hashed = start_gateway([engine.address], str(tmp), "--request-log", str(hashed_log))
    try:
        clear = start_gateway([engine.address], str(tmp), "--request-log", str(clear_log),
                              "--request-log-session-keys")
    except BaseException:
        hashed.stop()
        raise
    try:
        for gw in (hashed, clear):
            _chat(gw, "first turn", "conv-7")
            _chat(gw, "first turn then second turn", "conv-7")
            _chat(gw, "no session here")
        yield (hashed, hashed_log), (clear, clear_log)
    finally:
        hashed.stop()
        clear.stop()


def _chat(gw, content: str, session: str | None = None) -> None:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text


def _lines(path: Path, n: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while True:
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if len(rows) >= n or time.monotonic() > deadline:
            return rows


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]  # the format, pinned independently


def test_default_log_has_the_session_hash_not_the_key(gateways) -> None:
    (gw, path), _ = gateways
    rows = _lines(path, 3)
    assert len(rows) == 3, gw.log_text()[-2000:]
    assert "conv-7" not in path.read_text()
    a, b, none = rows
    for r in (a, b):
        assert r["session"] is None and r["session_hash"] == _hash("default/conv-7")
        assert r["session_hash"] == log_cli.session_hash("default/conv-7")
    assert none["session"] is None and none["session_hash"] is None
    for r in rows:
        assert r["timings"]["restore_ms"] == RESTORE_MS
        assert {"total_ms", "ttft_ms", "queue_ms", "prefill_ms", "decode_ms", "engine_ttft_ms"} <= set(r["timings"])
        assert set(r["cached_tokens"]) == {"resident_frontier", "resident_checkpoint", "host_entry",
                                           "session_lookup", "shared_prefix", "total"}
    assert b["cached_tokens"]["resident_frontier"] == 6 and b["cached_tokens"]["total"] == 6


def test_session_keys_flag_logs_the_key_in_clear_too(gateways) -> None:
    _, (gw, path) = gateways
    rows = _lines(path, 3)
    assert [r["session"] for r in rows] == ["default/conv-7", "default/conv-7", None]
    assert [r["session_hash"] for r in rows] == [_hash("default/conv-7")] * 2 + [None]


def test_summarize_reads_what_the_gateway_wrote(gateways) -> None:
    (_, hashed_path), (_, clear_path) = gateways
    for path, key in ((hashed_path, None), (clear_path, "default/conv-7")):
        summary = log_cli.read_log(str(path))
        assert summary.malformed == [] and summary.requests == 3
        conv = next(s for s in summary.sessions if s.hash == _hash("default/conv-7"))
        assert conv.key == key and conv.tenant == "default" and len(conv.turns) == 2
        first, second = conv.turns
        assert (first.number, first.cached_tokens, first.level) == (1, 0, None)
        assert second.number == 2 and second.level == "resident_frontier" and second.restore_ms == RESTORE_MS
        assert any(s.hash is None for s in summary.sessions)
        text = log_cli.summary_text(summary, summary.sessions)
        assert f"session {_hash('default/conv-7')}" in text and "(no session)" in text
        assert ("default/conv-7" in text) == (key is not None)
