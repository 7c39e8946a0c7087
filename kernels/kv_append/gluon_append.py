"""nvfp4 and fp8 KV append in Gluon: two lanes per 16-value block, butterflies and sums by warp shuffles.

Same bytes as ``reference.append`` (and ``triton_kernel``) for nvfp4 and fp8 caches with head_dim
64, 128 or 256, with or without the Hadamard rotation, K offset, block-scale counts and K error
feedback (fp8: ``_store_fp8``, the same layout without the scale search, below). A program
encodes ``R`` token rows of one KV head of K or V (grid ``[cdiv(N, R), num_kv_heads, 2]``); every thread holds eight consecutive values of a row (an "octet"), so a
16-value block lives in two neighbouring lanes and a row of ``d`` values in ``d / 8`` lanes
(lane ``= row_in_warp * d/8 + octet``). The layout is what the Triton kernel cannot state,
and it is the point:

- the Hadamard butterflies of span 1, 2 and 4 are additions within a thread, those of span
  8 .. d/2 take the partner value from lane ``lane ^ (span / 8)`` by ``shfl.sync.bfly`` — no
  shared memory, no barrier (the Triton kernel moves the row through shared memory between
  stages);
- a block's maximum and each scale candidate's squared error are a thread's sum of eight plus
  one shuffle from the neighbour lane, and the per-block work of a candidate (its value, the
  seven thresholds, the step) is shared by eight values instead of two to four;
- the scale search compares two values at once (``_error``): the candidate's thresholds
  ``t * s`` are exact fp16 numbers, so ``a >= T`` and ``a > T`` are decided exactly on ``a``
  rounded to fp16 toward zero and toward +inf (``_half_pairs``, once per value); one
  ``set.*.u32.f16x2`` gives both values' half masks, ``lop3`` selects thresholds and grid
  products on both halves, and only the squared differences are taken apart — about 10
  instructions per value and candidate plus ~3 of per-candidate constants, against ~15 with the
  fp32 tree (``nvfp4_tree``, still used for the final codes);
- the query-weighted rounding of K (``kv_formats.feedback``) runs its sixteen sequential
  column steps in the pair of lanes of the block, each lane updating only its own eight
  elements (``_feedback_codes``: the low lane's errors of steps 0-7 reach the high lane by one
  shuffle each, outside the low lane's own chain; since 2026-12-03, before which both lanes
  ran the whole recursion on a copy of the block: H200, A/B, nvfp4 3.93 -> 3.72 us at four
  warps, fp8 2.69 -> 2.49), instead of taking each column out of a row spread over threads;
  the head's feedback matrices are copied to shared memory (``cp.async``, each lane's eight
  columns of a row: 16 KB per program at d = 256, 32 KB before) at the program's start, while
  the search runs (read from global memory inside the recursion, where the compiler places the
  loads, a step took 6.7-6.9 us against 5.4-5.6; an L1 prefetch at the start did not help);
- K rows with feedback search the codec's three-code list (c6, c6-1, c4:
  ``nvfp4.feedback_candidates``), the other rows its ten (K) / eight (V) codes: nvfp4 with K
  feedback 3.74 -> 2.99 us at four warps (A/B, H200, 2026-12-04; docs/kernels.md "K feedback's
  own scale list").

Measured on the H200 (``benchmarks/kv_attention.py --only append``: one layer of a 64-sequence
decode step, 27B layout, CUDA-graph replay, same run; block scales counted, as the engine does):
nearest rounding 3.13 us against the Triton kernel's 3.66 (0.86x); with K feedback 5.38 against
5.34. Launched with PDL (``kernels.pdl``, the default since ``0894170``): 2.84 against 3.21
and, with K feedback at two warps, 4.78 against 5.05 (three runs on one machine start), so
``triton_kernel.append`` picks this kernel for nvfp4 either way. The fp16-pair search (A/B in
one process against the fp32 tree, minimum of five rounds, same bytes): nearest rounding 2.85
-> 2.64 us (one warp; two: 2.81 -> 2.72), K feedback 4.76 -> 4.50 (two warps), 4.61 -> 4.31
(four warps: the default for K feedback since, as four rows share one copy of the head's
feedback matrices). Before that search (Nsight Compute, fp32 tree): one warp per scheduler, ~2,100
instructions per K warp of which the ten-candidate search was ~1,300 (about 14 per value and
candidate: three comparisons, three threshold selects, the grid value's selects, the error's
multiply-adds), and 22% of the stalls were instruction-cache misses of the unrolled code — yet
the search as a loop measured slower (3.13 -> 3.37 us: the unrolled candidates overlap). The
kernel's static sm_90 code: 2,072 -> 1,896 instructions (nearest), 3,096 -> 2,912 (feedback).
Then the recursion's cuts (``_feedback_codes``: its broadcasts add no zeros, and ``_grid``): K
feedback 4.29 -> 4.03 us at four warps (fp8 3.71 -> 3.67 at two), 2,984 -> 2,808 instructions.

The arithmetic is the reference's step for step, through the Triton kernel's own element-wise
helpers (``triton_kernel.e4m3_encode``, ``e4m3_value``, ``nvfp4_tree``: exact E4M3 rounding
from the bits, the threshold tree) or exact equivalents (the fp16 pairs; the recursion's
thresholds and values in K's units, ``_grid``; fp8's elements by the hardware conversion, below),
the fixed-point error,
ties keeping the earlier candidate; the feedback launch disables FMA contraction. Hopper only, like the
attention kernel in ``paged_attention.gluon_decode`` (the only GPU it has been run on).

fp8 (``append_kernel`` with ``FP8``, ``_store_fp8``): the K row's offset and rotation as above
(``_load_k``), each element rounded by the hardware's E4M3 conversion (``_e4m3_word``: four values
per word, ``cvt.rn.satfinite.e4m3x2.f32``, the codec's round-half-even with saturation; negative
zero cleared) or, for K with feedback, the recursion of ``_feedback_codes`` with ``_e4m3_hw`` (the
conversion there and back: two instructions where ``e4m3_encode``'s exact steps took about ten;
equal to the codec on every finite fp32, ``tests/kernels/test_gluon_e4m3.py``), eight code bytes
per thread stored as two words; every element's ``|x| / g`` is counted (programs of 1024 elements
or more sum their counts in 21-bit fields, ``_count_flags_wide``, so K feedback runs four warps
like nvfp4's). H200, one layer of a 64-sequence step, graph replay: nearest rounding 1.54 us
against the Triton kernel's 1.84 (counted), with K feedback (two warps) 3.84 against 4.04; 3.67
since the recursion's broadcasts add no zeros, 3.29 with the hardware conversion (A/B, 1.54 ->
1.46 nearest), 2.71 at four warps with the feedback matrices' swizzle below (docs/kernels.md).
"""

from __future__ import annotations

import os
import struct

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from deepwell.kernels import pdl
from deepwell.kernels.cuda_arch import capability
from deepwell.kernels.hadamard.reference import scale as hadamard_scale
from deepwell.kernels.kv_append.triton_kernel import _count_scales, count_flags, e4m3_encode, e4m3_value, nvfp4_tree, scale_flags
from deepwell.kernels.kv_formats import nvfp4
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HEAD_DIMS = (64, 128, 256)  # d / 8 lanes per row must fit a warp


@gluon.constexpr_function
def _rows_layout(O, W):
    """[R, O] tensors (one value per thread): lane = (row in warp) * O + octet."""
    return gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32 // O, O], warps_per_cta=[W, 1],
                            order=[1, 0])


@gluon.constexpr_function
def _octets_layout(O, W, E):
    """[R, O, E] tensors: the thread of (row, octet) holds the E values along the last axis."""
    return gl.BlockedLayout(size_per_thread=[1, 1, E], threads_per_warp=[32 // O, O, 1], warps_per_cta=[W, 1, 1],
                            order=[2, 1, 0])


@gluon.constexpr_function
def _shfl_asm(mask):
    return f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, -1;"


@gluon.jit
def _bfly_i(x, MASK: gl.constexpr):
    """int32 ``x`` of lane ``lane ^ MASK``."""
    return gl.inline_asm_elementwise(_shfl_asm(MASK), "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _bfly_f(x, MASK: gl.constexpr):
    """fp32 ``x`` of lane ``lane ^ MASK`` (moved as its bits)."""
    return _bfly_i(x.to(gl.int32, bitcast=True), MASK).to(gl.float32, bitcast=True)


@gluon.jit
def _unbind8(x, l2: gl.constexpr):
    """[R, O, 8] -> the eight [R, O] tensors of positions 0..7 (register moves only)."""
    R: gl.constexpr = x.shape[0]
    O: gl.constexpr = x.shape[1]
    ev, od = gl.split(gl.reshape(x, [R, O, 4, 2]))
    e0, e1 = gl.split(gl.reshape(ev, [R, O, 2, 2]))
    o0, o1 = gl.split(gl.reshape(od, [R, O, 2, 2]))
    x0, x4 = gl.split(e0)
    x2, x6 = gl.split(e1)
    x1, x5 = gl.split(o0)
    x3, x7 = gl.split(o1)
    return (gl.convert_layout(x0, l2, assert_trivial=True), gl.convert_layout(x1, l2, assert_trivial=True),
            gl.convert_layout(x2, l2, assert_trivial=True), gl.convert_layout(x3, l2, assert_trivial=True),
            gl.convert_layout(x4, l2, assert_trivial=True), gl.convert_layout(x5, l2, assert_trivial=True),
            gl.convert_layout(x6, l2, assert_trivial=True), gl.convert_layout(x7, l2, assert_trivial=True))


@gluon.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@gluon.jit
def _load_octets(ptr, rows, mask, stride, R: gl.constexpr, O: gl.constexpr, l2: gl.constexpr,
                 l3: gl.constexpr):
    """fp32 values of the eight tensors of ``ptr + rows * stride + (8 * octet + e)``."""
    r3 = gl.convert_layout(rows, gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    m3 = gl.convert_layout(mask, gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    o3 = gl.arange(0, O, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    e3 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    off = (gl.expand_dims(gl.expand_dims(r3.to(gl.int64) * stride, 1), 2)
           + gl.expand_dims(gl.expand_dims(o3 * 8, 0), 2) + gl.expand_dims(gl.expand_dims(e3, 0), 1))
    x = gl.load(ptr + off, mask=gl.expand_dims(gl.expand_dims(m3, 1), 2), other=0.0).to(gl.float32)
    return _unbind8(gl.reshape(x, [R, O, 8]), l2)


@gluon.jit
def _load_k(k_ptr, koff_ptr, rows, in_range, oct2, hd, stride_kn, stride_kh, stride_on, D: gl.constexpr,
            HSCALE: gl.constexpr, HADAMARD: gl.constexpr, HAS_OFFSET: gl.constexpr, l2: gl.constexpr, l3: gl.constexpr,
            HO: gl.constexpr):
    """K rows as stored before rounding (``reference.stored_rows``): loaded as octets, minus the
    K offset (the head's, ``stride_on`` 0, or the token's), Hadamard-rotated (butterflies of span
    1-4 in the thread, 8 .. 4 HO by shuffles: ``HO`` octets per transform, D / 8 for the whole
    row, 2 for each 16-element block)."""
    O: gl.constexpr = D // 8
    R: gl.constexpr = l2.warps_per_cta[0] * l2.threads_per_warp[0]
    x = _load_octets(k_ptr + hd * stride_kh, rows, in_range, stride_kn, R, O, l2, l3)
    if HAS_OFFSET:
        koff = _load_octets(koff_ptr + hd * D, rows, in_range, stride_on, R, O, l2, l3)
        y = ()
        for e in gl.static_range(8):
            y = y + (x[e] - koff[e],)
        x = y
    if HADAMARD:
        for s in gl.static_range(3):  # spans 1, 2, 4: within the thread
            y = ()
            for e in gl.static_range(8):
                if ((e >> s) & 1) == 0:
                    y = y + (x[e] + x[e + (1 << s)],)
                else:
                    y = y + (x[e - (1 << s)] - x[e],)
            x = y
        for s in gl.static_range(_log2(HO)):  # spans 8 .. 4 HO: lane ^ 2**s
            lo = ((oct2 >> s) & 1) == 0
            y = ()
            for e in gl.static_range(8):
                p = _bfly_f(x[e], 1 << s)
                y = y + (gl.where(lo, x[e] + p, p - x[e]),)
            x = y
        y = ()
        for e in gl.static_range(8):
            y = y + (x[e] * HSCALE,)
        x = y
    return x


@gluon.jit
def _copy_feedback(f_s, fb_ptr, hd, D: gl.constexpr, W: gl.constexpr):
    """Start copying the head's K feedback matrices into ``f_s`` (row ``i * O + o``: the eight
    entries of row ``i`` of octet ``o``'s block matrix in the columns of the octet's own
    elements, ``8 * (o & 1) ..``: each lane of a block reads only the columns it updates)."""
    O: gl.constexpr = D // 8
    cl: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [W, 1], [1, 0])
    ci = gl.arange(0, 16 * O, layout=gl.SliceLayout(1, cl))  # row i * O + o
    cj = gl.arange(0, 8, layout=gl.SliceLayout(0, cl))
    coff = gl.expand_dims((ci // O) * 16 + ((ci % O) >> 1) * 256 + (ci & 1) * 8, 1) + gl.expand_dims(cj, 0)
    async_copy.async_copy_global_to_shared(f_s, fb_ptr + hd * (D * 16) + coff)
    async_copy.commit_group()


# the E2M1 thresholds of ``kv_formats.nvfp4`` step 3 in ``nvfp4_tree``'s order: 1.75, 3.5, 0.75
# (inclusive: a tie rounds up), then 5, 2.5, 1.25, 0.25 (exclusive)
_TREE_ORDER = (1.75, 3.5, 0.75, 5.0, 2.5, 1.25, 0.25)
assert sorted(_TREE_ORDER) == [t for t, _ in nvfp4.THRESHOLDS]
_THRESHOLD_BITS = tuple(struct.unpack("<H", struct.pack("<e", t))[0] for t in _TREE_ORDER)  # fp16, exact
# the grid's doubled values (``nvfp4.block_error``'s ``h`` for indices 1-7) in both 16-bit halves
_PACKED_HALVES = tuple(int(2 * v) * 0x10001 for v in nvfp4.E2M1_VALUES[1:])


@gluon.constexpr_function
def _thresholds_asm():
    muls = " ".join(f"mov.b32 c, {b * 0x10001:#010x}; mul.rn.f16x2 ${i}, s2, c;" for i, b in enumerate(_THRESHOLD_BITS))
    return "{ .reg .f16 h; .reg .b32 s2, c; cvt.rn.f16.f32 h, $7; mov.b32 s2, {h, h}; " + muls + " }"


@gluon.constexpr_function
def _packed(k):
    return _PACKED_HALVES[k - 1]


@gluon.jit
def _thresholds(s):
    """The seven thresholds ``t * s`` as fp16 pairs (both halves; every product is exact: ``s``
    is an E4M3 value in [2**-9, 448], ``t`` has at most three significant bits)."""
    return gl.inline_asm_elementwise(_thresholds_asm(), "=r,=r,=r,=r,=r,=r,=r,f", [s],
                                     dtype=(gl.int32,) * 7, is_pure=True, pack=1)


@gluon.jit
def _half_pairs(a):
    """This thread's eight ``a`` as four fp16 pairs (values 2p and 2p + 1 in the low and high
    halves), rounded toward zero and toward +inf. For ``a >= 0`` and any fp16 value ``T``:
    ``a >= T`` iff ``RZ(a) >= T`` and ``a > T`` iff ``RU(a) > T`` (rounding is monotone and
    keeps ``T``), so the comparisons of step 3 against the exact fp16 thresholds are exact on
    the pairs (NaN compares false either way)."""
    rz = ()
    ru = ()
    for p in gl.static_range(4):
        lo, hi = gl.inline_asm_elementwise(
            "{ .reg .f16 l, h; cvt.rz.f16.f32 l, $2; cvt.rz.f16.f32 h, $3; mov.b32 $0, {l, h}; "
            "cvt.rp.f16.f32 l, $2; cvt.rp.f16.f32 h, $3; mov.b32 $1, {l, h}; }",
            "=r,=r,f,f", [a[2 * p], a[2 * p + 1]], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        rz = rz + (lo,)
        ru = ru + (hi,)
    return rz, ru


# one pair of values under one candidate: the threshold tree of ``nvfp4_tree`` on both halves at
# once (``set.*.u32.f16x2``: 0xffff / 0 per half; ``lop3`` 0xCA: ``a ? b : c`` bitwise), the
# grid value times the step selected the same way as 16-bit halves (``Qk = k * step`` in both
# halves; a selected one is below 2**14, see ``_error``), then the two squared differences.
_PAIR_ASM = gl.constexpr(
    "{ .reg .b32 m2, m1, m0, t, x, y, u, v, w, q, Q, ql, qh, d0, d1, e; "
    "set.ge.u32.f16x2 m2, $1, $6; "
    "lop3.b32 t, m2, $7, $8, 0xCA; "
    "set.ge.u32.f16x2 m1, $1, t; "
    "lop3.b32 x, m1, $9, $10, 0xCA; "
    "lop3.b32 y, m1, $11, $12, 0xCA; "
    "lop3.b32 t, m2, x, y, 0xCA; "
    "set.gt.u32.f16x2 m0, $2, t; "
    "lop3.b32 u, m0, $19, $18, 0xCA; "
    "lop3.b32 v, m0, $17, $16, 0xCA; "
    "lop3.b32 w, m1, u, v, 0xCA; "
    "lop3.b32 x, m0, $15, $14, 0xCA; "
    "and.b32 y, m0, $13; "
    "lop3.b32 q, m1, x, y, 0xCA; "
    "lop3.b32 Q, m2, w, q, 0xCA; "
    "and.b32 ql, Q, 0xffff; "
    "shr.u32 qh, Q, 16; "
    "sub.s32 d0, $3, ql; "
    "sub.s32 d1, $4, qh; "
    "mad.lo.s32 e, d0, d0, $5; "
    "mad.lo.s32 $0, d1, d1, e; }"
)


_PAIR_CONSTRAINTS = gl.constexpr("=r," + ",".join(["r"] * 19))


@gluon.jit
def _error(rz, ru, big_a, c, half_unit):
    """int32 squared error of the block under scale code ``c`` (``kv_formats.nvfp4`` step 4):
    this thread's eight values as four fp16 pairs (``_half_pairs``), then the neighbour lane's
    sum. The same numbers as ``nvfp4_tree`` + ``triton_kernel.e2m1_halves`` value by value. The packed
    products: a value whose grid index ``k > 0`` is selected has ``a > 0.25 s``, so ``step =
    trunc(s * unit / 2) < 2 * a * unit < 2**14`` and its ``Q = h[k] * step`` is within
    ``1.2 * a * unit < 2**14`` too (``A = trunc(a * unit) < 2**13``): it fits a 16-bit half;
    products that do not fit are never selected."""
    s = e4m3_value(c)
    step = (s * half_unit).to(gl.int32)
    t175, t35, t075, t5, t25, t125, t025 = _thresholds(s)
    err = gl.zeros_like(step)
    for p in gl.static_range(4):
        err = gl.inline_asm_elementwise(
            _PAIR_ASM, _PAIR_CONSTRAINTS,
            [rz[p], ru[p], big_a[2 * p], big_a[2 * p + 1], err, t175, t35, t075, t5, t25, t125, t025,
             step * _packed(1), step * _packed(2), step * _packed(3), step * _packed(4), step * _packed(5),
             step * _packed(6), step * _packed(7)],
            dtype=gl.int32, is_pure=True, pack=1)
    return err + _bfly_i(err, 1)


@gluon.jit
def _try(c, best, best_err, rz, ru, big_a, half_unit):
    err = _error(rz, ru, big_a, c, half_unit)
    better = err < best_err
    return gl.where(better, c, best), gl.where(better, err, best_err)


@gluon.jit
def _nibble(col, a, s):
    """E2M1 nibble (sign at bit 3) of value ``col`` (``a = |col| / g``) under scale value ``s``
    (0: the block encodes to zero)."""
    b2, b1, b0 = nvfp4_tree(a, s)
    idx = gl.where(s > 0, 4 * b2.to(gl.int32) + 2 * b1.to(gl.int32) + b0.to(gl.int32), 0)
    return idx | (((col < 0) & (idx > 0)).to(gl.int32) << 3)


@gluon.jit
def _nearest_nibbles(x, a, s):
    """The eight nibbles of this thread's values, rounded to nearest under scale values ``s``."""
    nib = ()
    for e in gl.static_range(8):
        nib = nib + (_nibble(x[e], a[e], s),)
    return nib


@gluon.jit
def _unbind16(x, l2: gl.constexpr):
    """[R, O, 16] -> the sixteen [R, O] tensors of positions 0..15 (register moves only)."""
    R: gl.constexpr = x.shape[0]
    O: gl.constexpr = x.shape[1]
    ev, od = gl.split(gl.reshape(x, [R, O, 8, 2]))
    e = _unbind8(ev, l2)
    o = _unbind8(od, l2)
    return (e[0], o[0], e[1], o[1], e[2], o[2], e[3], o[3], e[4], o[4], e[5], o[5], e[6], o[6], e[7], o[7])


@gluon.jit
def _grid(sv, g):
    """nvfp4 under scale values ``sv`` [R, O], in K's own units (times ``g``) for the recursion:
    the seven thresholds ``(t * s) * g`` in ``nvfp4_tree``'s order, then the eight magnitudes
    ``((h / 2) * s) * g`` of indices 0..7 (``h`` the doubled grid value). Every product is
    exact (``t`` and ``h / 2`` have at most three significant bits, ``s`` four, ``g`` is a power
    of two), so ``|w| >= (t * s) * g`` iff ``|w| / g >= t * s`` — the reference's comparison
    on ``a = |w| / g`` — and a magnitude is the value the reference's error subtracts."""
    tg = ()
    for t in gl.static_range(7):
        tg = tg + ((_tree_threshold(t) * sv) * g,)
    mg = ()
    for k in gl.static_range(8):
        mg = mg + (((_half_grid(k) * 0.5) * sv) * g,)
    return tg, mg


@gluon.constexpr_function
def _tree_threshold(t):
    return _TREE_ORDER[t]


@gluon.constexpr_function
def _half_grid(k):
    return float(int(2 * nvfp4.E2M1_VALUES[k]))


# E4M3 by the hardware (sm_89+): ``cvt.rn.satfinite`` is round-half-even with saturation at 448,
# the codec's rule (``kv_formats.e4m3``) for every finite input; the code comes back to fp16 by
# ``cvt.rn.f16x2.e4m3x2`` (every E4M3 value is an fp16 number) and to fp32 exactly.
_E4M3_ASM = gl.constexpr(
    "{ .reg .b16 c; .reg .b32 h, k; .reg .f16 l, u; "
    "cvt.rn.satfinite.e4m3x2.f32 c, $2, $2; "
    "cvt.rn.f16x2.e4m3x2 h, c; "
    "mov.b32 {l, u}, h; "
    "cvt.f32.f16 $1, l; "
    "cvt.u32.u16 k, c; "
    "and.b32 $0, k, 0xff; }"
)


@gluon.jit
def _e4m3_hw(y):
    """(signed E4M3 code, its fp32 value) of fp32 ``y``: the same as ``e4m3_encode(|y|)`` with
    the sign at bit 7 (``kv_formats.e4m3.encode_signed``), by two conversions instead of ~10
    operations. A value that rounds to zero gets code 0 (the hardware's negative zero, 0x80, is
    cleared; its value -0.0 subtracts like +0.0)."""
    c, val = gl.inline_asm_elementwise(_E4M3_ASM, "=r,=f,f", [y], dtype=(gl.int32, gl.float32), is_pure=True,
                                       pack=1)
    return gl.where(c == 0x80, 0, c), val


# four values' E4M3 codes as one word (byte e = value e; ``a`` goes to the upper byte of a pair)
_E4M3_WORD_ASM = gl.constexpr(
    "{ .reg .b16 lo, hi; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
    "mov.b32 $0, {lo, hi}; }"
)


@gluon.jit
def _e4m3_word(y0, y1, y2, y3):
    """The signed E4M3 codes of ``y0..y3`` in bytes 0..3 of an int32, as ``_e4m3_hw``: bytes of
    negative zero (0x80) cleared word-wide (a byte's low seven bits are zero iff adding 0x7f
    leaves its bit 7 clear)."""
    w = gl.inline_asm_elementwise(_E4M3_WORD_ASM, "=r,f,f,f,f", [y0, y1, y2, y3], dtype=gl.int32, is_pure=True,
                                  pack=1)
    nonzero = ((w & 0x7F7F7F7F) + 0x7F7F7F7F) & -0x7F7F7F80  # & 0x80808080 as an int32
    return w & (nonzero | 0x7F7F7F7F)


@gluon.jit
def _rounded(col, inv_g, g, sv, tg, mg, FP8: gl.constexpr):
    """(code, error) of value ``col``: fp8 its signed E4M3 code (sign at bit 7); nvfp4 its E2M1
    nibble (sign at bit 3) under scale values ``sv`` with ``(tg, mg) = _grid(sv, g)``. The error is
    ``col`` minus the code's exact value (times ``g``), as the reference computes it. nvfp4's
    error takes the tree's three comparisons and three selects among the magnitudes (the
    recursion's critical path); the nibble is built beside it."""
    if FP8:
        c, val = _e4m3_hw(col * inv_g)
        return c, col - val * g
    else:
        ac = gl.abs(col)
        b2 = ac >= tg[0]
        b1 = ac >= gl.where(b2, tg[1], tg[2])
        b0 = ac > gl.where(b2, gl.where(b1, tg[3], tg[4]), gl.where(b1, tg[5], tg[6]))
        mag = gl.where(b2, gl.where(b1, gl.where(b0, mg[7], mg[6]), gl.where(b0, mg[5], mg[4])),
                       gl.where(b1, gl.where(b0, mg[3], mg[2]), gl.where(b0, mg[1], mg[0])))
        idx = gl.where(sv > 0, 4 * b2.to(gl.int32) + 2 * b1.to(gl.int32) + b0.to(gl.int32), 0)
        nib = idx | (((col < 0) & (idx > 0)).to(gl.int32) << 3)
        return nib, col - gl.where(col < 0, -mag, mag)


@gluon.jit
def _feedback_codes(x, half, inv_g, g, sv, f_s, l2: gl.constexpr, l3f: gl.constexpr, FP8: gl.constexpr):
    """The eight codes of this thread's values (``_rounded``), the block rounded with error
    feedback (``kv_formats.feedback``, as ``triton_kernel.nvfp4_feedback`` / ``fp8_feedback``).
    Each lane of a block updates only its own eight elements: step ``i`` rounds element ``i``
    in the lane that holds it (the other lane's rounding of its register ``i % 8`` is
    discarded); for ``i < 8`` the low lane's error reaches the high lane by one shuffle (the
    low lane's own chain has none), and from ``i = 8`` on only the high lane's elements after
    ``i`` change. Entries left of the diagonal are zero (``F[i, k] = 0`` for ``k <= i``), so
    updating an element at or before the step leaves it as it is. ``f_s`` (shared memory [16 O,
    8]): the lane's eight columns of row ``i`` at row ``i O + o`` (``_copy_feedback``). Products
    and differences are rounded one by one (the launch disables FMA contraction)."""
    lo = half == 0
    w = x
    R: gl.constexpr = l3f.warps_per_cta[0] * l3f.threads_per_warp[0]
    O: gl.constexpr = l3f.threads_per_warp[1]
    rows0 = gl.zeros([R, O, 8], gl.float32, layout=l3f)
    async_copy.wait_group(0)
    gl.thread_barrier()
    if FP8:
        tg = ()
        mg = ()
    else:
        tg, mg = _grid(sv, g)
    codes = ()
    for i in gl.static_range(16):
        code, err = _rounded(w[i % 8], inv_g, g, sv, tg, mg, FP8)
        codes = codes + (code,)
        if i < 15:
            if i < 8:  # the high lane takes the low lane's error
                err = gl.where(lo, err, _bfly_f(err, 1))
            fi = gl.expand_dims(f_s.slice(i * O, O).load(gl.SliceLayout(0, l3f)), 0)  # F[i, own columns]
            f = _unbind8(gl.broadcast(fi, rows0)[0], l2)  # [R, O, 8] without arithmetic (x + 0.0: an FADD)
            nw = ()
            for k in gl.static_range(8):
                if i < 8 or k > i - 8:
                    nw = nw + (w[k] - err * f[k],)
                else:
                    nw = nw + (w[k],)
            w = nw
    out = ()
    for e in gl.static_range(8):
        out = out + (gl.where(lo, codes[e], codes[e + 8]),)
    return out


@gluon.jit
def append_kernel(
    cache_ptr, k_ptr, v_ptr, slot_ptr, g_ptr, koff_ptr, cnt_ptr, fb_ptr,
    N, NUM_HEADS,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cp, stride_ckv, stride_ch, stride_on,
    D: gl.constexpr, HSCALE: gl.constexpr, HADAMARD: gl.constexpr, HAS_OFFSET: gl.constexpr,
    COUNT: gl.constexpr, FEEDBACK: gl.constexpr, SCALE_OFF: gl.constexpr,
    SEARCH_DOWN: gl.constexpr, SEARCH_UP: gl.constexpr, UP_SPAN: gl.constexpr, FB_DOWN: gl.constexpr,
    FB_LO: gl.constexpr, FB_HI: gl.constexpr, ERR_BITS: gl.constexpr, ERR_EXP_FLOOR: gl.constexpr,
    PDL: gl.constexpr, FP8: gl.constexpr, HSIZE: gl.constexpr = 0,
):
    """nvfp4 (``FP8`` False: the block-scale search, E2M1 nibbles, page layout 3) or fp8 (each
    element E4M3-rounded; ``_store_fp8``) rows of one KV head of K or V. ``HSIZE``: K's
    Hadamard transform size (0: D; ``KVLayout.hadamard_size``) and ``HSCALE`` its scale."""
    pdl.enter(PDL)
    O: gl.constexpr = D // 8
    W: gl.constexpr = gl.num_warps()
    R: gl.constexpr = W * (32 // O)
    l2: gl.constexpr = _rows_layout(O, W)
    l3: gl.constexpr = _octets_layout(O, W, 8)
    pid_t = gl.program_id(0)
    hd = gl.program_id(1)
    kv = gl.program_id(2)
    rows = pid_t * R + gl.arange(0, R, layout=gl.SliceLayout(1, l2))
    octet = gl.arange(0, O, layout=gl.SliceLayout(0, l2))
    in_range = rows < N
    slot = gl.load(slot_ptr + rows, mask=in_range, other=-1).to(gl.int64)
    valid = slot >= 0
    g = gl.load(g_ptr + kv * NUM_HEADS + hd)
    inv_g = gl.div_rn(1.0, g)  # exact: g is a power of two
    zero2 = gl.zeros([R, O], gl.int32, layout=l2)
    oct2 = gl.expand_dims(octet, 0) + zero2
    half = oct2 & 1
    if FEEDBACK:
        # rows of 32 bytes (a lane's eight columns of row i): the swizzle phase steps every four
        # rows, so a quarter-warp's eight 16-byte reads (rows i O + o, eight octets) land in eight
        # distinct bank groups (with 64-byte rows before: phase per two rows, 4.03 -> 3.89 us nvfp4)
        f_s = gl.allocate_shared_memory(gl.float32, [16 * O, 8], gl.SwizzledSharedLayout(vec=4, per_phase=4, max_phase=2,
                                                                                          order=[1, 0]))
    else:
        f_s = g_ptr  # a placeholder (unused)
    if kv == 0:
        if FEEDBACK:  # the K feedback matrices of the head's blocks, one per octet, copied while the search runs
            _copy_feedback(f_s, fb_ptr, hd, D, W)
        x = _load_k(k_ptr, koff_ptr, rows, in_range, oct2, hd, stride_kn, stride_kh, stride_on, D, HSCALE,
                    HADAMARD, HAS_OFFSET, l2, l3, (HSIZE if HSIZE > 0 else D) // 8)
    else:
        x = _load_octets(v_ptr + hd * stride_vh, rows, in_range, stride_vn, R, O, l2, l3)
    if FP8:
        _store_fp8(x, kv, hd, valid, slot, oct2, half, zero2, inv_g, g, f_s, cache_ptr, cnt_ptr,
                   stride_cp, stride_ckv, stride_ch, NUM_HEADS, D, COUNT, FEEDBACK, l2, W)
    else:
        _store_nvfp4(x, kv, hd, valid, slot, oct2, half, zero2, inv_g, g, f_s, cache_ptr, cnt_ptr,
                     stride_cp, stride_ckv, stride_ch, NUM_HEADS, D, SCALE_OFF, COUNT, FEEDBACK,
                     SEARCH_DOWN, SEARCH_UP, UP_SPAN, FB_DOWN, FB_LO, FB_HI, ERR_BITS, ERR_EXP_FLOOR, l2, W)


@gluon.jit
def _store_nvfp4(x, kv, hd, valid, slot, oct2, half, zero2, inv_g, g, f_s, cache_ptr, cnt_ptr,
                 stride_cp, stride_ckv, stride_ch, NUM_HEADS, D: gl.constexpr, SCALE_OFF: gl.constexpr,
                 COUNT: gl.constexpr, FEEDBACK: gl.constexpr, SEARCH_DOWN: gl.constexpr, SEARCH_UP: gl.constexpr,
                 UP_SPAN: gl.constexpr, FB_DOWN: gl.constexpr, FB_LO: gl.constexpr, FB_HI: gl.constexpr,
                 ERR_BITS: gl.constexpr, ERR_EXP_FLOOR: gl.constexpr, l2: gl.constexpr, W: gl.constexpr):
    """nvfp4 codes and block scales of the rows ``x`` (``kv_formats.nvfp4``): the block scale's
    search, the elements rounded to nearest or, for K with ``FEEDBACK``, with error feedback,
    then page layout 3's code words and the scale bytes."""
    O: gl.constexpr = D // 8
    # block scale (kv_formats.nvfp4 steps 1-4)
    enc = inv_g * 0.1666666716337204  # fp32(1/6), see nvfp4.INV_6
    amax = gl.abs(x[0])
    for e in gl.static_range(1, 8):
        amax = gl.maximum(amax, gl.abs(x[e]))
    amax = gl.maximum(amax, _bfly_f(amax, 1))
    sv = amax * enc
    c6, s6 = e4m3_encode(sv)
    a = ()
    for e in gl.static_range(8):
        a = a + (gl.abs(x[e]) * inv_g,)
    m = a[0]
    for e in gl.static_range(1, 8):
        m = gl.maximum(m, a[e])
    m = gl.maximum(m, _bfly_f(m, 1))
    c4, _ = e4m3_encode(m * 0.25)
    top = gl.minimum(c4 + SEARCH_UP, 126)
    ex = gl.maximum((m.to(gl.int32, bitcast=True) >> 23) - 127, ERR_EXP_FLOOR)
    unit = ((127 + ERR_BITS - ex) << 23).to(gl.float32, bitcast=True)
    half_unit = ((126 + ERR_BITS - ex) << 23).to(gl.float32, bitcast=True)
    big_a = ()
    for e in gl.static_range(8):
        big_a = big_a + ((a[e] * unit).to(gl.int32),)
    clip = kv == 0
    c0 = gl.where(clip | (6.0 * s6 >= m), c6, gl.minimum(c6 + 1, 126))
    top = gl.maximum(top, c0)
    rz, ru = _half_pairs(a)
    best = c0
    best_err = _error(rz, ru, big_a, c0, half_unit)
    # the other candidates in the reference's order (unrolled: a loop measured 3.13 -> 3.37 us per step)
    if FEEDBACK and clip:  # K rounded with feedback: c6, c6-1, c4 (nvfp4.feedback_candidates)
        for k in gl.static_range(1, FB_DOWN + 1):
            best, best_err = _try(gl.maximum(c0 - k, 1), best, best_err, rz, ru, big_a, half_unit)
        for j in gl.static_range(FB_LO, FB_HI + 1):
            best, best_err = _try(gl.minimum(gl.maximum(c4 + j, 1), 126), best, best_err, rz, ru, big_a, half_unit)
    else:
        if clip:
            for k in gl.static_range(1, SEARCH_DOWN + 1):
                best, best_err = _try(gl.maximum(c0 - k, 1), best, best_err, rz, ru, big_a, half_unit)
        for k in gl.static_range(1, UP_SPAN + 1):
            best, best_err = _try(gl.minimum(c0 + k, top), best, best_err, rz, ru, big_a, half_unit)
    s_code = gl.where(c6 > 0, best, 0)
    s_best = gl.where(c6 > 0, e4m3_value(best), 0.0)
    if COUNT:  # zero / subnormal / saturated block scales (kernels.calibration), one lane per block
        _count_scales(cnt_ptr + (kv * NUM_HEADS + hd) * 3, sv, gl.expand_dims(valid, 1) & (half == 0))
    # element codes
    if FEEDBACK:
        if kv == 0:
            nib = _feedback_codes(x, half, inv_g, g, s_best, f_s, l2, _octets_layout(O, W, 8), False)
        else:
            nib = _nearest_nibbles(x, a, s_best)
    else:
        nib = _nearest_nibbles(x, a, s_best)
    # page layout 3 (kv_formats.nvfp4): byte j = low element j (sign 7, index 1-3) | high element
    # j + d/2 (index 4-6, sign 0); the high elements are in lane ^ (O / 2)
    low_a = zero2
    low_b = zero2
    high_a = zero2
    high_b = zero2
    for e in gl.static_range(4):
        low_a = low_a | ((((nib[e] & 8) << 4) | ((nib[e] & 7) << 1)) << (8 * e))
        low_b = low_b | ((((nib[e + 4] & 8) << 4) | ((nib[e + 4] & 7) << 1)) << (8 * e))
        high_a = high_a | ((((nib[e] & 7) << 4) | (nib[e] >> 3)) << (8 * e))
        high_b = high_b | ((((nib[e + 4] & 7) << 4) | (nib[e + 4] >> 3)) << (8 * e))
    word_a = low_a | _bfly_i(high_a, O // 2)
    word_b = low_b | _bfly_i(high_b, O // 2)
    page = gl.where(valid, slot // 64, 0)
    off = gl.where(valid, slot % 64, 0)
    base = cache_ptr + page * stride_cp + kv * stride_ckv + hd * stride_ch  # [R]
    base2 = gl.expand_dims(base, 1)
    wptr = (base2 + gl.expand_dims(off * (D // 2), 1) + oct2 * 8).to(gl.pointer_type(gl.int32))
    wmask = gl.expand_dims(valid, 1) & (oct2 < O // 2)
    gl.store(wptr, word_a, mask=wmask)
    gl.store(wptr + 1, word_b, mask=wmask)
    blk = oct2 >> 1
    if kv == 0:
        sptr = base2 + SCALE_OFF + gl.expand_dims(off * (D // 16), 1) + blk
    else:  # V's scale region is block-major (kv_formats.layout.scale_slot)
        slot_v = 16 * ((off >> 1) & 3) + (off & 1) + 2 * (off >> 3)
        sptr = base2 + SCALE_OFF + gl.expand_dims(slot_v, 1) + blk * 64
    gl.store(sptr, s_code.to(gl.uint8), mask=gl.expand_dims(valid, 1) & (half == 0))


@gluon.jit
def _nearest_fp8_words(x, inv_g):
    """This thread's eight values rounded to nearest (``triton_kernel.fp8_codes``) as two code words
    (``_e4m3_word``: elements 0-3, 4-7)."""
    return (_e4m3_word(x[0] * inv_g, x[1] * inv_g, x[2] * inv_g, x[3] * inv_g),
            _e4m3_word(x[4] * inv_g, x[5] * inv_g, x[6] * inv_g, x[7] * inv_g))


@gluon.jit
def _code_words(code, zero2):
    """Eight code bytes as two words (elements 0-3, 4-7)."""
    word_a = zero2
    word_b = zero2
    for e in gl.static_range(4):
        word_a = word_a | ((code[e] & 0xFF) << (8 * e))
        word_b = word_b | ((code[e + 4] & 0xFF) << (8 * e))
    return word_a, word_b


@gluon.jit
def _count_flags_wide(cnt_ptr, flags, ok):
    """``count_flags`` for a program of 1024 or more elements: each thread's packed 10-bit fields
    (a sum of eight flags) widened to 21-bit fields of an int64 before the one reduction."""
    f = gl.where(ok, flags, 0)
    wide = ((f & 1023).to(gl.int64) | (((f >> 10) & 1023).to(gl.int64) << 21)
            | ((f >> 20).to(gl.int64) << 42))
    packed = gl.sum(gl.sum(wide, axis=1), axis=0)
    if packed != 0:
        n_zero = packed & 2097151
        n_sub = (packed >> 21) & 2097151
        n_sat = packed >> 42
        if n_zero != 0:
            gl.atomic_add(cnt_ptr + 0, n_zero, sem="relaxed")
        if n_sub != 0:
            gl.atomic_add(cnt_ptr + 1, n_sub, sem="relaxed")
        if n_sat != 0:
            gl.atomic_add(cnt_ptr + 2, n_sat, sem="relaxed")


@gluon.jit
def _store_fp8(x, kv, hd, valid, slot, oct2, half, zero2, inv_g, g, f_s, cache_ptr, cnt_ptr,
               stride_cp, stride_ckv, stride_ch, NUM_HEADS, D: gl.constexpr, COUNT: gl.constexpr,
               FEEDBACK: gl.constexpr, l2: gl.constexpr, W: gl.constexpr):
    """fp8 (``kv_formats.fp8``, ``triton_kernel``'s ``FMT == 1``) codes of the rows ``x``: each
    element E4M3-rounded on its own or, for K with ``FEEDBACK``, block by block with error
    feedback (``_feedback_codes``); eight code bytes per thread stored as two words. ``COUNT``:
    every element's ``|x| / g`` is a scale input (fp8 counts elements), so a program holds under
    1024 of them (``launch``)."""
    O: gl.constexpr = D // 8
    if COUNT:
        flags = zero2
        for e in gl.static_range(8):
            flags = flags + scale_flags(gl.abs(x[e] * inv_g))
        ok = gl.expand_dims(valid, 1) & (oct2 >= 0)
        if W * (32 // O) * D < 1024:
            count_flags(cnt_ptr + (kv * NUM_HEADS + hd) * 3, flags, ok)
        else:
            _count_flags_wide(cnt_ptr + (kv * NUM_HEADS + hd) * 3, flags, ok)
    if FEEDBACK:
        if kv == 0:
            code = _feedback_codes(x, half, inv_g, g, g, f_s, l2, _octets_layout(O, W, 8), True)
            word_a, word_b = _code_words(code, zero2)
        else:
            word_a, word_b = _nearest_fp8_words(x, inv_g)
    else:
        word_a, word_b = _nearest_fp8_words(x, inv_g)
    page = gl.where(valid, slot // 64, 0)
    off = gl.where(valid, slot % 64, 0)
    base = cache_ptr + page * stride_cp + kv * stride_ckv + hd * stride_ch  # [R]
    wptr = (gl.expand_dims(base + off * D, 1) + oct2 * 8).to(gl.pointer_type(gl.int32))
    wmask = gl.expand_dims(valid, 1) & (oct2 >= 0)
    gl.store(wptr, word_a, mask=wmask)
    gl.store(wptr + 1, word_b, mask=wmask)


def supported(layout: KVLayout) -> bool:
    """What these kernels cover; everything else stays with ``triton_kernel``."""
    return layout.fmt in (KVFormat.NVFP4, KVFormat.FP8) and layout.head_dim in HEAD_DIMS and layout.page_size == 64


def available(device: torch.device) -> bool:
    """Hopper and not the interpreter."""
    return device.type == "cuda" and not INTERPRET and capability(device) == (9, 0)


def launch(cache: torch.Tensor, layout: KVLayout, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
           global_scales: torch.Tensor, k_offset: torch.Tensor | None, scale_counts: torch.Tensor | None,
           k_feedback: torch.Tensor | None, num_warps: int = 1) -> None:
    """Launch over already validated arguments (``triton_kernel.append`` checks them and picks
    this kernel where ``supported`` and ``available``)."""
    n = k.shape[0]
    d = layout.head_dim
    rows = num_warps * (32 // (d // 8))
    grid = (triton.cdiv(n, rows), layout.num_kv_heads, 2)
    fp8 = layout.fmt is KVFormat.FP8
    append_kernel[grid](
        cache, k, v, slots, global_scales, global_scales if k_offset is None else k_offset,
        slots if scale_counts is None else scale_counts, slots if k_feedback is None else k_feedback,
        n, layout.num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2),
        k_offset.stride(0) if k_offset is not None and k_offset.dim() == 3 else 0,
        D=d, HSCALE=hadamard_scale(layout.hadamard_size or d), HADAMARD=layout.hadamard,
        HSIZE=0 if layout.hadamard_size in (0, d) else layout.hadamard_size, HAS_OFFSET=k_offset is not None,
        COUNT=scale_counts is not None, FEEDBACK=k_feedback is not None, SCALE_OFF=layout.scale_offset,
        SEARCH_DOWN=nvfp4.SEARCH_DOWN, SEARCH_UP=nvfp4.SEARCH_UP, UP_SPAN=nvfp4.UP_SPAN,
        FB_DOWN=nvfp4.FEEDBACK_DOWN, FB_LO=nvfp4.FEEDBACK_FOUR_LO, FB_HI=nvfp4.FEEDBACK_FOUR_HI,
        ERR_BITS=nvfp4.ERR_BITS,
        ERR_EXP_FLOOR=nvfp4.ERR_EXP_FLOOR, FP8=fp8, num_warps=num_warps, enable_fp_fusion=k_feedback is None,
        **pdl.launch_kwargs(k.device, "append"),
    )
