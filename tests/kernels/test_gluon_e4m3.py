"""The Gluon append's E4M3 rounding by the hardware (``cvt.rn.satfinite.e4m3x2.f32``) against the
codec (``kv_formats.e4m3.encode_signed``) on every finite fp32 value (H200)."""

from __future__ import annotations

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from deepwell.kernels.kv_append import gluon_append
from deepwell.kernels.kv_formats import e4m3


@gluon.jit
def _probe(x_ptr, code_ptr, val_ptr, word_ptr, N, BLOCK: gl.constexpr):
    """Per value ``_e4m3_hw`` (code, value); per group of four ``_e4m3_word``."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    w = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=lay)  # word index
    m = w < N // 4
    ys = ()
    for e in gl.static_range(4):
        y = gl.load(x_ptr + 4 * w + e, mask=m, other=0.0)
        c, v = gluon_append._e4m3_hw(y)
        gl.store(code_ptr + 4 * w + e, c.to(gl.uint8), mask=m)
        gl.store(val_ptr + 4 * w + e, v, mask=m)
        ys = ys + (y,)
    gl.store(word_ptr + w, gluon_append._e4m3_word(ys[0], ys[1], ys[2], ys[3]), mask=m)


@pytest.mark.gpu
def test_hardware_e4m3_equals_the_codec_on_every_finite_float():
    dev = torch.device("cuda")
    if not gluon_append.available(dev):
        pytest.skip("the Gluon append needs a Hopper GPU")
    chunk = 1 << 28
    block = 512
    checked = 0
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, device=dev, dtype=torch.int64)
        x = (bits - (1 << 32) * (bits >= (1 << 31))).to(torch.int32).view(torch.float32)
        x = x[torch.isfinite(x)].contiguous()
        n = x.numel() - x.numel() % 4
        x = x[:n]
        code = torch.empty(n, dtype=torch.uint8, device=dev)
        val = torch.empty(n, dtype=torch.float32, device=dev)
        word = torch.empty(n // 4, dtype=torch.int32, device=dev)
        _probe[(triton_cdiv(n // 4, block),)](x, code, val, word, n, BLOCK=block, num_warps=4)
        want = e4m3.encode_signed(x)
        mag = e4m3.encode_magnitude(x.abs())[1]
        bad = (code != want).nonzero()
        assert bad.numel() == 0, f"codes differ at {x[bad[:5, 0]].tolist()}: {code[bad[:5, 0]].tolist()} vs {want[bad[:5, 0]].tolist()}"
        assert torch.equal(val.abs(), mag), "values differ"
        assert torch.equal(val < 0, (x < 0) & (mag > 0)), "signs differ"
        assert torch.equal(word.view(torch.uint8), want), "packed words differ"
        checked += n
    assert checked > 4_000_000_000


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
