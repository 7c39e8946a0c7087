"""Reference codecs: E4M3 rounding, nvfp4/fp8/int8/bf16 edge cases, layout sizes, Hadamard."""

from __future__ import annotations

import pytest
import torch

from kernels.hadamard import fwht, matrix
from kernels.kv_formats import KVLayout, bf16, e4m3, fp8, int8, nvfp4

ALL_E4M3 = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8)  # non-negative finite codes


def e4m3_values() -> torch.Tensor:
    return ALL_E4M3.view(torch.float8_e4m3fn).float()


def test_e4m3_exact_values_round_trip():
    code, val = e4m3.encode_magnitude(e4m3_values())
    assert torch.equal(code, ALL_E4M3)
    assert torch.equal(val, e4m3_values())


def test_e4m3_midpoints_round_half_even_and_saturate():
    vals = e4m3_values().double()
    mids = ((vals[:-1] + vals[1:]) / 2).float()
    assert torch.equal(mids.double(), (vals[:-1] + vals[1:]) / 2)  # midpoints are exact in fp32
    code, _ = e4m3.encode_magnitude(mids)
    lo = ALL_E4M3[:-1].to(torch.int32)
    want = torch.where(lo % 2 == 0, lo, lo + 1)  # ties go to the even code
    assert torch.equal(code.to(torch.int32), want)
    above = torch.nextafter(mids, torch.full_like(mids, 1e9))
    below = torch.nextafter(mids, torch.zeros_like(mids))
    assert torch.equal(e4m3.encode_magnitude(above)[0].to(torch.int32), lo + 1)
    assert torch.equal(e4m3.encode_magnitude(below)[0].to(torch.int32), lo)
    big = torch.tensor([448.0, 464.0, 480.0, 1e6, 3e38])
    assert e4m3.encode_magnitude(big)[0].tolist() == [126] * 5


def test_e4m3_matches_torch_cast_on_random_values():
    g = torch.Generator().manual_seed(1)
    x = torch.exp2(torch.rand(200_000, generator=g) * 22 - 13)  # 2**-13 .. 2**9
    x = x[x <= 448]
    code, val = e4m3.encode_magnitude(x)
    assert torch.equal(val, x.to(torch.float8_e4m3fn).float())
    assert torch.equal(e4m3.decode(code), val)


def test_e4m3_tiny_values():
    tiny = torch.tensor([0.0, 2.0**-11, 2.0**-10, 2.0**-10 * 1.0000001, 3 * 2.0**-10, 2.0**-9, 1e-30])
    code, val = e4m3.encode_magnitude(tiny)
    # 2**-10 is the tie between 0 and the smallest subnormal 2**-9: goes to even (0)
    assert code.tolist() == [0, 0, 0, 1, 2, 1, 0]
    assert val.tolist() == [0.0, 0.0, 0.0, 2.0**-9, 2.0**-8, 2.0**-9, 0.0]


def _e2m1_oracle(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 index of |x| / s in fp64 with ties to even, saturating (independent oracle)."""
    grid = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
    y = (x.double().abs() / s.double()).clamp(max=6.0)
    dist = (y[..., None] - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    cand = (dist == best).to(torch.int64)
    # among tied candidates prefer the even index
    score = cand * (2 - (torch.arange(8) % 2))
    return score.argmax(dim=-1)


def _unpack(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int64)
    return torch.cat((c & 15, c >> 4), dim=-1)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_nvfp4_matches_independent_oracle(d):
    g = torch.Generator().manual_seed(d)
    n = 4000
    x = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float())
    gs = torch.full((n,), 0.25)
    codes, scales = nvfp4.encode(x, gs)
    assert codes.shape == (n, d // 2) and scales.shape == (n, d // 16)
    s = e4m3.decode(scales).repeat_interleave(16, -1) * 0.25
    nib = _unpack(codes)
    idx = nib & 7
    ok = s > 0
    want = _e2m1_oracle(x, torch.where(ok, s, torch.ones_like(s)))
    assert torch.equal(torch.where(ok, idx, 0), torch.where(ok, want, 0))
    assert bool((idx[~ok] == 0).all())
    sign = (nib >> 3) == 1
    assert torch.equal(sign, (x < 0) & (idx > 0))
    # block scale = E4M3(amax / 6 / g)
    amax = x.abs().view(n, d // 16, 16).amax(-1)
    assert torch.equal(scales, e4m3.encode_magnitude(amax * nvfp4.INV_6 * 4.0)[0])
    back = nvfp4.decode(codes, scales, gs)
    assert torch.equal(back, torch.where(sign, -1.0, 1.0) * torch.tensor(nvfp4.E2M1_VALUES)[idx] * s)


def test_nvfp4_edge_blocks():
    d = 64
    one = torch.ones(16)
    # scale for amax 6: E4M3(1.0) = 1.0 -> thresholds at multiples of 1
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0, 0.0])
    sat = torch.tensor([6.0, -6.0, 7.0, -7.0, 6.0 * 448, 5.0, 5.0001, 0.2, 0.0, -0.0, 1.0, 2.0, 3.0, 4.0, 0.5, 1.5])
    zero = torch.zeros(16)
    tiny = torch.full((16,), 1e-6)  # amax / 6 far below E4M3's smallest subnormal -> scale 0
    x = torch.stack([torch.cat((ties, sat, zero, tiny)), torch.cat((zero, zero, zero, -one * 3))])
    codes, scales = nvfp4.encode(x, torch.ones(2))
    sc = e4m3.decode(scales)
    assert sc[0].tolist()[:3] == [1.0, 448.0, 0.0] and sc[0, 3].item() == 0.0
    nib = _unpack(codes)
    # ties go to the even magnitude index: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert nib[0, :16].tolist() == [0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14, 7, 0]
    # second block has scale 448 (saturated: amax 2688 / 6 = 448): 7 and 6*448 are 6*448 at most
    assert nib[0, 16:18].tolist() == [0, 0] and nib[0, 20] == 7
    assert bool((nib[0, 32:] == 0).all()) and bool((scales[0, 2:] == 0).all())
    assert bool((nib[1, :48] == 0).all())
    assert nib[1, 48:].tolist() == [15] * 16 and sc[1, 3].item() == 0.5  # -3 = -6 * 0.5


def test_nvfp4_saturates_beyond_six_scales():
    x = torch.tensor([[6.0] + [1.0] * 14 + [9.0]] * 2).repeat(1, 4)  # amax 9 -> scale 1.5
    codes, scales = nvfp4.encode(x, torch.ones(2))
    back = nvfp4.decode(codes, scales, torch.ones(2))
    assert e4m3.decode(scales)[0, 0].item() == 1.5
    assert back[0, 15].item() == 9.0 and back[0, 0].item() == 6.0
    xs = x.clone()
    xs[:, 15] = 100.0  # scale E4M3(100/6)=16 -> 6*16 = 96 is the largest value
    codes, scales = nvfp4.encode(xs, torch.ones(2))
    assert nvfp4.decode(codes, scales, torch.ones(2))[0, 15].item() == 96.0


def test_fp8_codec():
    x = torch.tensor([[0.0, -0.0, 1.0, -1.0, 1.0625, 1.1875, 500.0, -1e9, 2.0**-10, -(2.0**-9), 3.0, 2.0**-20] + [0.0] * 52])
    codes, scales = fp8.encode(x, torch.ones(1))
    assert scales.shape == (1, 0)
    c = codes[0].tolist()
    # 1.0625 is the tie between 1.0 (code 56) and 1.125 (57): even -> 56; 1.1875 -> 58 (1.25)
    assert c[:12] == [0, 0, 56, 184, 56, 58, 126, 254, 0, 129, 68, 0]
    back = fp8.decode(codes, scales, torch.full((1,), 4.0))
    assert back[0, 6].item() == 448.0 * 4 and back[0, 3].item() == -4.0
    codes2, _ = fp8.encode(x * 4, torch.full((1,), 4.0))  # a power-of-two scale is exact
    assert torch.equal(codes2, codes)


def test_int8_codec():
    x = torch.zeros(3, 64)
    x[0, :4] = torch.tensor([127.0, 2.5, 3.5, -2.5])  # s = 127 * fp32(1/127) = 1.0: exact ties
    x[1] = torch.linspace(-3, 5, 64)
    codes, scales = int8.encode(x, torch.ones(3))
    s = scales.view(torch.float32)
    assert s[0].item() == 1.0 and s[2].item() == 0.0
    q = codes.view(torch.int8)
    assert q[0, :4].tolist() == [127, 2, 4, -2]
    assert bool((q[2] == 0).all())
    assert q[1].abs().max().item() == 127
    back = int8.decode(codes, scales, torch.ones(3))
    assert float((back[1] - x[1]).abs().max()) <= float(s[1]) / 2 * 1.0001


def test_bf16_codec_round_half_even():
    x = torch.tensor([[1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20] + [0.0] * 61])
    codes, _ = bf16.encode(x, torch.ones(1))
    back = bf16.decode(codes, torch.empty(1, 0, dtype=torch.uint8), torch.ones(1))
    assert back[0, :3].tolist() == [1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7]


def test_layout_sizes():
    assert KVLayout.make("nvfp4", 4, 256).token_bytes == 144
    assert KVLayout.make("bf16", 4, 256).token_bytes == 512
    assert KVLayout.make("fp8", 4, 256).token_bytes == 256
    assert KVLayout.make("int8", 4, 256).token_bytes == 260
    lay = KVLayout.make("nvfp4", 4, 256)
    assert lay.page_bytes == 2 * 4 * 64 * 144 and lay.scale_offset == 64 * 128
    with pytest.raises(ValueError):
        KVLayout.make("nvfp4", 4, 96)
    with pytest.raises(ValueError):
        KVLayout.make("int4", 4, 64)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard(d):
    x = torch.randn(37, d, dtype=torch.float64)
    y = fwht(x)
    ref = x @ matrix(d)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-6
    assert float((fwht(y).double() - x).norm() / x.norm()) < 1e-6  # its own inverse
    q, k = torch.randn(5, d), torch.randn(5, d)
    dots = (fwht(q) * fwht(k)).sum(-1)
    assert torch.allclose(dots, (q * k).sum(-1), rtol=1e-4, atol=1e-4)
