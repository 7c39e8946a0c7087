"""Triton RMSNorm family: ``rms_norm``, ``add_rms_norm`` (residual add + norm) and
``gated_rms_norm``, one launch each over rows of any leading shape.

Maths (``references``), per row of ``N`` elements, ``X`` the dtype the row is normed in:
``y = xf * (1 / sqrt(sum(xf^2) / N + eps))`` in fp32 (``xf`` = the row in ``X``, widened), then

- zero-centered: ``round_X(y * (1 + wf))`` (``1 + w`` in fp32), dtype ``X``;
- plain: ``round_P(wf * round_X(y))``, dtype ``P = promote(w.dtype, X)`` (torch's ``w * y.to(X)``);
- gated (plain weight): ``round_X(round_P(wf * round_X(y)) * silu(float(gate)))``, dtype ``X``.

``add_rms_norm``: the new residual ``round_R(residual + x)``, ``R = promote(residual, x)``, is
stored and normed (``X = R``). ``gated_rms_norm(..., dtype=D)`` first rounds an fp32 ``x`` to
``D`` (``X = D``): the reference on ``x.to(D)``, with the cast fused. The square sum is a
tree reduction and the divisions are correctly rounded (torch CPU's ``rsqrt`` is ``1 / sqrt``),
so results differ from torch's only by reduction-order ulps before a rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.fused.common import kind, launch_kwargs, round_to, row_tile, rows, silu_f32


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, g_ptr, w_ptr, out_ptr, res_ptr, n_rows,
    stride_x, stride_r, stride_g, stride_o, stride_res, eps, g_heads, stride_gh,
    N: tl.constexpr, X_KIND: tl.constexpr, P_KIND: tl.constexpr, CAST: tl.constexpr,
    RES: tl.constexpr, GATED: tl.constexpr, ZC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, BLOCK_N)
    mask = (row < n_rows)[:, None] & (col < N)[None, :]
    r64 = row.to(tl.int64)[:, None]
    col2 = col[None, :]
    x = tl.load(x_ptr + r64 * stride_x + col2, mask=mask, other=0.0).to(tl.float32)
    if RES:
        x = round_to(x + tl.load(r_ptr + r64 * stride_r + col2, mask=mask, other=0.0).to(tl.float32), X_KIND)
        tl.store(res_ptr + r64 * stride_res + col2, x.to(res_ptr.dtype.element_ty), mask=mask)
    elif CAST:
        x = round_to(x, X_KIND)
    ss = tl.sum(x * x, axis=1)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(ss, N * 1.0) + eps))
    y = x * inv[:, None]
    w = tl.load(w_ptr + col, mask=col < N, other=0.0).to(tl.float32)[None, :]
    if ZC:
        out = round_to(y * (1.0 + w), X_KIND)
    else:
        out = round_to(w * round_to(y, X_KIND), P_KIND)
        if GATED:
            # gate row r at (r // g_heads) * stride_g + (r % g_heads) * stride_gh: a [T, H, N] view
            # of a wider projection ([T, H * N] columns of it) is read in place
            g_off = (r64 // g_heads) * stride_g + (r64 % g_heads) * stride_gh
            gate = tl.load(g_ptr + g_off + col2, mask=mask, other=0.0).to(tl.float32)
            out = round_to(out * silu_f32(gate), X_KIND)
    tl.store(out_ptr + r64 * stride_o + col2, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, *,
            residual: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
            gate: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {list(weight.shape)}")
    xd = dtype or x.dtype
    out_dtype = xd if zero_centered or gate is not None else torch.promote_types(weight.dtype, xd)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    x2 = rows(x, n)
    r = x2.shape[0]
    if r == 0:
        return out
    r2 = rows(residual, n) if residual is not None else x2
    g2, g_heads, stride_gh = _gate_rows(gate, n) if gate is not None else (x2, 1, 0)
    res2 = res_out.view(-1, n) if res_out is not None else out.view(-1, n)
    block_r, block_n, warps = row_tile(n, r, 2048 if gate is not None else 4096)
    _rms_norm_kernel[(triton.cdiv(r, block_r),)](
        x2, r2, g2, weight.contiguous(), out, res2, r,
        x2.stride(0), r2.stride(0), g2.stride(0), n, n, float(eps), g_heads, stride_gh,
        N=n, X_KIND=kind(xd), P_KIND=kind(out_dtype), CAST=xd != x.dtype, RES=residual is not None,
        GATED=gate is not None, ZC=zero_centered, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps,
        **launch_kwargs(x.device),
    )
    return out


def _gate_rows(gate: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """``(g, heads, head stride)``: gate row ``r`` of ``n`` elements at ``g.stride(0) * (r //
    heads) + head stride * (r % heads)``; a ``[..., H, n]`` view with a unit last stride whose heads
    do not merge with the leading dims (columns of a wider projection) is read in place."""
    if gate.dim() >= 3 and gate.stride(-1) == 1:
        h = gate.shape[-2]
        try:
            g3 = gate.view(-1, h, n)
        except RuntimeError:  # leading dims that do not merge: a copy below
            g3 = None
        if g3 is not None and g3.stride(0) != h * g3.stride(1):
            return g3, h, g3.stride(1)
    return rows(gate, n), 1, 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """``references.rms_norm`` over the last dim of ``x [..., N]``; ``weight [N]``."""
    return _launch(x, weight, eps, zero_centered)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)`` in one pass (``references.add_rms_norm``).
    ``inplace``: the new residual is written into ``residual`` (same dtype, contiguous)."""
    if x.shape != residual.shape:
        raise ValueError(f"x {list(x.shape)} and residual {list(residual.shape)} differ")
    rd = torch.promote_types(residual.dtype, x.dtype)
    if inplace:
        if residual.dtype != rd or not residual.is_contiguous():
            raise ValueError("an in-place residual must be contiguous and of the sum's dtype")
        new_res = residual
    else:
        new_res = torch.empty(x.shape, dtype=rd, device=x.device)
    normed = _launch(x, weight, eps, zero_centered, residual=residual, res_out=new_res, dtype=rd)
    return normed, new_res


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``references.gated_rms_norm(x.to(dtype), gate, weight, eps)`` (``dtype`` default
    ``x.dtype``): the GDN output norm, with ``core.to(dtype)`` fused."""
    if gate.shape != x.shape:
        raise ValueError(f"gate {list(gate.shape)} must match x {list(x.shape)}")
    return _launch(x, weight, eps, False, gate=gate, dtype=dtype)
