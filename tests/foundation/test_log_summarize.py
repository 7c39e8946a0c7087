"""``deepwell log summarize``: per-session turn tables of a crafted request log with several
sessions, lines of older formats (clear ``session`` and no ``session_hash``, no ``restore_ms``),
malformed lines and fields of the wrong type; every path in-process, no service."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from deepwell import cli, log_cli
from deepwell.log_cli import session_hash

T0 = 1_700_000_000.0
A = "default/agent-a"  # logged as its hash only (the current default)
B = "acme/legacy-b"  # an older log: the key in clear, no session_hash, no restore_ms


def _line(**kw) -> str:
    return json.dumps(kw, separators=(",", ":"))


def _rec(rid: str, ts: float, *, total_ms: float, session_hash_: str | None = None, session: str | None = None,
         tenant: str = "default", prompt: int = 100, completion: int = 10, cached: dict | None = None,
         ttft: float = 50.0, decode_ms: float = 100.0, restore_ms: float | None = 0.0, finish: str | None = "stop",
         status: int = 200) -> str:
    timings = {"total_ms": total_ms, "ttft_ms": ttft, "queue_ms": 1.0, "prefill_ms": 2.0, "decode_ms": decode_ms}
    if restore_ms is not None:
        timings["restore_ms"] = restore_ms
    rec = {"ts": ts, "request_id": rid, "tenant": tenant, "session": session, "endpoint": "messages",
           "status": status, "prompt_tokens": prompt, "completion_tokens": completion,
           "cached_tokens": {**(cached or {}), "total": sum((cached or {}).values())}, "timings": timings,
           "finish_reason": finish}
    if session_hash_ is not None:
        rec["session_hash"] = session_hash_
    return _line(**rec)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    ha = session_hash(A)
    lines = [
        # session A, turns finished out of order: turn 2 (long) finished after turn 3 started
        _rec("a1", T0 + 10, total_ms=2000, session_hash_=ha, prompt=1000, completion=50, decode_ms=500,
             ttft=800.25),
        "this is not json",
        _rec("a3", T0 + 40, total_ms=1000, session_hash_=ha, prompt=1400, completion=20, decode_ms=0,
             cached={"resident_frontier": 1300, "host_entry": 0}, ttft=90.0, finish="length"),
        _rec("a2", T0 + 45, total_ms=30_000, session_hash_=ha, prompt=1200, completion=40, decode_ms=400,
             cached={"resident_frontier": 100, "host_entry": 900}, ttft=120.0, restore_ms=23.5,
             finish="tool_calls"),
        "[1, 2, 3]",
        "",
        '{"ts": 1700000050, "request_id": "trunc',  # a line cut short (disk full, killed writer)
        # session B from an older gateway: clear key, no hash, no restore_ms, no engine_ttft_ms
        _rec("b1", T0 + 20, total_ms=500, session=B, tenant="acme", prompt=300, completion=30, decode_ms=300,
             restore_ms=None, cached={"shared_prefix": 200}),
        # ...and its next turn from the new gateway with --request-log-session-keys: the same session
        _rec("b2", T0 + 60, total_ms=500, session=B, session_hash_=session_hash(B), tenant="acme", prompt=400,
             completion=0, decode_ms=0, cached={"resident_checkpoint": 350}, finish=None, status=503),
        # requests without a session; one whose fields have the wrong types
        _rec("n1", T0 + 30, total_ms=100, prompt=10, completion=5, decode_ms=50),
        _line(request_id="n2", ts="yesterday", prompt_tokens="many", cached_tokens=[1], timings=None,
              status=200, finish_reason=7),
        _line(request_id="n3"),  # the oldest format imaginable: almost nothing
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["log", "summarize", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def test_groups_by_session_and_orders_turns_by_start(log: Path) -> None:
    s = log_cli.read_log(str(log))
    assert s.lines == 11 and s.malformed == [2, 5, 7] and s.requests == 8
    by = {x.hash: x for x in s.sessions}
    assert list(by) == [session_hash(A), session_hash(B), None]  # first seen first
    a = by[session_hash(A)]
    assert a.key is None and a.tenant == "default"
    assert [t.request_id for t in a.turns] == ["a1", "a2", "a3"]  # by start (ts - total_ms), not by finish
    assert [t.number for t in a.turns] == [1, 2, 3]
    a1, a2, a3 = a.turns
    assert a1.decode_tok_s == pytest.approx(100.0) and a1.level is None and a1.cached_fraction == 0.0
    assert (a2.cached_tokens, a2.level, a2.restore_ms) == (1000, "host_entry", 23.5)
    assert a2.decode_tok_s == pytest.approx(100.0) and a2.cached_fraction == pytest.approx(1000 / 1200)
    assert a3.decode_tok_s is None and a3.level == "resident_frontier"
    b = by[session_hash(B)]
    assert b.key == B and b.tenant == "acme" and [t.request_id for t in b.turns] == ["b1", "b2"]
    assert b.turns[0].restore_ms is None and b.turns[1].restore_ms == 0.0
    none = by[None]
    assert sorted(t.request_id for t in none.turns) == ["n1", "n2", "n3"]
    n2 = next(t for t in none.turns if t.request_id == "n2")
    assert (n2.started, n2.prompt_tokens, n2.cached_tokens, n2.ttft_ms, n2.finish_reason) == (None,) * 5


def test_totals(log: Path) -> None:
    s = log_cli.read_log(str(log))
    t = log_cli.totals(s.sessions[0])
    assert (t["turns"], t["prompt_tokens"], t["cached_tokens"]) == (3, 3600, 2300)
    assert t["level"] == "resident_frontier"  # 1400 of 2300
    assert t["ttft_ms_mean"] == pytest.approx((800.25 + 120 + 90) / 3)
    assert t["decode_tok_s"] == pytest.approx(90 / 900 * 1000)  # a3 decoded nothing: not in the rate
    assert t["restore_ms"] == 23.5 and t["finish"] == {"stop": 1, "tool_calls": 1, "length": 1}
    b, none = log_cli.totals(s.sessions[1]), log_cli.totals(s.sessions[2])
    assert b["finish"] == {"stop": 1, "HTTP 503": 1} and b["restore_ms"] == 0.0  # the one line that has it
    assert none["finish"] == {"stop": 1, "unknown": 2} and none["prompt_tokens"] == 10


def test_text_output(log: Path, capsys) -> None:
    rc, out, err = _run(capsys, str(log))
    assert rc == 0 and err == ""
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 4  # three sessions and the footer
    a, b, none, foot = blocks
    head, header, *rows = a.splitlines()
    assert head.startswith(f"session {session_hash(A)}  tenant default  3 turns  ")
    assert header.split() == ["TURN", "STARTED", "PROMPT", "CACHED", "CACHED", "%", "LEVEL", "TTFT", "ms",
                              "DECODE", "tok/s", "RESTORE", "ms", "FINISH"]
    assert rows[0].split() == ["1", _clock(T0 + 8), "1000", "0", "0.0", "-", "800.2", "100.0", "0.0", "stop"]
    assert rows[1].split() == ["2", _clock(T0 + 15), "1200", "1000", "83.3", "host", "120.0", "100.0", "23.5",
                               "tool_calls"]
    assert rows[2].split() == ["3", _clock(T0 + 39), "1400", "1300", "92.9", "frontier", "90.0", "-", "0.0",
                               "length"]
    assert rows[3].split() == ["total", "3600", "2300", "63.9", "frontier", "336.8", "100.0", "23.5", "1", "length,",
                               "1", "stop,", "1", "tool_calls"]
    assert f"  {B}  tenant acme  2 turns" in b.splitlines()[0]
    b1, b2 = b.splitlines()[2:4]
    assert b1.split()[-3:] == ["100.0", "-", "stop"]  # no restore_ms in the older line
    assert b2.split()[-5:] == ["50.0", "-", "0.0", "HTTP", "503"] and "checkpoint" in b2
    assert none.splitlines()[0] == "session (no session)  3 turns  " + time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(T0 + 29.9))
    assert foot == "8 requests in 3 sessions; 3 malformed lines skipped (lines 2, 5, 7)"


def test_session_filter(log: Path, capsys) -> None:
    ha = session_hash(A)
    for wanted in (ha, ha[:6], A):  # a hash, a prefix of one, the clear key (hashed to find it)
        rc, out, _ = _run(capsys, str(log), "--session", wanted)
        assert rc == 0 and out.startswith(f"session {ha}") and out.count("\nsession ") == 0, wanted
        assert "(1 shown)" in out
    rc, out, _ = _run(capsys, str(log), "--session", "none")
    assert rc == 0 and out.startswith("session (no session)")
    rc, out, err = _run(capsys, str(log), "--session", "fffffffffff")
    assert rc == 1 and out == "" and "no session 'fffffffffff'" in err


def test_json_output(log: Path, capsys) -> None:
    rc, out, _ = _run(capsys, str(log), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert (doc["lines"], doc["requests"], doc["malformed"], doc["malformed_lines"]) == (11, 8, 3, [2, 5, 7])
    assert [s["session_hash"] for s in doc["sessions"]] == [session_hash(A), session_hash(B), None]
    a = doc["sessions"][0]
    assert a["session"] is None and a["totals"]["cached_tokens"] == 2300
    assert [t["request_id"] for t in a["turns"]] == ["a1", "a2", "a3"]
    assert a["turns"][1]["restore_ms"] == 23.5 and a["turns"][1]["level"] == "host_entry"
    rc, out, _ = _run(capsys, str(log), "--json", "--session", B)
    assert [s["session"] for s in json.loads(out)["sessions"]] == [B]


def test_empty_missing_and_all_malformed_files(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _run(capsys, str(empty)) == (0, f"no requests in {empty}\n", "")
    rc, out, _ = _run(capsys, str(empty), "--json")
    assert rc == 0 and json.loads(out)["sessions"] == [] and json.loads(out)["requests"] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe garbage\n" + b"[" * 100_000 + b"\n" + b"null\n")
    rc, out, _ = _run(capsys, str(bad))
    assert rc == 0 and out == f"no requests in {bad}; 3 malformed lines skipped (lines 1, 2, 3)\n"
    rc, out, err = _run(capsys, str(tmp_path / "missing.jsonl"))
    assert rc == 1 and out == "" and "cannot read" in err and "missing.jsonl" in err


def test_file_from_the_gateway_setting_and_help(log: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("DEEPWELL_GATEWAY_REQUEST_LOG", str(log))
    rc, out, _ = _run(capsys)  # FILE defaults to the gateway's --request-log setting
    assert rc == 0 and out.endswith("8 requests in 3 sessions; 3 malformed lines skipped (lines 2, 5, 7)\n")
    monkeypatch.delenv("DEEPWELL_GATEWAY_REQUEST_LOG")
    rc, _, err = _run(capsys)
    assert rc == 2 and "give FILE" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["log", "summarize", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "usage: deepwell log summarize" in out and "--session HASH" in out
    assert cli.main(["log"]) == 2 and "summarize" in capsys.readouterr().out


def test_session_hash_is_stable() -> None:
    assert session_hash(A) == "%s" % session_hash(A) and len(session_hash(A)) == 16
    assert session_hash(A) != session_hash(B) and session_hash(None) is None and session_hash("") is None
    import hashlib

    assert session_hash(A) == hashlib.sha256(A.encode()).hexdigest()[:16]
