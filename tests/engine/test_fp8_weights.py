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
from tests.engine.helpers_models import one_torch_thread, prompt, run_chunks, save_tiny

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3_5_fp8")
    save_tiny("qwen3_5", d)
    return d


def _logits(runner) -> torch.Tensor:  # type: ignore[no-untyped-def]
    runner.allocate(8, 1)
    runner.reset_state(0)
    return torch.stack(run_chunks(runner, prompt(40), [30, 1, 9], list(range(8))))


def test_fp8_layers_keep_the_logits_within_fp8_rounding(tiny: Path) -> None:
    base = build_runner(open_model(tiny), page_size=8)
    ref = _logits(base)
    r = build_runner(open_model(tiny), page_size=8)
    count, saved = quantize_linears(r.model, min_features=32, block=(32, 32))
    layers = [m for m in r.model.modules() if isinstance(m, FP8Linear)]
    assert count == len(layers) > 0 and saved > 0
    names = {n for n, m in r.model.named_modules() if isinstance(m, FP8Linear)}
    assert "lm_head" not in names and not any(n.endswith("in_proj_a") for n in names)
    for m in layers:
        assert m.weight.dtype == torch.float8_e4m3fn
    got = _logits(r)
    assert not torch.allclose(got, ref, atol=1e-4)  # FP8's 3 mantissa bits change them
    # exactly what the original model gives with each of those weights rounded to its FP8 value
    rounded = build_runner(open_model(tiny), page_size=8)
    mods = dict(rounded.model.named_modules())
    with torch.no_grad():
        for name in names:
            q = dict(r.model.named_modules())[name]
            mods[name].weight.copy_(fp8_gemm.dequantize(q.weight, q.weight_scale_inv, q.block))
    want = _logits(rounded)
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
