"""``benchmarks/gpu_e2e.py`` at its tiny shape on the CPU: the plumbing of the GPU benchmark (the
figures mean nothing here). The benchmark itself runs on a GPU machine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_e2e
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.sampling import SamplingParams



def test_tiny_moe_shape_counts_the_picked_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--shape qwen3.6-35b-a3b --tiny``: a MoE hybrid through the same engine; its roofline
    counts the experts a step's tokens pick (expected under uniform routing), not all of them."""
    out = tmp_path / "e2e.json"
    gpu_e2e.main(["--shape", "qwen3.6-35b-a3b", "--tiny", "--device", "cpu", "--contexts", "256", "--batches", "1",
                  "4", "--kv-dtypes", "bf16", "--weight-dtypes", "bf16", "--skip-prefill", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["errors"] == [] and data["config"]["shape"] == "tiny Qwen3.6-35B-A3B"
    st = data["model"]["fp32"]
    assert st["moe_layers"] == 4 and st["num_experts"] == 16 and st["top_k"] == 4
    assert 0 < st["expert_bytes"] < st["weight_bytes_streamed"]
    assert st["active_layer_params"] == pytest.approx(st["layer_params"] - st["expert_params"] * 12 / 16)
    decode = {d["batch"]: d for d in data["decode"]}
    for b in (1, 4):  # E (1 - (1 - k/E)^B) of the E experts per layer
        picked = 1 - (1 - 4 / 16) ** b
        assert decode[b]["weight_bytes"] == pytest.approx(
            st["weight_bytes_streamed"] - st["expert_bytes"] * (1 - picked))
    assert "4 MoE layers of 16 experts, top-4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu_e2e.parse_args(["--shape", "qwen3.6-35b-a3b", "--hf"])

def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_tiny_cpu_run_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.json"
    t0 = time.perf_counter()
    returned = gpu_e2e.main(["--tiny", "--device", "cpu", "--contexts", "256", "--batches", "1", "2",
                             "--kv-dtypes", "bf16", "--json", str(out)])
    assert time.perf_counter() - t0 < 60
    data = json.loads(out.read_text())
    assert data["errors"] == [] and returned["errors"] == []

    den = data["denominators"]
    assert _positive(den["hbm"]["bytes_per_s"]) and _positive(den["gemm"]["flops_per_s"])

    decode = {(d["batch"], d["context"]): d for d in data["decode"]}
    assert set(decode) == {(1, 256), (2, 256)}
    for d in decode.values():
        assert "skipped" not in d
        assert d["fill"] == "direct"  # 256 > the tiny --fill-above (128): pages written, not prefilled
        for key in ("tok_s", "roofline_tok_s", "fraction", "fraction_weights_only", "fraction_weights_kv",
                    "bytes_per_step", "weight_bytes", "kv_bytes", "state_bytes", "bandwidth"):
            assert _positive(d[key]), (key, d[key])
        assert d["tokens"] == d["batch"] * d["steps"]
        assert d["bytes_per_step"] == pytest.approx(d["weight_bytes"] + d["kv_bytes"] + d["state_bytes"])
        assert d["roofline_tok_s"] == pytest.approx(d["batch"] * d["bandwidth"] / d["bytes_per_step"])
        assert d["mean_context"] > 256  # the context the KV bytes are counted at: the filled one
    assert decode[(2, 256)]["kv_bytes"] == pytest.approx(2 * decode[(1, 256)]["kv_bytes"], rel=0.05)

    prefill = {p["tokens"]: p for p in data["prefill"]}
    assert set(prefill) == {256, 512}
    for p in prefill.values():
        assert _positive(p["tok_s"]) and _positive(p["flops_per_s"]) and _positive(p["mfu"])

    resident = {r["kv"]: r for r in data["resident"]}
    assert {"bf16", "nvfp4"} <= set(resident)
    assert resident["nvfp4"]["tokens"] > resident["bf16"]["tokens"] > 0

    names = [t["name"] for t in data["targets"]]
    assert any("decode batch 1 at 4k" in n for n in names)
    assert any("batch 2 / batch 1" in n for n in names)
    assert any("prefill MFU" in n for n in names)
    assert all(isinstance(t["pass"], bool) and "not meaningful" in t["note"] for t in data["targets"])

    text = capsys.readouterr().out
    assert "decode fp32-w bf16-kv batch=1 ctx=256: " in text and "of roofline" in text
    assert "[fill: direct" in text
    assert "float32" in text  # the tiny CPU run says it runs in fp32
    assert "PASS" in text or "MISS" in text
    if gpu_e2e.fp8_weight_option() is None:
        assert any(n.startswith("fp8 weights: not implemented") for n in data["notes"])


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_direct_fill_leaves_each_request_at_its_context(tmp_path: Path, kv: str) -> None:
    args = gpu_e2e.parse_args(["--tiny", "--device", "cpu"])
    src = open_model(gpu_e2e.write_model(tmp_path / "m", gpu_e2e.TINY), weights=False)
    eng = gpu_e2e.Engine(args, src, torch.device("cpu"), torch.float32, {})
    core = eng.open(kv, 1024, 2)
    n = 300
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    sinks = [gpu_e2e.Sink() for _ in range(2)]
    reqs = [core.make_request(gpu_e2e.random_prompt(n, core.runner.vocab_size, i), params, sink=s)
            for i, s in enumerate(sinks)]
    for r in reqs:
        core.submit(r)
    gpu_e2e.fill_direct(core, reqs, n, seed=0)
    runner, ps = core.runner, core.blocks.page_size
    for r in reqs:
        assert r.num_computed == n - 1
        assert runner.slot_position(core.blocks.state_slot(r.request_id)) == n - 1
        table = core.blocks.block_table(r.request_id)
        pages = runner.kv.page_tensors()[0]  # layer 0 (K for a float pool, the page bytes quantized)
        assert all(bool(pages[p].abs().sum() > 0) for p in table[: (n - 1) // ps])  # the full pages are written
        if kv == "bf16":  # position n - 1 is the prompt's last token: not written, the first step computes it
            last = table[(n - 1) // ps]
            assert bool((pages[last][(n - 1) % ps] == 0).all())
    assert core.step() == 2  # one token each: the last prompt token, computed as a decode
    assert [s.tokens for s in sinks] == [1, 1]
    assert all(r.num_computed == n for r in reqs)
    for r in reqs:
        core.cancel(r.request_id)
    assert core.blocks.used_pages == 0


def test_pools_are_sized_per_batch_and_what_cannot_fit_is_skipped(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """As on CUDA, every state slot comes out of the pool's memory: a long context that fits only
    with one slot gets a pool of its own; a batch that cannot fit even with its own is skipped."""

    def budget(self: gpu_e2e.Engine, runner: Any, slots: int) -> tuple[int, str]:
        spec = runner.memory_spec()
        return 12 * spec.bytes_per_page + (2 - slots) * spec.bytes_per_state_slot, f"12 pages + {2 - slots} slots"

    monkeypatch.setattr(gpu_e2e.Engine, "pool_budget", budget)
    out = tmp_path / "e2e.json"
    gpu_e2e.main(["--tiny", "--device", "cpu", "--contexts", "64", "780", "--batches", "1", "2",
                  "--kv-dtypes", "bf16", "--skip-prefill", "--json", str(out)])
    data = json.loads(out.read_text())
    decode = {(d["batch"], d["context"]): d for d in data["decode"]}
    assert "pool holds 12" in decode[(2, 780)]["skipped"]  # 2 x 13 pages: never fits
    for key in ((1, 64), (2, 64), (1, 780)):  # (1, 780): 13 pages, only with one slot's memory back
        assert _positive(decode[key]["fraction"]), key
    assert data["errors"] == []


def test_profile_cold_prefill_and_hf_paths_run(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    args = ["--tiny", "--device", "cpu", "--contexts", "64", "--batches", "1", "--kv-dtypes", "nvfp4",
            "--skip-prefill", "--decode-steps", "2", "--profile", "--prefill-414k", "--cold-tokens", "512",
            "--hf", "--hf-context", "64", "--hf-prefill", "128", "--json", str(out)]
    # transformers' Qwen3.5 Gated DeltaNet takes fla's Triton kernels whenever fla imports, CPU
    # tensors included ("Pointer argument cannot be accessed from Triton (cpu tensor?)"), and picks
    # them when its modeling module is imported: the CPU run gets a process in which fla does not
    # import (as where it is not installed), so HF takes its torch path.
    # The child runs in tmp_path with the repository appended to its path (not first, as a cwd
    # would be: the checkout's top-level ``kernels/`` would then shadow any installed package of
    # that name, which transformers probes for).
    repo = str(Path(__file__).resolve().parents[2])
    code = (f"import sys, json; sys.path.append({repo!r}); sys.modules['fla'] = None; from benchmarks import gpu_e2e; "
            f"gpu_e2e.main(json.loads({json.dumps(json.dumps(args))}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["errors"] == []
    assert data["decode"][0]["fill"] == "prefill"  # 64 <= --fill-above: prefilled through the engine
    prof = data["profile"][0]
    assert len(prof["top"]) > 0 and prof["gpu_busy"] is None  # no kernels on a CPU
    assert _positive(data["cold_prefill"][0]["seconds"])
    hf = data["hf"]
    assert set(hf["ratios"]) == {"prefill_128", "decode"}
    assert all(_positive(r) for r in hf["ratios"].values())


def test_fp8_gemm_times_sum_a_step_per_shape(tmp_path: Path) -> None:
    """The FP8 breakdown: one figure per weight shape and row count, with the served kernel, its
    bytes over the time, and layers x time as the step's share (a fixed timer stands in for CUDA)."""
    from deepwell.engine_service.layers.fp8_linear import quantize_linears
    from deepwell.engine_service.runner import build_runner
    from deepwell.kernels.fp8_gemm import triton_kernel
    from tests.engine.helpers_models import save_tiny

    save_tiny("qwen3_5", tmp_path / "m")
    model = build_runner(open_model(tmp_path / "m"), device="cpu", dtype=torch.float32, page_size=16).model
    assert quantize_linears(model, min_features=32, block=(32, 32))[0] > 0  # the tiny shapes are below 128
    assert gpu_e2e.fp8_gemm_times(model, torch.device("cpu"), torch.float32, 1e12) == []  # no timer off CUDA
    calls = []

    def timer(kind: str, m: int, n: int, k: int) -> float:
        calls.append((kind, m, n, k))
        return 1e-5 * m

    figs = gpu_e2e.fp8_gemm_times(model, torch.device("cpu"), torch.float32, 1e12, timer=timer)
    shapes = {f["shape"] for f in figs}
    assert figs and len(figs) == 2 * len(shapes) and {f["rows"] for f in figs} == {1, 5}
    for f in figs:
        n, k = map(int, f["shape"].split("x"))
        assert f["kernel"] == triton_kernel.few_row_kernel((n, k), f["rows"])
        assert (f["kernel"], f["rows"], n, k) in calls
        assert f["us"] == pytest.approx(10.0 * f["rows"])
        assert f["step_ms"] == pytest.approx(f["layers"] * f["us"] / 1e3)
        assert f["gb_s"] > n * k / (f["us"] * 1e-6) / 1e9 - 1e-9  # codes plus scales over the time
        assert f["fraction"] == pytest.approx(f["gb_s"] * 1e9 / 1e12)
