"""The short soak of CI: ``benchmarks/soak.py`` with 3 sessions for 30 s against ``deepwell up``
(the embedded SmolLM2 model on the CPU), SIGKILLing the KV-cache daemon at 6 s and the engine
at 14 s. No completed generation may be lost or differ from the fault-free replay, the idle
engine and daemon must be back at their baseline, and the requests sent while the engine was
down must get a 503 or a connection error, not hang. About 55-60 s on two shared cores."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks import soak
from tests.engine.fixtures_smollm2 import smollm2_gguf_path


@pytest.mark.timeout(400)
def test_short_soak_with_a_daemon_and_an_engine_kill(tmp_path: Path) -> None:
    smollm2_gguf_path()  # `deepwell up` serves the default model from the shared cache
    out = tmp_path / "soak.json"
    t0 = time.monotonic()
    result = soak.main(["--sessions", "3", "--duration-s", "30", "--turns", "3", "--max-tokens", "12",
                        "--kill", "daemon@6", "--kill", "engine@14", "--settle-s", "45",
                        "--cpu-kv-gib", "0.25", "--arena-mib", "64", "--request-timeout-s", "90",
                        "--workdir", str(tmp_path / "work"), "--json", str(out)])
    elapsed = time.monotonic() - t0
    assert json.loads(out.read_text())["passed"] == result["passed"]
    crit = result["criteria"]
    log = result.get("up_log_tail", "")
    assert "exception" not in result, (result.get("exception"), log)
    assert result["completed"] > 0, result
    # 0 wrong outputs: every completed generation equals its fault-free greedy replay
    rp = result["replay"]
    assert rp["compared"] == result["completed"] and rp["replay_failures"] == 0, rp
    assert rp["differences"] == 0, rp["examples"]
    # 0 lost (acknowledged by the gateway's request log, never delivered) and none misreported
    assert result["lost"]["count"] == 0, result["lost"]
    assert result["misreported"]["count"] == 0, result["misreported"]
    # both kills happened and both processes came back
    kills = {k["target"]: k for k in result["kills"]}
    assert set(kills) == {"daemon", "engine"} and all(k.get("downtime_s") is not None for k in kills.values()), \
        result["kills"]
    # the engine's downtime was answered with 503s / connection errors, and nothing hung
    during = result["engine_downtime_requests"]
    assert during.get("http_503", 0) + during.get("connect_error", 0) > 0, during
    assert result["engine_downtime_bad"] == {} and result["hangs"] == 0, (during, result["errors"])
    # idle: no running or waiting request, no pages or slots outside the prefix cache, no daemon holdings
    assert result["baseline_problems"] == [], (result["baseline_problems"], result["resources_after"])
    assert result["resources_after"]["engine"]["requests_running"] == 0
    assert result["stack_survived"] and result["up_exit"] == 0, log
    assert all(crit.values()), crit
    print(f"short soak: {elapsed:.0f} s, {result['requests']} requests, {result['completed']} completed")
