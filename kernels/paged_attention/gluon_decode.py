"""nvfp4 / fp8 / int8 paged decode attention in Gluon (Hopper): keys as the rows of the tensor-core products.

Same meaning as ``reference.paged_attention`` for ``T`` query tokens per sequence (decode,
or verify with a causal mask among them), nvfp4, fp8 and int8 caches with head_dim 128 or 256 and
``T`` x (query heads per KV head) <= 32 (the backend's choice for every such shape on Hopper:
``TritonBackend.uses_gluon``; T = 1-5 for the 27B layout). A program owns one (sequence, KV
head, split); each loop iteration one 64-token page:

- raw page bytes (K and V codes and block scales) arrive in shared memory through
  ``cp.async`` ``STAGES - 1`` pages ahead of use (a ring of ``STAGES`` buffers), so each
  program keeps its own memory latency covered instead of relying on a second program;
- ``Sᵀ = K·Qᵀ`` is a warpgroup MMA with the 64 keys as rows (M = 64) and the (query token,
  query head) pairs of the KV head as the N columns (8, 16 or 32, padded). K is unpacked from the page bytes straight into the A operand's
  registers: thread ``c`` of a quad holds 32 consecutive code bytes of a row, and the MMA's
  reduction index ``p`` is a permutation of the head dim (``_k_perm``) that Q, staged once in
  shared memory, follows too, so no value moves between threads. K's high half is unpacked
  while the low half's MMA runs, and V's low half while both do (no wait in between);
- ``Oᵀ = Vᵀ·Pᵀ``: at head_dim 256 (``V_REGS``) V is unpacked (fp16, times its block scales)
  straight into the A operand's registers: each thread loads four consecutive code bytes of
  each of its 16 keys, and the rows of ``Oᵀ`` are the head dim in the order that makes those
  bytes the thread's own rows (``_v_a_operand``; relabelled back before the output stores,
  ``_rows_in_d_order``), so no value moves between threads and V never touches shared
  memory again (H200: 4-6% faster decode, 32 KB less shared memory). V's block scales are
  block-major in the page (``kv_formats.layout.scale_slot``), so each thread's sixteen keys of
  a block are one 16-byte shared-memory load (``_v_block_scales``; 2-3% faster than sixteen
  single bytes). Otherwise (head_dim 128)
  V is unpacked in a row layout, stored to shared memory and read by the MMA as an MN-major
  A operand. ``Pᵀ`` goes through shared memory as the B operand;
- accumulation: the tensor cores round their fp32 accumulation toward zero, so adding page
  after page into one MMA accumulator drifts low (~2**-24 per page, 1.1e-4 after the 2048
  pages of a 128k sequence: split invariance lost). Each page's ``Oᵀ`` is therefore a fresh
  MMA added into the running sums with rounded fp32 FMAs (``FLUSH = 0``), or, where those
  registers would cost a program per SM (16 columns), the MMA accumulates ``FLUSH`` pages
  that are then added into fp32 sums in shared memory;
- softmax: each page's probabilities are relative to that page's own maximum rounded up to an
  integer (log2 units), so a page's fp16 ``P`` has the same bits in every split (split
  invariance to ~1e-7, not fp16's ~1e-4); they are scaled by an exact power of two to the
  running reference (an integer too) before the fp16 rounding, and the accumulator by another
  before ``Vᵀ·Pᵀ`` adds into it in the MMA (no second accumulator: 16-32 columns fit).

A layer whose K is centered per page (``kernels.page_center``) passes ``page_bias``: each page's
``q . c_P`` per column in log2 units, precomputed by one small launch
(``paged_attention.page_bias``), joins the column's page maximum and its exponent offset.

An E2M1 element becomes the fp16 pattern ``sign << 15 | index << 9`` (value * 2**-14; one mask
of the code word for the low elements, four operations for the high ones: page layout 3,
``kv_formats.nvfp4``) times its block's E4M3 scale in fp16 (exact); 2**14 and the global scales go into the fp32
score scale and the output scale. Probabilities are fp16 times 2**15 (``P_LOG2``).
Split-K writes normalized partial outputs and log2-sum-exps for ``triton_kernel.merge_splits``.

fp8 and int8 (``FMT`` 1 and 2; nvfp4 is 0): a row's ``d`` code bytes are copied as two
``[64, d/2]`` tiles, the halves of the head dim, which take the places of nvfp4's low and
high elements (the same registers, Q order and ``Vᵀ`` rows); each byte converts to fp16
exactly (E4M3: ``cvt.rn.f16x2.e4m3x2``; int8's -127..127), no block scales. fp8: V's codes
past the context are zeroed on the last page (an E4M3 byte can be NaN, which a zero
probability does not cancel); the global scales go into the score and output scales as for
nvfp4. int8: each key's fp32 token scale (copied with the page) multiplies its score row after
the MMA and V's multiplies its probability row before the fp16 rounding (``P_LOG2_INT8``; zero
past the context), the global scales are ignored (the format's rule). H200, 27B layout: fp8 /
int8 at 82-95% of HBM at batch x context >= 1M tokens against the Triton kernel's 53-64%
(docs/kernels.md).
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from deepwell.kernels import pdl
from deepwell.kernels.cuda_arch import capability
from deepwell.kernels.kv_formats import int8
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout
from deepwell.kernels.paged_attention import nvfp4_ptx
from deepwell.kernels.paged_attention.reference import check_inputs

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
P_LOG2 = 15.0
MAX_COLS = 32  # query tokens x query heads per KV head: the MMA's N (registers: O is [d, N] fp32)


@gluon.constexpr_function
def _j_basis(row, j):
    """3-D basis [row, block, byte-in-block] of code byte ``j`` of row ``row``."""
    return [row, j // 16, j % 16]


@gluon.constexpr_function
def _k_codes_layout(CB):
    """K code bytes [64 rows, CB // 16 blocks, 16] as the A operand wants them, in byte terms.

    Thread (warp w, lane l) holds rows ``16 w + l // 4`` and ``+ 8`` and, with ``c = l % 4``,
    bytes ``j = (CB / 4) c + 4 kc + 2 ihi + ilo`` of each; register order ilo, ihi, kc0, kc1,
    row + 8, kc2.. (four consecutive bytes first: one 32-bit word per unpack)."""
    nkc = CB // 16
    kc_bits = [1 << b for b in range(nkc.bit_length() - 1)]
    regs = [[0, 0, 1], [0, 0, 2]]
    regs += [_j_basis(0, 4 * k) for k in kc_bits[:2]]
    regs += [[8, 0, 0]]
    regs += [_j_basis(0, 4 * k) for k in kc_bits[2:]]
    lanes = [_j_basis(0, (CB // 4) * c) for c in (1, 2)] + [[1, 0, 0], [2, 0, 0], [4, 0, 0]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[[16, 0, 0], [32, 0, 0]],
                                      block_bases=[], shape=[64, CB // 16, 16])


@gluon.constexpr_function
def _k_codes_layout_2d(CB):
    """``_k_codes_layout`` over [64 rows, CB bytes]."""
    l3 = _k_codes_layout(CB)
    flat = lambda bs: [[r, 16 * blk + w] for r, blk, w in bs]
    return gl.DistributedLinearLayout(reg_bases=flat(l3.reg_bases), lane_bases=flat(l3.lane_bases),
                                      warp_bases=flat(l3.warp_bases), block_bases=[], shape=[64, CB])


@gluon.constexpr_function
def _v_codes_layout(CB):
    """V code bytes [64 rows, CB // 16 blocks, 16]: eight consecutive bytes per thread."""
    nb = CB // 16
    return gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[32 // (2 * nb), nb, 2],
                            warps_per_cta=[4, 1, 1], order=[2, 1, 0])


@gluon.constexpr_function
def _v_pair_layout(CB, PAIRED):
    """V code bytes [64 keys, CB // 16 blocks, 16] for ``Vᵀ`` as the A operand in registers
    (CB = 128). ``PAIRED``: register order key bit 0, byte bit 0, keys 8/16/32, byte bit 1 --
    the A operand's own (rows = bytes in ``_v_a_operand``'s order, reduction index = keys), so the
    two keys of an fp16x2 register come from one unpack; otherwise the four consecutive bytes
    of a key first (one 32-bit shared-memory load each; the conversion between the two only
    moves bytes within a thread). Lanes: keys 2/4 and bytes 4/8/16; warps: bytes 32/64."""
    regs = [[1, 0, 0], [0, 0, 1], [8, 0, 0], [16, 0, 0], [32, 0, 0], [0, 0, 2]]
    if not PAIRED:
        regs = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0]]
    lanes = [[2, 0, 0], [4, 0, 0], [0, 0, 4], [0, 0, 8], [0, 1, 0]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[[0, 2, 0], [0, 4, 0]],
                                      block_bases=[], shape=[64, CB // 16, 16])


@gluon.constexpr_function
def _v_pair_layout_2d(CB):
    """``_v_pair_layout(CB, False)`` over [64 keys, CB bytes]."""
    l3 = _v_pair_layout(CB, False)
    flat = lambda bs: [[r, 16 * blk + w] for r, blk, w in bs]
    return gl.DistributedLinearLayout(reg_bases=flat(l3.reg_bases), lane_bases=flat(l3.lane_bases),
                                      warp_bases=flat(l3.warp_bases), block_bases=[], shape=[64, CB])


@gluon.constexpr_function
def _out_layout(CB, N):
    """``Oᵀ`` [CB, N] after ``_rows_in_d_order``: the accumulator's own threads and registers,
    registers ordered so that each thread's four consecutive head-dim rows come first."""
    regs = [[1, 0], [2, 0], [0, 1]] + [[0, 8 << k] for k in range((N // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2], [0, 4], [4, 0], [8, 0], [16, 0]],
                                      warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[CB, N])


@gluon.jit
def _rows_in_d_order(x, CB: gl.constexpr, N: gl.constexpr, out_l: gl.constexpr):
    """``Oᵀ`` [CB, N] with V from registers has row ``m = 64 b1 + 32 b6 + 16 b5 + 8 b0 + (b2-4)``
    for head-dim byte ``b`` (``_v_a_operand``): relabel to head-dim order (no data moves)."""
    x = gl.reshape(x, [2, 2, 2, 2, 8, N])
    x = gl.reshape(gl.permute(x, (1, 2, 4, 0, 3, 5)), [CB, N])
    return gl.convert_layout(x, out_l, assert_trivial=True)


@gluon.jit
def _v_a_operand(x, CB: gl.constexpr, a_l: gl.constexpr):
    """[64 keys, NB, 16] fp16 in ``_v_pair_layout`` -> ``Vᵀ`` [CB rows, 64 keys] as the A operand,
    row ``64 b1 + 32 b6 + 16 b5 + 8 b0 + (b2-4)`` for byte ``b``: the same registers, only the
    labels change."""
    x = gl.permute(gl.reshape(x, [64, CB]), (1, 0))
    x = gl.reshape(x, [2, 2, 8, 2, 2, 64])  # byte = 64 b6 + 32 b5 + 4 (b2-4) + 2 b1 + b0
    x = gl.reshape(gl.permute(x, (3, 0, 1, 4, 2, 5)), [CB, 64])  # row = 64 b1 + 32 b6 + 16 b5 + 8 b0 + (b2-4)
    return gl.convert_layout(x, a_l, assert_trivial=True)


@gluon.constexpr_function
def _copy_layout(width, vec):
    """cp.async of a [64, width] byte tile, ``vec`` bytes per thread and copy."""
    tpr = width // vec
    return gl.BlockedLayout(size_per_thread=[1, vec], threads_per_warp=[32 // tpr, tpr], warps_per_cta=[4, 1],
                            order=[1, 0])


def _k_perm(cb: int) -> list[int]:
    """Byte (= head-dim index within a half) of MMA reduction index ``p``: the inverse view of
    ``_k_codes_layout`` (p = 16 kc + 8 ihi + 2 c + ilo <-> j = (cb / 4) c + 4 kc + 2 ihi + ilo)."""
    out = []
    for p in range(cb):
        kc, ihi, c, ilo = p // 16, (p // 8) % 2, (p // 2) % 4, p % 2
        out.append((cb // 4) * c + 4 * kc + 2 * ihi + ilo)
    return out


# a code word's low / high elements as fp16 pairs times their scales (nvfp4_ptx)
_ASM_LO = gl.constexpr(nvfp4_ptx.scaled_half(True))
_ASM_HI = gl.constexpr(nvfp4_ptx.scaled_half(False))


@gluon.jit
def _unpack_half(c, sc, HI: gl.constexpr):
    """code bytes -> fp16 values * 2**-14 of their low (``HI`` False: head-dim ``j``) or high
    elements (``j + d/2``), times their fp16 block scales ``sc`` (same shape, broadcast)."""
    return gl.inline_asm_elementwise(asm=_ASM_HI if HI else _ASM_LO, constraints="=r,=r,r,r,r", args=[c, sc],
                                     dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _pow2(e):
    """2**e for integer-valued e <= 0, exactly (0 below 2**-126, and for -inf): ``e + 2**23 +
    127`` is exact and holds ``e + 127`` in its low mantissa bits, which the shift moves into
    the exponent field (no float-to-int conversion, a quarter-rate instruction)."""
    x = (gl.maximum(e, -127.0) + 8388735.0).to(gl.int32, bitcast=True)
    return (x << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _issue_page(cache_ptr, bt_ptr, b, pg, stage, kc_s, ks_s, vc_s, vs_s,
                stride_bt, stride_cp, stride_ckv, stride_ch, kvh,
                CB: gl.constexpr, SB: gl.constexpr, SCALE_OFF: gl.constexpr, FMT: gl.constexpr):
    page = gl.load(bt_ptr + b.to(gl.int64) * stride_bt + pg).to(gl.int64)
    base = cache_ptr + page * stride_cp + kvh * stride_ch
    cl: gl.constexpr = _copy_layout(CB, 16)
    if FMT != 0:  # rows of 2 CB code bytes: each half of the head dim to its own tile
        r2 = gl.arange(0, 64, layout=gl.SliceLayout(1, cl))
        c2 = gl.arange(0, CB, layout=gl.SliceLayout(0, cl))
        offs2 = gl.expand_dims(r2, 1) * (2 * CB) + gl.expand_dims(c2, 0)
        async_copy.async_copy_global_to_shared(kc_s.index(2 * stage), base + offs2)
        async_copy.async_copy_global_to_shared(kc_s.index(2 * stage + 1), base + CB + offs2)
        async_copy.async_copy_global_to_shared(vc_s.index(2 * stage), base + stride_ckv + offs2)
        async_copy.async_copy_global_to_shared(vc_s.index(2 * stage + 1), base + stride_ckv + CB + offs2)
        if FMT == 2:  # int8: K's and V's fp32 token scales, one per thread (K's 64, then V's, in ks_s)
            sl1: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4],
                                                 order=[0])
            j = gl.arange(0, 128, layout=sl1)
            sp = base + SCALE_OFF + (j // 64).to(gl.int64) * stride_ckv + (j % 64) * 4
            async_copy.async_copy_global_to_shared(ks_s.index(stage), sp.to(gl.pointer_type(gl.float32)))
    else:
        sl: gl.constexpr = _copy_layout(SB, 8)
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, cl))
        cc = gl.arange(0, CB, layout=gl.SliceLayout(0, cl))
        offs = gl.expand_dims(r, 1) * CB + gl.expand_dims(cc, 0)
        rs = gl.arange(0, 64, layout=gl.SliceLayout(1, sl))
        cs = gl.arange(0, SB, layout=gl.SliceLayout(0, sl))
        offs_s = SCALE_OFF + gl.expand_dims(rs, 1) * SB + gl.expand_dims(cs, 0)
        async_copy.async_copy_global_to_shared(kc_s.index(stage), base + offs)
        async_copy.async_copy_global_to_shared(ks_s.index(stage), base + offs_s)
        async_copy.async_copy_global_to_shared(vc_s.index(stage), base + stride_ckv + offs)
        # V's scale region is block-major ([SB blocks, 64 slots], kv_formats.layout.scale_slot)
        vl: gl.constexpr = _copy_layout(64, SB // 2)
        rv = gl.arange(0, SB, layout=gl.SliceLayout(1, vl))
        cv = gl.arange(0, 64, layout=gl.SliceLayout(0, vl))
        offs_vs = SCALE_OFF + gl.expand_dims(rv, 1) * 64 + gl.expand_dims(cv, 0)
        async_copy.async_copy_global_to_shared(vs_s.index(stage), base + stride_ckv + offs_vs)


# four int8 codes (one 32-bit word) -> two fp16 pairs: the byte ``x + 128`` under the fp16 high
# byte 0x64 is the fp16 number 1024 + x + 128, exactly, so one xor, two byte permutes and two
# half-precision subtractions of 1152 (0x6480) convert four codes (the compiler's conversion
# takes an I2F and ~2 byte moves per code: 1001 instructions per page against 652 for fp8)
_ASM_INT8 = gl.constexpr(
    "{ .reg .b32 u, a, b, c; xor.b32 u, $2, 0x80808080; mov.b32 c, 0x64806480; "
    "prmt.b32 a, u, 0x64646464, 0x4140; prmt.b32 b, u, 0x64646464, 0x4342; "
    "sub.rn.f16x2 $0, a, c; sub.rn.f16x2 $1, b, c; }")


@gluon.jit
def _bytes_f16(c, FMT: gl.constexpr):
    """fp8 (``FMT`` 1) / int8 (2) code bytes -> fp16 values, exactly (E4M3 and -127..127 are
    fp16 numbers; NaN codes stay NaN)."""
    if FMT == 1:
        return c.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    else:
        return gl.inline_asm_elementwise(asm=_ASM_INT8, constraints="=r,=r,r", args=[c], dtype=gl.float16,
                                         is_pure=True, pack=4)


@gluon.jit
def _byte_rows(tile, valid, l2: gl.constexpr, l3: gl.constexpr, MASK: gl.constexpr, FMT: gl.constexpr):
    """A half's fp8 / int8 V code bytes [64 keys, CB] from shared memory -> [64, NB, 16] in
    ``l3``; fp8 with ``MASK``: keys >= ``valid`` (past the context, whatever their bytes: 0x7F
    is NaN, and a zero probability does not cancel it in the MMA) become code 0 (int8 codes are
    finite and those keys' probabilities are zeroed with their token scales)."""
    NB: gl.constexpr = tile.shape[1] // 16
    c = gl.convert_layout(gl.reshape(tile.load(l2), [64, NB, 16]), l3)
    if MASK and FMT == 1:
        row = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
        c = gl.where(gl.expand_dims(gl.expand_dims(row < valid, 1), 2), c, 0)
    return c


@gluon.jit
def _scales_fp16(lo, hi):
    """E4M3 block-scale bytes [64, NB] (low half's blocks, high half's) -> fp16 [64, NB, 1]."""
    return (gl.expand_dims(lo.to(gl.float8e4nv, bitcast=True).to(gl.float16), 2),
            gl.expand_dims(hi.to(gl.float8e4nv, bitcast=True).to(gl.float16), 2))


@gluon.jit
def _block_scales(sc, NB: gl.constexpr, l3: gl.constexpr):
    """K's block scales [64, 2 NB] (row-major) in shared memory -> fp16 [64, NB, 1] per half in
    the codes' layout ``l3``. Never masked: a row past the context only reaches its own
    score, which the score mask replaces."""
    return _scales_fp16(sc.slice(0, NB, dim=1).load(gl.SliceLayout(2, l3)),
                        sc.slice(NB, NB, dim=1).load(gl.SliceLayout(2, l3)))


@gluon.constexpr_function
def _v_scales_view(NB):
    """Half of V's block-major scale region of a page (NB blocks x 64 slots) as [64 keys, NB]:
    the key of slot bits 0-5 is bits 0, 3, 4, 5, 1, 2 (``kv_formats.layout.scale_slot``),
    then come the blocks."""
    keys = [[1, 0], [8, 0], [16, 0], [32, 0], [2, 0], [4, 0]]
    return gl.SharedLinearLayout(offset_bases=keys + [[0, 1 << k] for k in range(NB.bit_length() - 1)])


@gluon.jit
def _v_block_scales(sc, valid, NB: gl.constexpr, l3: gl.constexpr, MASK: gl.constexpr):
    """V's block scales from its block-major scale region [2 NB, 64] (low half's blocks, high
    half's): [64, NB, 1] fp16 per half in the codes' layout ``l3``. With ``_v_pair_layout`` each thread's
    sixteen keys of a block are sixteen consecutive bytes (one 16-byte load)."""
    view: gl.constexpr = _v_scales_view(NB)
    lo = sc.slice(0, NB, dim=0)._reinterpret(gl.uint8, [64, NB], view).load(gl.SliceLayout(2, l3))
    hi = sc.slice(NB, NB, dim=0)._reinterpret(gl.uint8, [64, NB], view).load(gl.SliceLayout(2, l3))
    if MASK:  # rows >= valid (past the context, whatever their bytes) get scale 0
        row = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
        ok = gl.expand_dims(row < valid, 1)
        lo = gl.where(ok, lo, 0)
        hi = gl.where(ok, hi, 0)
    return _scales_fp16(lo, hi)


@gluon.jit
def _split_pages(ctx, split, NUM_SPLITS: gl.constexpr):
    """(first page, page count) of split ``split`` of a ``ctx``-token sequence."""
    n_pages = gl.cdiv(ctx, 64)
    pps = gl.cdiv(n_pages, NUM_SPLITS)
    p_begin = split * pps
    return p_begin, gl.maximum(gl.minimum(p_begin + pps, n_pages) - p_begin, 0)


@gluon.jit
def decode_kernel(
    q_ptr, out_ptr, opart_ptr, lse_ptr, cache_ptr, gscale_ptr, bt_ptr, ctx_ptr, perm_ptr, bias_ptr,
    qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cp, stride_ckv, stride_ch, stride_bt, H, W_BIAS,
    D: gl.constexpr, G: gl.constexpr, SCALE_OFF: gl.constexpr,
    NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, P_SHIFT: gl.constexpr,
    T: gl.constexpr, N: gl.constexpr, V_REGS: gl.constexpr, FLUSH: gl.constexpr, PDL: gl.constexpr,
    FMT: gl.constexpr = 0, PC: gl.constexpr = False,
):
    pdl.enter(PDL)
    CB: gl.constexpr = D // 2
    SB: gl.constexpr = D // 16
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    hq = H * G

    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)

    # raw page ring: K and V codes swizzled by 16-byte chunks (both are read down rows: a
    # warp's V loads span four keys 128 bytes apart, four-way bank conflicts unswizzled)
    kc_lay: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=128 // CB, max_phase=CB // 16, order=[1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    # fp8 / int8: a row's 2 CB bytes as two [64, CB] tiles per stage (the halves of the head
    # dim, as nvfp4's low and high elements); no block scales (``vs_s`` a placeholder; int8's
    # token scales in ``ks_s``, fp8's ``ks_s`` a placeholder)
    if FMT != 0:
        kc_s = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, 64, CB], kc_lay)
        vc_s = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, 64, CB], kc_lay)
        if FMT == 2:
            flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
            ks_s = gl.allocate_shared_memory(gl.float32, [STAGES, 128], flat)  # K's 64, then V's
        else:
            ks_s = kc_s
        vs_s = vc_s
    else:
        kc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, CB], kc_lay)
        vc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, CB], kc_lay)
        ks_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, SB], plain)
        vs_s = gl.allocate_shared_memory(gl.uint8, [STAGES, SB, 64], plain)
    if not V_REGS:
        vt_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, CB], gl.float16)
        vt_s = gl.allocate_shared_memory(gl.float16, [2, 64, CB], vt_lay)
    q_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, CB], gl.float16)
    q_s = gl.allocate_shared_memory(gl.float16, [2, N, CB], q_lay)  # the low and high halves of the head dim
    p_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, 64], gl.float16)
    p_s = gl.allocate_shared_memory(gl.float16, [N, 64], p_lay)
    o_s = p_s  # placeholders where unused (``_page``)
    if V_REGS:
        vt_s = p_s
    if FLUSH > 0:  # the sums of the flushed accumulators (each thread its own elements)
        o_s = gl.allocate_shared_memory(gl.float32, [2, CB, N], plain)
        o_s.index(0).store(gl.zeros([CB, N], gl.float32, layout=acc_l))
        o_s.index(1).store(gl.zeros([CB, N], gl.float32, layout=acc_l))

    ctx = gl.load(ctx_ptr + b)
    p_begin, n = _split_pages(ctx, split, NUM_SPLITS)
    bias_row = bias_ptr  # PC: the [W_BIAS, N] page terms of this (sequence, KV head) (``page_bias``)
    if PC:
        bias_row = bias_ptr + (b * H + kvh).to(gl.int64) * W_BIAS * N

    for pre in gl.static_range(STAGES - 1):
        if pre < n:
            _issue_page(cache_ptr, bt_ptr, b, p_begin + pre, pre, kc_s, ks_s, vc_s, vs_s,
                        stride_bt, stride_cp, stride_ckv, stride_ch, kvh, CB, SB, SCALE_OFF, FMT)
        async_copy.commit_group()

    # Q (fp16, the MMA's reduction order) into shared memory once
    ql: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                        order=[1, 0])
    nq = gl.arange(0, N, layout=gl.SliceLayout(1, ql))  # column n: query token n // G, head n % G
    pp = gl.arange(0, CB, layout=gl.SliceLayout(0, ql))
    dj = gl.load(perm_ptr + pp)
    qtok = (b * T + gl.expand_dims(nq // G, 1)).to(gl.int64)
    qrow = q_ptr + qtok * stride_qt + (kvh * G + gl.expand_dims(nq % G, 1)) * stride_qh
    qmask = gl.expand_dims(nq < T * G, 1) & gl.expand_dims(pp < CB, 0)
    q_s.index(0).store(gl.load(qrow + gl.expand_dims(dj, 0), mask=qmask, other=0.0).to(gl.float16))
    q_s.index(1).store(gl.load(qrow + CB + gl.expand_dims(dj, 0), mask=qmask, other=0.0).to(gl.float16))

    if FMT == 2:  # int8 ignores the global scales (token scales instead)
        gk = 1.0
        gv = 1.0
    else:
        gk = gl.load(gscale_ptr + kvh)
        gv = gl.load(gscale_ptr + H + kvh)
    UNIT: gl.constexpr = 16384.0 if FMT == 0 else 1.0  # nvfp4's fp16 values are E2M1 * 2**-14
    s_scale = qk_scale * gk * UNIT

    m_i = gl.full([N], float("-inf"), gl.float32, layout=col_l)
    l_r = gl.zeros([64, N], gl.float32, layout=acc_l)  # per-row partial sums, times P_SHIFT (one reduction at the end)
    m_o = gl.full([N], float("-inf"), gl.float32, layout=col_l)  # the reference of o_s's sums
    acc_lo = gl.zeros([CB, N], gl.float32, layout=acc_l)
    acc_hi = gl.zeros([CB, N], gl.float32, layout=acc_l)
    zero_o = gl.zeros([CB, N], gl.float32, layout=acc_l)

    # The tensor cores' fp32 accumulation rounds toward zero: adding page after page into the
    # MMA's accumulator leaves it ~2**-24 low per page (1.1e-4 after the 2048 pages of a 128k
    # sequence, split invariance lost). FLUSH = 0: each page's Oᵀ is a fresh MMA added into
    # the accumulators with rounded fp32 FMAs; FLUSH > 0 (for registers' sake): the MMA
    # accumulates FLUSH pages, then they are added into o_s (rescaled exactly to ``m_i``).
    # Pages that every query token sees in full come first, without masks (H200: 3-5% faster
    # decode), then the last one or two with them.
    n_full = gl.minimum(gl.maximum((ctx - T + 1) // 64 - p_begin, 0), n)
    # PC at T = 1: each page's terms are loaded one page ahead (the first one here; H200, A/B:
    # 128k x 1 51.3 -> 49.7 us, 0.7-3% elsewhere at T = 1; T = 2 / 4 measured 1-8% slower so,
    # they load each page's own at the page)
    pcol = gl.arange(0, N, layout=col_l)
    if PC and T == 1:
        pb = gl.load(bias_row + p_begin * N + pcol, mask=(pcol >= 0) & (n > 0), other=0.0)
    else:
        pb = gl.zeros([N], gl.float32, layout=col_l)
    for i in range(0, n_full):
        m_i, l_r, m_o, acc_lo, acc_hi, pb = _page(
            i, n, p_begin, ctx, b, kvh, cache_ptr, bt_ptr, stride_bt, stride_cp, stride_ckv, stride_ch,
            kc_s, ks_s, vc_s, vs_s, q_s, p_s, vt_s, o_s, s_scale, m_i, l_r, m_o, acc_lo, acc_hi, zero_o, bias_row,
            pb, CB, SB, SCALE_OFF, STAGES, P_SHIFT, T, G, N, V_REGS, FLUSH, False, FMT, PC)
    for i in range(n_full, n):
        m_i, l_r, m_o, acc_lo, acc_hi, pb = _page(
            i, n, p_begin, ctx, b, kvh, cache_ptr, bt_ptr, stride_bt, stride_cp, stride_ckv, stride_ch,
            kc_s, ks_s, vc_s, vs_s, q_s, p_s, vt_s, o_s, s_scale, m_i, l_r, m_o, acc_lo, acc_hi, zero_o, bias_row,
            pb, CB, SB, SCALE_OFF, STAGES, P_SHIFT, T, G, N, V_REGS, FLUSH, True, FMT, PC)

    async_copy.wait_group(0)
    if FLUSH > 0:
        m_o = _flush(o_s, 0, acc_lo, acc_hi, m_o, m_i, acc_l)
        acc_lo = o_s.index(0).load(acc_l)
        acc_hi = o_s.index(1).load(acc_l)
    l_i = gl.sum(l_r, axis=0) * (1.0 / P_SHIFT)
    out_scale = gv * UNIT / P_SHIFT
    den = gl.where(l_i > 0, l_i, 1.0)
    o_scale = gl.expand_dims(out_scale / den, 0)
    o_lo = acc_lo * o_scale
    o_hi = acc_hi * o_scale
    if V_REGS:  # rows back in head-dim order, four consecutive per thread (16-byte stores)
        out_l: gl.constexpr = _out_layout(CB, N)
        o_lo = _rows_in_d_order(o_lo, CB, N, out_l)
        o_hi = _rows_in_d_order(o_hi, CB, N, out_l)
    else:
        out_l: gl.constexpr = acc_l
    d_lo = gl.arange(0, CB, layout=gl.SliceLayout(1, out_l))
    gg = gl.arange(0, N, layout=gl.SliceLayout(0, out_l))
    omask = gl.expand_dims(gg < T * G, 0) & gl.expand_dims(d_lo < CB, 1)
    otok = b.to(gl.int64) * T + gg // G
    if NUM_SPLITS == 1:
        orow = out_ptr + gl.expand_dims(otok * stride_ot + (kvh * G + gg % G) * stride_oh, 0)
        gl.store(orow + gl.expand_dims(d_lo, 1), o_lo.to(out_ptr.dtype.element_ty), mask=omask)
        gl.store(orow + CB + gl.expand_dims(d_lo, 1), o_hi.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        part = (otok * hq + kvh * G + gg % G) * NUM_SPLITS + split
        prow = opart_ptr + gl.expand_dims(part, 0) * D
        gl.store(prow + gl.expand_dims(d_lo, 1), o_lo, mask=omask)
        gl.store(prow + CB + gl.expand_dims(d_lo, 1), o_hi, mask=omask)
        gg_l = gl.arange(0, N, layout=col_l)
        lse = gl.where(l_i > 0, m_i + gl.log2(den), float("-inf"))
        gl.store(lse_ptr + (b.to(gl.int64) * T + gg_l // G) * hq * NUM_SPLITS + (kvh * G + gg_l % G) * NUM_SPLITS
                 + split, lse, mask=gg_l < T * G)


@gluon.jit
def _page(i, n, p_begin, ctx, b, kvh, cache_ptr, bt_ptr, stride_bt, stride_cp, stride_ckv, stride_ch,
          kc_s, ks_s, vc_s, vs_s, q_s, p_s, vt_s, o_s, s_scale, m_i, l_r, m_o, acc_lo, acc_hi, zero_o, bias_row,
          pb, CB: gl.constexpr, SB: gl.constexpr, SCALE_OFF: gl.constexpr, STAGES: gl.constexpr,
          P_SHIFT: gl.constexpr, T: gl.constexpr, G: gl.constexpr, N: gl.constexpr,
          V_REGS: gl.constexpr, FLUSH: gl.constexpr, MASK: gl.constexpr, FMT: gl.constexpr, PC: gl.constexpr):
    """Page ``i`` of the program's ``n``: issue the copy of page ``i + STAGES - 1``, then
    scores, softmax and ``Oᵀ`` for this one. ``MASK`` False (every page but the last one or
    two): every query token sees all 64 keys, so neither the scores nor V's block scales (fp8:
    V's codes) are masked; ``vt_s`` / ``o_s`` are placeholders where ``V_REGS`` / ``FLUSH``
    leave them unused. ``PC``: K is centered per page; ``bias_row[page * N + n]`` is column
    ``n``'s ``q . c_P`` in log2 units (``page_bias``), added to the column's page maximum and
    taken out of its exponent offset (per column: nothing per score); at ``T`` = 1 ``pb`` holds
    this page's terms, loaded one page ahead. Returns the running state (m_i, l_r, m_o, acc_lo,
    acc_hi) and the next page's terms (``pb`` itself unless ``PC`` at ``T`` = 1)."""
    NB: gl.constexpr = CB // 16
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    kl3: gl.constexpr = _k_codes_layout(CB)
    kl2: gl.constexpr = _k_codes_layout_2d(CB)
    vl3: gl.constexpr = _v_codes_layout(CB)
    vl2: gl.constexpr = _copy_layout(CB, 8)
    vp3: gl.constexpr = _v_pair_layout(CB, True)
    vp2: gl.constexpr = _v_pair_layout_2d(CB)

    nxt = i + STAGES - 1
    if nxt < n:
        _issue_page(cache_ptr, bt_ptr, b, p_begin + nxt, nxt % STAGES, kc_s, ks_s, vc_s, vs_s,
                    stride_bt, stride_cp, stride_ckv, stride_ch, kvh, CB, SB, SCALE_OFF, FMT)
    async_copy.commit_group()
    async_copy.wait_group(STAGES - 1)
    gl.thread_barrier()
    st = i % STAGES
    pb_next = pb
    if PC:  # T = 1: the next page's terms (``pb`` holds this page's, loaded one page ahead); T > 1:
        # this page's, before the unpacks (H200: through the page ring instead measured slower
        # for nvfp4, 51.3 -> 58.2 us at 128k x 1, 561 -> 631 us at T = 4 128k x 8)
        pcol = gl.arange(0, N, layout=gl.SliceLayout(0, acc_l))
        if T == 1:
            pb_next = gl.load(bias_row + (p_begin + i + 1) * N + pcol, mask=(pcol >= 0) & (i + 1 < n), other=0.0)
        else:
            pb = gl.load(bias_row + (p_begin + i) * N + pcol)
    # zero (the loop runs only for ctx > 0) but not to the compiler, and different in every
    # iteration as far as it knows: the MMAs' shared-memory descriptors are then built in
    # uniform registers each page instead of being hoisted into ~40 ordinary ones (H200:
    # 168 -> 123 registers; verify 255 with spills -> 237 without, T = 4 4-8% faster)
    zi = (i + ctx < 0).to(gl.int32)
    q_lo = q_s.index(zi)
    q_hi = q_s.index(zi + 1)
    if not V_REGS:
        vt_lo = vt_s.index(zi)
        vt_hi = vt_s.index(zi + 1)
    first = (p_begin + i) * 64
    valid = ctx - first  # keys of this page: rows < valid

    # K: bytes -> A operand registers, block scales never masked (``_block_scales``; fp8 /
    # int8: a row past the context only reaches its own score, whatever its bytes, NaN included)
    if FMT != 0:
        kc = gl.convert_layout(gl.reshape(kc_s.index(2 * st).load(kl2), [64, NB, 16]), kl3, assert_trivial=True)
        k_lo = _to_a_operand(_bytes_f16(kc, FMT), CB, a_l)
    else:
        kc = gl.convert_layout(gl.reshape(kc_s.index(st).load(kl2), [64, NB, 16]), kl3, assert_trivial=True)
        ks_lo, ks_hi = _block_scales(ks_s.index(st), NB, kl3)
        k_lo = _to_a_operand(_unpack_half(kc, ks_lo, False), CB, a_l)
    s = warpgroup_mma(k_lo, q_lo.permute((1, 0)), gl.zeros([64, N], gl.float32, layout=acc_l), use_acc=False,
                      is_async=True)
    # the high half unpacks while the low half's MMA runs, V's low half while both do (H200,
    # 27B layout: decode 2-5% and verify 3-7% faster than waiting after each MMA, 3-5 more
    # registers at T = 1: still three programs per SM)
    if FMT != 0:
        kc = gl.convert_layout(gl.reshape(kc_s.index(2 * st + 1).load(kl2), [64, NB, 16]), kl3,
                               assert_trivial=True)
        k_hi = _to_a_operand(_bytes_f16(kc, FMT), CB, a_l)
    else:
        k_hi = _to_a_operand(_unpack_half(kc, ks_hi, True), CB, a_l)
    s = warpgroup_mma(k_hi, q_hi.permute((1, 0)), s, is_async=True)
    if V_REGS:
        if FMT != 0:
            vc = _byte_rows(vc_s.index(2 * st), valid, vp2, vp3, MASK, FMT)
            va_lo = _v_a_operand(_bytes_f16(vc, FMT), CB, a_l)
        else:
            vc = gl.convert_layout(gl.reshape(vc_s.index(st).load(vp2), [64, NB, 16]), vp3)
            vs_lo, vs_hi = _v_block_scales(vs_s.index(st), valid, NB, vp3, MASK)
            va_lo = _v_a_operand(_unpack_half(vc, vs_lo, False), CB, a_l)

    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    if FMT == 2:  # int8: each key's token scale times its score row (NaN past the context: masked below)
        s = s * gl.expand_dims(ks_s.index(st).slice(0, 64).load(gl.SliceLayout(1, acc_l)), 1)
    if MASK:
        srow = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        if T == 1:
            seen = gl.expand_dims(srow < valid, 1)
        else:  # causal among the T tokens
            gcol = gl.arange(0, N, layout=gl.SliceLayout(0, acc_l))
            seen = gl.expand_dims(srow, 1) < gl.expand_dims(valid - T + 1 + gcol // G, 0)
        s = gl.where(seen, s, float("-inf"))
    # probabilities relative to the page's own maximum rounded up to an integer (log2 units),
    # so a page's fp16 P has the same bits in every split; the running reference m_i is an
    # integer too, so every rescaling is by an exact power of two (_pow2). The score scale
    # (> 0) is applied after the maximum and inside the exponent's FMA.
    if PC:
        c_t = gl.ceil(gl.max(s, axis=0) * s_scale + pb)
    else:
        c_t = gl.ceil(gl.max(s, axis=0) * s_scale)
    m_new = gl.maximum(m_i, c_t)
    if T == 1 or not MASK:  # every column sees a key of this page: c_t and m_new are finite
        c_ref = c_t
        m_ref = m_new
    else:  # -inf in a column whose token sees no key of this page / has seen none yet
        c_ref = gl.where(c_t > float("-inf"), c_t, 0.0)
        m_ref = gl.where(m_new > float("-inf"), m_new, 0.0)
    if PC:
        p = gl.exp2(s * s_scale - gl.expand_dims(c_ref - pb, 0))
    else:
        p = gl.exp2(s * s_scale - gl.expand_dims(c_ref, 0))
    w = gl.expand_dims(_pow2(c_t - m_ref), 0)
    alpha = gl.expand_dims(_pow2(m_i - m_ref), 0)
    m_i = m_new
    pw = p * (w * P_SHIFT)  # P's fp16 values; the row sums stay in these units (exact)
    if FMT == 2:  # int8: V's token scales go into P (masked past the context: they may be NaN)
        vsc = ks_s.index(st).slice(64, 64).load(gl.SliceLayout(1, acc_l))
        if MASK:
            vsc = gl.where(gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l)) < valid, vsc, 0.0)
        p_s.store(gl.permute((pw * gl.expand_dims(vsc, 1)).to(gl.float16), (1, 0)))
    else:
        p_s.store(gl.permute(pw.to(gl.float16), (1, 0)))
    if V_REGS:  # V: bytes -> A operand registers (the low half above), after P is in shared memory
        fence_async_shared()
        gl.thread_barrier()
        acc_lo, o_lo = _o_mma(va_lo, p_s, acc_lo, alpha, zero_o, FLUSH)
        if FMT != 0:
            va_hi = _v_a_operand(_bytes_f16(_byte_rows(vc_s.index(2 * st + 1), valid, vp2, vp3, MASK, FMT), FMT),
                                 CB, a_l)
        else:
            va_hi = _v_a_operand(_unpack_half(vc, vs_hi, True), CB, a_l)
        acc_hi, o_hi = _o_mma(va_hi, p_s, acc_hi, alpha, zero_o, FLUSH)
    else:  # V: bytes -> fp16 rows in shared memory
        if FMT != 0:
            vt_lo.store(gl.reshape(_bytes_f16(_byte_rows(vc_s.index(2 * st), valid, vl2, vl3, MASK, FMT), FMT),
                                   [64, CB]))
            vt_hi.store(gl.reshape(_bytes_f16(_byte_rows(vc_s.index(2 * st + 1), valid, vl2, vl3, MASK, FMT), FMT),
                                   [64, CB]))
        else:
            vc = gl.convert_layout(gl.reshape(vc_s.index(st).load(vl2), [64, NB, 16]), vl3, assert_trivial=True)
            vs_lo, vs_hi = _v_block_scales(vs_s.index(st), valid, NB, vl3, MASK)
            vt_lo.store(gl.reshape(_unpack_half(vc, vs_lo, False), [64, CB]))
            vt_hi.store(gl.reshape(_unpack_half(vc, vs_hi, True), [64, CB]))
        fence_async_shared()
        gl.thread_barrier()
        acc_lo, o_lo = _o_mma(vt_lo.permute((1, 0)), p_s, acc_lo, alpha, zero_o, FLUSH)
        acc_hi, o_hi = _o_mma(vt_hi.permute((1, 0)), p_s, acc_hi, alpha, zero_o, FLUSH)
    l_r = l_r * alpha + pw
    o_lo, o_hi = warpgroup_mma_wait(num_outstanding=0, deps=(o_lo, o_hi))
    if FLUSH > 0:
        acc_lo = o_lo
        acc_hi = o_hi
        if i % FLUSH == FLUSH - 1:
            m_o = _flush(o_s, zi, acc_lo, acc_hi, m_o, m_i, acc_l)
            acc_lo = gl.zeros_like(acc_lo)
            acc_hi = gl.zeros_like(acc_hi)
    else:
        acc_lo = acc_lo * alpha + o_lo
        acc_hi = acc_hi * alpha + o_hi
    return m_i, l_r, m_o, acc_lo, acc_hi, pb_next


@gluon.jit
def _o_mma(a, p_s, acc, alpha, zero_o, FLUSH: gl.constexpr):
    """Issue one half of this page's ``Oᵀ = Vᵀ·Pᵀ`` (``a``: Vᵀ, registers or shared memory):
    into the accumulator rescaled by ``alpha`` (FLUSH > 0) or as a fresh product. Returns
    (the accumulator, the MMA's pending result)."""
    if FLUSH > 0:
        acc = acc * alpha
        o = warpgroup_mma(a, p_s.permute((1, 0)), acc, is_async=True)
    else:
        o = warpgroup_mma(a, p_s.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    return acc, o


@gluon.jit
def _flush(o_s, zi, acc_lo, acc_hi, m_o, m_i, acc_l: gl.constexpr):
    """o_s (relative to ``m_o``) += the accumulators (relative to ``m_i``), rescaled to ``m_i``
    exactly; returns ``m_i``, o_s's new reference."""
    sc = gl.expand_dims(gl.where(m_o > float("-inf"), _pow2(m_o - gl.where(m_i > float("-inf"), m_i, 0.0)), 0.0), 0)
    s_lo = o_s.index(zi)  # zi: an opaque zero, so the addresses are not hoisted out of the loop
    s_hi = o_s.index(zi + 1)
    s_lo.store(s_lo.load(acc_l) * sc + acc_lo)
    s_hi.store(s_hi.load(acc_l) * sc + acc_hi)
    return m_i


@gluon.jit
def _to_a_operand(x, CB: gl.constexpr, a_l: gl.constexpr):
    """[64, NB, 16] values in byte order -> [64, CB] in the MMA's reduction order (p), which
    is the same registers: only the index labels change."""
    NKC: gl.constexpr = CB // 16
    x = gl.reshape(x, [64, 4, NKC, 2, 2])
    x = gl.permute(x, (0, 2, 3, 1, 4))
    x = gl.reshape(x, [64, CB])
    return gl.convert_layout(x, a_l, assert_trivial=True)


_PERM_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


FORMATS = (KVFormat.NVFP4, KVFormat.FP8, KVFormat.INT8)
_FMT_CODE = {KVFormat.NVFP4: 0, KVFormat.FP8: 1, KVFormat.INT8: 2}
# int8's probabilities carry V's token scales, which must stay below 16 for them to fit fp16 at
# 2**12 (as ``triton_kernel``'s int8 path): the format saturates them at 15 (``int8.SCALE_MAX``)
P_LOG2_INT8 = 12.0
assert int8.SCALE_MAX * 2.0**P_LOG2_INT8 < 65504.0


def supported(layout: KVLayout, group: int, tokens_per_seq: int = 1) -> bool:
    """What this kernel covers; everything else stays with ``triton_kernel``."""
    return (layout.fmt in FORMATS and layout.head_dim in (128, 256) and group >= 1
            and 1 <= tokens_per_seq * group <= MAX_COLS)


def available(device: torch.device) -> bool:
    """Hopper (sm_90: warpgroup MMA) and not the interpreter."""
    return device.type == "cuda" and not INTERPRET and capability(device) == (9, 0)


def num_columns(tokens_per_seq: int, group: int) -> int:
    """The MMA's N: query tokens x heads of a KV head, padded to a power of two >= 8."""
    return max(8, triton.next_power_of_2(tokens_per_seq * group))


def programs_per_sm(tokens_per_seq: int, group: int, head_dim: int = 256, fmt: KVFormat = KVFormat.NVFP4) -> int:
    """Programs per SM that split counts are planned for (sm_90, two ring stages): at head_dim
    256, 3 at 8 or 16 columns and 2 at 32 (registers / shared memory: docs/kernels.md); at
    head_dim 128 (V through shared memory) 3 at 8 columns, else 2 -- conservative there
    (72 / 127 / 168 registers and 38-48 KB at 8 / 16 / 32 columns fit more; not timed).
    fp8 (twice nvfp4's page bytes in the ring, no flushed accumulators): 3 at 8 columns, else 2."""
    v_regs, _ = kernel_config(tokens_per_seq, group, head_dim, fmt)
    most = 16 if v_regs and fmt is KVFormat.NVFP4 else 8
    return 3 if num_columns(tokens_per_seq, group) <= most else 2


def kernel_config(tokens_per_seq: int, group: int, head_dim: int,
                  fmt: KVFormat = KVFormat.NVFP4) -> tuple[bool, int]:
    """(V from registers, FLUSH) for a shape, the fastest measured (docs/kernels.md): V from
    registers at head_dim 256; accumulators in registers except for nvfp4 at 16 columns with
    V from registers, where they would take three programs per SM to two (216 registers; 168
    with the MMA's accumulators flushed every 32 pages; fp8's ring of 64 KB leaves no room for
    the flushed sums in a third program's shared memory)."""
    v_regs = head_dim == 256
    flush = fmt is KVFormat.NVFP4 and v_regs and num_columns(tokens_per_seq, group) == 16
    return v_regs, 32 if flush else 0


def max_registers(columns: int, v_regs: bool, flush: int) -> int | None:
    """168 (three programs per SM) for 16 columns, V from registers and flushed accumulators:
    ptxas takes 195 uncapped and spills nothing at 168 (sm_90, triton 3.6)."""
    return 168 if columns == 16 and v_regs and flush > 0 else None


def paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    layout: KVLayout,
    global_scales: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    *,
    tokens_per_seq: int = 1,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    stages: int = 2,
    v_regs: bool | None = None,
    flush: int | None = None,
    page_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode / verify attention, Q already rotated: ``tokens_per_seq`` query tokens per
    block-table row, stored back to back, the last of them at position ``context_lens - 1``
    (causal among them). Same meaning as ``reference.paged_attention`` with ``q_len = T``
    everywhere; nvfp4 with head_dim 128/256 and T x group <= 32 only (``supported``).
    ``num_splits`` > 1 splits each sequence's pages; ``scratch`` (float32, at least
    ``B * T * Hq * splits * d`` and ``B * T * Hq * splits`` elements) may be preallocated.
    ``page_bias`` (fp32 ``[B, Hkv, W, N]``, ``N = num_columns``, ``W`` at least the block
    table's width): the cache holds K centered per page, and each page's ``q . c_P`` in log2
    units (``paged_attention.page_bias.page_bias`` with ``scale = sm_scale * log2(e)``) is
    added to its scores."""
    from deepwell.kernels.paged_attention.triton_kernel import merge_splits

    check_inputs(q, cache, layout, global_scales, block_tables, context_lens, None, None)
    total, hq, d = q.shape
    h = layout.num_kv_heads
    group = hq // h
    t = tokens_per_seq
    if not supported(layout, group, t):
        raise ValueError(f"gluon decode needs nvfp4, fp8 or int8, head_dim 128/256 and "
                         f"tokens_per_seq * group <= {MAX_COLS}; "
                         f"got {layout.fmt.value}, d={layout.head_dim}, group={group}, tokens_per_seq={t}")
    if total != block_tables.shape[0] * t:
        raise ValueError(f"q must hold {t} tokens per block-table row ({block_tables.shape[0] * t}), got {total}")
    cfg = kernel_config(t, group, d, layout.fmt)
    v_regs = cfg[0] if v_regs is None else v_regs
    flush = cfg[1] if flush is None else flush
    if v_regs and d != 256:
        raise ValueError(f"v_regs needs head_dim 256, got {d}")
    if not sm_scale > 0:  # the page maximum is taken before the scale (``_page``)
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    if num_splits < 1 or stages < 2 or flush < 0:
        raise ValueError(f"num_splits must be >= 1, stages >= 2 and flush >= 0, got {num_splits}, {stages}, {flush}")
    if q.stride(-1) != 1 or not global_scales.is_contiguous():
        raise ValueError("q must be contiguous in the last dimension and global scales contiguous")
    if out is None:
        out = torch.empty_like(q)
    elif (tuple(out.shape) != tuple(q.shape) or out.stride(-1) != 1 or out.device != q.device
          or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"out must be a float32/bfloat16/float16 tensor shaped like q {list(q.shape)} on "
                         f"{q.device} with a contiguous last dimension, got {out.dtype} {list(out.shape)}")
    n_cols = num_columns(t, group)
    if page_bias is not None:
        want = (block_tables.shape[0], h, n_cols)
        if (page_bias.dtype != torch.float32 or page_bias.dim() != 4 or not page_bias.is_contiguous()
                or (page_bias.shape[0], page_bias.shape[1], page_bias.shape[3]) != want
                or page_bias.shape[2] < block_tables.shape[1] or page_bias.device != q.device):
            raise ValueError(f"page_bias must be contiguous float32 [{want[0]}, {h}, >= {block_tables.shape[1]}, "
                             f"{n_cols}] on {q.device}, got {page_bias.dtype} {list(page_bias.shape)}")
    key = (d, q.device)
    if key not in _PERM_CACHE:
        _PERM_CACHE[key] = torch.tensor(_k_perm(d // 2), dtype=torch.int32, device=q.device)
    perm = _PERM_CACHE[key]
    if num_splits > 1:
        need = total * hq * num_splits
        if scratch is None:
            scratch = (torch.empty(need * d, dtype=torch.float32, device=q.device),
                       torch.empty(need, dtype=torch.float32, device=q.device))
        opart, lse = scratch
        if (opart.dtype != torch.float32 or lse.dtype != torch.float32 or opart.numel() < need * d
                or lse.numel() < need or not opart.is_contiguous() or not lse.is_contiguous()
                or opart.device != q.device or lse.device != q.device):
            raise ValueError(f"scratch must be contiguous float32 tensors on {q.device} of at least {need * d} "
                             f"and {need} elements for {num_splits} splits, got {opart.numel()} and {lse.numel()}")
    else:
        opart = lse = out
    decode_kernel[(block_tables.shape[0], h, num_splits)](
        q, out, opart, lse, cache, global_scales, block_tables, context_lens, perm,
        perm if page_bias is None else page_bias,
        sm_scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), block_tables.stride(0), h,
        0 if page_bias is None else page_bias.shape[2],
        D=d, G=group, SCALE_OFF=layout.scale_offset, NUM_SPLITS=num_splits, STAGES=stages,
        P_SHIFT=2.0 ** (P_LOG2_INT8 if layout.fmt is KVFormat.INT8 else P_LOG2), T=t, N=num_columns(t, group),
        V_REGS=v_regs, FLUSH=flush, FMT=_FMT_CODE[layout.fmt], PC=page_bias is not None, num_warps=4,
        maxnreg=max_registers(num_columns(t, group), v_regs, flush), **pdl.launch_kwargs(q.device, "attention"),
    )
    if num_splits > 1:
        merge_splits(out, opart, lse, num_splits)
    return out
