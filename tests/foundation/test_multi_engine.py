"""Scale-out end to end with real processes on loopback: one KV-cache daemon, two engines
(SmolLM2-135M, CPU) sharing its arena (the same ``--kv-daemon``), and one gateway routing to both.

- **Session affinity**: turn 2 of a session (turn 1's messages + the reply + a new user message)
  goes to the engine that served turn 1 and reuses that engine's resident cache (levels 1-2) for
  at least the whole turn-1 prompt.
- **Failover restores from the daemon**: the session's engine gets SIGTERM (it spills its cache
  entries to the daemon on the way out, ``--shutdown-spill-s``); turn 3 through the gateway
  succeeds on the other engine, which resumes the session from the host tier (level 3,
  ``host_entry``) for at least the whole turn-2 prompt, and answers exactly what a cold engine
  answers: the dead engine comes back on its address as a fresh process without a daemon and with
  ``--prefix-cache off``, the session returns to it (rendezvous), and the same turn 3 gives the
  same text in the same number of tokens with nothing cached.

The observable is the gateway's JSONL request log (``--request-log``): per request the engine
address that served it and the cached tokens per reuse level (the engine's ``CacheHits``), joined
to the HTTP response by ``x-request-id``; the response's ``usage.prompt_tokens_details.cached_tokens``
must equal the level total. The gateway exposes text, not token ids, so "the same tokens" is
checked as the same prompt (token count, one rendering path), the same text and the same number
of completion tokens at temperature 0. About 30-40 s on two shared cores.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine.fixtures_smollm2 import smollm2_gguf_path
from tests.engine.helpers_process import engine_process
from tests.gateway.fake_engine import start_gateway
from tests.kvcache.kvtest_helpers import Daemon, wait_until

MAX_TOKENS = 8
SESSION = "multi-engine-session"
LEVELS = ("resident_frontier", "resident_checkpoint", "host_entry", "session_lookup", "shared_prefix")

# long enough that each turn's prompt spans a few 64-token pages (the daemon's digest pages)
TURN1 = ("I am planning a small vegetable garden behind my house. The plot gets about six hours of "
         "sun in the morning and shade in the afternoon, the soil is heavy clay, and I live in a "
         "place with cool, wet springs and short, warm summers. Which three vegetables should I "
         "start with, and why?")
TURN2 = "Thanks. How often should I water them during the first month after planting?"
TURN3 = "And what is one simple thing I can add to the clay soil to improve it?"


def _records(log_path: Path, request_id: str) -> list[dict[str, Any]]:
    if not log_path.exists():
        return []
    out = []
    for line in log_path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec["request_id"] == request_id:
                out.append(rec)
    return out


class Client:
    def __init__(self, url: str, log_path: Path) -> None:
        self.url = url
        self.log_path = log_path

    def chat(self, messages: list[dict[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """One greedy chat turn of the session: (response body, its request-log record)."""
        r = httpx.post(self.url + "/v1/chat/completions", headers={"x-session-id": SESSION}, timeout=120,
                       json={"model": "default", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert wait_until(lambda: _records(self.log_path, rid), timeout_s=10), f"no request-log line for {rid}"
        records = _records(self.log_path, rid)
        assert len(records) == 1, records
        rec = records[0]
        body = r.json()
        assert rec["status"] == 200 and rec["finish_reason"] is not None, rec
        assert body["usage"]["prompt_tokens"] == rec["prompt_tokens"], (body["usage"], rec)
        assert body["usage"]["completion_tokens"] == rec["completion_tokens"], (body["usage"], rec)
        # the OpenAI usage field is the engine's per-level CacheHits, summed
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == rec["cached_tokens"]["total"], (body, rec)
        assert rec["cached_tokens"]["total"] == sum(rec["cached_tokens"].get(k, 0) for k in LEVELS), rec
        return body, rec


def _healthy(url: str, address: str) -> bool:
    try:
        engines = httpx.get(url + "/health", timeout=5).json()["engines"]
    except (httpx.HTTPError, ValueError):
        return False
    return any(e["address"] == address and e["healthy"] and e["model"] for e in engines)


def _shutdown_spills(stderr_log: Path) -> list[int]:
    """``entries`` of the engine's ``shutdown_spill`` log lines (JSON lines off a TTY)."""
    out = []
    for line in stderr_log.read_text().splitlines():
        if '"shutdown_spill"' in line:
            out.append(int(json.loads(line)["entries"]))
    return out


@pytest.mark.timeout(300)
def test_session_affinity_and_failover_restore_from_the_daemon(tmp_path: Path) -> None:
    model = smollm2_gguf_path()
    # small pools so each engine starts in a few seconds on two shared cores
    # --device cpu: fp32 on the CPU, where a restored prefix and a cold prefill give the same greedy
    # tokens (device auto takes CUDA where a GPU is visible: bf16, other kernels for prefill and decode)
    args = ["--model", str(model), "--num-pages", "32", "--max-concurrency", "2", "--cpu-threads", "1",
            "--log-level", "info", "--device", "cpu"]
    engine_stacks = {name: ExitStack() for name in ("a", "b")}
    with ExitStack() as stack:
        daemon = Daemon(arena_bytes=64 << 20, granule_bytes=1 << 20)
        stack.callback(daemon.cleanup)
        daemon.start()
        engines: dict[str, str] = {}  # name -> gRPC address
        for name, es in engine_stacks.items():
            stack.callback(es.close)  # (a no-op once closed)
            (tmp_path / name).mkdir()
            engines[name], _ = es.enter_context(engine_process(tmp_path / name, [*args, "--kv-daemon", daemon.address]))
        by_address = {addr: name for name, addr in engines.items()}
        log_path = tmp_path / "requests.jsonl"
        gw = start_gateway(list(engines.values()), str(tmp_path), "--request-log", str(log_path))
        stack.callback(gw.stop)
        assert wait_until(lambda: all(_healthy(gw.url, a) for a in engines.values()), timeout_s=60), \
            gw.log_text()[-3000:]
        client = Client(gw.url, log_path)

        # -- turn 1: a cold prefill on the session's engine
        messages = [{"role": "user", "content": TURN1}]
        body1, rec1 = client.chat(messages)
        home = by_address[rec1["engine"]]
        other = "b" if home == "a" else "a"
        assert rec1["cached_tokens"]["total"] == 0, rec1
        reply1 = body1["choices"][0]["message"]["content"]
        assert reply1, body1

        # -- turn 2: same engine, served from its resident cache
        messages += [{"role": "assistant", "content": reply1}, {"role": "user", "content": TURN2}]
        body2, rec2 = client.chat(messages)
        assert rec2["engine"] == engines[home], (rec1, rec2)
        hits2 = rec2["cached_tokens"]
        resident = hits2.get("resident_frontier", 0) + hits2.get("resident_checkpoint", 0)
        assert resident >= rec1["prompt_tokens"], rec2  # the whole of turn 1's prompt, at least
        assert rec2["cached_tokens"]["total"] == resident, rec2  # nothing from the host tier or elsewhere
        assert resident < rec2["prompt_tokens"], rec2
        reply2 = body2["choices"][0]["message"]["content"]
        assert reply2, body2

        # -- the session's engine stops (SIGTERM): it spills its cache entries to the daemon first
        engine_stacks[home].close()  # SIGTERM, then waits for the process to exit
        spills = _shutdown_spills(tmp_path / home / "stderr.log")
        assert spills and spills[-1] >= 1, (tmp_path / home / "stderr.log").read_text()[-3000:]

        # -- turn 3: fails over to the other engine, which resumes the session from the daemon
        messages += [{"role": "assistant", "content": reply2}, {"role": "user", "content": TURN3}]
        body3, rec3 = client.chat(messages)
        assert rec3["engine"] == engines[other], rec3
        host = rec3["cached_tokens"].get("host_entry", 0)
        assert host >= rec2["prompt_tokens"], rec3  # the whole of turn 2's prompt, at least, from the host
        assert rec3["cached_tokens"]["total"] == host, rec3  # level 3 only: the other engine had nothing resident
        assert host < rec3["prompt_tokens"], rec3
        assert rec3["timings"].get("restore_ms", 0) > 0, rec3
        restored = body3["choices"][0]["message"]["content"]

        # -- the cold reference: the dead engine comes back on its address as a fresh process with
        # no daemon and no prefix cache; the session returns to it and turn 3 is computed from scratch
        (tmp_path / f"{home}-cold").mkdir()
        port = engines[home].rsplit(":", 1)[1]
        cold_addr, _ = stack.enter_context(engine_process(
            tmp_path / f"{home}-cold", [*args, "--listen", f"127.0.0.1:{port}", "--prefix-cache", "off"]))
        assert cold_addr == engines[home]
        assert wait_until(lambda: _healthy(gw.url, cold_addr), timeout_s=60), gw.log_text()[-3000:]
        body_cold, rec_cold = client.chat(messages)
        assert rec_cold["engine"] == engines[home], rec_cold
        assert rec_cold["cached_tokens"]["total"] == 0, rec_cold
        assert rec_cold["prompt_tokens"] == rec3["prompt_tokens"], (rec_cold, rec3)
        assert (restored, rec3["completion_tokens"], rec3["finish_reason"]) == (
            body_cold["choices"][0]["message"]["content"], rec_cold["completion_tokens"], rec_cold["finish_reason"])
        assert gw.alive()
