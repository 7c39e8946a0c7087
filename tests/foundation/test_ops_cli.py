"""``deepwell sessions`` and ``deepwell stats`` against a live stack: a KV-cache daemon, a real
engine process (a tiny hybrid model, a resident budget of one session, a host tier) and a gateway
with API keys and an admin key. Two sessions: one spilled to the host, one resident."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from deepwell import ops_cli

ADMIN, USER = "sk-ops-secret", "sk-alice-secret"


@dataclass
class Stack:
    url: str
    engine_metrics: str
    daemon: str


def _complete(url: str, prompt: list[int], session: str = "") -> dict:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {USER}"}
    if session:
        headers["X-Session-Id"] = session
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body, headers), timeout=60) as r:
        return json.loads(r.read())


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from tests.engine.helpers_models import save_tiny
    from tests.engine.helpers_process import engine_process
    from tests.gateway.fake_engine import start_gateway, tokenizer_json
    from tests.kvcache.kvtest_helpers import Daemon

    tmp = tmp_path_factory.mktemp("ops")
    model = tmp / "model"
    save_tiny("qwen3_5", model)
    (model / "tokenizer.json").write_text(tokenizer_json())  # a real (small) tokenizer for the gateway
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with ExitStack() as stack:
        daemon = Daemon(arena_bytes=16 << 20, granule_bytes=1 << 20).start()
        stack.callback(daemon.cleanup)
        (tmp / "engine").mkdir()
        address, metrics = stack.enter_context(engine_process(tmp / "engine", [
            "--model", str(model), "--num-pages", "40", "--page-size", "16", "--max-concurrency", "2",
            "--cache-fraction", "0.15", "--cpu-threads", "1", "--log-level", "warning",
            "--kv-daemon", daemon.address]))
        gw = start_gateway([address], str(tmp), "--api-keys", f"ops:{ADMIN},alice:{USER}", "--admin-keys", "ops",
                           timeout_s=120)
        stack.callback(gw.stop)
        _complete(gw.url, _prompt(1, 60), "a")
        _complete(gw.url, _prompt(2, 60), "b")
        for _ in range(50):  # sessionless requests step the engine: the resident budget spills a
            _complete(gw.url, [7, 8, 9])
            rows = ops_cli.fetch_sessions(gw.url, ADMIN)["data"]
            if {r["session"]: r["placement"] for r in rows}.get("a") == "host":
                break
            time.sleep(0.05)
        yield Stack(gw.url, metrics, daemon.address)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deepwell.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_sessions_json_and_table(stack: Stack) -> None:
    r = _cli("sessions", "--url", stack.url, "--api-key", ADMIN, "--json")
    assert r.returncode == 0, r.stderr
    rows = {x["session"]: x for x in json.loads(r.stdout)["data"]}
    assert set(rows) == {"a", "b"}  # sessionless requests are not listed
    a, b = rows["a"], rows["b"]
    assert (a["placement"], a["tenant"], a["session_key"]) == ("host", "alice", "alice/a")
    assert b["placement"] == "resident" and b["resident_bytes"] > 0 and a["host_bytes"] > 0
    for x in (a, b):
        assert x["cached_tokens"] >= 60 and x["last_turn"]["prompt_tokens"] == 60 and x["last_turn"]["ttft_ms"] > 0
        assert x["age_s"] >= x["idle_s"] > 0
    table = _cli("sessions", "--url", stack.url, "--api-key", ADMIN)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["SESSION", "TENANT", "WHERE", "CACHED", "LAST", "%", "TTFT", "ms", "AGE", "IDLE",
                                "BYTES"]
    by_session = {line.split()[0]: line.split() for line in lines[1:]}
    assert by_session["a"][1:3] == ["alice", "host"] and by_session["b"][1:3] == ["alice", "GPU"]
    assert by_session["a"][4] == "0.0"  # the last turn's cached share: a first turn
    # --watch on a pipe: plain tables one after another
    watch = _cli("sessions", "--url", stack.url, "--api-key", ADMIN, "--watch", "0.1", "--count", "2")
    assert watch.returncode == 0 and watch.stdout.count("SESSION") == 2 and "\x1b[" not in watch.stdout


def test_sessions_needs_an_admin_key(stack: Stack) -> None:
    for args in ((), ("--api-key", USER)):
        r = _cli("sessions", "--url", stack.url, *args)
        assert r.returncode == 1
        assert ("HTTP 401" if not args else "HTTP 403") in r.stderr, r.stderr


def test_sessions_watch_clears_a_terminal(stack: Stack) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    parser = argparse.ArgumentParser()
    ops_cli._sessions_configure(parser)
    args = parser.parse_args(["--url", stack.url, "--api-key", ADMIN, "--watch", "0.01", "--count", "2"])
    assert ops_cli._sessions_run(args, out, sleep=lambda s: None) == 0
    assert out.getvalue().count(ops_cli.CLEAR) == 2 and "alice" in out.getvalue()


def test_stats_on_one_screen(stack: Stack) -> None:
    r = _cli("stats", "--url", stack.url, "--engine-metrics", stack.engine_metrics, "--daemon-address", stack.daemon,
             "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert set(s) == {"gateway", "engine", "daemon"} and not any("error" in v for v in s.values()), s
    assert s["gateway"]["requests"]["2xx"] >= 3 and s["gateway"]["tokens"]["prompt"] >= 120
    e = s["engine"]
    assert e["tokens"]["prefilled"] >= 120 and e["spills"].get("ok", 0) >= 1 and e["kv_pages"]["total"] == 40
    assert sum(e["requests"]["finished"].values()) >= 3
    assert s["daemon"]["entries"] >= 1 and s["daemon"]["arena_bytes"] == 16 << 20
    text = _cli("stats", "--url", stack.url, "--engine-metrics", stack.engine_metrics,
                "--daemon-address", stack.daemon)
    assert text.returncode == 0, text.stderr
    for label in ("gateway", "engine", "daemon", "cache hits", "pages / slots", "spills", "restores", "arena"):
        assert label in text.stdout, text.stdout
    # what is not given is skipped; what cannot be read says so
    only = _cli("stats", "--url", "", "--engine-metrics", "http://127.0.0.1:9/metrics")
    assert only.returncode == 1 and "engine" in only.stdout and "cannot reach" in only.stdout
    assert "gateway" not in only.stdout


def test_engine_stats_carry_the_daemons_arena(stack: Stack) -> None:
    """The status page's host-tier box: each engine's Stats (through /v1/deepwell/stats) holds the
    daemon's arena figures, read by the engine from the daemon."""
    import urllib.request

    req = urllib.request.Request(stack.url + "/v1/deepwell/stats", headers={"authorization": f"Bearer {ADMIN}"})
    body = json.loads(urllib.request.urlopen(req, timeout=30).read())
    (engine,) = body["engines"]
    host = engine["stats"]["host"]
    assert host["arena_bytes"] == 16 << 20 and host["entries"] >= 1 and 0 < host["committed_bytes"] <= 16 << 20


def test_metrics_parsing() -> None:
    text = ('# HELP x y\nx_total{a="1",b="q\\"z"} 3.0\nx_total{a="2"} 4\ny 1e3\nbad line\n'
            'h_seconds_sum 0.5\nh_seconds_count 2\n')
    m = ops_cli.Metrics(ops_cli.parse_metrics(text))
    assert m.total("x_total") == 7 and m.total("x_total", a="1") == 3 and m.by("x_total", "b") == {'q"z': 3.0}
    assert m.total("y") == 1000 and m.mean_ms("h_seconds") == 250.0 and m.mean_ms("nope") is None
    assert ops_cli.metrics_url("http://h:1") == "http://h:1/metrics"
    assert ops_cli.metrics_url("h:1/custom") == "http://h:1/custom"
    assert ops_cli.human_bytes(1536) == "1.5 KiB" and ops_cli.human_bytes(10) == "10 B"
    assert ops_cli.human_duration(75) == "1m15s" and ops_cli.human_duration(None) == "-"
