"""Triton rotary embedding of q and k in one launch (NeoX half-split, partial rotary dims).

Maths (``references.apply_rope`` = ``engine_service.layers.rope.apply_rope``): for ``x [T, H, D]``
and ``cos, sin [T, RD]`` (``RD <= D`` even, ``h = RD / 2``), with ``P = promote(x, cos)`` and
every product and sum rounded to ``P`` as torch does:

    out[..., :h]   = round_P(round_P(x1 * c1) + round_P(-x2 * s1))
    out[..., h:RD] = round_P(round_P(x2 * c2) + round_P(x1 * s2))
    out[..., RD:]  = x[..., RD:]

(``x1, x2`` the halves of ``x[..., :RD]``, ``c1, c2`` / ``s1, s2`` those of cos / sin). Products
of two 16-bit floats are exact in fp32 and the kernel is compiled without FMA contraction, so
the result is bit-identical to torch's. Every ``rope_type`` of ``rope.py`` (default, linear,
yarn, llama3) only changes the cos/sin tables, which the caller passes.

``rope(q, k, cos, sin, inplace=False)``: q ``[..., Hq, D]``, k ``[..., Hk, D]`` (or None), cos /
sin ``[..., RD]`` with the same leading shape; rows may be strided (last dim contiguous).
``inplace`` rotates the first ``RD`` dims in place and leaves the rest unread (Qwen3.5: 64 of
256 dims), else new contiguous tensors are returned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.fused.common import INTERPRET, kind, launch_kwargs, round_to


@triton.jit
def _rope_tile(x_ptr, o_ptr, sx, so, tok, tmask, c1, c2, s1, s2,
               D: tl.constexpr, RD: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_REST: tl.constexpr, P_KIND: tl.constexpr, COPY_REST: tl.constexpr):
    cols = tl.arange(0, BLOCK_H)
    mask = tmask[:, None] & (cols < HALF)[None, :]
    xrow = x_ptr + tok * sx
    orow = o_ptr + tok * so
    x1 = tl.load(xrow + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = round_to(round_to(x1 * c1, P_KIND) + round_to(-x2 * s1, P_KIND), P_KIND)
    o2 = round_to(round_to(x2 * c2, P_KIND) + round_to(x1 * s2, P_KIND), P_KIND)
    ty = o_ptr.dtype.element_ty
    tl.store(orow + cols[None, :], o1.to(ty), mask=mask)
    tl.store(orow + HALF + cols[None, :], o2.to(ty), mask=mask)
    if COPY_REST:
        for c0 in tl.static_range(RD, D, BLOCK_REST):
            rc = c0 + tl.arange(0, BLOCK_REST)
            rmask = tmask[:, None] & (rc < D)[None, :]
            rest = tl.load(xrow + rc[None, :], mask=rmask, other=0.0)
            tl.store(orow + rc[None, :], rest.to(ty), mask=rmask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, n_tok, hq,
    sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h, sc_t, ss_t,
    D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_T: tl.constexpr, P_KIND: tl.constexpr, COPY_REST: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token block, head): heads ``[0, hq)`` of q then those of k."""
    pdl.enter(PDL)
    HALF: tl.constexpr = RD // 2
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tok
    tok = t.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_H)[None, :]
    cmask = tmask[:, None] & (cols < HALF)
    c1 = tl.load(cos_ptr + tok * sc_t + cols, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * sc_t + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * ss_t + cols, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * ss_t + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    if h < hq:
        _rope_tile(q_ptr + h.to(tl.int64) * sq_h, qo_ptr + h.to(tl.int64) * sqo_h, sq_t, sqo_t, tok, tmask,
                   c1, c2, s1, s2, D, RD, HALF, BLOCK_H, BLOCK_REST, P_KIND, COPY_REST)
    else:
        hk = (h - hq).to(tl.int64)
        _rope_tile(k_ptr + hk * sk_h, ko_ptr + hk * sko_h, sk_t, sko_t, tok, tmask,
                   c1, c2, s1, s2, D, RD, HALF, BLOCK_H, BLOCK_REST, P_KIND, COPY_REST)


def _heads(x: torch.Tensor, inplace: bool) -> torch.Tensor:
    """``x [..., H, D]`` as ``[T, H, D]`` with a unit last stride (a view when ``inplace``)."""
    if inplace:
        x3 = x.view(-1, x.shape[-2], x.shape[-1])  # raises where no view exists
        if x3.stride(-1) != 1:
            raise ValueError("in-place rope needs a unit stride in the last dim")
        return x3
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
         inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(apply_rope(q, cos, sin), apply_rope(k, cos, sin))`` in one launch (module doc)."""
    rd, d = cos.shape[-1], q.shape[-1]
    if sin.shape != cos.shape or rd % 2 or rd > d or (k is not None and k.shape[-1] != d):
        raise ValueError(f"cos/sin {list(cos.shape)} / {list(sin.shape)} do not fit head dim {d}")
    p = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
    if inplace and (q.dtype != p or (k is not None and k.dtype != p)):
        raise ValueError(f"in-place rope needs q/k in the result dtype {p}")
    q3 = _heads(q, inplace)
    k3 = _heads(k, inplace) if k is not None else q3[:, :0]
    n_tok = q3.shape[0]
    if k3.shape[0] != n_tok:
        raise ValueError(f"q has {n_tok} tokens, k {k3.shape[0]}")
    c2, s2 = cos.reshape(-1, rd), sin.reshape(-1, rd)
    c2 = c2 if c2.stride(-1) == 1 else c2.contiguous()
    s2 = s2 if s2.stride(-1) == 1 else s2.contiguous()
    if c2.shape[0] != n_tok:
        raise ValueError(f"cos/sin have {c2.shape[0]} rows for {n_tok} tokens")
    if inplace:
        qo, ko = q3, k3
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=p, device=q.device)
        k_out = torch.empty(k.shape, dtype=p, device=q.device) if k is not None else None
        qo = q_out.view(q3.shape)
        ko = k_out.view(k3.shape) if k_out is not None else qo[:, :0]
    heads = q3.shape[1] + k3.shape[1]
    if n_tok == 0 or heads == 0:
        return q_out, k_out
    block_h = triton.next_power_of_2(max(rd // 2, 1))
    per_prog = 2048 if INTERPRET else 2048 if n_tok >= 64 else 256  # tile elements per half
    block_t = max(1, min(per_prog // block_h, triton.next_power_of_2(n_tok)))
    _rope_kernel[(triton.cdiv(n_tok, block_t), heads)](
        q3, k3, qo, ko, c2, s2, n_tok, q3.shape[1],
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), c2.stride(0), s2.stride(0),
        D=d, RD=rd, BLOCK_H=block_h, BLOCK_REST=min(triton.next_power_of_2(max(d - rd, 1)), 256),
        BLOCK_T=block_t, P_KIND=kind(p), COPY_REST=not inplace and rd < d,
        num_warps=1 if block_t * block_h <= 256 else 4,
        enable_fp_fusion=False, **launch_kwargs(q.device),
    )
    return q_out, k_out
