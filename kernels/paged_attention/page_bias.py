"""``page_center.page_bias`` as one Triton launch: each page's ``q . c_P`` for decode / verify.

A layer whose K is centered per page (``kernels.page_center``) needs ``q . c_P`` added to the
scores of page ``P``'s keys. The Gluon decode kernel takes it per (sequence, KV head, page) as
one value per column of its score tile, precomputed here for the block table's whole width
(fp32 ``[B, Hkv, W, N]``, in the kernel's log2 units): adding it to a page's column maximum and
to the exponent's per-column offset costs the page loop nothing per score. Grid ``[B, Hkv,
cdiv(W, BP)]``: a program takes its columns' query terms (``PageCenter.query_terms``: fp32
products of the unrotated query and ``mu``) and ``BP`` pages' table rows, and multiplies them
as an fp32 product (``tl.dot`` with IEEE fp32 sums; the reference sums in fp64: equal to ~1e-6
relative). With a sink key (``PageCenter.sink``) the first block's programs replace page 0's
row by ``q . sink_adj`` (an fp32 sum over the head dim). Launched with PDL where Q's rotation is
(``kernels.pdl``, family ``rotate``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.page_center import PageCenter

BLOCK_PAGES = 64
DOT_PRECISION = "tf32x3"  # three tf32 tensor-core products (fp32-accurate); "ieee": fp32 FMAs, 2-5x slower (H200)


@triton.jit
def page_bias_kernel(q_ptr, mu_ptr, tab_ptr, sink_ptr, out_ptr, scale, W, tab_pages, stride_qt, stride_qh,
                     T: tl.constexpr, G: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr,
                     HR: tl.constexpr, RP: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr, SINK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    blk = tl.program_id(2)
    H = tl.num_programs(1)
    # the columns' query terms, transposed: [A | B] along rows (query_terms' order), columns n
    jj = tl.arange(0, RP)
    n = tl.arange(0, NP)
    j = jj % HR
    col_ok = n < T * G
    m = (jj < 2 * HR)[:, None] & col_ok[None, :]
    qcol = q_ptr + (b * T + n // G).to(tl.int64)[None, :] * stride_qt + (kvh * G + n % G)[None, :] * stride_qh
    q1 = tl.load(qcol + j[:, None], mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(qcol + HR + j[:, None], mask=m, other=0.0).to(tl.float32)
    m1 = tl.load(mu_ptr + kvh * D + j)[:, None]
    m2 = tl.load(mu_ptr + kvh * D + HR + j)[:, None]
    terms = tl.where((jj < HR)[:, None], q1 * m1 + q2 * m2, q2 * m1 - q1 * m2)  # [RP, NP]; 0 where masked
    p = blk * BP + tl.arange(0, BP)
    row = tl.minimum(p, tab_pages - 1).to(tl.int64)
    tab = tl.load(tab_ptr + row[:, None] * (2 * HR) + jj[None, :], mask=(jj < 2 * HR)[None, :], other=0.0)
    dot = tl.dot(tab, terms, input_precision=PREC)  # [BP, NP], fp32 sums
    if SINK:  # page 0 is centered on the sink key: its term is q . sink_adj (the first block's programs)
        if blk == 0:
            dd = tl.arange(0, D)
            qf = tl.load(qcol + dd[:, None], mask=col_ok[None, :], other=0.0).to(tl.float32)  # [D, NP]
            sk = tl.load(sink_ptr + kvh * D + dd)
            st = tl.sum(qf * sk[:, None], axis=0)  # [NP]
            dot = tl.where((p == 0)[:, None], st[None, :], dot)
    out = out_ptr + ((b * H + kvh).to(tl.int64) * W + p[:, None]) * N + n[None, :]
    tl.store(out, tl.where(col_ok[None, :], dot * scale, 0.0), mask=(p < W)[:, None] & (n < N)[None, :])


def page_bias(pc: PageCenter, q: torch.Tensor, tokens_per_seq: int, columns: int, width: int, scale: float,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Same meaning as ``page_center.page_bias`` (fp32 sums instead of fp64); ``out`` (fp32
    ``[B, Hkv, width, columns]``, contiguous) may be preallocated. Shapes only are checked, so
    the call is safe inside CUDA-graph capture."""
    nq, hq, d = q.shape
    hkv = pc.mu.shape[0]
    t = tokens_per_seq
    g = hq // hkv
    if t < 1 or nq % t or hq % hkv or d != pc.mu.shape[1] or columns < t * g or columns & (columns - 1):
        raise ValueError(f"page_bias needs q [B * T, Hq, {pc.mu.shape[1]}] (Hq a multiple of {hkv}) with T = {t} "
                         f">= 1 and a power-of-two columns >= T * G; got q {list(q.shape)}, columns {columns}")
    if q.stride(-1) != 1 or q.device != pc.mu.device:
        raise ValueError(f"q must be contiguous in its last dimension and on {pc.mu.device}, got {q.device}")
    b = nq // t
    shape = (b, hkv, width, columns)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"out must be contiguous float32 {list(shape)} on {q.device}, got {out.dtype} "
                         f"{list(out.shape)}")
    if b == 0 or width == 0:
        return out
    hr = pc.rotary_dim // 2
    adj = pc.sink_adj
    page_bias_kernel[(b, hkv, triton.cdiv(width, BLOCK_PAGES))](
        q, pc.mu, pc.table, pc.mu if adj is None else adj, out, scale, width, pc.table.shape[0], q.stride(0),
        q.stride(1), T=t, G=g, N=columns, NP=max(16, columns), D=d, HR=hr,
        RP=max(16, triton.next_power_of_2(2 * hr)), BP=BLOCK_PAGES, PREC=DOT_PRECISION, SINK=adj is not None,
        num_warps=4, **pdl.launch_kwargs(q.device, "rotate"),
    )
    return out
