"""Programmatic dependent launch (``kernels.pdl``): off wherever it cannot apply; on Hopper, a
layer's kernel chain (append, Q rotation, attention, split merge) captured in one CUDA graph
with PDL on every kernel gives the bytes and outputs of the same chain run eagerly without it."""

from __future__ import annotations

import pytest
import torch

from deepwell.kernels import pdl
from deepwell.kernels.backend import KVCacheLayer, TritonBackend, slots_from_positions
from deepwell.kernels.kv_formats import KVLayout
from tests.kernels.helpers import build_case


def test_off_on_cpu_and_when_switched_off(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not pdl.enabled(cpu, "append")
    assert pdl.launch_kwargs(cpu, "merge") == {"PDL": False}
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.selected() == frozenset()
    assert not pdl.enabled(cuda, "append")  # decided before asking the device
    monkeypatch.setenv(pdl.ENV, "append, merge")
    assert pdl.selected() == {"append", "merge"} and not pdl.enabled(cuda, "rotate")
    monkeypatch.setenv(pdl.ENV, "all")
    assert pdl.selected() == set(pdl.KERNELS)
    monkeypatch.delenv(pdl.ENV)
    assert pdl.selected() == set(pdl.DEFAULT) == {"append", "rotate", "merge", "fused", "linear"}
    assert "attention" not in pdl.selected()  # measured slower
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(cuda, "append")


def test_unknown_names_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel family"):
        pdl.enabled(torch.device("cpu"), "prefill")
    monkeypatch.setenv(pdl.ENV, "append,decode")
    with pytest.raises(ValueError, match=r"unknown kernel families \['decode'\]"):
        pdl.selected()


def test_weight_prefetch_lines(monkeypatch):
    cpu = torch.device("cpu")
    assert pdl.prefetch_lines() == pdl.PREFETCH_LINES
    assert pdl.streaming_kwargs(cpu) == {"PDL": False, "PREFETCH": 0}  # no PDL, no prefetch
    monkeypatch.setenv(pdl.PREFETCH_ENV, "0")
    assert pdl.prefetch_lines() == 0
    monkeypatch.setenv(pdl.PREFETCH_ENV, "8")
    assert pdl.prefetch_lines() == 8
    for bad in ("3", "128", "-1", "four"):
        monkeypatch.setenv(pdl.PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match="power of two up to 64"):
            pdl.prefetch_lines()


@pytest.mark.parametrize(("name", "value"), [("DEEPWELL_PDL", "append,decode"), ("DEEPWELL_PDL_PREFETCH", "3"),
                                            ("DEEPWELL_SPLITK_FIXUP", "yes")])
def test_the_engine_refuses_a_bad_kernel_switch_before_loading(monkeypatch, tmp_path, name, value):
    from deepwell import configs
    from deepwell.engine_service import cli
    from deepwell.engine_service.config import EngineConfig

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        pdl.check_env()

    def never(*a, **k):  # the weights are not loaded
        raise AssertionError("build_runner ran")

    cfg = EngineConfig(model=str(tmp_path))
    with pytest.raises(configs.ConfigError, match=f"invalid environment: {name}="):
        cli._build_runner(never, cfg, None, "cpu", torch.float32)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs a GPU with programmatic dependent launch (sm_90+)")
@pytest.mark.parametrize("fmt,fed", [("nvfp4", False), ("nvfp4", True), ("bf16", False), ("fp8", True)])
def test_graph_of_layer_steps_with_pdl_equals_eager_without(monkeypatch, fmt, fed):
    """Four decode steps of one layer (append one token per sequence, then decode over it:
    every decode reads the token its append just wrote, through the split merge), captured
    back to back in one graph with PDL and replayed, against the same steps run eagerly with
    ``DEEPWELL_PDL=0``: identical cache bytes and outputs."""
    layout = KVLayout.make(fmt, 4, 256)
    lens0 = [700, 65, 1]
    case = build_case(layout, lens0, seed=11, device="cuda")
    gen = torch.Generator().manual_seed(5)
    fb = (torch.triu(torch.randn(4, 16, 16, 16, generator=gen) * 0.1, 1).contiguous().cuda() if fed else None)
    steps = []
    for s in range(4):
        lens = torch.tensor([n + s + 1 for n in lens0], dtype=torch.int32, device="cuda")
        pos = lens.long() - 1
        steps.append(dict(
            lens=lens, slots=slots_from_positions(case.block_tables, torch.arange(3, device="cuda"), pos),
            k=torch.randn(3, 4, 256, generator=gen).to(torch.bfloat16).cuda(),
            v=torch.randn(3, 4, 256, generator=gen).to(torch.bfloat16).cuda(),
            q=torch.randn(3, 24, 256, generator=gen).to(torch.bfloat16).cuda(),
            out=torch.empty(3, 24, 256, dtype=torch.float32, device="cuda")))
    be = TritonBackend()

    def run(layer):
        for st in steps:
            be.append(layer, st["k"], st["v"], st["slots"], validate=False)
            be.decode_attention(st["q"], layer, case.block_tables, st["lens"], sm_scale=0.0625, out=st["out"],
                                validate=False)

    monkeypatch.setenv(pdl.ENV, "0")
    eager = KVCacheLayer(layout, case.cache.clone(), case.scales, k_feedback=fb)
    run(eager)
    want = [st["out"].clone() for st in steps]
    monkeypatch.setenv(pdl.ENV, "all")
    assert all(pdl.enabled(torch.device("cuda"), k) for k in pdl.KERNELS)
    layer = KVCacheLayer(layout, case.cache.clone(), case.scales, k_feedback=fb)
    run(layer)  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        run(layer)
    for _ in range(3):
        layer.data.copy_(case.cache)
        for st in steps:
            st["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(layer.data, eager.data)
        for st, w in zip(steps, want):
            assert torch.equal(st["out"], w)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs a GPU with programmatic dependent launch (sm_90+)")
@pytest.mark.parametrize("fixup", ["0", "1"])
def test_graph_of_mlp_chains_with_pdl_equals_eager_without(monkeypatch, fixup):
    """The "fused" and "linear" families: RMSNorm with the residual add, the FP8 few-row kernels
    of every kind (split K, summed by one more launch or, ``fixup`` "1", inside the GEMM's own:
    ``DEEPWELL_SPLITK_FIXUP``), SwiGLU and the 16-bit GEMV, chained as in an MLP at 1 and 5 rows,
    captured in one graph with PDL on every kernel and replayed, against the chain run eagerly
    with ``DEEPWELL_PDL=0`` and the separate sum: identical outputs."""
    from deepwell.kernels.fp8_gemm import reference as fp8_ref
    from deepwell.kernels.fp8_gemm import triton_kernel as fp8
    from deepwell.kernels.fused.activation import silu_and_mul
    from deepwell.kernels.fused.norm import add_rms_norm
    from deepwell.kernels.gemv import triton_kernel as gemv

    gen = torch.Generator(device="cuda").manual_seed(3)
    hidden, inter = 1024, 2048
    norm_w = torch.randn(hidden, device="cuda", generator=gen).bfloat16()
    codes, scales = fp8_ref.quantize(torch.randn(2 * inter, hidden, device="cuda", generator=gen) * 0.02)
    down = (torch.randn(hidden, inter, device="cuda", generator=gen) * 0.02).bfloat16()
    cases = [(kind, rows, torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16(),
              torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16())
             for kind in fp8.FEW_ROW_KERNELS for rows in (1, 5)]

    def chain(kind, x, res):
        h, r = add_rms_norm(x, res.clone(), norm_w, 1e-6, False)
        gate_up = fp8.few_row_matmul(kind, h, codes, scales)
        return gemv.linear(silu_and_mul(gate_up), down), r

    monkeypatch.setenv(pdl.ENV, "0")
    monkeypatch.setenv(gemv.FIXUP_ENV, "0")
    want = [chain(kind, x, res) for kind, _, x, res in cases]
    monkeypatch.setenv(pdl.ENV, "all")
    monkeypatch.setenv(gemv.FIXUP_ENV, fixup)
    for kind, _, x, res in cases:
        chain(kind, x, res)  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got = [chain(kind, x, res) for kind, _, x, res in cases]
    for _ in range(3):
        for out, r in got:
            out.fill_(float("nan"))
            r.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for (kind, rows, _, _), (out, r), (w_out, w_r) in zip(cases, got, want):
            assert torch.equal(out, w_out) and torch.equal(r, w_r), (kind, rows)
    if fixup == "1":  # the sums ran inside the GEMMs, and every tile counter is back at zero
        counters = gemv.fixup_counters(torch.device("cuda", torch.cuda.current_device()), 1)
        assert counters is not None and not counters.any()
