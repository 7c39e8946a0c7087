"""Global-scale calibration and the zero / subnormal / saturated block-scale counters."""

from __future__ import annotations

import pytest
import torch

from deepwell.kernels.calibration import (ScaleCounter, calibrate, count_rows, count_scales, head_counts, k_error_energy,
                                 k_offset, stationary_channels)
from deepwell.kernels.hadamard import fwht
from deepwell.kernels.kv_formats import KVLayout


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
    for fmt in ("fp8", "int8", "nvfp4"):  # head_counts: count_rows of each head, as a tensor
        f = KVLayout.make(fmt, 2, 64, False)
        per_head = head_counts(f, v, f.default_scales()[1])
        for h in range(2):
            c = count_rows(f, v[:, h:h + 1], f.default_scales()[1, h:h + 1])
            assert per_head[h].tolist() == [c.zero, c.subnormal, c.saturated]
    assert head_counts(KVLayout.make("bf16", 2, 64), v, torch.ones(2)) is None


def test_calibrate_rejects_bad_arguments():
    lay = KVLayout.make("nvfp4", 1, 64)
    x = torch.randn(4, 1, 64)
    with pytest.raises(ValueError):
        calibrate(lay, x, x, percentile=0.0)
    with pytest.raises(ValueError):
        calibrate(lay, x, x, headroom=0.5)


def test_stationary_channels_follow_rope_frequencies():
    # NeoX half-split over the first 2 * len(inv_freq) dims; the rest never rotate
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)  # 1, 0.1, 0.01, 0.001
    keep = stationary_channels(inv, 16, max_position=500)  # angle bound pi/4: inv * 500 <= 0.785
    assert keep.tolist() == [False, False, False, True] * 2 + [True] * 8
    assert stationary_channels(inv, 8, max_position=1).tolist() == [False, True, True, True] * 2
    assert not bool(stationary_channels(inv, 8, max_position=1 << 20).any())
    with pytest.raises(ValueError, match="head_dim"):
        stationary_channels(inv, 4, 10)


def test_k_offset_is_the_masked_mean():
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(300, 2, 8, generator=gen) + torch.arange(8.0)
    keep = torch.tensor([True, False] * 4)
    mu = k_offset(k, keep)
    assert mu.dtype == torch.float32 and mu.shape == (2, 8) and mu.is_contiguous()
    assert torch.allclose(mu[:, keep], k.mean(0)[:, keep], atol=1e-6) and bool((mu[:, ~keep] == 0).all())
    assert torch.equal(k_offset(k), k.double().mean(0).float())
    with pytest.raises(ValueError, match="N >= 1"):
        k_offset(torch.zeros(0, 2, 8))
    with pytest.raises(ValueError, match="keep must be"):
        k_offset(k, keep[:4])


def _attend_shifted_keys(fmt: str, center: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-backend decode over keys with a large shared component, and the exact
    fp64 attention over the original (unquantized) K/V."""
    from deepwell.kernels.backend import KVCacheLayer, ReferenceBackend

    gen = torch.Generator().manual_seed(4)
    n, h, hq, d = 200, 2, 4, 64
    shift = 6.0 + torch.randn(h, d, generator=gen)
    k = torch.randn(n, h, d, generator=gen) + shift
    v = torch.randn(n, h, d, generator=gen)
    q = torch.randn(1, hq, d, generator=gen) * 0.3
    lay = KVLayout.make(fmt, h, d)
    layer = KVCacheLayer.allocate(lay, 4)
    if center:
        layer.k_offset = k_offset(k)
    rows = k - layer.k_offset if center else k
    layer.scales.copy_(calibrate(lay, rows, v))
    be = ReferenceBackend()
    be.append(layer, k, v, torch.arange(n))
    out = be.decode_attention(q, layer, torch.arange(4, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32),
                              sm_scale=d ** -0.5)
    kk = k.double().repeat_interleave(hq // h, 1)  # [n, hq, d]
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0].double(), kk) * d ** -0.5, -1)
    exact = torch.einsum("hn,nhd->hd", p, v.double().repeat_interleave(hq // h, 1))
    return out[0].double(), exact


def test_k_centering_is_exact_for_attention_and_cuts_the_error():
    """Centering shifts every key of a head alike, which the softmax cancels: the output is
    still attention over the original K (bf16 cache: within bf16 rounding), and with a large
    shared component the quantized formats lose much less."""
    got, exact = _attend_shifted_keys("bf16", center=True)
    assert float((got - exact).norm() / exact.norm()) < 1e-2
    for fmt in ("fp8", "nvfp4"):
        errs = {}
        for center in (False, True):
            got, exact = _attend_shifted_keys(fmt, center)
            errs[center] = float((got - exact).norm() / exact.norm())
        assert errs[True] < 0.7 * errs[False], (fmt, errs)  # measured 0.65x (fp8), 0.59x (nvfp4)


def _blocks_eye(h: int, d: int) -> torch.Tensor:
    return torch.eye(16, dtype=torch.float64).expand(h, d // 16, 16, 16).clone()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("rotate", [False, True, 16])  # 16: one Hadamard transform per 16-element block
def test_k_error_energy_is_the_stored_keys_error(fmt: str, rotate: bool | int) -> None:
    """What ``k_error_energy`` weighs is exactly the error of the keys the append stores: K
    appended to a paged cache (row 0 without feedback, the rest with it, as the engine stores
    nvfp4's position 0) and read back, minus the rows in the stored basis; with the block
    products the identity it is the plain squared error, with others the quadratic form."""
    from deepwell.kernels.kv_append import reference as append_ref
    from deepwell.kernels.kv_formats import feedback

    gen = torch.Generator().manual_seed(11)
    n, h, d = 70, 2, 64
    lay = KVLayout.make(fmt, h, d, rotate)
    k = torch.randn(n, h, d, generator=gen) * torch.linspace(0.2, 3.0, d)
    v = torch.randn(n, h, d, generator=gen)
    g = calibrate(lay, k, v)
    # queries far from isotropic (a few strong directions), as real ones are
    basis = torch.randn(3, d, generator=gen, dtype=torch.float64)
    qf = torch.randn(4 * n, 2 * h, 3, generator=gen, dtype=torch.float64) @ basis
    qf = qf + 0.1 * torch.randn(4 * n, 2 * h, d, generator=gen, dtype=torch.float64)
    prod, count = feedback.block_covariance(qf, h)
    cov = prod / count
    fb = feedback.from_block_covariance(cov)
    cache = lay.allocate(2, "cpu")
    slots = torch.arange(n)
    append_ref.append(cache, lay, k[:1], v[:1], slots[:1], g)
    append_ref.append(cache, lay, k[1:], v[1:], slots[1:], g, k_feedback=fb)
    got, _ = append_ref.gather(cache, lay, torch.tensor([0, 1]), n, g)
    e = (got - append_ref.stored_rows(k, lay, 0)).double()
    assert k_error_energy(lay, k, g, _blocks_eye(h, d), fb, nearest_rows=1) == pytest.approx(
        float(e.square().sum()), rel=1e-9)
    eb = e.view(n, h, d // 16, 16)
    want = float(torch.einsum("nhbi,hbij,nhbj->", eb, cov, eb))
    assert k_error_energy(lay, k, g, cov, fb, nearest_rows=1) == pytest.approx(want, rel=1e-9)
    # feedback lowers the weighted error it was made for; nearest rounding throughout differs
    assert k_error_energy(lay, k, g, cov, fb) < k_error_energy(lay, k, g, cov)


def test_k_error_energy_tells_which_basis_stores_keys_better() -> None:
    """Keys on fp8's grid store exactly as they are and not once rotated; keys with one large
    channel per block (an outlier the rotation spreads) store better rotated (nvfp4)."""
    h, d = 1, 64
    eye = _blocks_eye(h, d)
    grid = torch.tensor([0.0, 0.5, -1.0, 1.5, 2.0, -3.0, 0.25, 4.0]).repeat(40, h, d // 8)
    plain, rot = (KVLayout.make("fp8", h, d, r) for r in (False, True))
    for lay in (plain, rot):
        g = calibrate(lay, grid, grid)
        if not lay.hadamard:
            assert k_error_energy(lay, grid, g, eye) == 0.0
        else:
            assert k_error_energy(lay, grid, g, eye) > 0.0
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(200, h, d, generator=gen) * 0.05
    k[:, :, ::16] += 8.0 * torch.sign(torch.randn(200, h, d // 16, generator=gen))
    energy = {}
    for r in (False, True):
        lay = KVLayout.make("nvfp4", h, d, r)
        energy[r] = k_error_energy(lay, k, calibrate(lay, k, k), eye)
    assert energy[True] < energy[False], energy


def test_k_error_energy_rejects_bad_arguments() -> None:
    lay = KVLayout.make("nvfp4", 2, 64)
    k = torch.randn(5, 2, 64)
    g = torch.ones(2, 2)
    with pytest.raises(ValueError, match="q_blocks must be"):
        k_error_energy(lay, k, g, torch.zeros(2, 4, 16, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="nearest_rows"):
        k_error_energy(lay, k, g, _blocks_eye(2, 64), nearest_rows=6)
