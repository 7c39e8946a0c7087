"""Triton paged attention over a quantized cache: decode, speculative verify and prefill.

One kernel family, the format a compile-time choice. A program owns ``BLOCK_M`` rows of
one sequence and one KV head, a row being a (query token, query head of that KV head's
group) pair — so all query heads sharing a KV head read each K/V page once (GQA grouping),
and the same kernel serves 1-16 token decode/verify (one row block) and long prefill chunks
(many row blocks). Grid: ``[work items, KV heads, splits]``; ``work_seq``/``work_row`` map a
work item to (sequence, first row). Pages are the 64-token key tiles.

Split-K: split ``s`` of ``num_splits`` handles pages ``[s * pps, (s + 1) * pps)`` with
``pps = cdiv(pages needed by the block, num_splits)``; with ``num_splits > 1`` each writes
a normalized partial output and its log2-sum-exp, and ``merge_kernel`` combines them. The
grid depends only on batch shape and ``num_splits`` (never on context lengths), so a
decode step can be captured in a CUDA graph with a fixed maximum split count.

Dequantization in registers, tensor cores for both products:
- K tiles become bf16 for bf16/int8 (exact) and meet bf16 Q; per-token int8 K scales and
  the global K scale multiply the fp32 scores.
- V tiles become fp16 (exact for fp8/int8/nvfp4) and meet fp16 probabilities (int8's
  per-token V scale is folded into them); bf16 V meets the probabilities split into a bf16
  high part and a bf16 residual (two products) so the result stays near fp32 accuracy;
  with ``precise_p`` (default for row blocks <= 64, i.e. decode/verify) fp16 probabilities
  get the same residual product, so split and unsplit results agree to ~1e-7. fp16
  probabilities are scaled by 2**15 (int8: 2**12, as they carry V's scale, which must stay
  below 16) so that the tiny probabilities of long contexts do not become fp16 subnormals.
- K tiles are fp16 instead for fp8 and nvfp4 (Q is cast to fp16: post-norm queries are
  far inside its range): E4M3 converts to fp16 in hardware, and an nvfp4 nibble ``n``
  becomes the fp16 bit pattern ``((n & 7) << 9) | ((n & 8) << 12)`` (= value * 2**-14),
  times its block's E4M3 scale in fp16 (exact); the 2**14 goes into the global scale.
Under ``TRITON_INTERPRET=1`` tiles are fp32 instead (the interpreter mishandles 16-bit
floats in dot products). Rows and columns are "halves" of the head dim (``[0, d/2)`` and
``[d/2, d)``), matching nvfp4's half-split nibble packing, so nothing is ever interleaved.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_append.triton_kernel import FMT_ID
from kernels.kv_formats.layout import KVFormat, KVLayout

LOG2E = 1.4426950408889634
# The interpreter keeps 16-bit floats as raw bits in dot/multiply, so it computes in fp32.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# nvfp4 unpacking through a PTX block (4 bytes -> 8 fp16 per block) instead of per-element ops
DEFAULT_UNPACK_ASM = True  # fastest on the H200 (docs/kernels.md)
DEFAULT_NV_LOAD = 2


@triton.jit
def _e2m1_pairs_asm(c):
    """uint8 code bytes -> (low-nibble, high-nibble) values as fp16 bit patterns (value *
    2**-14), four bytes per PTX block: a byte permute then and/shift/or on fp16x2 pairs."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, t, a, b;
        mov.b32 z, 0;
        prmt.b32 t, $4, z, 0x4140;
        and.b32 a, t, 0x00070007;
        shl.b32 a, a, 9;
        and.b32 b, t, 0x00080008;
        shl.b32 b, b, 12;
        or.b32 $0, a, b;
        and.b32 a, t, 0x00700070;
        shl.b32 a, a, 5;
        and.b32 b, t, 0x00800080;
        shl.b32 b, b, 8;
        or.b32 $2, a, b;
        prmt.b32 t, $4, z, 0x4342;
        and.b32 a, t, 0x00070007;
        shl.b32 a, a, 9;
        and.b32 b, t, 0x00080008;
        shl.b32 b, b, 12;
        or.b32 $1, a, b;
        and.b32 a, t, 0x00700070;
        shl.b32 a, a, 5;
        and.b32 b, t, 0x00800080;
        shl.b32 b, b, 8;
        or.b32 $3, a, b;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[c],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _load_halves(base, offs_n, kmask, FMT: tl.constexpr, D: tl.constexpr, SCALE_OFF: tl.constexpr,
                 SB: tl.constexpr, DT: tl.constexpr, MASKED: tl.constexpr, UNPACK_ASM: tl.constexpr = False,
                 NV_LOAD: tl.constexpr = 0):
    """Dequantized (lo, hi) halves [64, D/2] of one (page, K|V, head) block, in DT
    (nvfp4: times 2**-14). Rows with kmask False are zero when MASKED."""
    HALF: tl.constexpr = D // 2
    offs_c = tl.arange(0, HALF)
    m = kmask[:, None]
    if FMT == 0:
        p = base.to(tl.pointer_type(tl.bfloat16)) + offs_n[:, None] * D + offs_c[None, :]
        if MASKED:
            lo = tl.load(p, mask=m, other=0.0)
            hi = tl.load(p + HALF, mask=m, other=0.0)
        else:
            lo = tl.load(p)
            hi = tl.load(p + HALF)
        return lo.to(DT), hi.to(DT)
    elif FMT == 1:
        p = base + offs_n[:, None] * D + offs_c[None, :]
        if MASKED:
            lo = tl.load(p, mask=m, other=0)
            hi = tl.load(p + HALF, mask=m, other=0)
        else:
            lo = tl.load(p)
            hi = tl.load(p + HALF)
        return lo.to(tl.float8e4nv, bitcast=True).to(DT), hi.to(tl.float8e4nv, bitcast=True).to(DT)
    elif FMT == 2:
        p = base.to(tl.pointer_type(tl.int8)) + offs_n[:, None] * D + offs_c[None, :]
        if MASKED:
            lo = tl.load(p, mask=m, other=0)
            hi = tl.load(p + HALF, mask=m, other=0)
        else:
            lo = tl.load(p)
            hi = tl.load(p + HALF)
        return lo.to(DT), hi.to(DT)
    else:
        # nibble n -> fp16 bit pattern ((n & 7) << 9) | ((n & 8) << 12) = value * 2**-14 (exact
        # for every E2M1 x E4M3 product), times its block's E4M3 scale in fp16; the 2**14
        # goes into the global scale. NV_LOAD picks how the per-16 scale reaches each element:
        # 0: codes as [64, D/32, 16] so the scale broadcasts over the innermost axis;
        # 1: 2-D codes, every element loads its scale byte (L1 hits);
        # 2: 2-D codes, compact scale tile broadcast then reshaped.
        NB: tl.constexpr = D // 32
        offs_b = tl.arange(0, NB)
        if NV_LOAD == 0:
            offs_e = tl.arange(0, 16)
            p = base + offs_n[:, None, None] * HALF + offs_b[None, :, None] * 16 + offs_e[None, None, :]
            if MASKED:
                c = tl.load(p, mask=kmask[:, None, None], other=0)
            else:
                c = tl.load(p)
        else:
            p = base + offs_n[:, None] * HALF + offs_c[None, :]
            if MASKED:
                c = tl.load(p, mask=m, other=0)
            else:
                c = tl.load(p)
        if UNPACK_ASM:
            lo, hi = _e2m1_pairs_asm(c)
        else:
            ci = c.to(tl.int32)
            lo = (((ci & 7) << 9) | ((ci & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
            hi = (((ci & 0x70) << 5) | ((ci & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        if NV_LOAD == 1:
            sp = base + SCALE_OFF + offs_n[:, None] * SB + offs_c[None, :] // 16
        else:
            sp = base + SCALE_OFF + offs_n[:, None] * SB + offs_b[None, :]
        if MASKED:
            s_lo = tl.load(sp, mask=m, other=0)
            s_hi = tl.load(sp + NB, mask=m, other=0)
        else:
            s_lo = tl.load(sp)
            s_hi = tl.load(sp + NB)
        s_lo = s_lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s_hi = s_hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        if NV_LOAD == 0:
            lo = tl.reshape(lo * s_lo[:, :, None], [64, HALF])
            hi = tl.reshape(hi * s_hi[:, :, None], [64, HALF])
        elif NV_LOAD == 1:
            lo = lo * s_lo
            hi = hi * s_hi
        else:
            lo = lo * tl.reshape(tl.broadcast_to(s_lo[:, :, None], [64, NB, 16]), [64, HALF])
            hi = hi * tl.reshape(tl.broadcast_to(s_hi[:, :, None], [64, NB, 16]), [64, HALF])
        lo = lo.to(DT)
        hi = hi.to(DT)
        return lo, hi


@triton.jit
def paged_attention_fwd_kernel(
    q_ptr, out_ptr, opart_ptr, lse_ptr, cache_ptr, kscale_ptr, vscale_ptr,
    block_table_ptr, ctx_len_ptr, q_start_ptr, q_len_ptr, work_seq_ptr, work_row_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cp, stride_ckv, stride_ch, stride_bt,
    NUM_KV_HEADS,
    FMT: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr,
    SCALE_OFF: tl.constexpr, SB: tl.constexpr,
    BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_OUT: tl.constexpr,
    KDT: tl.constexpr, VDT: tl.constexpr, UNPACK_ASM: tl.constexpr, NV_LOAD: tl.constexpr,
    PRECISE_P: tl.constexpr, P_SCALE: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(work_seq_ptr + w)
    r0 = tl.load(work_row_ptr + w)
    ctx = tl.load(ctx_len_ptr + b)
    q_len = tl.load(q_len_ptr + b)
    q0 = tl.load(q_start_ptr + b)

    rows = r0 + tl.arange(0, BLOCK_M)
    t = rows // G
    head = kvh * G + rows % G
    row_ok = t < q_len
    q_pos = ctx - q_len + t
    t_max = tl.minimum((r0 + BLOCK_M - 1) // G, q_len - 1)
    kv_end = ctx - q_len + t_max + 1
    num_pages = tl.cdiv(kv_end, PAGE)
    pps = tl.cdiv(num_pages, NUM_SPLITS)
    p_lo = split * pps
    p_hi = tl.minimum(p_lo + pps, num_pages)

    offs_c = tl.arange(0, HALF)
    q_rows = q_ptr + (q0 + t).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_lo = tl.load(q_rows + offs_c[None, :], mask=row_ok[:, None], other=0.0).to(KDT)
    q_hi = tl.load(q_rows + HALF + offs_c[None, :], mask=row_ok[:, None], other=0.0).to(KDT)
    g_k = tl.load(kscale_ptr + kvh)
    g_v = tl.load(vscale_ptr + kvh)
    scale = qk_scale * g_k

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    offs_n = tl.arange(0, PAGE)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for p in range(p_lo, p_hi):
        page = tl.load(bt_row + p).to(tl.int64)
        kbase = cache_ptr + page * stride_cp + kvh * stride_ch
        vbase = kbase + stride_ckv
        k_pos = p * PAGE + offs_n
        k_ok = k_pos < kv_end
        k_lo, k_hi = _load_halves(kbase, offs_n, k_ok, FMT, D, SCALE_OFF, SB, KDT, False, UNPACK_ASM, NV_LOAD)
        s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
        if FMT == 2:
            ks = tl.load(kbase.to(tl.pointer_type(tl.float32)) + SCALE_OFF // 4 + offs_n)
            s = s * ks[None, :]
        s = s * scale
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc_lo = acc_lo * alpha[:, None]
        acc_hi = acc_hi * alpha[:, None]
        if FMT == 0 and VDT == tl.bfloat16:
            v_lo, v_hi = _load_halves(vbase, offs_n, k_ok, FMT, D, SCALE_OFF, SB, tl.bfloat16, True)
            p_big = pr.to(tl.bfloat16)
            p_res = (pr - p_big.to(tl.float32)).to(tl.bfloat16)
            acc_lo += tl.dot(p_big, v_lo) + tl.dot(p_res, v_lo)
            acc_hi += tl.dot(p_big, v_hi) + tl.dot(p_res, v_hi)
        else:
            v_lo, v_hi = _load_halves(vbase, offs_n, k_ok, FMT, D, SCALE_OFF, SB, VDT, True, UNPACK_ASM, NV_LOAD)
            # P (<= 1) is scaled by P_SCALE before the fp16 cast so that small probabilities
            # of long contexts stay normal fp16 numbers; 1 / P_SCALE is applied at the end
            if FMT == 2:
                vs = tl.load(vbase.to(tl.pointer_type(tl.float32)) + SCALE_OFF // 4 + offs_n, mask=k_ok, other=0.0)
                pw = pr * (vs * P_SCALE)[None, :]
            else:
                pw = pr * P_SCALE
            pr16 = pw.to(VDT)
            acc_lo += tl.dot(pr16, v_lo)
            acc_hi += tl.dot(pr16, v_hi)
            if PRECISE_P:
                # the fp16 rounding residual of P as a second product: split-K invariant to ~1e-7
                p_res = (pw - pr16.to(tl.float32)).to(VDT)
                acc_lo += tl.dot(p_res, v_lo)
                acc_hi += tl.dot(p_res, v_hi)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    inv_l = tl.where(l_i > 0, (g_v / P_SCALE) / l_safe, 0.0)
    o_lo = acc_lo * inv_l[:, None]
    o_hi = acc_hi * inv_l[:, None]
    if SPLIT_OUT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        part = (q0 + t).to(tl.int64) * (NUM_KV_HEADS * G) + head
        tl.store(lse_ptr + part * NUM_SPLITS + split, lse, mask=row_ok)
        o_rows = opart_ptr + (part * NUM_SPLITS + split)[:, None] * D
        tl.store(o_rows + offs_c[None, :], o_lo, mask=row_ok[:, None])
        tl.store(o_rows + HALF + offs_c[None, :], o_hi, mask=row_ok[:, None])
    else:
        o_rows = out_ptr + (q0 + t).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(o_rows + offs_c[None, :], o_lo.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(o_rows + HALF + offs_c[None, :], o_hi.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def merge_kernel(out_ptr, opart_ptr, lse_ptr, HQ, stride_ot, stride_oh,
                 D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    """out[t, h] = sum_s 2**(lse_s - max) o_s / sum_s 2**(lse_s - max)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    part = t.to(tl.int64) * HQ + h
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + part * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    wgt = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - mx), 0.0)
    offs_d = tl.arange(0, D)
    o = tl.load(opart_ptr + (part * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    res = tl.sum(o * wgt[:, None], axis=0) / tl.sum(wgt, axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def work_items(q_lens: list[int], group: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first row) of every row block: rows of sequence b are q_lens[b] * group."""
    seqs, starts = [], []
    for b, n in enumerate(q_lens):
        for r in range(0, n * group, block_m):
            seqs.append(b)
            starts.append(r)
    return (torch.tensor(seqs, dtype=torch.int32, device=device), torch.tensor(starts, dtype=torch.int32, device=device))


def pick_block_m(rows: int, max_block_m: int) -> int:
    return max(16, min(max_block_m, triton.next_power_of_2(max(rows, 1))))


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layout: KVLayout,
    global_scales: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    sm_scale: float,
    *,
    q_lens_host: list[int] | None = None,
    num_splits: int = 1,
    block_m: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    unpack_asm: bool | None = None,
    nv_load: int | None = None,
    precise_p: bool | None = None,
) -> torch.Tensor:
    """Same meaning as ``reference.paged_attention``.

    ``q_lens_host`` (the host copy of ``q_len``) avoids a device sync when ``work`` is not given.
    ``num_splits`` > 1 splits each sequence's pages (decode); ``work``/``scratch`` may be
    preallocated (CUDA graphs); ``out`` may be fp32 (for accuracy checks) or q's dtype.
    """
    total, hq, d = q.shape
    h = layout.num_kv_heads
    group = hq // h
    if hq % h or d != layout.head_dim:
        raise ValueError(f"q [{total}, {hq}, {d}] does not fit the layout ({h} KV heads, d={layout.head_dim})")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in the last dimension")
    lens = q_lens_host if q_lens_host is not None else [int(x) for x in q_len.tolist()]
    bm = block_m or pick_block_m(max(lens) * group, 64)
    if work is None:
        work = work_items(lens, group, bm, q.device)
    if out is None:
        out = torch.empty_like(q)
    gs = global_scales.to(torch.float32)
    if layout.fmt in (KVFormat.BF16, KVFormat.INT8):
        gs = torch.ones_like(gs)  # these formats ignore global scales
    elif layout.fmt is KVFormat.NVFP4:
        gs = gs * 16384.0  # E2M1 nibbles are read as fp16 patterns worth value * 2**-14
    kscale, vscale = gs[0].contiguous(), gs[1].contiguous()
    split_out = num_splits > 1
    if split_out:
        if scratch is None:
            scratch = (
                torch.empty(total * hq * num_splits * d, dtype=torch.float32, device=q.device),
                torch.empty(total * hq * num_splits, dtype=torch.float32, device=q.device),
            )
        opart, lse = scratch
    else:
        opart = lse = out
    nw = num_warps or (4 if bm <= 64 else 8)
    asm = (not INTERPRET and DEFAULT_UNPACK_ASM) if unpack_asm is None else (unpack_asm and not INTERPRET)
    ns = num_stages or 2
    grid = (work[0].numel(), h, num_splits)
    paged_attention_fwd_kernel[grid](
        q, out, opart, lse, cache, kscale, vscale,
        block_tables, context_lens, q_start, q_len, work[0], work[1],
        sm_scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), block_tables.stride(0),
        h,
        FMT=FMT_ID[layout.fmt], D=d, G=group, PAGE=layout.page_size,
        SCALE_OFF=layout.scale_offset, SB=max(layout.scale_bytes, 2),
        BLOCK_M=bm, NUM_SPLITS=num_splits, SPLIT_OUT=split_out,
        KDT=tl.float32 if INTERPRET else (tl.float16 if layout.fmt in (KVFormat.FP8, KVFormat.NVFP4) else tl.bfloat16),
        VDT=tl.float32 if INTERPRET else (tl.bfloat16 if layout.fmt is KVFormat.BF16 else tl.float16),
        UNPACK_ASM=asm,
        NV_LOAD=DEFAULT_NV_LOAD if nv_load is None else nv_load,
        PRECISE_P=(bm <= 64) if precise_p is None else precise_p,
        P_SCALE={KVFormat.BF16: 1.0, KVFormat.INT8: 4096.0}.get(layout.fmt, 32768.0),
        num_warps=nw, num_stages=ns,
    )
    if split_out:
        merge_kernel[(total, hq)](
            out, opart, lse, hq, out.stride(0), out.stride(1),
            D=d, NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
        )
    return out
