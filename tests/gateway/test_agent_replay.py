"""``benchmarks/agent_replay.py`` at CI scale: scripted coding-agent sessions through a real
gateway and a real engine process (CPU), for SmolLM2 (the embedded GGUF, attention only; its
ChatML template ignores tools, so the tools go into the system turn as the gateway's generic
Hermes tool prompt) and a tiny random Qwen3.5-style hybrid served through the
Qwen3.5 XML-tools template (turn checkpoints; a new user message drops the empty think
blocks of the tool loop before it, so the prompt diverges right after the previous query).

Each case runs tool loops (thinking blocks sent back within a loop, dropped by the client
after it and by the gateway always) and at least one new user message after a tool loop,
with a KV pool big enough for every session (no eviction pressure) — and once for the hybrid
with a pool and state slots far too small for its sessions and a KV-cache daemon behind the
engine (entries spilled before eviction, restored from host RAM) — and asserts: no
re-prefill of a cached turn and no shared-prefix miss (the definitions are the benchmark's),
cached fraction >= 95% on turns >= 2, and well above what the shared system-and-tools block
alone would give (so the sessions' own history was served), the response's
``cache_read_input_tokens`` and the engine's per-level hit counters equal to the gateway
log's. The sizes are chosen so that 95% leaves a margin of 1-2 points when every reusable
token is served, and both the table and the totals are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest

from benchmarks import agent_replay
from benchmarks.agent_sessions import ScriptConfig, session_requests

COMMON = ["--max-tokens", "4", "--loop-len", "2-3", "--seed", "0"]


def check_totals(totals: dict[str, Any], rows: list[dict[str, Any]], pressure: bool = False) -> None:
    assert totals["errors"] == 0, [r["error"] for r in rows if r["error"]]
    assert totals["usage_mismatches"] == 0 and totals["prompt_mismatches"] == 0
    assert totals["no_turn_boundary"] == 0
    bad = [(r["session"], r["turn"], r["cached_total"], r["reusable"]) for r in rows
           if r["re_prefill"] or r["shared_prefix_miss"]]
    assert totals["re_prefills"] == 0 and totals["shared_prefix_misses"] == 0, bad
    assert totals["cached_fraction_turn2plus"] >= agent_replay.TARGET_CACHED_FRACTION, totals
    # served the sessions' history, not just the shared block (which alone stays below 95%)
    assert totals["shared_prefix_only_fraction_turn2plus"] < agent_replay.TARGET_CACHED_FRACTION
    assert totals["cached_fraction_turn2plus"] >= totals["shared_prefix_only_fraction_turn2plus"] + 0.03
    assert totals["cached_by_level"]["shared_prefix"] > 0  # the sessions after the first share its prefix
    assert totals["engine_hits_match_log"] is True, (totals["engine"], totals["cached_by_level"])
    assert ((totals["engine"]["evictions"] or {}).get("pressure", 0) > 0) == pressure


def run_case(tmp_path: Path, args: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    out = tmp_path / "replay.json"
    totals = agent_replay.main([*args, *COMMON, "--workdir", str(tmp_path), "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["totals"]["cached_fraction_turn2plus"] == totals["cached_fraction_turn2plus"]
    return totals, data["rows"]


def test_smollm2_sessions_reuse_every_cached_turn(tmp_path: Path) -> None:
    try:
        from tests.engine.fixtures_smollm2 import smollm2_gguf_path

        smollm2_gguf_path()  # the engine loads it from the shared cache
    except Exception as exc:  # no network and no cached copy
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    totals, rows = run_case(tmp_path, [
        "--sessions", "2", "--turns", "6", "--system-chars", "9000", "--tools", "6",
        "--tool-output-chars", "100-300",
        "--engine-arg=--cpu-threads 1 --num-pages 160 --max-context 4096 --log-level warning",
    ])
    assert totals["ok"] == 12
    check_totals(totals, rows)


def test_tiny_hybrid_qwen35_template_sessions_reuse_every_cached_turn(tmp_path: Path) -> None:
    totals, rows = run_case(tmp_path, [
        "--tiny-hybrid", "--sessions", "3", "--turns", "8", "--system-chars", "30000", "--tools", "16",
        "--tool-output-chars", "200-600",
        "--engine-arg=--cpu-threads 1 --num-pages 1024 --max-context 32768 --log-level warning",
    ])
    assert totals["ok"] == 24
    check_totals(totals, rows)
    # the hybrid resumes only at checkpoints: every hit is a turn checkpoint or the shared prefix
    assert totals["cached_by_level"]["resident_frontier"] == 0
    assert all(r["reusable_from"] in ("turn", "prefix", "prefix (other session)") for r in rows if r["turn"] >= 2)


def test_tiny_hybrid_under_pressure_restores_from_the_host_tier(tmp_path: Path) -> None:
    """3 sessions in 6 state slots (2 running) and 14k tokens of pages for ~31k tokens of
    contexts: entries are spilled to the daemon before eviction and restored; nothing cached
    is computed again."""
    totals, rows = run_case(tmp_path, [
        "--tiny-hybrid", "--kv-daemon", "--daemon-arena-mib", "1024", "--sessions", "3", "--turns", "8",
        "--system-chars", "30000", "--tools", "16", "--tool-output-chars", "200-600",
        "--engine-arg=--cpu-threads 1 --num-pages 220 --max-context 12800 --state-slots 6 --max-concurrency 2 "
        "--log-level warning",
    ])
    assert totals["ok"] == 24
    check_totals(totals, rows, pressure=True)
    assert totals["cached_by_level"]["host_entry"] > 0


def test_script_has_tool_loops_dropped_thinking_and_a_new_user_turn() -> None:
    cfg = ScriptConfig(turns=6, loop_len=(2, 3), tool_output_chars=(100, 300))
    for s in range(3):
        reqs = session_requests(cfg, s)
        assert len(reqs) == 6 and all(len(b) > len(a) for a, b in zip(reqs, reqs[1:], strict=False))
        last = reqs[-1]
        texts = [i for i, m in enumerate(last) if m["role"] == "user" and m["content"][0]["type"] == "text"]
        assert len(texts) >= 2 and texts[1] > 2  # a new user message after a tool loop
        assert any(b["type"] == "tool_result" for m in last for b in m["content"] if isinstance(m["content"], list))
        for i, m in enumerate(last):
            thinking = any(b["type"] == "thinking" for b in m["content"]) if m["role"] == "assistant" else None
            if thinking is not None:  # kept within the current loop, dropped before the latest user message
                assert thinking == (i > texts[-1])
    assert session_requests(cfg, 1) == session_requests(cfg, 1)  # deterministic


def _turn(session: int, k: int, ids: list[int], turn_b: int | None, prefix_b: int | None, sent: float,
          done: float, cached: int) -> agent_replay.Turn:
    t = agent_replay.Turn(session, k, f"r{session}-{k}", f"s{session}", {},
                          agent_replay.Prompt(array("I", ids).tobytes(), len(ids), turn_b, prefix_b))
    t.sent, t.done, t.status = sent, done, 200
    t.record = {"cached_tokens": {"total": cached}, "prompt_tokens": len(ids)}
    return t


def test_reusable_point_definition() -> None:
    shared = list(range(100, 110))  # 10 tokens of system + tools
    a1 = _turn(0, 1, shared + [1, 2, 3, 4], 12, 10, 0.0, 1.0, 0)
    a2 = _turn(0, 2, shared + [1, 2, 3, 4, 5, 6, 7], 15, 10, 1.1, 2.0, 12)
    # a new user turn that diverges after token 11: only the prefix image (10) is below it
    a3 = _turn(0, 3, shared + [1, 9, 9, 9, 9], 14, 10, 2.1, 3.0, 9)
    b1 = _turn(1, 1, shared + [7, 7], 11, 10, 1.5, 2.5, 0)  # after a1 finished: a1's prefix is reusable
    c1 = _turn(2, 1, shared + [8, 8], 11, 10, 0.5, 1.4, 0)  # sent before a1 finished: nothing earlier
    d1 = _turn(3, 1, shared[:4] + [5], 4, None, 9.0, 9.5, 0)  # agrees with others only below their boundaries
    agent_replay.reusable_points([a1, a2, a3, b1, c1, d1])
    assert [(t.reusable, t.reusable_from) for t in (a1, a2, a3, b1, c1, d1)] == [
        (0, ""), (12, "turn"), (10, "prefix"), (10, "prefix (other session)"), (0, ""), (0, "")]
    rows = [agent_replay.row(t) for t in (a1, a2, a3, b1, c1, d1)]
    assert [r["re_prefill"] for r in rows] == [False, False, True, False, False, False]
    assert [r["shared_prefix_miss"] for r in rows] == [False, False, False, True, False, False]
    totals = agent_replay.totals_of(rows)
    assert totals["re_prefills"] == 1 and totals["re_prefill_tokens"] == 1 and totals["shared_prefix_misses"] == 1
