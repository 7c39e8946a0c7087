"""Triton Gated DeltaNet gating: the decay ``g`` and the write strength ``beta`` in one launch.

Maths (``references.gdn_gating`` = ``engine_service.layers.gdn``), per token and value head:

    g    = -exp(float(A_log)) * softplus(float(a) + float(dt_bias))     fp32
    beta = round_B(sigmoid(float(b)))                                   dtype B = b.dtype

``softplus(x) = x if x > 20 else log1p(exp(x))`` (torch's threshold 20), ``sigmoid(x) =
1 / (1 + exp(-x))``; ``a, b [..., Hv]`` (rows may be strided: e.g. halves of one fused ``ba``
projection), ``A_log, dt_bias [Hv]``. fp32 transcendentals: within an ulp or two of torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.fused.common import exp_acc, kind, launch_kwargs, log1p_acc, round_to, row_tile, rows, sigmoid_f32


@triton.jit
def _gdn_gating_kernel(
    a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, n_rows, stride_a, stride_b,
    H: tl.constexpr, B_KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, BLOCK_H)
    hmask = col < H
    mask = (row < n_rows)[:, None] & hmask[None, :]
    r64 = row.to(tl.int64)[:, None]
    col2 = col[None, :]
    a = tl.load(a_ptr + r64 * stride_a + col2, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + col2, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + col, mask=hmask, other=0.0).to(tl.float32)[None, :]
    dt = tl.load(dt_ptr + col, mask=hmask, other=0.0).to(tl.float32)[None, :]
    x = a + dt
    sp = tl.where(x > 20.0, x, log1p_acc(exp_acc(x)))
    g = -exp_acc(a_log) * sp
    out = r64 * H + col2
    tl.store(g_ptr + out, g, mask=mask)
    beta = round_to(sigmoid_f32(b), B_KIND)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g fp32, beta in b.dtype)``, both of ``a``'s shape ``[..., Hv]`` (module doc)."""
    h = a.shape[-1]
    if b.shape != a.shape or A_log.shape != (h,) or dt_bias.shape != (h,):
        raise ValueError(f"a {list(a.shape)}, b {list(b.shape)}, A_log {list(A_log.shape)}, "
                         f"dt_bias {list(dt_bias.shape)}: want [..., Hv] twice and [Hv] twice")
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    a2, b2 = rows(a, h), rows(b, h)
    r = a2.shape[0]
    if r == 0 or h == 0:
        return g, beta
    block_r, block_h, warps = row_tile(h, r, 1024)
    _gdn_gating_kernel[(triton.cdiv(r, block_r),)](
        a2, b2, A_log.contiguous(), dt_bias.contiguous(), g, beta, r, a2.stride(0), b2.stride(0),
        H=h, B_KIND=kind(b.dtype), BLOCK_R=block_r, BLOCK_H=block_h, num_warps=min(warps, 4),
        **launch_kwargs(a.device),
    )
    return g, beta
