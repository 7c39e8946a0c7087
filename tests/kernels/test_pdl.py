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
    assert pdl.selected() == set(pdl.DEFAULT) == {"append", "rotate", "merge"}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(cuda, "append")


def test_unknown_names_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel family"):
        pdl.enabled(torch.device("cpu"), "prefill")
    monkeypatch.setenv(pdl.ENV, "append,decode")
    with pytest.raises(ValueError, match=r"unknown kernel families \['decode'\]"):
        pdl.selected()


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
