"""Triton paged attention over a quantized cache: decode, speculative verify and prefill.

One kernel family, the format a compile-time choice. A program owns ``BLOCK_M`` rows of
one sequence and one KV head, a row being a (query token, query head of that KV head's
group) pair — so all query heads sharing a KV head read each K/V page once (GQA grouping),
and the same kernel serves 1-16 token decode/verify (one row block) and long prefill chunks
(many row blocks). Grid: ``[work items, KV heads, splits]``; ``work_seq``/``work_row`` map a
work item to (sequence, first row). Key tiles are ``BN // 64`` whole pages (one, or two for
nvfp4 decode: ``default_pages_per_tile``); each tile's pages come from the block table, so
a tile may span two unrelated physical pages.

Split-K: split ``s`` of ``num_splits`` handles pages ``[s * pps, (s + 1) * pps)`` with
``pps`` = ``cdiv(pages needed by the block, num_splits)`` rounded up to whole tiles; with
``num_splits > 1`` each writes a normalized partial output and its log2-sum-exp, and
``merge_splits`` combines them. The grid depends only on batch shape and ``num_splits``
(never on context lengths), so a decode step can be captured in a CUDA graph with a fixed
maximum split count. For nvfp4 decode / verify the tiles run in two loops over the same tile
starts (``_attend_tile``): first those whose keys every row sees and that lie inside the
split, without masks, then the rest with the causal and split masks.

Softmax (``page_max``, default on): each tile's probabilities are taken relative to that
tile's own row maximum and its P V product starts from a zero accumulator; the running
state is rescaled in fp32. A tile therefore contributes the same bits whichever split it
falls in, which keeps split and unsplit results within ~1e-7 (tile boundaries are the same
for every split count). Prefill passes ``page_max=False``: the classic running maximum
with P V accumulated in place, which is cheaper and needs no split invariance. Each score
costs one fma and one exp2: the row maximum is taken before the scale (``scale > 0``) and
the exp2 argument carries the probabilities' fp16 factor (``P_LOG2``, below), which leaves
with ``l_i`` at the end. bf16 / fp8 / int8 decode and verify (row blocks up to 32) skip the
accumulator's rescale in tiles where no row's maximum grew (``alpha`` is then exactly 1).

Dequantization in registers, tensor cores for both products:
- K tiles become bf16 for bf16/int8 (exact) and meet bf16 Q; per-token int8 K scales and
  the global K scale multiply the fp32 scores.
- V tiles become fp16 (exact for fp8/int8/nvfp4) and meet fp16 probabilities (int8's
  per-token V scale is folded into them); bf16 V meets the probabilities split into a bf16
  high part and a bf16 residual (two products) so the result stays near fp32 accuracy.
  fp16 probabilities are scaled by 2**15 (int8: 2**12, as they carry V's scale, which must
  stay below 16: ``int8.SCALE_MAX``; ``P_LOG2``) so that small probabilities do not become fp16
  subnormals.
- K tiles are fp16 instead for fp8 and nvfp4 (Q is cast to fp16: post-norm queries are
  far inside its range): E4M3 converts to fp16 in hardware, and an nvfp4 element
  becomes the fp16 bit pattern ``sign << 15 | index << 9`` (= value * 2**-14),
  times its block's E4M3 scale in fp16 (exact); the 2**14 goes into the global scale.
- nvfp4 (``nv_load_k``/``nv_load_v``, see ``_load_halves``): K is unpacked straight into
  the tensor-core operand layout from the packed bytes (mode 2); V, whose operand runs
  along tokens while its bytes run along the head dim, is unpacked and scaled in its load
  layout by impure PTX blocks and reaches the tensor cores as an fp16 tile through
  shared memory (mode 5; mode 6, the halves one after the other, for 32-row blocks) —
  the compiler's alternative is one shared-memory load per byte.
- an fp16 workspace (``kv_dequant``: nvfp4 pages unpacked once for a long prefill chunk;
  ``dequantized=True``, internal format id 4) is read like bf16 pages but as fp16 K and V
  tiles with nvfp4's fp16 probabilities and global scales: no conversion in the loop.
Under ``TRITON_INTERPRET=1`` tiles are fp32 instead (the interpreter mishandles 16-bit
floats in dot products). Rows and columns are "halves" of the head dim (``[0, d/2)`` and
``[d/2, d)``), matching nvfp4's half-split packing, so nothing is ever interleaved.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.cuda_arch import capability
from deepwell.kernels.e4m3_unpack import e4m3_f16, has_fp8_conversion
from deepwell.kernels.kv_append.triton_kernel import FMT_ID
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout
from deepwell.kernels.paged_attention import nvfp4_ptx
from deepwell.kernels.paged_attention.reference import check_inputs

LOG2E = 1.4426950408889634
# The interpreter keeps 16-bit floats as raw bits in dot/multiply, so it computes in fp32.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# nvfp4 unpacking through a PTX block (4 bytes -> 8 fp16 per block) instead of per-element ops
DEFAULT_UNPACK_ASM = True  # fastest on the H200 (docs/kernels.md)
DEFAULT_NV_LOAD_K = 2
DEFAULT_NV_LOAD_V = 5
DEFAULT_NV_LOAD_V_32 = 6  # 32-row blocks (verify of 3-5 tokens: two-page tiles)


_PAIRS_PTX = tl.constexpr(nvfp4_ptx.pairs())
_LO_HALF_PTX = tl.constexpr(nvfp4_ptx.scaled_half(True))
_HI_HALF_PTX = tl.constexpr(nvfp4_ptx.scaled_half(False))


@triton.jit
def _e2m1_pairs_asm(c):
    """uint8 code bytes -> (low, high) elements as fp16 bit patterns (value * 2**-14), four
    bytes per PTX block (``nvfp4_ptx.pairs``: 9 instructions per 8 values)."""
    return tl.inline_asm_elementwise(asm=_PAIRS_PTX, constraints="=r,=r,=r,=r,r", args=[c],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _e2m1_scaled_half_asm(c, sc, HI: tl.constexpr):
    """One element set (the low elements, or the high ones when ``HI``) of uint8 code bytes as
    fp16, times the fp16 block scales ``sc`` (``mul.f16x2``, exact): the unpacking of
    ``_e2m1_pairs_asm`` for one half. Declared impure on purpose: the compiler then cannot
    re-create the dequantization in the tensor-core operand layout (which for V, whose
    operand runs along tokens, means one shared-memory byte load per code byte) and instead
    moves the finished fp16 tile through shared memory with (transposing) matrix loads.
    One half per call, so the two halves of a V tile can also be unpacked, multiplied and
    released one after the other (half the shared memory and registers held at once)."""
    if HI:
        ptx: tl.constexpr = _HI_HALF_PTX
    else:
        ptx: tl.constexpr = _LO_HALF_PTX
    return tl.inline_asm_elementwise(ptx, "=r,=r,r,r,r", [c, sc], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _e4m3_impure_asm(c):
    """E4M3 bytes -> fp16 (hardware ``cvt``, two per instruction), declared impure for the
    same reason as ``_e2m1_scaled_half_asm``: fp8 V then reaches the tensor cores as an fp16 tile
    through shared memory instead of one shared-memory load per byte."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }
        """,
        constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=False, pack=4,
    )


@triton.jit
def _v_scale_rows(vsbase, kmask, NB: tl.constexpr, BN: tl.constexpr, HI: tl.constexpr, MASKED: tl.constexpr):
    """nvfp4 V block scales [BN, NB] (uint8, the low or high half's blocks) of a tile's rows in
    token order, from the pages' block-major scale regions at ``vsbase`` [BN / 64] (bytes
    ``64 b + scale_slot(i)``, ``kv_formats.layout``): each region is read whole and contiguous
    (16-byte loads, which the pipeliner can stage), then its slots are relabelled as tokens.
    Rows with ``kmask`` False are 0 when ``MASKED`` (their bytes may be anything)."""
    P: tl.constexpr = BN // 64
    blk = tl.arange(0, NB) + (NB if HI else 0)
    slot = tl.arange(0, 64)
    t = tl.load(vsbase[:, None, None] + blk[None, :, None] * 64 + slot[None, None, :])  # [P, NB, 64]
    t = tl.permute(tl.reshape(t, [P, NB, 4, 8, 2]), (0, 3, 2, 4, 1))  # slot 16 a + 2 c + e: token 8 c + 2 a + e
    t = tl.reshape(t, [BN, NB])
    if MASKED:
        t = tl.where(kmask[:, None], t, 0)
    return t


@triton.jit
def _nvfp4_scale_pair(base, offs_n, kmask, cols, SCALE_OFF: tl.constexpr, SB: tl.constexpr, NB: tl.constexpr,
                      BN: tl.constexpr, MASKED: tl.constexpr, vsbase, BY_BLOCK: tl.constexpr):
    """(low, high) halves' block-scale bytes of a tile's rows: row-major regions at
    ``SCALE_OFF + offs_n * SB + cols`` (``cols``: block indices, per block [NB] or per element),
    or with ``BY_BLOCK`` (nvfp4 V) per block [BN, NB] from the block-major regions
    (``_v_scale_rows``)."""
    if BY_BLOCK:
        return _v_scale_rows(vsbase, kmask, NB, BN, False, MASKED), _v_scale_rows(vsbase, kmask, NB, BN, True, MASKED)
    sp = base[:, None] + SCALE_OFF + offs_n[:, None] * SB + cols[None, :]
    return _load_pair(sp, NB, kmask[:, None], MASKED)


@functools.lru_cache(maxsize=None)
def unpack_asm_for(cap: tuple[int, int], version: str = triton.__version__) -> bool:
    """Whether the unpacking PTX blocks (``_e2m1_pairs_asm``, ``_e2m1_scaled_half_asm``,
    ``_e4m3_impure_asm``) build for a GPU of compute capability ``cap`` with this Triton: not
    for datacenter Blackwell (10.x) before Triton 3.9 (3.6's sm_100 pipeline stops with an LLVM
    error on them; 3.9 builds them; ``benchmarks/triton_archs.py``), whose kernels then unpack
    with plain Triton operations (the interpreter's path: the same values). Cached: every
    launch asks."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return cap[0] != 10 or (major, minor) >= (3, 9)


@triton.jit
def _load_pair(p, step, m, MASKED: tl.constexpr):
    """``(p[...], p[... + step])``, zero where ``m`` is False when ``MASKED``."""
    if MASKED:
        a = tl.load(p, mask=m, other=0)
        b = tl.load(p + step, mask=m, other=0)
    else:
        a = tl.load(p)
        b = tl.load(p + step)
    return a, b


@triton.jit
def _load_nvfp4_half(base, offs_n, kmask, vsbase, D: tl.constexpr, DT: tl.constexpr, MASKED: tl.constexpr,
                     HI: tl.constexpr, BN: tl.constexpr, FP8_HW: tl.constexpr):
    """One half ([BN, D/2], low or high elements) of an nvfp4 V tile as in ``_load_halves``
    mode 5 (impure asm: the fp16 tile goes through shared memory), its block-major scales
    read at ``vsbase`` (``_v_scale_rows``)."""
    HALF: tl.constexpr = D // 2
    NB: tl.constexpr = D // 32
    p = base[:, None] + offs_n[:, None] * HALF + tl.arange(0, HALF)[None, :]
    sc = _v_scale_rows(vsbase, kmask, NB, BN, HI, MASKED)
    if MASKED:
        c = tl.load(p, mask=kmask[:, None], other=0)
    else:
        c = tl.load(p)
    sc = tl.reshape(tl.broadcast_to(e4m3_f16(sc, FP8_HW)[:, :, None], [BN, NB, 16]), [BN, HALF])
    return _e2m1_scaled_half_asm(c, sc, HI).to(DT)


@triton.jit
def _load_halves(base, offs_n, kmask, FMT: tl.constexpr, D: tl.constexpr, SCALE_OFF: tl.constexpr,
                 SB: tl.constexpr, DT: tl.constexpr, MASKED: tl.constexpr, UNPACK_ASM: tl.constexpr = False,
                 NV_LOAD: tl.constexpr = 0, BN: tl.constexpr = 64, vsbase=None, BY_BLOCK: tl.constexpr = False,
                 FP8_HW: tl.constexpr = True):
    """Dequantized (lo, hi) halves [BN, D/2] of ``BN`` cached tokens, in DT (nvfp4: times
    2**-14): row ``r`` is token ``offs_n[r]`` of the (page, K|V, head) block at byte pointer
    ``base[r]`` (one or two pages per tile). Rows with kmask False are zero when MASKED.
    ``BY_BLOCK`` (nvfp4 V): block scales block-major, read from the pages' scale regions at
    ``vsbase`` [BN / 64] (``_v_scale_rows``). ``FP8_HW``: E4M3 bytes (fp8 codes, nvfp4 block
    scales) through the hardware's conversion, else integer operations (``e4m3_f16``)."""
    HALF: tl.constexpr = D // 2
    offs_c = tl.arange(0, HALF)
    m = kmask[:, None]
    if FMT == 0 or FMT == 4:  # 4: an fp16 workspace of dequantized nvfp4 (``kv_dequant``)
        p = base.to(tl.pointer_type(tl.bfloat16 if FMT == 0 else tl.float16))[:, None] + offs_n[:, None] * D + offs_c[None, :]
        lo, hi = _load_pair(p, HALF, m, MASKED)
        return lo.to(DT), hi.to(DT)
    elif FMT == 1:
        p = base[:, None] + offs_n[:, None] * D + offs_c[None, :]
        lo, hi = _load_pair(p, HALF, m, MASKED)
        return e4m3_f16(lo, FP8_HW).to(DT), e4m3_f16(hi, FP8_HW).to(DT)
    elif FMT == 2:
        p = base.to(tl.pointer_type(tl.int8))[:, None] + offs_n[:, None] * D + offs_c[None, :]
        lo, hi = _load_pair(p, HALF, m, MASKED)
        return lo.to(DT), hi.to(DT)
    else:
        # element -> fp16 bit pattern sign << 15 | index << 9 = value * 2**-14 (exact for every
        # E2M1 x E4M3 product), times its block's E4M3 scale in fp16; the 2**14 goes into the
        # global scale. Code byte bits (page layout 3): low sign 7, low index 1-3, high index
        # 4-6, high sign 0. NV_LOAD picks how the per-16 scale reaches each element:
        # 0: codes as [BN, D/32, 16] so the scale broadcasts over the innermost axis;
        # 1: 2-D codes, every element loads its scale byte (L1 hits);
        # 2: 2-D codes, compact scale tile broadcast then reshaped;
        # 3: as 0, unpacking and scaling in one impure asm block (fp16 tile via shared memory);
        # 5: as 2, unpacking and scaling in one impure asm block (fp16 tile via shared memory);
        # 6 (V only, in the main loop): as 5, the two halves one after the other.
        # Without the asm (interpreter) 3 computes as 0 and 5 as 2.
        NB: tl.constexpr = D // 32
        offs_b = tl.arange(0, NB)
        if NV_LOAD == 0 or NV_LOAD == 3:
            offs_e = tl.arange(0, 16)
            p = base[:, None, None] + offs_n[:, None, None] * HALF + offs_b[None, :, None] * 16 + offs_e[None, None, :]
            if MASKED:
                c = tl.load(p, mask=kmask[:, None, None], other=0)
            else:
                c = tl.load(p)
        else:
            p = base[:, None] + offs_n[:, None] * HALF + offs_c[None, :]
            if MASKED:
                c = tl.load(p, mask=m, other=0)
            else:
                c = tl.load(p)
        if (NV_LOAD == 3 or NV_LOAD == 5) and UNPACK_ASM:
            s_lo, s_hi = _nvfp4_scale_pair(base, offs_n, kmask, offs_b, SCALE_OFF, SB, NB, BN, MASKED, vsbase,
                                           BY_BLOCK)
            s_lo = tl.broadcast_to(e4m3_f16(s_lo, FP8_HW)[:, :, None], [BN, NB, 16])
            s_hi = tl.broadcast_to(e4m3_f16(s_hi, FP8_HW)[:, :, None], [BN, NB, 16])
            if NV_LOAD == 5:  # codes are [BN, D/2]: so are their scales
                s_lo = tl.reshape(s_lo, [BN, HALF])
                s_hi = tl.reshape(s_hi, [BN, HALF])
            lo = _e2m1_scaled_half_asm(c, s_lo, False)
            hi = _e2m1_scaled_half_asm(c, s_hi, True)
            return tl.reshape(lo, [BN, HALF]).to(DT), tl.reshape(hi, [BN, HALF]).to(DT)
        if UNPACK_ASM:
            lo, hi = _e2m1_pairs_asm(c)
        else:
            ci = c.to(tl.int32)
            lo = ((ci & 0x8E) << 8).to(tl.int16).to(tl.float16, bitcast=True)
            hi = (((ci & 0x70) << 5) | ((ci & 1) << 15)).to(tl.int16).to(tl.float16, bitcast=True)
        if NV_LOAD == 1 and not BY_BLOCK:  # a scale byte per element (block-major ones: per block)
            s_lo, s_hi = _nvfp4_scale_pair(base, offs_n, kmask, offs_c // 16, SCALE_OFF, SB, NB, BN, MASKED, vsbase,
                                           BY_BLOCK)
        else:
            s_lo, s_hi = _nvfp4_scale_pair(base, offs_n, kmask, offs_b, SCALE_OFF, SB, NB, BN, MASKED, vsbase,
                                           BY_BLOCK)
        s_lo = e4m3_f16(s_lo, FP8_HW)
        s_hi = e4m3_f16(s_hi, FP8_HW)
        if BY_BLOCK and NV_LOAD == 1:  # per-block scales, spread over their 16 elements
            lo = lo * tl.reshape(tl.broadcast_to(s_lo[:, :, None], [BN, NB, 16]), [BN, HALF])
            hi = hi * tl.reshape(tl.broadcast_to(s_hi[:, :, None], [BN, NB, 16]), [BN, HALF])
        elif NV_LOAD == 0 or NV_LOAD == 3:
            lo = tl.reshape(lo * s_lo[:, :, None], [BN, HALF])
            hi = tl.reshape(hi * s_hi[:, :, None], [BN, HALF])
        elif NV_LOAD == 1:
            lo = lo * s_lo
            hi = hi * s_hi
        else:
            lo = lo * tl.reshape(tl.broadcast_to(s_lo[:, :, None], [BN, NB, 16]), [BN, HALF])
            hi = hi * tl.reshape(tl.broadcast_to(s_hi[:, :, None], [BN, NB, 16]), [BN, HALF])
        lo = lo.to(DT)
        hi = hi.to(DT)
        return lo, hi


@triton.jit
def _attend_tile(p, p_hi, sub, offs_n, bt_row, cache_ptr, stride_cp, stride_ckv, stride_ch, kvh, kv_end, q_pos, row_ok,
                 q_lo, q_hi, scale, acc_lo, acc_hi, m_i, l_i, ab, tab_ptr, tab_pages, inv_gk, FMT: tl.constexpr,
                 D: tl.constexpr,
                 SCALE_OFF: tl.constexpr, SB: tl.constexpr, KDT: tl.constexpr, VDT: tl.constexpr,
                 UNPACK_ASM: tl.constexpr, NV_LOAD_K: tl.constexpr, NV_LOAD_V: tl.constexpr, BN: tl.constexpr,
                 PAGE: tl.constexpr, P_LOG2: tl.constexpr, PAGE_MAX: tl.constexpr, MASKED: tl.constexpr,
                 LAZY: tl.constexpr, RD: tl.constexpr, RDP: tl.constexpr, FP8_HW: tl.constexpr):
    """One key tile (pages ``p .. p + BN/PAGE - 1``) folded into the running softmax state;
    without ``MASKED`` every key of the tile must be visible to every row and inside the split
    (dead rows then get finite values, which are never stored). ``RD`` > 0: K is centered per
    page (``kernels.page_center``): each page's ``q . c_P`` is added to its keys' scores, from
    the rows' query terms ``ab`` [BLOCK_M, RDP] and the page's row of ``tab_ptr`` [pages, RD];
    ``RD`` < 0: the same from precomputed page terms (``ab``: the rows' pointers at page 0,
    ``tab_pages`` the page stride)."""
    HALF: tl.constexpr = D // 2
    # BN // PAGE pages per tile; a page past this split's end repeats page p, masked
    pg = p + sub
    if MASKED:
        in_split = pg < p_hi
        page = tl.load(bt_row + tl.where(in_split, pg, p)).to(tl.int64)
    else:
        page = tl.load(bt_row + pg).to(tl.int64)
    kbase = cache_ptr + page * stride_cp + kvh * stride_ch
    vbase = kbase + stride_ckv
    vsbase = vbase  # placeholder: nvfp4 V's block scales come from per-page bases
    if FMT == 3:
        pg_t = p + tl.arange(0, BN // PAGE)
        if MASKED:
            pg_t = tl.where(pg_t < p_hi, pg_t, p)
        page_t = tl.load(bt_row + pg_t).to(tl.int64)
        vsbase = cache_ptr + page_t * stride_cp + kvh * stride_ch + stride_ckv + SCALE_OFF
    k_pos = pg * PAGE + offs_n
    if MASKED:
        k_ok = (k_pos < kv_end) & in_split
    else:
        k_ok = k_pos >= 0  # every key (the loads ignore it without MASKED)
    k_lo, k_hi = _load_halves(kbase, offs_n, k_ok, FMT, D, SCALE_OFF, SB, KDT, False, UNPACK_ASM, NV_LOAD_K, BN,
                              FP8_HW=FP8_HW)
    s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
    if FMT == 2:
        ks = tl.load(kbase.to(tl.pointer_type(tl.float32)) + SCALE_OFF // 4 + offs_n)
        s = s * ks[None, :]
    if RD < 0:  # the same from the precomputed page terms (``page_bias``): ab points at the rows'
        # entries of page 0 of this (sequence, KV head), tab_pages is the step from page to page
        for i in tl.static_range(BN // PAGE):
            pg_i = p + i
            if MASKED:
                pg_i = tl.where(pg_i < p_hi, pg_i, p)
            bias = tl.load(ab + pg_i.to(tl.int64) * tab_pages, mask=row_ok, other=0.0) * inv_gk
            s = s + tl.where((sub == i)[None, :], bias[:, None], 0.0)
    if RD > 0:  # K centered per page: q . c_P back, in the units of s (true score / g_k)
        offs_rd = tl.arange(0, RDP)
        for i in tl.static_range(BN // PAGE):
            pg_i = p + i
            if MASKED:
                pg_i = tl.where(pg_i < p_hi, pg_i, p)
            pg_i = tl.minimum(pg_i, tab_pages - 1)  # a context past the table (a caller's error) reads its last row
            cs = tl.load(tab_ptr + pg_i.to(tl.int64) * RD + offs_rd, mask=offs_rd < RD, other=0.0)
            bias = tl.sum(ab * cs[None, :], axis=1) * inv_gk
            s = s + tl.where((sub == i)[None, :], bias[:, None], 0.0)
    if MASKED:
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None] & in_split[None, :], s, float("-inf"))
    # scores in log2 units are s * scale (scale > 0, so the row max can be taken before the
    # multiply); P comes out times 2**P_LOG2 (fp16 V: small probabilities stay normal), so each
    # score costs one fma and one exp2, and l_i and the accumulator carry that factor
    m_pg = tl.max(s, axis=1) * scale
    m_new = tl.maximum(m_i, m_pg)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    if PAGE_MAX:
        # probabilities relative to this tile's own row max, so a tile's P (and its P V
        # product, accumulated from zero) is the same whichever split the tile falls in
        m_pg_use = tl.where(m_pg == float("-inf"), 0.0, m_pg)
        beta = tl.exp2(m_pg_use - m_use)
        pr = tl.exp2(s * scale - (m_pg_use - P_LOG2)[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1) * beta
    else:
        # classic running max: P V accumulates straight into the rescaled accumulator
        pr = tl.exp2(s * scale - (m_use - P_LOG2)[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc_lo = acc_lo * alpha[:, None]
        acc_hi = acc_hi * alpha[:, None]
    if FMT == 0 and VDT == tl.bfloat16:
        v_lo, v_hi = _load_halves(vbase, offs_n, k_ok, FMT, D, SCALE_OFF, SB, tl.bfloat16, MASKED, BN=BN)
        p_big = pr.to(tl.bfloat16)
        p_res = (pr - p_big.to(tl.float32)).to(tl.bfloat16)
        if PAGE_MAX:
            pv_lo = tl.dot(p_big, v_lo) + tl.dot(p_res, v_lo)
            pv_hi = tl.dot(p_big, v_hi) + tl.dot(p_res, v_hi)
        else:
            acc_lo += tl.dot(p_big, v_lo) + tl.dot(p_res, v_lo)
            acc_hi += tl.dot(p_big, v_hi) + tl.dot(p_res, v_hi)
    else:
        # P (<= 1) is already scaled by 2**P_LOG2 so that small probabilities stay normal
        # fp16 numbers; the factor leaves with l_i at the end
        if FMT == 2:
            vs = tl.load(vbase.to(tl.pointer_type(tl.float32)) + SCALE_OFF // 4 + offs_n, mask=k_ok, other=0.0)
            pr16 = (pr * vs[None, :]).to(VDT)
        else:
            pr16 = pr.to(VDT)
        if FMT == 1 and NV_LOAD_V >= 5 and UNPACK_ASM and FP8_HW:
            # fp8 V through the impure conversion (halves one after the other)
            vp = vbase[:, None] + offs_n[:, None] * D + tl.arange(0, HALF)[None, :]
            v_lo = _e4m3_impure_asm(tl.load(vp, mask=k_ok[:, None], other=0))
            pv_lo = tl.dot(pr16, v_lo)
            v_hi = _e4m3_impure_asm(tl.load(vp + HALF, mask=k_ok[:, None], other=0))
            pv_hi = tl.dot(pr16, v_hi)
            if not PAGE_MAX:
                acc_lo += pv_lo
                acc_hi += pv_hi
        elif FMT == 3 and NV_LOAD_V == 6 and UNPACK_ASM:
            # mode 6: as 5, the two halves one after the other
            v_lo = _load_nvfp4_half(vbase, offs_n, k_ok, vsbase, D, VDT, MASKED, False, BN, FP8_HW)
            pv_lo = tl.dot(pr16, v_lo)
            v_hi = _load_nvfp4_half(vbase, offs_n, k_ok, vsbase, D, VDT, MASKED, True, BN, FP8_HW)
            pv_hi = tl.dot(pr16, v_hi)
            if not PAGE_MAX:
                acc_lo += pv_lo
                acc_hi += pv_hi
        else:
            v_lo, v_hi = _load_halves(vbase, offs_n, k_ok, FMT, D, SCALE_OFF, SB, VDT, MASKED, UNPACK_ASM, NV_LOAD_V, BN,
                                      vsbase, FMT == 3, FP8_HW)
            if PAGE_MAX:
                pv_lo = tl.dot(pr16, v_lo)
                pv_hi = tl.dot(pr16, v_hi)
            else:
                acc_lo += tl.dot(pr16, v_lo)
                acc_hi += tl.dot(pr16, v_hi)
    if PAGE_MAX:
        if LAZY and tl.max((m_pg > m_i).to(tl.int32), axis=0) == 0:
            # no row's maximum grew, so alpha is exactly 1: the accumulator is left as is
            acc_lo = acc_lo + pv_lo * beta[:, None]
            acc_hi = acc_hi + pv_hi * beta[:, None]
        else:
            acc_lo = acc_lo * alpha[:, None] + pv_lo * beta[:, None]
            acc_hi = acc_hi * alpha[:, None] + pv_hi * beta[:, None]
    return acc_lo, acc_hi, m_new, l_i


@triton.jit(do_not_specialize=["win_lo", "win_hi"])
def paged_attention_fwd_kernel(
    q_ptr, out_ptr, opart_ptr, lse_ptr, cache_ptr, gscale_ptr,
    block_table_ptr, ctx_len_ptr, q_start_ptr, q_len_ptr, work_seq_ptr, work_row_ptr,
    ab_ptr, tab_ptr, tab_pages,
    qk_scale, win_lo, win_hi,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cp, stride_ckv, stride_ch, stride_bt, stride_abt, stride_abh,
    NUM_KV_HEADS,
    FMT: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr,
    SCALE_OFF: tl.constexpr, SB: tl.constexpr,
    BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_OUT: tl.constexpr,
    KDT: tl.constexpr, VDT: tl.constexpr, UNPACK_ASM: tl.constexpr, NV_LOAD_K: tl.constexpr,
    NV_LOAD_V: tl.constexpr, P_LOG2: tl.constexpr, BN: tl.constexpr, PAGE_MAX: tl.constexpr, LAZY: tl.constexpr,
    GS_MUL: tl.constexpr,
    UNIFORM_T: tl.constexpr, WPS: tl.constexpr, RD: tl.constexpr, RDP: tl.constexpr, PDL: tl.constexpr,
    FP8_HW: tl.constexpr = True,
):
    pdl.enter(PDL)
    HALF: tl.constexpr = D // 2
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if UNIFORM_T > 0:
        # decode/verify: every sequence has UNIFORM_T new tokens and WPS row blocks
        b = w // WPS
        r0 = (w % WPS) * BLOCK_M
        q_len = UNIFORM_T
        q0 = b * UNIFORM_T
    else:
        b = tl.load(work_seq_ptr + w)
        r0 = tl.load(work_row_ptr + w)
        q_len = tl.load(q_len_ptr + b)
        q0 = tl.load(q_start_ptr + b)
    ctx = tl.load(ctx_len_ptr + b)

    rows = r0 + tl.arange(0, BLOCK_M)
    t = rows // G
    head = kvh * G + rows % G
    row_ok = t < q_len
    q_pos = ctx - q_len + t
    t_max = tl.minimum((r0 + BLOCK_M - 1) // G, q_len - 1)
    kv_end = ctx - q_len + t_max + 1
    num_pages = tl.cdiv(kv_end, PAGE)
    # pages per split, a whole number of tiles so tiles start at the same pages whatever
    # the split count (which keeps split and unsplit results equal to ~1e-7)
    TILE_PAGES: tl.constexpr = BN // PAGE
    # the splits divide the caller's key window (absolute pages [win_lo, win_hi); all by default)
    p_end = tl.minimum(num_pages, win_hi)
    pps = tl.cdiv(tl.cdiv(tl.maximum(p_end - win_lo, 0), NUM_SPLITS), TILE_PAGES) * TILE_PAGES
    p_lo = win_lo + split * pps
    p_hi = tl.minimum(p_lo + pps, p_end)

    offs_c = tl.arange(0, HALF)
    q_rows = q_ptr + (q0 + t).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_lo = tl.load(q_rows + offs_c[None, :], mask=row_ok[:, None], other=0.0).to(KDT)
    q_hi = tl.load(q_rows + HALF + offs_c[None, :], mask=row_ok[:, None], other=0.0).to(KDT)
    if GS_MUL > 0:
        g_k = tl.load(gscale_ptr + kvh) * GS_MUL
        g_v = tl.load(gscale_ptr + NUM_KV_HEADS + kvh) * GS_MUL
    else:  # bf16 and int8 ignore global scales
        g_k = 1.0
        g_v = 1.0
    scale = qk_scale * g_k
    if RD > 0:  # the rows' query terms of K's per-page centering (A then B, kernels.page_center)
        offs_ab = tl.arange(0, RDP)
        ab = tl.load(ab_ptr + (q0 + t).to(tl.int64)[:, None] * stride_abt + head[:, None] * stride_abh
                     + offs_ab[None, :], mask=row_ok[:, None] & (offs_ab < RD)[None, :], other=0.0)
        inv_gk = 1.0 / g_k
    elif RD < 0:  # precomputed page terms [B, Hkv, W, N] (decode / verify: row = column t * G + g)
        ab = ab_ptr + (b * NUM_KV_HEADS + kvh).to(tl.int64) * stride_abt + rows
        inv_gk = 1.0 / g_k
    else:
        ab = 0.0
        inv_gk = 1.0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    offs_r = tl.arange(0, BN)
    offs_n = offs_r % PAGE
    sub = offs_r // PAGE
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    # tiles whose keys are all visible to every row and inside the split need no masks: the
    # loop over them skips the mask work; the rest (the tail: causal among the new tokens, a
    # tile's page past the split's end) follow masked. Tile starts are the same either way.
    # (nvfp4 decode / verify only: fp8 / int8 measured 0-4% slower with the second loop, bf16
    # the same; prefill keeps the single loop it was measured with)
    full_pages = (ctx - q_len + 1) // PAGE
    p_mid = p_lo
    if FMT == 3 and UNIFORM_T > 0:
        p_mid = p_lo + tl.maximum(tl.minimum(p_hi, full_pages) - p_lo, 0) // TILE_PAGES * TILE_PAGES
    for p in range(p_lo, p_mid, BN // PAGE):
        acc_lo, acc_hi, m_i, l_i = _attend_tile(
            p, p_hi, sub, offs_n, bt_row, cache_ptr, stride_cp, stride_ckv, stride_ch, kvh, kv_end, q_pos, row_ok,
            q_lo, q_hi, scale, acc_lo, acc_hi, m_i, l_i, ab, tab_ptr, tab_pages, inv_gk, FMT, D, SCALE_OFF, SB, KDT, VDT,
            UNPACK_ASM, NV_LOAD_K, NV_LOAD_V, BN, PAGE, P_LOG2, PAGE_MAX, False, LAZY, RD, RDP, FP8_HW)
    for p in range(p_mid, p_hi, BN // PAGE):
        acc_lo, acc_hi, m_i, l_i = _attend_tile(
            p, p_hi, sub, offs_n, bt_row, cache_ptr, stride_cp, stride_ckv, stride_ch, kvh, kv_end, q_pos, row_ok,
            q_lo, q_hi, scale, acc_lo, acc_hi, m_i, l_i, ab, tab_ptr, tab_pages, inv_gk, FMT, D, SCALE_OFF, SB, KDT, VDT,
            UNPACK_ASM, NV_LOAD_K, NV_LOAD_V, BN, PAGE, P_LOG2, PAGE_MAX, True, LAZY, RD, RDP, FP8_HW)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    inv_l = tl.where(l_i > 0, g_v / l_safe, 0.0)  # l_i and acc both carry 2**P_LOG2
    o_lo = acc_lo * inv_l[:, None]
    o_hi = acc_hi * inv_l[:, None]
    if SPLIT_OUT:
        lse = tl.where(l_i > 0, m_i + (tl.log2(l_safe) - P_LOG2), float("-inf"))
        part = (q0 + t).to(tl.int64) * (NUM_KV_HEADS * G) + head
        tl.store(lse_ptr + part * NUM_SPLITS + split, lse, mask=row_ok)
        o_rows = opart_ptr + (part * NUM_SPLITS + split)[:, None] * D
        if BLOCK_M >= 128:
            # fp32 [128, d/2] results stored in quarters of the head dim (H200, 4k chunk over a
            # 256k workspace: the kernel compiled with whole-half fp32 stores ran 10% slower, with
            # the same shared memory and registers; quarters ran as fast as bf16 outputs)
            QUART: tl.constexpr = HALF // 2
            offs_q = tl.arange(0, QUART)
            a, b2 = tl.split(tl.permute(tl.reshape(o_lo, [BLOCK_M, 2, QUART]), (0, 2, 1)))
            c, d2 = tl.split(tl.permute(tl.reshape(o_hi, [BLOCK_M, 2, QUART]), (0, 2, 1)))
            tl.store(o_rows + offs_q[None, :], a, mask=row_ok[:, None])
            tl.store(o_rows + QUART + offs_q[None, :], b2, mask=row_ok[:, None])
            tl.store(o_rows + HALF + offs_q[None, :], c, mask=row_ok[:, None])
            tl.store(o_rows + HALF + QUART + offs_q[None, :], d2, mask=row_ok[:, None])
        else:
            tl.store(o_rows + offs_c[None, :], o_lo, mask=row_ok[:, None])
            tl.store(o_rows + HALF + offs_c[None, :], o_hi, mask=row_ok[:, None])
    else:
        o_rows = out_ptr + (q0 + t).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(o_rows + offs_c[None, :], o_lo.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(o_rows + HALF + offs_c[None, :], o_hi.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def merge_kernel(out_ptr, opart_ptr, lse_ptr, HQ, stride_ot, stride_oh,
                 D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                 PDL: tl.constexpr):
    """out[t, h, d-block] = sum_s 2**(lse_s - max) o_s / sum_s 2**(lse_s - max); one program per
    (token, head, ``BLOCK_D`` head-dim values)."""
    pdl.enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    part = t.to(tl.int64) * HQ + h
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + part * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    wgt = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - mx), 0.0)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    o = tl.load(opart_ptr + (part * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    den = tl.sum(wgt, axis=0)
    # a row that sees no key in any split (only if q_len > context_len, which the reference
    # rejects) comes out as zeros, as without splits, instead of 0 / 0
    res = tl.sum(o * wgt[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def merge_splits(out: torch.Tensor, opart: torch.Tensor, lse: torch.Tensor, num_splits: int) -> None:
    """``out`` [tokens, heads, d] from the split-K partials ``opart`` / ``lse`` (``merge_kernel``).
    Fewer than 1024 (token, head) rows (small batches, many splits): a program per 32 head-dim
    values, so the partials are read by many SMs at once (H200, 128k x 1, 99 splits, d = 256:
    the whole-row merge took 3.2 of the call's 52.5 us); otherwise a program per row, as always
    under the interpreter, which pays per program (the same values: each is its own sum)."""
    total, hq, d = out.shape
    block_d = d if total * hq >= 1024 or INTERPRET else 32
    merge_kernel[(total, hq, d // block_d)](
        out, opart, lse, hq, out.stride(0), out.stride(1),
        D=d, NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        **pdl.launch_kwargs(out.device, "merge"),
    )


def host_int32(device: torch.device | str, *rows: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Host integer lists as int32 tensors on ``device``. On CUDA one pinned buffer, copied
    without blocking (``torch.tensor(..., device="cuda")`` synchronizes the stream: the GPU then
    idled while the host launched the rest of each prefill call, 0.8-1.1 ms of a 4k chunk over
    64k on the H200), each list starting on a 16-byte boundary of it."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return tuple(torch.tensor(list(r), dtype=torch.int32, device=dev) for r in rows)
    offs, flat = [], []
    for r in rows:
        offs.append(len(flat))
        flat.extend(r)
        flat.extend([0] * (-len(flat) % 4))
    buf = torch.tensor(flat or [0], dtype=torch.int32).pin_memory().to(dev, non_blocking=True)
    return tuple(buf[o:o + len(r)] for o, r in zip(offs, rows))


def work_items(q_lens: Sequence[int], group: int, block_m: int, device: torch.device | str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first row) of every row block: rows of sequence b are q_lens[b] * group.
    Cached per shape and stream (every layer of a step asks the same; the copy is ordered on the
    stream it was made on): read-only."""
    return _work_items(tuple(int(n) for n in q_lens), group, block_m, torch.device(device), stream_key(device))


def stream_key(device: torch.device | str) -> int:
    """The current stream of a CUDA device (0 elsewhere): part of the key of cached device
    tensors made by non-blocking copies."""
    dev = torch.device(device)
    return torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0


@functools.lru_cache(maxsize=64)
def _work_items(q_lens: tuple[int, ...], group: int, block_m: int, device: torch.device, stream: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    seqs, starts = [], []
    for b, n in enumerate(q_lens):
        for r in range(0, n * group, block_m):
            seqs.append(b)
            starts.append(r)
    seq_t, start_t = host_int32(device, seqs, starts)
    return seq_t, start_t


def default_pages_per_tile(layout: KVLayout, block_m: int) -> int:
    """Two pages per key tile for nvfp4 decode/verify (row blocks up to 32), one otherwise:
    fastest measured on the H200 (docs/kernels.md)."""
    return 2 if layout.fmt is KVFormat.NVFP4 and block_m <= 32 else 1


def pick_block_m(rows: int, max_block_m: int) -> int:
    return max(16, min(max_block_m, triton.next_power_of_2(max(rows, 1))))


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layout: KVLayout,
    global_scales: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    q_start: torch.Tensor | None,
    q_len: torch.Tensor | None,
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
    nv_load_k: int | None = None,
    nv_load_v: int | None = None,
    pages_per_tile: int | None = None,
    page_max: bool = True,
    uniform_t: int = 0,
    max_registers: int | None = None,
    dequantized: bool = False,
    key_pages: tuple[int, int] | None = None,
    partial: tuple[torch.Tensor, torch.Tensor] | None = None,
    page_center: tuple[torch.Tensor, torch.Tensor] | None = None,
    page_bias: torch.Tensor | None = None,
    fp8_hw: bool | None = None,
) -> torch.Tensor:
    """Same meaning as ``reference.paged_attention`` (Q already in the K space).

    ``dequantized``: ``cache`` is an fp16 workspace written by ``kv_dequant`` from an nvfp4
    cache (``layout`` its bf16-geometry layout, ``kv_dequant.workspace_layout``; values are
    the nvfp4 values / g * 2**-14, exact) and ``global_scales`` are the nvfp4 cache's.

    ``q_lens_host`` (the host copy of ``q_len``) avoids a device sync when ``work`` is not given.
    ``uniform_t`` > 0 (decode/verify: every sequence has that many new tokens, stored back to
    back) needs neither ``q_start``/``q_len`` nor ``work``: the kernel derives them, so one
    call is exactly the attention kernel (plus the merge when split) and CUDA-graph
    capturable. ``num_splits`` > 1 splits each sequence's pages (decode); ``scratch`` may be
    preallocated (CUDA graphs); ``out`` may be fp32 (for accuracy checks) or q's dtype.
    ``global_scales`` must be contiguous fp32 ``[2, Hkv]``. ``max_registers`` caps registers
    per thread (``ptxas`` ``maxnreg``: more programs per SM, possibly spills). ``q_len`` must
    not exceed ``context_lens`` (the reference raises; checking here would need a device
    sync): a query row that sees no key comes out as zeros, split or not.

    ``key_pages=(lo, hi)``: only the keys in pages ``[lo, hi)`` of every sequence (absolute
    page indices, causal masking as always; the splits divide that window) — one segment of a
    context whose pieces are attended one at a time (the backend's segmented workspace).
    ``partial=(o, lse)`` (fp32, contiguous, ``[tokens, Hq, num_splits, d]`` and ``[tokens,
    Hq, num_splits]``): the splits' results are left unmerged there — each ``o`` normalized
    over the keys its split saw and ``lse`` their log2-sum-exp (``-inf`` and zeros where it saw
    none), what ``merge_partials`` folds into a running result — and ``out`` is not written.

    ``page_center=(ab, table)``: the cache holds K centered per page (``kernels.page_center``);
    ``ab`` fp32 ``[tokens, Hq, r]`` are the rows' query terms (``PageCenter.query_terms`` of the
    unrotated queries), ``table`` fp32 ``[max_pages, r]`` (``PageCenter.table``, which must cover
    every key's page — the appends refuse positions past it — not checked here: that would read
    the context lengths back; a page past it reads the table's last row, never out of bounds).
    Each page's ``q . c_P`` joins its keys' scores, so the result is the attention over the
    uncentered keys (reference: ``page_center=``). ``page_bias`` instead (decode / verify,
    ``uniform_t`` >= 1): those terms precomputed, fp32 ``[B, Hkv, >= W, >= T * G]`` in true score
    units (``page_bias.page_bias`` with ``scale = 1``; column ``t * G + g``): one load per row
    and page instead of an ``r``-term sum.

    ``fp8_hw``: E4M3 bytes (fp8 codes, nvfp4 block scales) to fp16 by the hardware's conversion
    (default where the device has one: ``fp8_hw``), else by integer operations (``e4m3_f16``;
    the same values).
    """
    check_inputs(q, cache, layout, global_scales, block_tables, context_lens,
                 None if uniform_t else q_start, None if uniform_t else q_len)
    if dequantized and layout.fmt is not KVFormat.BF16:
        raise ValueError(f"a dequantized workspace has the bf16 page geometry, got a {layout.fmt.value} layout")
    total, hq, d = q.shape
    h = layout.num_kv_heads
    group = hq // h
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in the last dimension")
    if uniform_t and total != block_tables.shape[0] * uniform_t:
        raise ValueError(f"uniform_t={uniform_t}: q must hold {uniform_t} tokens per block-table row "
                         f"({block_tables.shape[0] * uniform_t}), got {total}")
    if not uniform_t and (q_start is None or q_len is None):
        raise ValueError("q_start and q_len are required unless uniform_t > 0")
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.stride(-1) != 1 or out.device != q.device
                            or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"out must be a float32/bfloat16/float16 tensor shaped like q {list(q.shape)} on "
                         f"{q.device} with a contiguous last dimension, got {out.dtype} {list(out.shape)}")
    if uniform_t:
        lens = [uniform_t]
    else:
        lens = q_lens_host if q_lens_host is not None else [int(x) for x in q_len.tolist()]
    bm = block_m or pick_block_m(max(lens) * group, 64)
    wps = triton.cdiv(uniform_t * group, bm) if uniform_t else 0
    if uniform_t:
        if q_start is None:
            q_start = q_len = context_lens  # unused: the kernel derives them from uniform_t
        work = (context_lens, context_lens)  # unused pointers
        n_work = block_tables.shape[0] * wps
    else:
        if work is None:
            work = work_items(lens, group, bm, q.device)
        n_work = work[0].numel()
    if out is None:
        out = torch.empty_like(q)
    if not global_scales.is_contiguous():  # (dtype and shape: check_inputs)
        raise ValueError("global scales must be contiguous float32 [2, num_kv_heads]")
    # the kernel reads g itself; nvfp4 elements are fp16 patterns worth value * 2**-14
    gs_mul = 16384.0 if dequantized else {KVFormat.BF16: 0.0, KVFormat.INT8: 0.0, KVFormat.NVFP4: 16384.0}.get(layout.fmt, 1.0)
    if key_pages is not None and not 0 <= key_pages[0] <= key_pages[1]:
        raise ValueError(f"key_pages must be (lo, hi) with 0 <= lo <= hi, got {key_pages}")
    win_lo, win_hi = key_pages if key_pages is not None else (0, 1 << 30)
    win_hi = min(win_hi, 1 << 30)
    if partial is not None:
        po, pl = partial
        want_o, want_l = [total, hq, num_splits, d], [total, hq, num_splits]
        if (po.dtype != torch.float32 or pl.dtype != torch.float32 or list(po.shape) != want_o
                or list(pl.shape) != want_l or not po.is_contiguous() or not pl.is_contiguous()
                or po.device != q.device or pl.device != q.device):
            raise ValueError(f"partial must be contiguous float32 tensors {want_o} and {want_l} on {q.device}")
    split_out = num_splits > 1 or partial is not None
    if partial is not None:
        scratch = partial
    if split_out:
        if scratch is None:
            scratch = (
                torch.empty(total * hq * num_splits * d, dtype=torch.float32, device=q.device),
                torch.empty(total * hq * num_splits, dtype=torch.float32, device=q.device),
            )
        opart, lse = scratch
        need = total * hq * num_splits
        if (opart.dtype != torch.float32 or lse.dtype != torch.float32 or opart.numel() < need * d
                or lse.numel() < need or not opart.is_contiguous() or not lse.is_contiguous()):
            raise ValueError(f"scratch must be contiguous float32 tensors of at least {need * d} and {need} "
                             f"elements for {num_splits} splits, got {opart.numel()} and {lse.numel()}")
    else:
        opart = lse = out
    if page_bias is not None:  # precomputed page terms (decode / verify)
        if page_center is not None or uniform_t < 1:
            raise ValueError("page_bias is for decode / verify (uniform_t >= 1) and replaces page_center")
        want = (block_tables.shape[0], h)
        if (page_bias.dtype != torch.float32 or page_bias.dim() != 4 or not page_bias.is_contiguous()
                or tuple(page_bias.shape[:2]) != want or page_bias.shape[2] < block_tables.shape[1]
                or page_bias.shape[3] < uniform_t * group or page_bias.device != q.device):
            raise ValueError(f"page_bias must be contiguous float32 [{want[0]}, {h}, >= {block_tables.shape[1]}, "
                             f">= {uniform_t * group}] on {q.device}, got {page_bias.dtype} {list(page_bias.shape)}")
        ab, table, r = page_bias, page_bias, -1
    elif page_center is not None:
        ab, table = page_center
        r = table.shape[1] if table.dim() == 2 else -1
        if (ab.dtype != torch.float32 or table.dtype != torch.float32 or ab.dim() != 3 or ab.shape[:2] != q.shape[:2]
                or ab.shape[2] != r or r < 2 or ab.stride(-1) != 1 or not table.is_contiguous()
                or ab.device != q.device or table.device != q.device):
            raise ValueError(f"page_center must be float32 (ab [{total}, {hq}, r], table [pages, r]) on {q.device} "
                             f"with ab's last dimension and the table contiguous")
    else:
        ab, table, r = out, out, 0  # placeholders (unused)
    nw = num_warps or (4 if bm <= 64 else 8)
    asm = (not INTERPRET and DEFAULT_UNPACK_ASM) if unpack_asm is None else (unpack_asm and not INTERPRET)
    asm = asm and (q.device.type != "cuda" or unpack_asm_for(capability(q.device)))
    # fastest measured on the H200 (docs/kernels.md): 2 stages; nvfp4 V in mode 5, except
    # mode 6 for 32-row blocks (with their two-page tiles mode 5 needs ~127 KB of shared memory)
    ns = num_stages or 2
    if nv_load_v is None:
        nv_load_v = DEFAULT_NV_LOAD_V_32 if 16 < bm <= 32 else DEFAULT_NV_LOAD_V
    grid = (n_work, h, num_splits)
    paged_attention_fwd_kernel[grid](
        q, out, opart, lse, cache, global_scales,
        block_tables, context_lens, q_start, q_len, work[0], work[1],
        ab, table, table.shape[0] if r > 0 else (ab.shape[3] if r < 0 else 1),
        sm_scale * LOG2E, win_lo, win_hi,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), block_tables.stride(0),
        ab.stride(0) if r > 0 else (ab.stride(1) if r < 0 else 0), ab.stride(1) if r > 0 else 0,
        h,
        FMT=4 if dequantized else FMT_ID[layout.fmt], D=d, G=group, PAGE=layout.page_size,
        SCALE_OFF=layout.scale_offset, SB=max(layout.scale_bytes, 2),
        BLOCK_M=bm, NUM_SPLITS=num_splits, SPLIT_OUT=split_out,
        KDT=tl.float32 if INTERPRET else (tl.float16 if dequantized or layout.fmt in (KVFormat.FP8, KVFormat.NVFP4)
                                          else tl.bfloat16),
        VDT=tl.float32 if INTERPRET else (tl.bfloat16 if layout.fmt is KVFormat.BF16 and not dequantized else tl.float16),
        UNPACK_ASM=asm,
        FP8_HW=has_fp8_conversion(q.device) if fp8_hw is None else fp8_hw,
        NV_LOAD_K=DEFAULT_NV_LOAD_K if nv_load_k is None else nv_load_k,
        NV_LOAD_V=nv_load_v,
        BN=layout.page_size * (pages_per_tile or default_pages_per_tile(layout, bm)),
        PAGE_MAX=page_max,
        # skip the accumulator's rescale in tiles where no row's maximum grew (exact): bf16 /
        # fp8 / int8 decode and verify measured 0-7% faster on the H200, nvfp4 0-1% slower;
        # with wgmma-sized row blocks the branch made triton 3.6's pipeliner fail (docs/kernels.md)
        LAZY=page_max and layout.fmt is not KVFormat.NVFP4 and bm <= 32,
        GS_MUL=gs_mul,
        UNIFORM_T=uniform_t, WPS=wps, RD=r, RDP=triton.next_power_of_2(r) if r > 0 else 1,
        P_LOG2=15.0 if dequantized else {KVFormat.BF16: 0.0, KVFormat.INT8: 12.0}.get(layout.fmt, 15.0),
        num_warps=nw, num_stages=ns, **({"maxnreg": max_registers} if max_registers else {}),
        **pdl.launch_kwargs(q.device, "attention"),
    )
    if split_out and partial is None:
        merge_splits(out, opart, lse, num_splits)
    return out


def merge_partials(o: torch.Tensor, lse: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor) -> None:
    """Fold partial results of more keys into the running result ``(o, lse)`` in place: ``o``
    fp32 ``[tokens, Hq, d]`` normalized, ``lse`` ``[tokens, Hq]`` its log2-sum-exp (start from
    zeros and ``-inf``); ``(o_new, lse_new)`` ``[tokens, Hq, S, d]`` / ``[tokens, Hq, S]`` as
    ``paged_attention(..., partial=...)`` leaves them. The result is the attention over all the
    keys seen, zeros and ``-inf`` where none was. Plain torch: a few passes over the rows."""
    m = torch.maximum(lse, lse_new.amax(-1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp2(lse - m)  # 0 where lse is -inf
    wb = torch.exp2(lse_new - m[..., None])
    tot = wa + wb.sum(-1)
    seen = tot > 0
    safe = torch.where(seen, tot, torch.ones_like(tot))
    inv = torch.where(seen, 1.0 / safe, torch.zeros_like(tot))
    o.mul_((wa * inv)[..., None]).add_(torch.einsum("thsd,ths->thd", o_new, wb * inv[..., None]))
    lse.copy_(torch.where(seen, m + torch.log2(safe), torch.full_like(tot, float("-inf"))))
