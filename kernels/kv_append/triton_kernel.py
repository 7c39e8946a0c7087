"""Triton fused KV append: (Hadamard on K) + quantize + scatter, byte-identical to ``reference``.

One program encodes ``BLOCK_T`` tokens of one KV head of K or V (grid ``[cdiv(N,
BLOCK_T), num_kv_heads, 2]``) and writes their code and scale rows into the pages named by
``slots``. Every arithmetic step mirrors the reference codec exactly (see
``kernels.kv_formats``): the Hadamard butterflies in the same order, E4M3 rounding from
exponent bits and the (y + 1.5*2**23) - 1.5*2**23 round-half-even, nvfp4 magnitudes by
comparisons against exact thresholds (a three-level binary search, the same count as the
reference's seven comparisons) and its block scale by the same candidate search
(clipping candidates for K only) with the same int32 fixed-point error (``kv_formats.nvfp4`` step 4: power-of-two products,
truncating conversions, integer sums — no result depends on reduction order or FMA
contraction), int8 through the correctly rounded ``div_rn`` (its token scale saturating at
``int8.SCALE_MAX``).
Works for prefill chunks and decode steps alike (tokens of many sequences in one call).

K first has the optional ``k_offset`` row of its head (or of its token) subtracted in fp32 (as the reference
does). With ``scale_counts`` (fp8 / int8 / nvfp4) every program adds its zero / subnormal /
saturated block-scale (fp8: element, int8: token-scale) counts per head (the reference's
numbers exactly: the same fp32 scale inputs, compared against the same bounds) with an atomic
add only for a kind that occurred (int8: one per such row);
always-on int64 atomics measured 4.65 -> 6.35 us (nvfp4) per layer.

With ``k_feedback`` (fp8 / nvfp4) a K program rounds its rows with the reference's error
feedback recursion (``kv_formats.feedback``): sixteen column steps over every 16-block of
its tokens, each column taken out exactly (a masked sum of one value and zeros) one (fp8)
or two (nvfp4) steps ahead — from the row before a step's update, then corrected by the
updates' products and differences at its own position, so the cross-thread sum overlaps the
rounding (``_lookahead``) — the products and differences kept separate (the launch sets
``enable_fp_fusion=False``, so no FMA contraction anywhere in that compilation).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.hadamard.reference import scale as hadamard_scale
from deepwell.kernels.hadamard.triton_fn import fwht_rows
from deepwell.kernels.calibration import counted_per_row
from deepwell.kernels.kv_append.reference import check_k_feedback, check_k_offset, check_scale_counts
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout, check_global_scales
from deepwell.kernels.kv_formats.int8 import INV_127, SCALE_MAX
from deepwell.kernels.kv_formats import nvfp4
from deepwell.kernels.kv_formats.nvfp4 import INV_6

FMT_ID = {KVFormat.BF16: 0, KVFormat.FP8: 1, KVFormat.INT8: 2, KVFormat.NVFP4: 3}
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# the kernel spells int8's fp32(1/127) and SCALE_MAX and nvfp4's fp32(1/6) as literals (jit
# code cannot read module globals)
assert INV_127 == 0.007874015718698502 and SCALE_MAX == 15.0
assert INV_6 == 0.1666666716337204


@triton.jit
def e4m3_encode(v):
    """fp32 v >= 0 -> (int32 E4M3 code, fp32 rounded value); see kv_formats.e4m3."""
    v = tl.minimum(v, 448.0)
    e = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    y = v * ((130 - e) << 23).to(tl.float32, bitcast=True)
    r = (y + 12582912.0) - 12582912.0
    code = ((e + 7) << 3) + r.to(tl.int32) - 8
    val = r * ((e + 124) << 23).to(tl.float32, bitcast=True)
    return code, val


@triton.jit
def e4m3_value(code):
    """int32 E4M3 code (1..126) -> fp32 value, exactly: ``r * 2**(max(e, 1) - 10)``."""
    ef = code >> 3
    r = tl.where(ef > 0, (code & 7) + 8, code & 7).to(tl.float32)
    return r * ((tl.maximum(ef, 1) + 117) << 23).to(tl.float32, bitcast=True)


@triton.jit
def nvfp4_tree(a, sb):
    """E2M1 index bits of ``a`` [T, B, 16] under scale values ``sb`` [T, B, 1]: the number of
    thresholds ``t * s`` passed (``kv_formats.nvfp4`` step 3) found by a binary search
    instead of seven comparisons: 1.75 s (inclusive) splits the grid in halves, then 3.5 s
    or 0.75 s (inclusive), then 5 / 2.5 / 1.25 / 0.25 s (exclusive) — the thresholds are
    increasing, so the count is ``4 b2 + 2 b1 + b0``. Returns the bits (b2, b1, b0)."""
    b2 = a >= 1.75 * sb
    b1 = a >= tl.where(b2, 3.5 * sb, 0.75 * sb)
    b0 = a > tl.where(b2, tl.where(b1, 5.0 * sb, 2.5 * sb), tl.where(b1, 1.25 * sb, 0.25 * sb))
    return b2, b1, b0


@triton.jit
def nvfp4_index(a, s):
    """E2M1 magnitude index (0..7) of ``a`` [T, B, 16] under scale values ``s`` [T, B]; 0
    where ``s == 0`` (``kv_formats.nvfp4.e2m1_index``)."""
    sb = s[:, :, None]
    b2, b1, b0 = nvfp4_tree(a, sb)
    return tl.where(sb > 0, 4 * b2.to(tl.int32) + 2 * b1.to(tl.int32) + b0.to(tl.int32), 0)


@triton.jit
def e2m1_halves(b2, b1, b0):
    """Doubled E2M1 value ``(0, 1, 2, 3, 4, 6, 8, 12)[4 b2 + 2 b1 + b0]`` of the search bits
    (nested selects: fewer instructions than arithmetic on the bits)."""
    return tl.where(b2, tl.where(b1, tl.where(b0, 12, 8), tl.where(b0, 6, 4)), tl.where(b1, tl.where(b0, 3, 2), tl.where(b0, 1, 0)))


@triton.jit
def nvfp4_block_error(a, big_a, s, half_unit):
    """int32 squared error per block of blocks ``a`` [T, B, 16] under scale values ``s``
    [T, B]: the fixed-point error of ``kv_formats.nvfp4.block_error`` (``e2m1_halves``). (A zero ``s`` only occurs in blocks whose codes are forced to
    zero, and its error stays below 2**30: ``step`` is 0.)"""
    b2, b1, b0 = nvfp4_tree(a, s[:, :, None])
    h = e2m1_halves(b2, b1, b0)
    step = (s * half_unit).to(tl.int32)
    dd = big_a - h * step[:, :, None]
    return tl.sum(dd * dd, axis=2)


@triton.jit
def _try_scale(c, best, best_err, a, big_a, half_unit):
    """(best, best_err) after candidate code ``c``: taken only where strictly better (ties
    keep the earlier candidate)."""
    err = nvfp4_block_error(a, big_a, e4m3_value(c), half_unit)
    better = err < best_err
    return tl.where(better, c, best), tl.where(better, err, best_err)


@triton.jit
def fp8_codes(x, sv):
    """Signed E4M3 codes int32 of ``x`` from ``sv = |x| / g`` (nearest rounding)."""
    code, _ = e4m3_encode(sv)
    return code | (((x < 0) & (code != 0)).to(tl.int32) << 7)


@triton.jit
def nvfp4_nibbles(a, xb, best, c6):
    """E2M1 nibbles int32 [T, B, 16] of blocks ``xb`` (``a = |xb| / g``) under scale codes
    ``best``, zero where ``c6 == 0`` (nearest rounding)."""
    idx = nvfp4_index(a, e4m3_value(best))
    idx = tl.where(c6[:, :, None] > 0, idx, 0)
    return idx | (((xb < 0) & (idx > 0)).to(tl.int32) << 3)


@triton.jit
def feedback_rows(fb_ptr, BLOCK_T: tl.constexpr, NB: tl.constexpr):
    """The head's 16 feedback rows (row ``i`` of every block), each at the blocks' shape [T, B, 16]
    (rows re-read the same addresses), issued together before the recursion (K programs only):
    H200, nvfp4, 64 tokens x 4 heads, d = 256: 5.05 us per layer against 6.5 with each row
    loaded in its step and 5.8-7.3 with the loads at the program's start (docs/kernels.md)."""
    j = tl.arange(0, 16)[None, None, :]
    ptrs = fb_ptr + (tl.zeros([BLOCK_T, NB, 16], dtype=tl.int32) + tl.arange(0, NB)[None, :, None] * 256 + j)
    rows = ()
    for i in tl.static_range(16):
        rows = rows + (tl.load(ptrs + i * 16),)
    return rows


@triton.jit
def _column(w, i):
    """Column ``i`` of every block of ``w`` [T, B, 16] (exact: one value plus zeros)."""
    j = tl.arange(0, 16)[None, None, :]
    return tl.sum(tl.where(j == i, w, 0.0), axis=2)


@triton.jit
def _superdiagonal(rows, k: tl.constexpr):
    """``F[i, i + k]`` per block ([T, B]) for i = 0 .. 15 - k, from the feedback rows."""
    out = ()
    for i in tl.static_range(16 - k):
        out = out + (_column(rows[i], i + k),)
    return out


@triton.jit
def _lookahead(w, i: tl.constexpr, err, p1, fd1, fd2, rows, AHEAD: tl.constexpr):
    """One step of the recursion's bookkeeping after column ``i``'s error ``err``: (column
    ``i + 1``'s final value, the partial value of column ``i + 2`` (``AHEAD == 2``), the row
    after step ``i``). A column is taken out of the row *before* this step's update, so its
    cross-thread sum runs while this step (and with ``AHEAD == 2`` the next one too) rounds,
    and then gets the product and difference each update makes at its position (``- err *
    F[i, i + 1]``, ``- err * F[i, i + 2]``) — exactly the reference's values. ``AHEAD == 1``:
    column ``i + 1`` from the row before the update, ``p1`` unused."""
    if AHEAD == 2:
        col = p1 - err * fd1[i]
        if i < 14:
            p1 = _column(w, i + 2) - err * fd2[i]
            w = w - err[:, :, None] * rows[i]
    else:
        col = _column(w, i + 1) - err * fd1[i]
        w = w - err[:, :, None] * rows[i]
    return col, p1, w


@triton.jit
def _lookahead_start(w, rows, AHEAD: tl.constexpr):
    """(column 0, the ``p1`` of ``_lookahead``, ``F[i, i + 1]``, ``F[i, i + 2]`` (AHEAD 2; else
    ``F[i, i + 1]`` again)) of blocks ``w``."""
    col = _column(w, 0)
    fd1 = _superdiagonal(rows, 1)
    if AHEAD == 2:
        p1 = _column(w, 1)
        fd2 = _superdiagonal(rows, 2)
    else:
        p1 = col
        fd2 = fd1
    return col, p1, fd1, fd2


@triton.jit
def fp8_feedback(x, inv_g, g, rows, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """Signed E4M3 codes int32 [T, D] of rows ``x`` rounded with error feedback (``rows``:
    ``feedback_rows`` of the head; ``kv_formats.feedback``: products and differences rounded
    one by one, the launch turns FMA contraction off)."""
    w = tl.reshape(x, [BLOCK_T, D // 16, 16])
    codes = tl.zeros([BLOCK_T, D // 16, 16], dtype=tl.int32)
    # one column ahead (H200: two ahead measured 4.41 -> 4.75 us per 64-token step)
    col, p1, fd1, fd2 = _lookahead_start(w, rows, 1)
    j = tl.arange(0, 16)[None, None, :]
    for i in tl.static_range(16):
        c, mag = e4m3_encode(tl.abs(col) * inv_g)
        neg = (col < 0) & (c != 0)
        val = mag * g
        codes = tl.where(j == i, (c | (neg.to(tl.int32) << 7))[:, :, None], codes)
        err = col - tl.where(neg, -val, val)
        if i < 15:
            col, p1, w = _lookahead(w, i, err, p1, fd1, fd2, rows, 1)
    return tl.reshape(codes, [BLOCK_T, D])


@triton.jit
def nvfp4_feedback(xb, inv_g, g, sv, rows):
    """E2M1 nibbles (sign in bit 3) int32 [T, B, 16] of blocks ``xb`` under block-scale values
    ``sv`` [T, B] (0: the block encodes to zero), rounded with error feedback as ``fp8_feedback``."""
    w = xb
    nib = tl.zeros(xb.shape, dtype=tl.int32)
    # two columns ahead (H200: 5.03 -> 4.95 us per 64-token step against one ahead)
    col, p1, fd1, fd2 = _lookahead_start(w, rows, 2)
    j = tl.arange(0, 16)[None, None, :]
    for i in tl.static_range(16):
        b2, b1, b0 = nvfp4_tree(tl.abs(col) * inv_g, sv)
        idx = tl.where(sv > 0, 4 * b2.to(tl.int32) + 2 * b1.to(tl.int32) + b0.to(tl.int32), 0)
        h = tl.where(idx < 4, idx, tl.where(idx < 6, 2 * idx - 4, 4 * idx - 16))
        mag = (h.to(tl.float32) * 0.5) * sv * g
        neg = col < 0
        nib = tl.where(j == i, (idx | ((neg & (idx > 0)).to(tl.int32) << 3))[:, :, None], nib)
        err = col - tl.where(neg, -mag, mag)
        if i < 15:
            col, p1, w = _lookahead(w, i, err, p1, fd1, fd2, rows, 2)
    return nib


@triton.jit
def scale_flags(sv):
    """The zero / subnormal / saturated flags of scale inputs ``sv`` (``kernels.calibration``
    definitions) packed in 10-bit fields of an int32 (sums of under 1024 inputs stay apart)."""
    flags = (sv == 0.0).to(tl.int32) + ((sv > 0.0) & (sv < 0.015625)).to(tl.int32) * 1024
    return flags + (sv > 448.0).to(tl.int32) * 1048576


@triton.jit
def _count_scales(cnt_ptr, sv, ok):
    """Add the zero / subnormal / saturated counts of the scale inputs ``sv`` (where ``ok``)
    to ``cnt_ptr[0:3]`` (int64): ``count_flags`` of their ``scale_flags`` (``append`` keeps a
    program under 1024 inputs)."""
    count_flags(cnt_ptr, scale_flags(sv), ok)


@triton.jit
def count_flags(cnt_ptr, flags, ok):
    """Add packed ``scale_flags`` (where ``ok``; their total per field under 1024) to
    ``cnt_ptr[0:3]``: one int32 reduction, then an atomic only for a kind that occurred
    (relaxed: nothing is ordered after the counts; the default acquire-release order puts a
    GPU-wide fence and an L1 invalidation behind each)."""
    packed = tl.sum(tl.where(ok, flags, 0))
    if packed != 0:
        n_zero = packed & 1023
        n_sub = (packed >> 10) & 1023
        n_sat = packed >> 20
        if n_zero != 0:
            tl.atomic_add(cnt_ptr + 0, n_zero.to(tl.int64), sem="relaxed")
        if n_sub != 0:
            tl.atomic_add(cnt_ptr + 1, n_sub.to(tl.int64), sem="relaxed")
        if n_sat != 0:
            tl.atomic_add(cnt_ptr + 2, n_sat.to(tl.int64), sem="relaxed")


@triton.jit
def kv_append_fwd_kernel(
    cache_ptr, k_ptr, v_ptr, slot_ptr, g_ptr, koff_ptr, cnt_ptr, fb_ptr,
    N, NUM_HEADS,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cp, stride_ckv, stride_ch, stride_on,
    FMT: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, HSCALE: tl.constexpr,
    HADAMARD: tl.constexpr, HAS_OFFSET: tl.constexpr, COUNT: tl.constexpr, FEEDBACK: tl.constexpr,
    PAGE: tl.constexpr, CODE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr, SCALE_OFF: tl.constexpr, BLOCK_T: tl.constexpr,
    SEARCH_DOWN: tl.constexpr, SEARCH_UP: tl.constexpr, UP_SPAN: tl.constexpr, FB_DOWN: tl.constexpr,
    FB_LO: tl.constexpr, FB_HI: tl.constexpr, ERR_BITS: tl.constexpr, ERR_EXP_FLOOR: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    kv = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = offs_t < N
    slot = tl.load(slot_ptr + offs_t, mask=in_range, other=-1).to(tl.int64)
    valid = slot >= 0
    # 1/g and fp32(1/6)/g are exact (g is a power of two); read here, not computed per call
    inv_g = tl.math.div_rn(1.0, tl.load(g_ptr + kv * NUM_HEADS + h))
    page = tl.where(valid, slot // PAGE, 0)
    off = tl.where(valid, slot % PAGE, 0)
    offs_d = tl.arange(0, D)
    row = offs_t.to(tl.int64)[:, None]
    if kv == 0:
        x = tl.load(k_ptr + row * stride_kn + h * stride_kh + offs_d[None, :], mask=in_range[:, None], other=0.0).to(tl.float32)
        if HAS_OFFSET:  # one row per head (stride_on 0) or per token
            x = x - tl.load(koff_ptr + row * stride_on + h * D + offs_d[None, :], mask=in_range[:, None], other=0.0)
        if HADAMARD:
            x = fwht_rows(x, BLOCK_T, D, LOG2D, HSCALE)
    else:
        x = tl.load(v_ptr + row * stride_vn + h * stride_vh + offs_d[None, :], mask=in_range[:, None], other=0.0).to(tl.float32)
    base = cache_ptr + page * stride_cp + kv * stride_ckv + h * stride_ch
    code_row = base + off * CODE_BYTES
    scale_row = base + SCALE_OFF + off * SCALE_BYTES
    if FMT == 0:
        # round-half-even to bf16 from the bits (the interpreter's own cast truncates)
        b = x.to(tl.int32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        ptrs = code_row.to(tl.pointer_type(tl.int16))[:, None] + offs_d[None, :]
        tl.store(ptrs, (b >> 16).to(tl.int16), mask=valid[:, None])
    elif FMT == 1:
        sv = tl.abs(x * inv_g)
        if COUNT:
            _count_scales(cnt_ptr + (kv * NUM_HEADS + h) * 3, sv, valid[:, None] & (offs_d[None, :] >= 0))
        if FEEDBACK:
            if kv == 0:
                g = tl.load(g_ptr + h)
                rows = feedback_rows(fb_ptr + h * (D * 16), BLOCK_T, D // 16)
                code = fp8_feedback(x, inv_g, g, rows, BLOCK_T, D)
            else:
                code = fp8_codes(x, sv)
        else:
            code = fp8_codes(x, sv)
        tl.store(code_row[:, None] + offs_d[None, :], code.to(tl.uint8), mask=valid[:, None])
    elif FMT == 2:
        sv = tl.max(tl.abs(x), axis=1) * 0.007874015718698502  # fp32(1/127), see int8.INV_127
        if COUNT:  # zero and saturated (int8.SCALE_MAX) token scales; there is no subnormal range.
            # One predicated atomic per row that has either (rare): no reduction, no barrier
            cnt = cnt_ptr + (kv * NUM_HEADS + h) * 3 + tl.zeros([BLOCK_T], tl.int32)
            one = tl.full([BLOCK_T], 1, tl.int64)
            tl.atomic_add(cnt, one, mask=valid & (sv == 0.0), sem="relaxed")
            tl.atomic_add(cnt + 2, one, mask=valid & (sv > 15.0), sem="relaxed")
        s = tl.where(sv > 15.0, 15.0, sv)  # int8.SCALE_MAX (NaN stays NaN, as torch's clamp)
        safe = tl.where(s > 0, s, 1.0)
        y = tl.math.div_rn(x, safe[:, None])
        r = (y + 12582912.0) - 12582912.0
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        q = tl.where(s[:, None] > 0, r, 0.0).to(tl.int32).to(tl.int8)
        tl.store(code_row.to(tl.pointer_type(tl.int8))[:, None] + offs_d[None, :], q, mask=valid[:, None])
        tl.store(scale_row.to(tl.pointer_type(tl.float32)), s, mask=valid)
    else:
        enc = inv_g * 0.1666666716337204  # fp32(1/6), see nvfp4.INV_6
        xb = tl.reshape(x, [BLOCK_T, D // 16, 16])
        ab = tl.abs(xb)
        sv = tl.max(ab, axis=2) * enc
        c6, s6 = e4m3_encode(sv)
        if COUNT:
            _count_scales(cnt_ptr + (kv * NUM_HEADS + h) * 3, sv, valid[:, None] & (tl.arange(0, D // 16)[None, :] >= 0))
        a = ab * inv_g
        m = tl.max(a, axis=2)
        c4, _ = e4m3_encode(m * 0.25)
        top = tl.minimum(c4 + SEARCH_UP, 126)
        # fixed point of the error: unit = 2**(ERR_BITS - exponent(m)) (see kv_formats.nvfp4)
        ex = tl.maximum((m.to(tl.int32, bitcast=True) >> 23) - 127, ERR_EXP_FLOOR)
        unit = ((127 + ERR_BITS - ex) << 23).to(tl.float32, bitcast=True)
        half_unit = ((126 + ERR_BITS - ex) << 23).to(tl.float32, bitcast=True)
        big_a = (a * unit[:, :, None]).to(tl.int32)
        # K may clip (candidates below c6); V starts at the first code with 6 s >= m
        clip = kv == 0
        c0 = tl.where(clip | (6.0 * s6 >= m), c6, tl.minimum(c6 + 1, 126))
        top = tl.maximum(top, c0)
        best_err = nvfp4_block_error(a, big_a, e4m3_value(c0), half_unit)
        best = c0
        if FEEDBACK and clip:  # K rounded with feedback: c6, c6-1, c4 (nvfp4.feedback_candidates)
            for k in tl.static_range(1, FB_DOWN + 1):
                best, best_err = _try_scale(tl.maximum(c0 - k, 1), best, best_err, a, big_a, half_unit)
            for j in tl.static_range(FB_LO, FB_HI + 1):
                best, best_err = _try_scale(tl.minimum(tl.maximum(c4 + j, 1), 126), best, best_err, a, big_a,
                                            half_unit)
        else:
            if clip:  # V has no candidates below c0 (skipping them changes nothing: ties keep the earlier)
                for k in tl.static_range(1, SEARCH_DOWN + 1):
                    best, best_err = _try_scale(tl.maximum(c0 - k, 1), best, best_err, a, big_a, half_unit)
            # (no early exit when every block of the program is past its top: measured 8% slower,
            # the branches keep the compiler from interleaving the candidates)
            for k in tl.static_range(1, UP_SPAN + 1):
                best, best_err = _try_scale(tl.minimum(c0 + k, top), best, best_err, a, big_a, half_unit)
        # the winner's element indices, evaluated once (not carried through the search)
        s_code = tl.where(c6 > 0, best, 0)
        if FEEDBACK:
            if kv == 0:
                g = tl.load(g_ptr + h)
                rows = feedback_rows(fb_ptr + h * (D * 16), BLOCK_T, D // 16)
                nib = nvfp4_feedback(xb, inv_g, g, tl.where(c6 > 0, e4m3_value(best), 0.0), rows)
            else:
                nib = nvfp4_nibbles(a, xb, best, c6)
        else:
            nib = nvfp4_nibbles(a, xb, best, c6)
        halves = tl.permute(tl.reshape(nib, [BLOCK_T, 2, D // 2]), (0, 2, 1))
        lo, hi = tl.split(halves)
        # page layout 3 (kv_formats.nvfp4): low sign at bit 7, low index at 1-3, high index at 4-6, high sign at 0
        packed = (((lo & 8) << 4) | ((lo & 7) << 1) | ((hi & 7) << 4) | (hi >> 3)).to(tl.uint8)
        offs_c = tl.arange(0, D // 2)
        tl.store(code_row[:, None] + offs_c[None, :], packed, mask=valid[:, None])
        offs_s = tl.arange(0, D // 16)
        if kv == 0:
            sptr = scale_row[:, None] + offs_s[None, :]
        else:  # V's scale region is block-major (kv_formats.layout.scale_slot)
            slot_v = 16 * ((off >> 1) & 3) + (off & 1) + 2 * (off >> 3)
            sptr = (base + SCALE_OFF + slot_v)[:, None] + offs_s[None, :] * PAGE
        tl.store(sptr, s_code.to(tl.uint8), mask=valid[:, None])


def _gluon_serves(layout: KVLayout, device: torch.device) -> bool:
    """Whether ``gluon_append`` (nvfp4 and fp8) serves this layout on this device."""
    if layout.fmt not in (KVFormat.NVFP4, KVFormat.FP8) or INTERPRET or device.type != "cuda":
        return False
    try:
        from deepwell.kernels.kv_append import gluon_append
    except ImportError:  # a Triton without Gluon
        return False
    return gluon_append.supported(layout) and gluon_append.available(device)


def append_kernel(layout: KVLayout, device: torch.device, *, impl: str = "auto", block_t: int | None = None) -> str:
    """The kernel ``append`` runs, "gluon" or "triton". "auto": the Gluon kernel for nvfp4 and fp8
    where it applies (H200, 64-sequence step, launched with PDL: nvfp4 2.64 against the Triton
    kernel's ~3.2 us per layer with nearest rounding, 4.03 against ~5.05 with K feedback; fp8 1.54
    against 1.84, 3.67 against 4.04; docs/kernels.md). ValueError for an
    unknown ``impl`` and for "gluon" where the Gluon kernel does not apply."""
    if impl not in ("auto", "triton", "gluon"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'gluon', got {impl!r}")
    if impl == "triton":
        return "triton"
    if block_t is None and _gluon_serves(layout, device):
        return "gluon"
    if impl == "gluon":
        raise ValueError(f"the Gluon append needs nvfp4 or fp8 with head_dim in (64, 128, 256) on a Hopper GPU and no "
                         f"block_t; got {layout.fmt.value}, d={layout.head_dim} on {device}, block_t={block_t}")
    return "triton"


def append(
    cache: torch.Tensor,
    layout: KVLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    global_scales: torch.Tensor,
    k_offset: torch.Tensor | None = None,
    scale_counts: torch.Tensor | None = None,
    k_feedback: torch.Tensor | None = None,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
    validate: bool = True,
    impl: str = "auto",
) -> None:
    """Same contract as ``reference.append``; ``validate=False`` skips the checks that read
    values back to the host (global scales powers of two, a finite K offset and feedback: the
    engine checks those where it sets them), so the call never synchronizes (CUDA-graph capture,
    and a decode step that does not wait on the GPU once per layer); shapes and dtypes are
    always checked. ``impl``: "auto" runs nvfp4 and
    fp8 through the Gluon kernel (``gluon_append``) where it applies (Hopper, head_dim 64-256) and
    everything else here; "triton" always here; "gluon" insists on the
    Gluon kernel (ValueError where it does not apply). Both write the same bytes."""
    kernel = append_kernel(layout, k.device, impl=impl, block_t=block_t)
    n = k.shape[0]
    layout.check_cache(cache)
    want = (n, layout.num_kv_heads, layout.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k and v must be {list(want)}, got {list(k.shape)} and {list(v.shape)}")
    if tuple(slots.shape) != (n,):
        raise ValueError(f"slots must be [{n}], got {list(slots.shape)}")
    if scale_counts is not None:
        check_scale_counts(scale_counts, layout)
    if validate:
        check_global_scales(global_scales, layout)
        if k_offset is not None:
            check_k_offset(k_offset, layout, n)
        if k_feedback is not None:
            check_k_feedback(k_feedback, layout)
    elif global_scales.dtype != torch.float32 or tuple(global_scales.shape) != (2, layout.num_kv_heads):
        raise ValueError(f"global scales must be float32 [2, {layout.num_kv_heads}], got {global_scales.dtype} "
                         f"{list(global_scales.shape)}")
    if n == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in the last dimension")
    if global_scales.dtype != torch.float32 or not global_scales.is_contiguous():
        raise ValueError("global scales must be contiguous float32 [2, num_kv_heads]")
    if k_offset is not None and (k_offset.dtype != torch.float32 or not k_offset.is_contiguous()
                                 or k_offset.dim() not in (2, 3) or (k_offset.dim() == 3 and k_offset.shape[0] != n)):
        raise ValueError(f"k_offset must be contiguous float32 [num_kv_heads, head_dim] or [{n}, num_kv_heads, head_dim]")
    stride_on = k_offset.stride(0) if k_offset is not None and k_offset.dim() == 3 else 0
    if k_feedback is not None and (k_feedback.dtype != torch.float32 or not k_feedback.is_contiguous()):
        raise ValueError("k_feedback must be contiguous float32 [num_kv_heads, head_dim / 16, 16, 16]")
    d = layout.head_dim
    hs = layout.hadamard_size or d  # K's Hadamard transform size (HADAMARD says whether it runs)
    count = scale_counts if layout.fmt is not KVFormat.BF16 else None
    if count is not None and (count.dtype != torch.int64 or not count.is_contiguous()):
        raise ValueError("scale_counts must be contiguous int64 [2, num_kv_heads, 3]")
    if kernel == "gluon":
        from deepwell.kernels.kv_append import gluon_append

        # with K feedback four rows share one copy of the feedback matrices (H200: nvfp4 3.72
        # against 3.81 us at two warps, fp8 2.49 against 2.57); nearest rounding: one row per program
        gluon_append.launch(cache, layout, k, v, slots, global_scales, k_offset, count, k_feedback,
                            num_warps=num_warps or (4 if k_feedback is not None else 1))
        return
    # tokens per program, fastest measured on the H200 for a 64-sequence decode step (docs/kernels.md);
    # counting fp8 elements needs < 1024 per program (10-bit fields in _count_scales)
    bt = block_t or (2 if layout.fmt is KVFormat.NVFP4 or k_feedback is not None
                     or (count is not None and 4 * counted_per_row(layout) >= 1024) else 4)
    if block_t is None and INTERPRET:  # the interpreter pays per program: fewer, larger ones (same bytes;
        bt = 64                        # nvfp4 70 tokens x 3 heads at d = 64: 32.8 s at 2 tokens, 4.6 s at 16)
        while count is not None and bt > 1 and bt * counted_per_row(layout) >= 1024:
            bt //= 2
    if count is not None and bt * counted_per_row(layout) >= 1024:
        raise ValueError(f"block_t={bt} puts 1024 or more scale inputs in a program; counting needs fewer")
    # fp8 with K feedback: 8 warps (H200, 64-sequence decode step: 4.40 against 4.57 us at 4 warps)
    warps = 8 if layout.fmt is KVFormat.FP8 and k_feedback is not None else 4
    grid = (triton.cdiv(n, bt), layout.num_kv_heads, 2)
    kv_append_fwd_kernel[grid](
        cache, k, v, slots, global_scales, global_scales if k_offset is None else k_offset,
        slots if count is None else count, slots if k_feedback is None else k_feedback,
        n, layout.num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), stride_on,
        FMT=FMT_ID[layout.fmt], D=d, LOG2D=int(math.log2(hs)), HSCALE=hadamard_scale(hs),
        HADAMARD=layout.hadamard, HAS_OFFSET=k_offset is not None, COUNT=count is not None,
        FEEDBACK=k_feedback is not None, PAGE=layout.page_size, CODE_BYTES=layout.code_bytes,
        SCALE_BYTES=max(layout.scale_bytes, 1), SCALE_OFF=layout.scale_offset, BLOCK_T=bt,
        SEARCH_DOWN=nvfp4.SEARCH_DOWN, SEARCH_UP=nvfp4.SEARCH_UP, UP_SPAN=nvfp4.UP_SPAN,
        FB_DOWN=nvfp4.FEEDBACK_DOWN, FB_LO=nvfp4.FEEDBACK_FOUR_LO, FB_HI=nvfp4.FEEDBACK_FOUR_HI,
        ERR_BITS=nvfp4.ERR_BITS, ERR_EXP_FLOOR=nvfp4.ERR_EXP_FLOOR, num_warps=num_warps or warps,
        # the feedback recursion rounds every product and difference on its own, as the reference
        enable_fp_fusion=k_feedback is None, **pdl.launch_kwargs(k.device, "append"),
    )
