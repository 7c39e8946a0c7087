"""Global-scale calibration and the zero / subnormal / saturated block-scale counters."""

from __future__ import annotations

import pytest
import torch

from kernels.calibration import ScaleCounter, calibrate, count_rows, count_scales
from kernels.hadamard import fwht
from kernels.kv_formats import KVLayout


def _is_pow2(t: torch.Tensor) -> bool:
    m, _ = torch.frexp(t)
    return bool((m == 0.5).all())


@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 3e3])
def test_nvfp4_calibration_removes_subnormal_and_saturated_scales(magnitude):
    lay = KVLayout.make("nvfp4", 2, 64)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(512, 2, 64, generator=gen) * magnitude
    v = torch.randn(512, 2, 64, generator=gen) * magnitude * 3
    before = count_scales(lay, k, v, lay.default_scales())
    g = calibrate(lay, k, v)
    assert g.shape == (2, 2) and _is_pow2(g)
    after = count_scales(lay, k, v, g)
    for c in after.values():
        assert c.blocks == 512 * 2 * 4 and c.subnormal == 0 and c.saturated == 0 and c.zero == 0
    if magnitude < 1e-3:
        assert before["k"].subnormal == before["k"].blocks  # uncalibrated: every scale subnormal
    if magnitude > 1e3:
        assert before["v"].saturated > 0


def test_calibrated_block_amax_sits_below_the_top_with_headroom():
    lay = KVLayout.make("nvfp4", 1, 64, False)
    x = torch.randn(4096, 1, 64)
    g = calibrate(lay, x, x, percentile=99.9, headroom=4.0)
    amax = x.abs().view(4096, 4, 16).amax(-1).flatten()
    p = float(torch.quantile(amax, 0.999))
    top = p / (6 * float(g[0, 0]))
    assert 448 / 8 < top <= 448 / 4  # power of two: within one binade below the target


def test_fp8_calibration_and_other_formats():
    x = torch.randn(256, 3, 64) * 2000
    lay = KVLayout.make("fp8", 3, 64)
    g = calibrate(lay, x, x)
    assert _is_pow2(g) and float(g.min()) >= 4.0
    assert count_scales(lay, x, x, g)["k"].saturated == 0
    assert count_scales(lay, x, x, lay.default_scales())["k"].saturated > 0
    for fmt in ("bf16", "int8"):
        lay = KVLayout.make(fmt, 3, 64)
        assert torch.equal(calibrate(lay, x, x), torch.ones(2, 3))
        assert count_scales(lay, x, x, lay.default_scales())["k"].blocks == 256 * 3


def test_counter_accumulates_and_rows_variant_matches():
    plain = KVLayout.make("nvfp4", 2, 64, False)
    k = torch.zeros(10, 2, 64)
    k[:5] = 1e-6  # tiny: subnormal (rounds to zero) scales
    v = torch.randn(10, 2, 64) * 1e4
    c = ScaleCounter()
    c.update(plain, k, v, plain.default_scales())
    c.update(plain, k, v, plain.default_scales())
    assert (c.k.blocks, c.k.zero, c.k.subnormal, c.k.saturated) == (160, 80, 80, 0)
    assert c.v.saturated > 0
    lay = KVLayout.make("nvfp4", 2, 64)  # rotated: a constant row has all its energy in block 0
    c = ScaleCounter()
    c.update(lay, k, v, lay.default_scales())
    assert (c.k.zero, c.k.subnormal) == (70, 10)
    one = count_scales(lay, k, v, lay.default_scales())
    assert count_rows(lay, fwht(k), lay.default_scales()[0]) == one["k"]
    assert count_rows(lay, v, lay.default_scales()[1]) == one["v"]


def test_calibrate_rejects_bad_arguments():
    lay = KVLayout.make("nvfp4", 1, 64)
    x = torch.randn(4, 1, 64)
    with pytest.raises(ValueError):
        calibrate(lay, x, x, percentile=0.0)
    with pytest.raises(ValueError):
        calibrate(lay, x, x, headroom=0.5)
