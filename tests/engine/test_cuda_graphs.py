"""Decode steps through ``engine_service.graphs`` (the CUDA-graph path) on CPU.

Capture needs CUDA (the ``gpu``-marked tests at the end of this file capture the engine's
steps and compare them with eager steps and HF on a GPU); here ``capture=False`` runs the very
same static-buffer step eagerly: loading the persistent inputs, padding a batch to its bucket
with the scratch page and slot, the graph's step context and the runner's bookkeeping. They
must give the eager path's logits and tokens, and never touch a page or slot the batch does
not own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepwell import configs
from deepwell.engine_service.cli import graph_plan
from deepwell.engine_service.config import EngineConfig
from deepwell.engine_service.engine import EngineCore, EngineLimits
from deepwell.engine_service.graph_audit import audit
from deepwell.engine_service.graphs import graph_buckets, reserve_bytes
from deepwell.engine_service.layers.fp8_linear import FP8Linear, dequant_bytes, quantize_linears
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import build_runner
from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice
from tests.engine.helpers_models import greedy_three, one_torch_thread, prompt, save_tiny_head_dim

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

PAGES, SLOTS = 16, 4


@pytest.fixture(scope="module")
def hybrid64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.test_kv_quant import save_hybrid

    d = tmp_path_factory.mktemp("hybrid64")
    save_hybrid(d)
    return d


def _runner(path: Path, kv: str, graphs: int):  # type: ignore[no-untyped-def]
    dtype = torch.bfloat16 if kv == "bf16" else torch.float32
    r = build_runner(open_model(path), device="cpu", dtype=dtype, kv_dtype=kv, page_size=64,
                     kv_paged="on" if kv == "bf16" else "auto")
    if graphs:
        r.plan_graphs(graphs)
    r.allocate(PAGES, SLOTS)
    if graphs:
        r.capture_graphs(capture=False)
    return r


def test_buckets() -> None:
    assert graph_buckets(1) == (1,)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(12) == (1, 2, 4, 8, 12)
    with pytest.raises(ValueError):
        graph_buckets(0)


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_static_decode_steps_equal_eager_ones(hybrid64: Path, kv: str) -> None:
    eager, graphed = _runner(hybrid64, kv, 0), _runner(hybrid64, kv, 4)
    assert graphed.kv.num_pages == PAGES + 1 and graphed.state.num_slots == SLOTS + 1  # the scratch page, slot
    lens = (70, 9, 130)
    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    ids = [prompt(n, seed=i + 1) for i, n in enumerate(lens)]
    # slot 3 holds a fourth sequence the decode batches do not include: it must not move
    for r in (eager, graphed):
        for slot in range(SLOTS):
            r.reset_state(slot)
        r.forward(ForwardBatch(torch.tensor(prompt(20, seed=9)), [SeqSlice(3, [8], 0, 20)]))
        r.forward(ForwardBatch(torch.tensor([t for x in ids for t in x]),
                               [SeqSlice(i, tables[i], 0, n) for i, n in enumerate(lens)]))
    fourth = [t[3].clone() for t in graphed.state.slot_tensors()]
    pos = list(lens)
    nxt = [x[-1] for x in ids]
    for step in range(5):
        batch = ForwardBatch(torch.tensor(nxt), [SeqSlice(i, tables[i], pos[i], 1) for i in range(3)])
        a, b = eager.forward(batch), graphed.forward(batch)
        assert a.shape == b.shape == (3, eager.vocab_size)
        err = (a - b).abs().max() / a.abs().max()
        assert err < (2e-2 if kv == "bf16" else 1e-5), (step, float(err))
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        nxt = a.argmax(-1).tolist()
        pos = [p + 1 for p in pos]
    assert graphed.graphs is not None and graphed.graphs.replays == 5
    assert [graphed.slot_position(i) for i in range(3)] == pos
    assert all(torch.equal(t[3], f) for t, f in zip(graphed.state.slot_tensors(), fourth))
    # a batch of one runs the smallest bucket; position 0 and multi-token slices run eagerly
    assert graphed.graphs.bucket(1) == 1 and graphed.graphs.bucket(3) == 4
    assert not graphed.graphs.accepts(ForwardBatch(torch.tensor([1]), [SeqSlice(0, [0], 0, 1)]))
    assert not graphed.graphs.accepts(ForwardBatch(torch.tensor([1, 2]), [SeqSlice(0, [0], 5, 2)]))


def test_graph_metrics(hybrid64: Path) -> None:
    from deepwell.engine_service.metrics import EngineMetrics

    m = EngineMetrics("t")
    m.set_cuda_graphs(None)
    assert m.registry.get_sample_value("deepwell_engine_cuda_graph_buckets", {"model": "t", "which": "largest"}) == 0
    r = _runner(hybrid64, "bf16", 4)
    r.graphs._graphs = {(b, 1): None for b in r.graphs.buckets}  # as captured (CPU: none are)
    r.graphs.memory_bytes = 3 << 20
    m.set_cuda_graphs(r.graphs)
    get = m.registry.get_sample_value
    assert get("deepwell_engine_cuda_graph_buckets", {"model": "t", "which": "count"}) == 3
    assert get("deepwell_engine_cuda_graph_buckets", {"model": "t", "which": "largest"}) == 4
    assert get("deepwell_engine_cuda_graph_memory_bytes", {"model": "t"}) == 3 << 20


def test_graph_steps_check_their_inputs(hybrid64: Path) -> None:
    r = _runner(hybrid64, "bf16", 2)
    r.reset_state(0)
    r.forward(ForwardBatch(torch.tensor(prompt(10)), [SeqSlice(0, [0], 0, 10)]))
    for batch, match in [
        (ForwardBatch(torch.tensor([1]), [SeqSlice(0, [0], 9, 1)]), "holds position 10"),
        (ForwardBatch(torch.tensor([1]), [SeqSlice(0, [PAGES], 10, 1)]), "page ids"),  # the scratch page
        (ForwardBatch(torch.tensor([1] * 60), [SeqSlice(0, [0, PAGES], 10, 60)]), "page ids"),  # eager path too
        (ForwardBatch(torch.tensor([1]), [SeqSlice(SLOTS, [0], 10, 1)]), "state slot"),  # the scratch slot
        (ForwardBatch(torch.tensor([999]), [SeqSlice(0, [0], 10, 1)]), "token ids"),
    ]:
        with pytest.raises(ValueError, match=match):
            r.forward(batch)
    assert r.graphs is not None and r.graphs.replays == 0


def _greedy(path: Path, graphs: int) -> list[list[int]]:
    runner = build_runner(open_model(path), device="cpu", dtype=torch.float32, kv_dtype="nvfp4", page_size=64)
    if graphs:
        runner.plan_graphs(graphs)
    core = EngineCore(runner, EngineLimits(num_pages=24, num_state_slots=6, max_concurrency=3, token_budget=48,
                                           queue_size=4, max_context=512, prefix_cache=False), eos_ids=())
    if graphs:
        runner.capture_graphs(capture=False)
    outs = greedy_three(core)
    assert core.blocks.used_pages == 0 and core.blocks.num_pages == 24
    if graphs:
        assert runner.graphs is not None and runner.graphs.replays > 0
    return outs


def test_engine_tokens_equal_with_graph_steps(hybrid64: Path) -> None:
    assert _greedy(hybrid64, 3) == _greedy(hybrid64, 0)


def test_moe_engine_tokens_equal_with_graph_steps(tmp_path: Path) -> None:
    """MoE models take graph steps too (on CUDA their routed experts run without a host sync,
    ``kernels.moe``; here the static-buffer steps run eagerly)."""
    save_tiny_head_dim("qwen3_5_moe", tmp_path / "moe64")
    assert _greedy(tmp_path / "moe64", 3) == _greedy(tmp_path / "moe64", 0)


def test_graph_settings(hybrid64: Path) -> None:
    with pytest.raises(configs.ConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="on", device="cpu")
    with pytest.raises(configs.ConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="sometimes")
    r = build_runner(open_model(hybrid64), device="cpu", dtype=torch.float32, kv_dtype="fp32", page_size=64)
    assert graph_plan(EngineConfig(), r) == 0  # auto on CPU: off
    with pytest.raises(configs.ConfigError, match="not CUDA"):
        graph_plan(EngineConfig(cuda_graphs="on"), r)
    assert "gathered float pool" in (r.graphs_unsupported() or "")
    with pytest.raises(ValueError, match="gathered float pool"):
        r.plan_graphs(4)
    spec = r.memory_spec()
    assert reserve_bytes(r.args, spec, 8, torch.bfloat16) > reserve_bytes(r.args, spec, 1, torch.bfloat16) > (
        spec.bytes_per_page + spec.bytes_per_state_slot)
    # FP8 weights: a captured step of >= DEQUANT_MIN_TOKENS rows dequantizes its largest weight
    plain = reserve_bytes(r.args, spec, 128, torch.bfloat16)
    assert reserve_bytes(r.args, spec, 128, torch.bfloat16, dequant_bytes=1000) == plain + 1000
    assert reserve_bytes(r.args, spec, 64, torch.bfloat16, dequant_bytes=1000) == reserve_bytes(
        r.args, spec, 64, torch.bfloat16)
    assert dequant_bytes(r.model, torch.bfloat16) == 0
    quantize_linears(r.model, min_features=16)
    widest = max(m.out_features * m.in_features for m in r.model.modules() if isinstance(m, FP8Linear))
    assert dequant_bytes(r.model, torch.bfloat16) == 2 * widest


def test_audit_finds_host_syncs() -> None:
    x = torch.arange(6.0)

    def step() -> None:
        int(x.sum())
        x[x > 2].sum()
        x.tolist()
        x * 2  # fine

    kinds = sorted({h.op for h in audit(step, "cpu")})
    assert "Tensor.tolist" in kinds and "Tensor.__int__" in kinds and any("boolean mask" in k for k in kinds)
    assert all(h.kind == "sync" for h in audit(step, "cpu"))
    assert audit(lambda: x * 2, "cpu") == []


# -- on a GPU: captured graphs ------------------------------------------------------------
def _hf(path: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _model(tmp_path: Path, hybrid64: Path, arch: str) -> Path:
    if arch == "qwen3_5":
        return hybrid64
    save_tiny_head_dim(arch, tmp_path / f"{arch}64")
    return tmp_path / f"{arch}64"


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", ["qwen3_5", "llama", "qwen3_5_moe"])
@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_decode_step_has_no_capture_hazards_on_gpu(tmp_path: Path, hybrid64: Path, arch: str, kv: str) -> None:
    r = build_runner(open_model(_model(tmp_path, hybrid64, arch)), device="cuda", dtype=torch.bfloat16, kv_dtype=kv,
                     page_size=64)
    r.plan_graphs(4)
    r.allocate(PAGES, SLOTS)
    g = r.capture_graphs(capture=False)
    g.inputs.pad(4)
    g._forward(4)  # lazy constants and autotuning first, as the capture's warm-up does
    hazards = audit(lambda: g._forward(4), "cuda")
    for h in hazards:
        print(h)
    assert not hazards


@pytest.mark.gpu
@pytest.mark.timeout(900)  # the kernels' first compilation
@pytest.mark.parametrize("arch", ["qwen3_5", "llama", "qwen3_5_moe"])
@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_captured_decode_agrees_with_eager_and_hf(tmp_path: Path, hybrid64: Path, arch: str, kv: str) -> None:
    from tests.engine.helpers_models import hf_logits

    path = _model(tmp_path, hybrid64, arch)
    ids = prompt(64)
    ref = hf_logits(_hf(path), ids)  # fp32 oracle [64, vocab]
    out = {}
    for graphs in (0, 4):
        r = build_runner(open_model(path), device="cuda", dtype=torch.bfloat16, kv_dtype=kv, page_size=64)
        if graphs:
            r.plan_graphs(graphs)
        r.allocate(PAGES, SLOTS)
        if graphs:
            g = r.capture_graphs()
            diff, scale = g.check()
            assert diff <= 1e-3 * scale, (diff, scale)
            assert sorted(g.describe()["captured"]) == [1, 2, 4]
        slot = 0 if r.state is not None else -1
        if slot >= 0:
            r.reset_state(0)
        rows = [r.forward(ForwardBatch(torch.tensor(ids[:32]), [SeqSlice(slot, [3, 5], 0, 32)]))[-1]]
        for p in range(32, 64):  # teacher-forced decode steps: through the graph when captured
            rows.append(r.forward(ForwardBatch(torch.tensor([ids[p]]), [SeqSlice(slot, [3, 5], p, 1)]))[-1])
        out[graphs] = torch.stack(rows[:-1]).float().cpu()  # positions 31..62
        if graphs:
            assert r.graphs is not None and r.graphs.replays == 32
    want = ref[31:63]
    kl = torch.nn.functional.kl_div(out[4].log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    rel = ((out[4] - out[0]).abs().max() / out[0].abs().max()).item()
    print(f"{arch} {kv}: graphed vs eager max rel diff {rel:.2e}; mean KL vs HF fp32 {kl:.2e}")
    assert rel <= 1e-3
    assert kl <= (1e-3 if kv == "bf16" else 2e-2)
    assert torch.equal(out[4].argmax(-1), out[0].argmax(-1))


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_captured_engine_tokens_equal_eager_on_gpu(hybrid64: Path) -> None:
    def greedy(mode: str) -> list[list[int]]:
        from deepwell.engine_service.cli import build_core

        runner = build_runner(open_model(hybrid64), device="cuda", dtype=torch.bfloat16, kv_dtype="nvfp4",
                              page_size=64)
        cfg = EngineConfig(device="cuda", kv_dtype="nvfp4", num_pages=40, max_concurrency=3, token_budget=64,
                           prefix_cache="off", cuda_graphs=mode, max_context=512)
        core = build_core(cfg, open_model(hybrid64), runner)
        assert (runner.graphs is not None) == (mode == "on")
        return greedy_three(core, max_tokens=16)

    assert greedy("on") == greedy("off")
