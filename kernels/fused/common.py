"""Shared pieces of the fused elementwise kernels: torch-exact rounding, accurate exp/log1p,
row views and launch sizes.

Every fused kernel loads its inputs, widens them to fp32 and repeats the reference's torch
expression step by step, rounding each intermediate to the dtype torch would hold it in
(``round_to``), so a result differs from the reference only where an fp32 transcendental or
a reduction order differs by an ulp before a rounding. Details:

- ``round_to(x, KIND)``: fp32 -> the nearest value of dtype ``KIND`` (0 fp32: as is, 1 bf16,
  2 fp16), ties to even, returned as fp32. bf16 is rounded from the bits because the
  interpreter's own cast truncates; the store's cast of the rounded value is then exact.
- ``exp_acc`` / ``log1p_acc``: libdevice's ``expf`` / ``log1pf`` on the GPU (what torch's CUDA
  ops call, not the fast ``ex2.approx``); numpy's under ``TRITON_INTERPRET=1``.
- ``sigmoid_f32`` = ``1 / (1 + exp(-x))``, ``silu_f32`` = ``x / (1 + exp(-x))`` with
  correctly rounded divisions: torch's CPU and CUDA formulas for float / bf16 / fp16.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: dtype -> ``round_to`` KIND; other dtypes have no fused kernel (the ops fall back).
KIND: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def round_to(x, KIND: tl.constexpr):
    """fp32 ``x`` rounded (ties to even) to fp32 (0), bf16 (1) or fp16 (2), kept as fp32."""
    if KIND == 1:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return tl.where(x != x, x, b.to(tl.float32, bitcast=True))
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


if INTERPRET:

    @triton.jit
    def exp_acc(x):
        return tl.exp(x)

    @triton.jit
    def log1p_acc(x):
        # Goldberg: log(u) * x / (u - 1) is within a few ulp of log1p(x) (numpy's log is exact-ish)
        u = 1.0 + x
        d = tl.where(u == 1.0, 1.0, u - 1.0)  # no 0 / 0 in the branch not taken
        return tl.where(u == 1.0, x, tl.log(u) * tl.math.div_rn(x, d))

else:
    from triton.language.extra import libdevice

    @triton.jit
    def exp_acc(x):
        return libdevice.exp(x)

    @triton.jit
    def log1p_acc(x):
        return libdevice.log1p(x)


@triton.jit
def sigmoid_f32(x):
    return tl.math.div_rn(1.0, 1.0 + exp_acc(-x))


@triton.jit
def silu_f32(x):
    return tl.math.div_rn(x, 1.0 + exp_acc(-x))


def kind(dtype: torch.dtype) -> int:
    if dtype not in KIND:
        raise ValueError(f"fused kernels take float32 / bfloat16 / float16, got {dtype}")
    return KIND[dtype]


def supported(*tensors: torch.Tensor) -> bool:
    """All floating dtypes the kernels handle (the ops fall back to the reference otherwise)."""
    return all(t.dtype in KIND for t in tensors)


def rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` as ``[R, n]`` with a unit last stride: a view where one exists, else a copy."""
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 or n == 1 else x2.contiguous()


def row_tile(n: int, r: int, budget: int = 4096) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_N, num_warps)`` for a kernel holding ``[BLOCK_R, BLOCK_N]`` fp32 tiles:
    the whole row (``BLOCK_N >= n``), as many rows as fit ``budget`` elements (``16 x`` more
    under the interpreter, which pays per program), never more than the ``r`` rows there are."""
    block_n = triton.next_power_of_2(max(n, 1))
    cap = budget * (16 if INTERPRET else 1)
    block_r = max(1, min(cap // block_n, triton.next_power_of_2(max(r, 1))))
    elems = block_r * block_n
    warps = 4 if elems <= 2048 else 8 if elems <= 8192 else 16
    return block_r, block_n, warps


def launch_kwargs(device: torch.device) -> dict:
    """PDL for the fused kernels: ``kernels.pdl``'s ``"fused"`` family (selected by ``DEEPWELL_PDL``)."""
    return pdl.launch_kwargs(device, "fused")
