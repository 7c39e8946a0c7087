"""FP8 MoE experts (``layers.moe.FP8Experts``): an FP8 checkpoint's per-expert codes and scales
load unchanged into the fused FP8 tensors (native serving), 16-bit experts quantize after
loading (``--weight-dtype fp8``), and the model computes what its dequantized experts compute.

The tiny ``qwen3_5_moe`` (hidden 64, expert intermediate 32) takes scale blocks of (32, 64): the
kernels step K by 64 and the gate and up halves of a fused expert must own whole blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepwell.engine_service.layers.moe import Experts, FP8Experts, prepare_experts, quantize_experts
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import build_runner
from deepwell.kernels import fp8_gemm
from tests.engine.helpers_models import chunk_logits, one_torch_thread, save_tiny, write_fp8_checkpoint

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

BLOCK = (32, 64)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3_5_moe")
    save_tiny("qwen3_5_moe", d)
    return d


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (Experts, FP8Experts))}


def _dequantized_into(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """``dst``'s 16-bit experts set to ``src``'s FP8 experts' dequantized weights."""
    theirs = _experts(src)
    with torch.no_grad():
        for name, mine in _experts(dst).items():
            q = theirs[name]
            assert isinstance(mine, Experts) and isinstance(q, FP8Experts)
            for w, codes, scales in ((mine.gate_up_proj, q.gate_up_proj, q.gate_up_proj_scale_inv),
                                     (mine.down_proj, q.down_proj, q.down_proj_scale_inv)):
                for e in range(w.shape[0]):
                    w[e] = fp8_gemm.dequantize(codes[e], scales[e], q.block)


def test_quantized_experts_compute_their_dequantized_weights(tiny_moe: Path) -> None:
    base = build_runner(open_model(tiny_moe), page_size=8)
    ref = chunk_logits(base)
    r = build_runner(open_model(tiny_moe), page_size=8)
    before = {n: (m.gate_up_proj.clone(), m.down_proj.clone()) for n, m in _experts(r.model).items()}
    count, saved = quantize_experts(r.model, BLOCK)
    ex = _experts(r.model)
    assert count == len(ex) == 4 and saved > 0 and all(isinstance(m, FP8Experts) for m in ex.values())
    for name, m in ex.items():  # each expert quantized on its own
        codes, scales = fp8_gemm.quantize(before[name][0][5], BLOCK)
        assert torch.equal(m.gate_up_proj[5].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(m.gate_up_proj_scale_inv[5], scales)
    got = chunk_logits(r)
    assert not torch.allclose(got, ref, atol=1e-4)  # FP8 rounding changes them
    plain = build_runner(open_model(tiny_moe), page_size=8)
    _dequantized_into(plain.model, r.model)
    want = chunk_logits(plain)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), float((got - want).abs().max())


def test_experts_that_do_not_fit_stay_16_bit(tiny_moe: Path) -> None:
    r = build_runner(open_model(tiny_moe), page_size=8)
    assert prepare_experts(r.model, (64, 64)) == set()  # intermediate 32: a gate block would hold up rows
    assert quantize_experts(r.model, (32, 32)) == (0, 0)  # K blocks of 32: the kernels step by 64
    assert all(isinstance(m, Experts) for m in _experts(r.model).values())
    with pytest.raises(ValueError, match="multiple of the scale"):
        FP8Experts(4, 64, 32, (64, 64))


def _fp8_moe_checkpoint(src: Path, dst: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``src``'s experts as Qwen's FP8 layout (``BLOCK``), except expert 1 of layer 0 (left in 16
    bits) and the down_proj of expert 2 of layer 1 (one per-tensor scale); the rest of the model
    stays 16-bit. Returns the codes and scales written, by weight name."""
    from safetensors.torch import load_file

    written: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if ".mlp.experts." not in name or name.startswith("model.layers.0.mlp.experts.1."):
            out[name] = t
            continue
        if name == "model.layers.1.mlp.experts.2.down_proj.weight":
            scale = t.float().abs().amax() / fp8_gemm.FP8_MAX
            codes, scales = (t.float() / scale).to(torch.float8_e4m3fn), scale.reshape(1)
        else:
            codes, scales = fp8_gemm.quantize(t.float(), BLOCK)
        out[name], out[name + "_scale_inv"] = codes, scales
        written[name] = (codes, scales)
    write_fp8_checkpoint(src, dst, out, BLOCK)
    return written


def _slices(m: FP8Experts, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales of ``<m>.{e}.{proj}.weight`` inside the fused FP8 tensors."""
    e, proj = int(name.split(".")[-3]), name.split(".")[-2]
    inter, rows = m.down_proj.shape[2], m.down_proj.shape[2] // m.block[0]
    if proj == "down_proj":
        return m.down_proj[e], m.down_proj_scale_inv[e]
    j = proj == "up_proj"
    return m.gate_up_proj[e, j * inter : (j + 1) * inter], m.gate_up_proj_scale_inv[e, j * rows : (j + 1) * rows]


def test_fp8_moe_checkpoint_loads_its_own_expert_codes(tiny_moe: Path, tmp_path: Path) -> None:
    written = _fp8_moe_checkpoint(tiny_moe, tmp_path / "fp8")
    src = open_model(tmp_path / "fp8")
    assert src.iter_fp8 is not None
    native = build_runner(src, page_size=8, weight_dtype="fp8")  # the checkpoint's pairs into FP8 experts
    deq = build_runner(src, page_size=8)  # CPU, auto: dequantized at load
    ex = _experts(native.model)
    assert len(ex) == 4 and all(isinstance(m, FP8Experts) and m.block == BLOCK for m in ex.values())
    for name, (codes, scales) in written.items():
        m = ex[name.split(".experts.")[0] + ".experts"]
        got_codes, got_scales = _slices(m, name)
        assert torch.equal(got_codes.view(torch.uint8), codes.view(torch.uint8)), name  # bit for bit
        assert torch.equal(got_scales, scales.expand_as(got_scales) if scales.numel() == 1 else scales), name
    # the expert the checkpoint holds in 16 bits: quantized as it loads
    m0 = ex["model.layers.0.mlp.experts"]
    w = _experts(deq.model)["model.layers.0.mlp.experts"].gate_up_proj[1, :32]
    codes, scales = fp8_gemm.quantize(w.float(), BLOCK)
    assert torch.equal(m0.gate_up_proj[1, :32].view(torch.uint8), codes.view(torch.uint8))
    # the served model computes what the dequantized checkpoint computes (expert 1 of layer 0
    # rounded to its FP8 values)
    _dequantized_into(deq.model, native.model)
    got, want = chunk_logits(native), chunk_logits(deq)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), float((got - want).abs().max())
