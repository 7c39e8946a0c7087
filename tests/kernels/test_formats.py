"""Reference codecs: E4M3 rounding, nvfp4/fp8/int8/bf16 edge cases, layout sizes, Hadamard."""

from __future__ import annotations

import pytest
import torch

from deepwell.kernels.hadamard import fwht, matrix
from deepwell.kernels.kv_formats import KVLayout, bf16, e4m3, fp8, int8, nvfp4

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
    """Nibbles ``sign << 3 | index`` [N, d] of packed codes, from the documented bits of byte
    ``j``: 7 = element j's sign, 1-3 its index, 4-6 element j + d/2's index, 0 its sign."""
    c = codes.to(torch.int64)
    lo = (((c >> 7) & 1) << 3) | ((c >> 1) & 7)
    hi = ((c & 1) << 3) | ((c >> 4) & 7)
    return torch.cat((lo, hi), dim=-1)


def test_nvfp4_code_byte_bits():
    """Byte j: low element's sign at bit 7 and index at bits 1-3, high element's index at
    bits 4-6 and sign at bit 0 (page layout 3); zero has no sign."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = -6.0, 0.5  # byte 0: 0x80 | 7 << 1 | 1 << 4 = 0x9E
    x[0, 1], x[0, 17] = 1.5, -3.0  # byte 1: 3 << 1 | 5 << 4 | 1 = 0x57
    x[0, 2], x[0, 18] = -0.0, -0.5  # byte 2: 1 << 4 | 1 = 0x11
    codes, _ = nvfp4.encode_with_scales(x, torch.ones(1), torch.tensor([[56, 56]], dtype=torch.uint8))
    assert codes[0, :4].tolist() == [0x9E, 0x57, 0x11, 0]
    assert nvfp4.decode(codes, torch.tensor([[56, 56]], dtype=torch.uint8), torch.ones(1))[0, [0, 16, 1, 17, 18]].tolist() \
        == [-6.0, 0.5, 1.5, -3.0, -0.5]


def _e4m3_code(v: torch.Tensor) -> torch.Tensor:
    """E4M3 RNE saturating code of fp32 v >= 0 through torch's own cast (an independent path)."""
    return v.clamp(max=448.0).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)


def _search_oracle(x: torch.Tensor, g: float, clip: bool) -> torch.Tensor:
    """Block-scale codes [N, d/16] of the documented search, evaluated independently: every code
    from ``c0`` (``c6``; without clipping the first code whose 6 s >= amax) — or from
    max(c6 - SEARCH_DOWN, 1) with clipping — up to max(min(c4 + SEARCH_UP, 126), c0) and at
    most c0 + UP_SPAN, scored in
    fp64 / int64 with the E2M1 oracle, ties to the earliest in the order c0, c0-1, ..., c0+1,
    ...; c6 = 0 -> 0."""
    n, d = x.shape
    a = (x.double().abs() / g).view(n, d // 16, 16)
    amax = x.abs().view(n, d // 16, 16).amax(-1)
    c6 = _e4m3_code(amax * nvfp4.INV_6 * (1.0 / g))
    m = a.amax(-1)
    c4 = _e4m3_code((m / 4).float())
    c0 = c6 if clip else torch.where(6 * c6.to(torch.uint8).view(torch.float8_e4m3fn).double() < m, (c6 + 1).clamp(max=126), c6)
    top = torch.maximum((c4 + nvfp4.SEARCH_UP).clamp(max=126), c0)
    low = (c0 - nvfp4.SEARCH_DOWN).clamp(min=1) if clip else c0
    exp = torch.frexp(m)[1].to(torch.int64) - 1  # m = f * 2**exp with 1 <= f < 2
    exp = exp.clamp(min=nvfp4.ERR_EXP_FLOOR)
    big_a = torch.floor(a * torch.exp2((nvfp4.ERR_BITS - exp).double())[..., None]).to(torch.int64)
    halves = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12])
    best_key = torch.full(c6.shape, 1 << 62, dtype=torch.int64)
    best = torch.zeros_like(c6)
    for off in range(-nvfp4.SEARCH_DOWN, nvfp4.UP_SPAN + 1):
        c = c0 + off
        valid = (c >= low) & (c <= top)
        s = c.clamp(0, 126).to(torch.uint8).view(torch.float8_e4m3fn).double()
        idx = _e2m1_oracle(a, torch.where(s > 0, s, 1.0)[..., None].expand_as(a))
        step = torch.floor(s * torch.exp2((nvfp4.ERR_BITS - 1 - exp).double())).to(torch.int64)
        sse = ((big_a - halves[idx] * step[..., None]) ** 2).sum(-1)
        rank = -off if off <= 0 else nvfp4.SEARCH_DOWN + off
        key = torch.where(valid, sse * 64 + rank, 1 << 62)
        better = key < best_key
        best, best_key = torch.where(better, c, best), torch.where(better, key, best_key)
    return torch.where(c6 > 0, best, 0).to(torch.uint8)


def test_nvfp4_decode_table_is_the_element_rule() -> None:
    """``decode`` reads elements through a table of the 256 code bytes: the same values as the
    element rule (``element_values``: unpacked index and sign) times the block and global
    scales, in the half-split order (element j in byte j's low bits, j + d/2 in its high bits)."""
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 256, (40, 32), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 127, (40, 4), dtype=torch.uint8, generator=g)
    gs = torch.rand(40, generator=g) + 0.5
    want = nvfp4.element_values(codes) * e4m3.decode(scales).repeat_interleave(16, -1) * gs[:, None]
    assert torch.equal(nvfp4.decode(codes, scales, gs), want)
    idx, neg = nvfp4.unpack_codes(codes)
    assert torch.equal(nvfp4.element_values(codes).abs(), torch.tensor(nvfp4.E2M1_VALUES)[idx])
    assert torch.equal(nvfp4.element_values(codes)[:, :32] < 0, neg[:, :32] & (idx[:, :32] > 0))


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_nvfp4_matches_independent_oracle(d, clip):
    g = torch.Generator().manual_seed(d)
    n = 4000 if d == 64 else 1000
    x = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float())
    gs = torch.full((n,), 0.25)
    codes, scales = nvfp4.encode(x, gs, clip=clip)
    assert codes.shape == (n, d // 2) and scales.shape == (n, d // 16)
    # block scales: the documented search (independent fp64 / int64 evaluation)
    assert torch.equal(scales, _search_oracle(x, 0.25, clip))
    if not clip:  # no block's largest value saturates unless its scale is E4M3's largest
        amax = x.abs().view(n, d // 16, 16).amax(-1) * 4.0
        assert bool(((6 * e4m3.decode(scales) >= amax) | (scales == 126) | (scales == 0)).all())
    # elements: round-half-even onto the E2M1 grid of the chosen scale, saturating
    s = e4m3.decode(scales).repeat_interleave(16, -1) * 0.25
    nib = _unpack(codes)
    idx = nib & 7
    ok = s > 0
    want = _e2m1_oracle(x, torch.where(ok, s, torch.ones_like(s)))
    assert torch.equal(torch.where(ok, idx, 0), torch.where(ok, want, 0))
    assert bool((idx[~ok] == 0).all())
    sign = (nib >> 3) == 1
    assert torch.equal(sign, (x < 0) & (idx > 0))
    back = nvfp4.decode(codes, scales, gs)
    assert torch.equal(back, torch.where(sign, -1.0, 1.0) * torch.tensor(nvfp4.E2M1_VALUES)[idx] * s)


@pytest.mark.parametrize("clip,bound", [(True, 0.8), (False, 0.9)])
def test_nvfp4_scale_search_lowers_error(clip, bound):
    # Gaussian blocks: the searched scales cut the squared error vs amax / 6 (K: by >= 20%,
    # V, which never clips: by >= 10%)
    x = torch.randn(4000, 64, generator=torch.Generator().manual_seed(5))
    g = torch.ones(4000)
    six = nvfp4.encode_with_scales(x, g, e4m3.encode_magnitude(nvfp4.block_scale_input(x, g))[0])
    err_six = float(((nvfp4.decode(*six, g) - x).double() ** 2).sum())
    err = float(((nvfp4.decode(*nvfp4.encode(x, g, clip=clip), g) - x).double() ** 2).sum())
    assert err <= bound * err_six


def test_nvfp4_scale_span_bound():
    # code(m / 4) - code(m / 6) is at most 6, so the up-candidates c0+1 .. c0+UP_SPAN reach
    # c4 + SEARCH_UP except where it is 6 (one code short: the documented cap)
    gen = torch.Generator().manual_seed(2)
    m = torch.exp2(torch.rand(1_000_000, generator=gen) * 24 - 12)
    vals = e4m3_values()
    m = torch.cat((m, vals * 6, vals * 4, (vals[:-1] + vals[1:]) * 3, (vals[:-1] + vals[1:]) * 2))
    c6 = e4m3.encode_magnitude(m * nvfp4.INV_6)[0].to(torch.int32)
    c4 = e4m3.encode_magnitude(m * 0.25)[0].to(torch.int32)
    assert int((c4 - c6).max()) == 6 and int((c4 - c6).min()) >= 0
    assert nvfp4.UP_SPAN == 6 + nvfp4.SEARCH_UP - 1


def test_nvfp4_error_fits_int32():
    # worst cases for the fixed-point error: one large value, all equal, 6x / 4x ratios, tiny
    # and zero blocks, saturating blocks; int32 sums must equal int64 sums
    rows = [
        [1.0] + [0.0] * 15, [1.0] * 16, [6.0] + [1.0] * 15, [4.0] + [5.0] * 15,
        [3e-3] * 16, [1e-30] * 16, [0.0] * 16, [1e9] + [1.0] * 15, [2.0**-127] * 16, [448.0 * 6] * 16,
    ]
    gen = torch.Generator().manual_seed(9)
    x = torch.cat((torch.tensor(rows), torch.randn(200, 16, generator=gen) * 10.0 ** torch.randint(-6, 6, (200, 1), generator=gen).float()))
    x = x.repeat(1, 4)
    n = x.shape[0]
    a = x.abs().view(n, 4, 16)
    m = a.amax(-1)
    exp = torch.clamp((m.view(torch.int32) >> 23) - 127, min=nvfp4.ERR_EXP_FLOOR)
    unit = e4m3._pow2(nvfp4.ERR_BITS - exp)
    c6 = e4m3.encode_magnitude(m * nvfp4.INV_6)[0]
    c4 = e4m3.encode_magnitude(m * 0.25)[0]
    for c in (nvfp4.scale_candidates(c6.to(torch.int32), c4, True) + nvfp4.scale_candidates(nvfp4.first_candidate(c6, m, False), c4, False)
              + nvfp4.feedback_candidates(c6, c4)):
        s = e4m3.decode(c.to(torch.uint8))
        err32, idx = nvfp4.block_error(a, unit, s)
        big_a = (a * unit[..., None]).double()
        assert bool((big_a < 2.0**31).all()) and bool(((s * unit * 0.5) < 2.0**31).all())
        step = (s * (unit * 0.5)).to(torch.int64)
        dd = (a * unit[..., None]).to(torch.int64) - nvfp4._HALVES[idx].to(torch.int64) * step[..., None]
        assert torch.equal(err32.to(torch.int64), (dd * dd).sum(-1))


def test_nvfp4_feedback_list_is_three_codes():
    """K rows rounded with error feedback search c6, c6-1, c4 (kept in 1..126), the least
    fixed-point error winning and ties keeping the earlier; the ten-code list is K's otherwise."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(300, 64, generator=gen) * 10.0 ** torch.randint(-4, 4, (300, 1), generator=gen).float()
    x[0, :16] = 0.0  # a zero block: scale 0
    x[1, :16] = 448.0 * 7  # saturating: c6 = c4 = 126
    x[2, :16] = torch.tensor([1.0] * 15 + [6.0])  # ties between candidates
    g = torch.full((300,), 0.5)
    got = nvfp4.choose_scale_codes(x, g, feedback=True).to(torch.int32)
    c6, a, m, c4 = nvfp4.search_inputs(x, g)
    exp = torch.clamp((m.view(torch.int32) >> 23) - 127, min=nvfp4.ERR_EXP_FLOOR)
    unit = e4m3._pow2(nvfp4.ERR_BITS - exp)
    c6i, c4i = c6.to(torch.int32), c4.to(torch.int32)
    cands = [c6i, (c6i - 1).clamp(1, 126), c4i.clamp(1, 126)]
    errs = torch.stack([nvfp4.block_error(a, unit, e4m3.decode(c.to(torch.uint8)))[0] for c in cands])
    want = torch.stack(cands).gather(0, errs.argmin(0, keepdim=True))[0]  # argmin: the first minimum
    want = torch.where(c6 > 0, want, 0)
    assert torch.equal(got, want)
    assert int(got[0, 0]) == 0 and int(got[1, 0]) == 126
    assert bool((got > 0).any()) and not torch.equal(got, nvfp4.choose_scale_codes(x, g).to(torch.int32))
    with pytest.raises(ValueError, match="K's"):
        nvfp4.choose_scale_codes(x, g, clip=False, feedback=True)


def test_nvfp4_element_rule_edge_blocks():
    # elements under a given scale (1.0): ties go to the even index, saturation at 6 * scale
    one = torch.ones(16)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0, 0.0])
    sat = torch.tensor([6.0, -6.0, 7.0, -7.0, 6.0 * 448, 5.0, 5.0001, 0.2, 0.0, -0.0, 1.0, 2.0, 3.0, 4.0, 0.5, 1.5])
    zero = torch.zeros(16)
    x = torch.stack([torch.cat((ties, sat, zero, -one * 3)), torch.cat((zero, zero, zero, -one * 3))])
    s_code = torch.tensor([[56, 56, 56, 48], [56, 56, 56, 48]], dtype=torch.uint8)  # 1.0 and 0.5
    codes, scales = nvfp4.encode_with_scales(x, torch.ones(2), s_code)
    assert torch.equal(scales, s_code)
    nib = _unpack(codes)
    # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4; no negative zero
    assert nib[0, :16].tolist() == [0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14, 7, 0]
    assert nib[0, 16:32].tolist() == [7, 15, 7, 15, 7, 6, 7, 0, 0, 0, 2, 4, 5, 6, 1, 3]
    assert bool((nib[:, 32:48] == 0).all())
    assert nib[0, 48:].tolist() == [15] * 16 and nib[1, 48:].tolist() == [15] * 16  # -3 = -6 * 0.5


def test_nvfp4_searched_scales_on_edge_blocks():
    zero = torch.zeros(16)
    tiny = torch.full((16,), 1e-6)  # amax / 6 far below E4M3's smallest subnormal -> scale 0
    huge = torch.full((16,), 1e6)  # saturates E4M3: the largest code, every element 6 * 448
    equal = torch.full((16,), 3.0)  # all equal: a scale putting 3.0 exactly on the grid (error 0)
    x = torch.cat((zero, tiny, huge, equal))[None].repeat(2, 1)
    codes, scales = nvfp4.encode(x, torch.ones(2), clip=False)
    codes_k, scales_k = nvfp4.encode(x, torch.ones(2), clip=True)
    assert torch.equal(codes, codes_k) and torch.equal(scales, scales_k)
    back = nvfp4.decode(codes, scales, torch.ones(2))
    assert scales[0, :3].tolist() == [0, 0, 126]
    assert bool((back[:, :32] == 0).all()) and bool((_unpack(codes)[:, :32] == 0).all())
    assert bool((back[0, 32:48] == 6.0 * 448).all())
    assert torch.equal(back[:, 48:], x[:, 48:])  # 3.0 = 6 * 0.5 is representable: zero error


def test_nvfp4_saturates_beyond_six_scales():
    x = torch.tensor([[6.0] + [1.0] * 14 + [9.0]] * 2).repeat(1, 4)
    s_code = e4m3.encode_magnitude(torch.full((2, 4), 1.5))[0]
    codes, scales = nvfp4.encode_with_scales(x, torch.ones(2), s_code)
    back = nvfp4.decode(codes, scales, torch.ones(2))
    assert back[0, 15].item() == 9.0 and back[0, 0].item() == 6.0
    s_code = e4m3.encode_magnitude(torch.full((2, 4), 1.0))[0]  # 9 > 6 * 1.0: saturates to 6
    codes, scales = nvfp4.encode_with_scales(x, torch.ones(2), s_code)
    assert nvfp4.decode(codes, scales, torch.ones(2))[0, 15].item() == 6.0


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


def test_int8_scale_saturates_where_the_decode_kernels_need_it():
    """Token scales stop at SCALE_MAX = 15 (fp16 probabilities x scale x 2**12 < 65504): a row
    whose amax passes 127 * 15 keeps its smaller values and clamps the larger ones; the
    calibration counts it as saturated, a row just below does not."""
    from deepwell.kernels.calibration import count_scales

    top = 127 * int8.SCALE_MAX  # 1905
    x = torch.zeros(3, 64)
    x[0, :3] = torch.tensor([5000.0, -2000.0, 30.0])
    x[1, :2] = torch.tensor([top, -1.0])
    codes, scales = int8.encode(x, torch.ones(3))
    assert scales.view(torch.float32)[:, 0].tolist() == [15.0, float(torch.tensor(top) * int8.INV_127), 0.0]
    back = int8.decode(codes, scales, torch.ones(3))
    assert back[0, :3].tolist() == [top, -top, 30.0] and back[1, 0].item() == top
    assert 2.0**12 * int8.SCALE_MAX < 65504
    lay = KVLayout.make("int8", 1, 64)
    c = count_scales(lay, x.view(3, 1, 64), x.view(3, 1, 64), lay.default_scales())
    assert (c["k"].blocks, c["k"].zero, c["k"].subnormal, c["k"].saturated) == (3, 1, 0, 1)


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


def test_nvfp4_v_scales_are_block_major_in_slot_order():
    """V's block scale of token i, block b sits at byte 64 b + scale_slot(i) of the region; the
    slots of the tokens one decode thread holds (same bits 1-2) are 16 consecutive bytes."""
    from deepwell.kernels.kv_formats.layout import scale_slot

    rows = torch.arange(64)
    assert sorted(scale_slot(rows).tolist()) == list(range(64))
    for lane in range(4):
        mine = rows[((rows >> 1) & 3) == lane]
        assert sorted(scale_slot(mine).tolist()) == list(range(16 * lane, 16 * lane + 16))
    lay = KVLayout.make("nvfp4", 1, 64)
    assert lay.scales_by_block(1) and not lay.scales_by_block(0)
    assert lay.scale_index(1, torch.tensor([9])).tolist() == [[2 + 1 + 0, 64 + 3, 128 + 3, 192 + 3]]
    assert lay.scale_index(0, torch.tensor([9])).tolist() == [[36, 37, 38, 39]]
    assert not KVLayout.make("int8", 1, 64).scales_by_block(1)


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


def _run_ptx(src: str, regs: dict[str, int]) -> dict[str, int]:
    """Evaluate the straight-line 32-bit PTX the nvfp4 unpack uses (and / shr / shl / lop3 /
    mov / prmt with immediates) on Python integers."""
    def val(tok: str) -> int:
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    for stmt in filter(None, (s.strip() for s in src.replace("{", ";").replace("}", ";").split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        dst = args[0]
        if op == "and.b32":
            r = val(args[1]) & val(args[2])
        elif op == "shr.b32":
            r = val(args[1]) >> int(args[2])
        elif op == "shl.b32":
            r = val(args[1]) << int(args[2])
        elif op == "mov.b32":
            r = val(args[1])
        elif op == "lop3.b32":
            a, b, c, lut = val(args[1]), val(args[2]), val(args[3]), int(args[4], 16)
            r = sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i for i in range(32))
        elif op == "prmt.b32":
            x, y, sel = val(args[1]), val(args[2]), int(args[3], 16)
            pool = (y << 32) | x
            r = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        else:
            raise AssertionError(f"unexpected PTX op {op!r}")
        regs[dst] = r & 0xFFFFFFFF
    return regs


def test_nvfp4_ptx_unpack_matches_the_codec():
    """The GPU kernels' PTX (``paged_attention.nvfp4_ptx``), evaluated bit by bit on every code
    byte value: each fp16 lane is the codec's value times 2**-14 (low elements, then high)."""
    from deepwell.kernels.paged_attention import nvfp4_ptx

    codes = torch.arange(256, dtype=torch.uint8).view(16, 16)  # rows of d = 32: every byte value once
    want = nvfp4.decode(codes, torch.full((16, 2), 56, dtype=torch.uint8), torch.ones(16)) * 2.0**-14
    src = nvfp4_ptx.pairs()
    for w in range(64):  # code word w: bytes 4k .. 4k + 3 of row r
        r, k = divmod(w, 4)
        word = int.from_bytes(bytes(codes[r, 4 * k : 4 * k + 4].tolist()), "little")
        regs = _run_ptx(src.replace("$4", "c").replace("$0", "o0").replace("$1", "o1").replace("$2", "o2")
                        .replace("$3", "o3"), {"c": word})
        lanes = [regs[o] >> (16 * k) & 0xFFFF for o in ("o0", "o1", "o2", "o3") for k in (0, 1)]
        got = torch.tensor(lanes, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        assert torch.equal(got, torch.cat((want[r, 4 * k : 4 * k + 4], want[r, 16 + 4 * k : 20 + 4 * k]))), w
        for low in (True, False):  # the scaled halves' extraction leaves the same high bytes
            r = _run_ptx(nvfp4_ptx.high_bytes("x", "c", low), {"c": word})
            assert r["x"] == regs["x" if low else "y"]
