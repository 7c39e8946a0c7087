"""Triton Hadamard transform: the ``reference.fwht`` butterflies, bit for bit.

``fwht_rows`` operates on an fp32 tile ``[R, D]`` (``D`` a power of two) and returns the
normalized transform of every row, evaluating exactly the adds/subtracts of
``reference.fwht`` in the same order, then one multiply by ``SCALE`` (= ``reference.scale(D)``),
so the bits match; the fused append kernel uses it on K. ``rotate(x)`` runs it as one
kernel over the rows of ``x [..., D]`` and rounds to ``x``'s dtype (round-half-even, done
from the bits for bf16 because the interpreter's cast truncates): exactly
``reference.fwht(x).to(x.dtype)``, which is how the attention backend brings Q into the K
space in one launch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.hadamard.reference import SUPPORTED_DIMS, scale


@triton.jit
def fwht_rows(x, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, SCALE: tl.constexpr):
    for i in tl.static_range(LOG2D):
        y = tl.reshape(x, [R, D // (2 << i), 2, 1 << i])
        y = tl.permute(y, (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.join(a + b, a - b)
        y = tl.permute(y, (0, 1, 3, 2))
        x = tl.reshape(y, [R, D])
    return x * SCALE


@triton.jit
def _rotate_kernel(x_ptr, y_ptr, n_rows, D: tl.constexpr, LOG2D: tl.constexpr, SCALE: tl.constexpr,
                   BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (rows < n_rows)[:, None]
    offs = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    y = fwht_rows(tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32), BLOCK_R, D, LOG2D, SCALE)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        b = y.to(tl.int32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        tl.store(y_ptr.to(tl.pointer_type(tl.int16)) + offs, (b >> 16).to(tl.int16), mask=ok)
    else:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def rotate(x: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """``reference.fwht(x, size).to(x.dtype)`` in one kernel; ``x`` contiguous ``[..., D]``
    (``size``: each ``size`` consecutive elements through the transform of that size)."""
    d = x.shape[-1]
    size = d if size is None else size
    if size not in SUPPORTED_DIMS or d % size or d not in SUPPORTED_DIMS:
        raise ValueError(f"hadamard size must be one of {SUPPORTED_DIMS} and divide {d}, got {size}")
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel() // d
    if n:
        block_r = max(1, min(16, 4096 // d))
        _rotate_kernel[(triton.cdiv(n, block_r),)](x, y, n, D=d, LOG2D=int(math.log2(size)), SCALE=scale(size), BLOCK_R=block_r,
                                                     **pdl.launch_kwargs(x.device, "rotate"))
    return y
