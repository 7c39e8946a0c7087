"""``--weight-dtype fp8``: the decoder's linear layers as block-scaled FP8 (``layers.fp8_linear``).

On CPU the FP8 layer runs the reference (dequantize, then matmul), so the model's logits stay
within FP8's rounding of the original's, and its layers hold one byte per weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepwell.engine_service.config import EngineConfig
from deepwell.engine_service.layers.fp8_linear import FP8Linear, quantize_linears
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import build_runner
from deepwell.kernels import fp8_gemm
from tests.engine.helpers_models import chunk_logits, one_torch_thread, save_tiny, write_fp8_checkpoint

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3_5_fp8")
    save_tiny("qwen3_5", d)
    return d


def test_fp8_layers_keep_the_logits_within_fp8_rounding(tiny: Path) -> None:
    base = build_runner(open_model(tiny), page_size=8)
    ref = chunk_logits(base)
    r = build_runner(open_model(tiny), page_size=8)
    count, saved = quantize_linears(r.model, min_features=32, block=(32, 32))
    layers = [m for m in r.model.modules() if isinstance(m, FP8Linear)]
    assert count == len(layers) > 0 and saved > 0
    names = {n for n, m in r.model.named_modules() if isinstance(m, FP8Linear)}
    assert "lm_head" not in names and not any(n.endswith("in_proj_a") for n in names)
    for m in layers:
        assert m.weight.dtype == torch.float8_e4m3fn
    got = chunk_logits(r)
    assert not torch.allclose(got, ref, atol=1e-4)  # FP8's 3 mantissa bits change them
    # exactly what the original model gives with each of those weights rounded to its FP8 value
    rounded = build_runner(open_model(tiny), page_size=8)
    mods = dict(rounded.model.named_modules())
    with torch.no_grad():
        for name in names:
            q = dict(r.model.named_modules())[name]
            mods[name].weight.copy_(fp8_gemm.dequantize(q.weight, q.weight_scale_inv, q.block))
    want = chunk_logits(rounded)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), float((got - want).abs().max())
    # each FP8 layer computes exactly the reference product of its dequantized weight
    m = layers[0]
    x = torch.randn(3, m.in_features)
    w = fp8_gemm.dequantize(m.weight, m.weight_scale_inv, m.block)
    assert torch.allclose(m(x), x @ w.t() + (m.bias if m.bias is not None else 0), atol=1e-5)


def test_weight_dtype_option(tiny: Path) -> None:
    r = build_runner(open_model(tiny), page_size=8, weight_dtype="fp8")  # hidden 64 < 128: nothing to quantize
    assert not any(isinstance(m, FP8Linear) for m in r.model.modules())
    with pytest.raises(ValueError, match="weight_dtype"):
        build_runner(open_model(tiny), weight_dtype="int4")
    with pytest.raises(ValueError, match="weight_dtype"):
        EngineConfig(weight_dtype="int4")


# -- FP8 checkpoints served natively ------------------------------------------------------
BLOCK = (32, 32)


def _fp8_checkpoint(src: Path, dst: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``src``'s tiny model as an FP8 block-scaled checkpoint (Qwen's layout, ``BLOCK`` blocks):
    every decoder linear of both sides >= 32 quantized, except layer 0's ``mlp.down_proj``
    (left in 16 bits) and layer 1's ``mlp.up_proj`` (one per-tensor scale). Returns the codes and
    scales written, by weight name."""
    from safetensors.torch import load_file

    tensors = load_file(str(src / "model.safetensors"))
    written: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        eligible = (name.startswith("model.layers.") and name.endswith("proj.weight") and t.dim() == 2
                    and min(t.shape) >= 32)
        if not eligible or name == "model.layers.0.mlp.down_proj.weight":
            out[name] = t
            continue
        if name == "model.layers.1.mlp.up_proj.weight":
            scale = t.float().abs().amax() / fp8_gemm.FP8_MAX
            codes, scales = (t.float() / scale).to(torch.float8_e4m3fn), scale.reshape(1)
        else:
            codes, scales = fp8_gemm.quantize(t.float(), BLOCK)
        out[name], out[name[: -len("weight")] + "weight_scale_inv"] = codes, scales
        out[name[: -len("weight")] + "input_scale"] = torch.ones(1)  # static activation scales: dropped
        written[name] = (codes, scales)
    write_fp8_checkpoint(src, dst, out, BLOCK)
    return written


def _weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The weight a checkpoint name fills in a built model: the module's own, or its rows in the
    GEMM its Gated DeltaNet layer stacked its projections into (``layers.projections``)."""
    from deepwell.engine_service.layers.gdn import PROJECTIONS

    mods = dict(model.named_modules())
    path = name[: -len(".weight")]
    if path in mods:
        return mods[path].weight
    parent, part = path.rsplit(".", 1)
    i = PROJECTIONS.index(part)
    for proj in mods[parent].fused_proj:
        if i < len(proj.sizes):
            lo = sum(proj.sizes[:i])
            return proj.layer.weight[lo : lo + proj.sizes[i]]
        i -= len(proj.sizes)
    raise KeyError(name)


def test_fp8_checkpoint_loads_its_own_codes(tiny: Path, tmp_path: Path) -> None:
    from deepwell.engine_service.layers.fp8_linear import prepare_linears
    from deepwell.engine_service.models.loader import build_model, load_weights

    written = _fp8_checkpoint(tiny, tmp_path / "fp8")
    src = open_model(tmp_path / "fp8")
    assert src.iter_fp8 is not None
    r = build_runner(src, page_size=8)  # CPU, auto: dequantized at load (the reference would dequantize per call)
    assert not any(isinstance(m, FP8Linear) for m in r.model.modules())
    model, family, text_cfg = build_model(src.config)
    names = prepare_linears(model, BLOCK, min_features=32)
    assert names >= set(written) and "model.layers.0.mlp.down_proj.weight" in names
    load_weights(model, family, text_cfg, src.iter_fp8(), fp8_layers=names, fp8_block=BLOCK)
    mods = dict(model.named_modules())
    for name, (codes, scales) in written.items():
        m = mods[name[: -len(".weight")]]
        assert isinstance(m, FP8Linear) and m.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(m.weight.view(torch.uint8), codes.view(torch.uint8)), name  # bit for bit
        want = scales.expand_as(m.weight_scale_inv) if scales.numel() == 1 else scales
        assert torch.equal(m.weight_scale_inv, want), name
    down = mods["model.layers.0.mlp.down_proj"]  # a 16-bit tensor for an FP8 layer: quantized as it loads
    codes, scales = fp8_gemm.quantize(_weight(r.model, "model.layers.0.mlp.down_proj.weight").float(), BLOCK)
    assert torch.equal(down.weight.view(torch.uint8), codes.view(torch.uint8))
    # the served model computes what the dequantized checkpoint computes, with the layers the
    # checkpoint held in 16 bits rounded to their FP8 values
    with torch.no_grad():
        for name in names - set(written):
            q = mods[name[: -len(".weight")]]
            _weight(r.model, name).copy_(fp8_gemm.dequantize(q.weight, q.weight_scale_inv, BLOCK))
    native = build_runner(src, page_size=8)
    native.model = model
    native.model.rotary = r.model.rotary
    got, want_logits = chunk_logits(native), chunk_logits(r)
    assert torch.allclose(got, want_logits, rtol=1e-4, atol=1e-4), float((got - want_logits).abs().max())


def test_fp8_pair_for_a_16_bit_layer_is_dequantized(tiny: Path, tmp_path: Path) -> None:
    """Where the model has no FP8 layer for a checkpoint pair (here: none prepared), it loads the
    dequantized weight: the same model as the dequantized stream gives."""
    from deepwell.engine_service.models.loader import build_model, load_weights

    _fp8_checkpoint(tiny, tmp_path / "fp8")
    src = open_model(tmp_path / "fp8")
    model, family, text_cfg = build_model(src.config)
    load_weights(model, family, text_cfg, src.iter_fp8(), fp8_block=BLOCK)
    ref = build_runner(src, page_size=8).model
    for n, p in model.named_parameters():
        assert torch.equal(p, _weight(ref, n) if n.endswith(".weight") else ref.get_parameter(n)), n


def test_weight_dtype_fp8_on_an_fp8_checkpoint_loads_through_the_pairs(tiny: Path, tmp_path: Path) -> None:
    _fp8_checkpoint(tiny, tmp_path / "fp8")
    src = open_model(tmp_path / "fp8")
    native = build_runner(src, page_size=8, weight_dtype="fp8")  # tiny: no layer reaches 128 features
    ref = build_runner(src, page_size=8)
    assert torch.equal(chunk_logits(native), chunk_logits(ref))
