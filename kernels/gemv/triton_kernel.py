"""``x @ w.T (+ bias)`` for a few tokens (decode) with 16-bit weights: a split-K GEMV in Triton.

Decode multiplies 1-16 activation rows by a weight of tens of MB, so the time is the time to
read the weight once from HBM; the products are free. The kernel is the FP8 W8A16 kernel
(``kernels.fp8_gemm.triton_kernel``) without the dequantization: a program owns ``BN`` output
columns (and a group of rows) and walks its share of K in ``BK`` steps, loading the weight tile
``[BN, BK]`` once for all the rows it serves. Two inner products (``variant``), because which
one reads faster at one token is a measurement, not a given:

- ``"dot"``: ``tl.dot`` of the activation tile ``[16, BK]`` (rows past M read as zeros: the
  tensor cores' smallest M) with the weight tile, fp32 accumulation. fp32 activations, and
  every dtype in the interpreter (whose 16-bit dot misreads its inputs), take IEEE fp32
  products of the same values instead (no TF32).
- ``"fma"``: no tensor cores. Per ``BK`` step the weight tile is widened to fp32 and each of up
  to ``FMA_ROWS`` rows (unrolled; more rows take more programs along the grid's first axis,
  each reading the weight again) accumulates ``tl.sum(w * x[None, :], axis=1)`` in fp32.
- ``"auto"`` (the default): ``"fma"`` up to ``FMA_MAX_TOKENS`` rows, ``"dot"`` above.

Few tokens leave few output tiles (one token at N = 5120 and ``BN = 64``: 80 programs for an
H100's 132 SMs, each walking all of K), so K is split (``split_count``: about
``PROGRAMS_PER_SM`` programs per SM, each split at least ``MIN_SPLIT_STEPS`` ``BK`` steps;
1 off CUDA). With one split the program adds the bias and stores the output; with more each
writes its fp32 partial sums to ``[split, M, N]`` and one small launch (``_reduce_kernel``)
adds them in split order (deterministic: no atomics), adds the bias and rounds once to x's
dtype (ties to even, also in the interpreter: ``kernels.fused.common.round_to``). Nothing
waits on the host, and the shapes depend on the arguments' shapes alone, so a CUDA graph can
capture a call.

Results differ from ``reference.linear`` (``F.linear``) by the fp32 summation order only.
Weight loads are unmasked where ``BN`` divides N and ``BK`` divides K (every Qwen3.5 linear
shape), so the compiler may issue 16-byte loads. ``supports(x, w)`` says whether a call
belongs here (up to ``MAX_TOKENS`` rows, on CUDA or under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.e4m3_unpack import e4m3_f16
from deepwell.kernels.fused.common import INTERPRET, KIND, round_to

#: Rows (tokens) the kernel is meant for; ``supports`` is False above (torch's GEMM then wins).
MAX_TOKENS = 16
#: The inner-product forms ``linear`` takes (``"auto"`` picks one by the row count).
VARIANTS = ("auto", "dot", "fma")
#: ``"auto"`` takes ``"fma"`` up to this many rows, ``"dot"`` above. Not measured yet: a guess
#: (fewer rows waste more of the 16-row tensor-core tile) until ``bench`` has run on an H100;
#: the block defaults below are likewise untuned.
FMA_MAX_TOKENS = 4
#: Rows one ``"fma"`` program serves (the kernel unrolls up to ``FMA_ROWS_MAX``); more rows, more programs.
FMA_ROWS = 4
FMA_ROWS_MAX = 8
DOT_BM = 16  # the dot variant's row tile: tl.dot's smallest M
# Split K until a launch has this many programs per SM (as the FP8 kernel), each split at
# least MIN_SPLIT_STEPS BK steps.
PROGRAMS_PER_SM = 4
MIN_SPLIT_STEPS = 4
DEFAULT_BLOCK_N = {"dot": 64, "fma": 64}
DEFAULT_BLOCK_K = {"dot": 128, "fma": 128}
REDUCE_BLOCK = 1024
#: Split-K sums inside the GEMM launch (``split_fixup``) instead of one more launch: on with
#: ``DEEPWELL_SPLITK_FIXUP=1`` (off by default until it is timed end to end on a GPU). Counters
#: for this many output tiles per launch are kept per device; a launch with more sums after it.
FIXUP_ENV = "DEEPWELL_SPLITK_FIXUP"
FIXUP_SLOTS = 1 << 14
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


@triton.jit
def _load_tile(ptrs, row_ok, k_ok, EVEN_ROWS: tl.constexpr, EVEN_K: tl.constexpr):
    """A ``[rows, BK]`` tile, masked only along the axes that can run past the tensor."""
    if EVEN_ROWS and EVEN_K:
        t = tl.load(ptrs)
    elif EVEN_K:
        t = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif EVEN_ROWS:
        t = tl.load(ptrs, mask=k_ok[None, :], other=0.0)
    else:
        t = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return t


@triton.jit
def _row_sum(w, x_ptrs, k_ok, EVEN_K: tl.constexpr):
    """``sum_k w[n, k] * x[k]`` in fp32 for one activation row."""
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=k_ok, other=0.0)
    return tl.sum(w * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _store_row(o_ptr, b_ptr, acc, m, M, N, rn, n_ok, pid_k, stride_om, SPLIT: tl.constexpr,
               HAS_BIAS: tl.constexpr, KIND_X: tl.constexpr):
    ok = n_ok & (m + 0 * rn < M)  # a tensor mask (the interpreter takes no scalar one)
    if SPLIT:  # fp32 partial sums [splits, M, N]: added (and the bias) by _reduce_kernel
        tl.store(o_ptr + pid_k.to(tl.int64) * M * N + m * N + rn, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(o_ptr + m * stride_om + rn, round_to(acc, KIND_X).to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _split_total(p_ptr, offs, ok, MN, splits, b_ptrs, HAS_BIAS: tl.constexpr):
    """``sum_s p[s * MN + offs]`` in split order, then the bias at ``b_ptrs``: the fp32 value
    both split-K sums (``_reduce_kernel``, ``split_fixup``) round once. The loads bypass L1
    (``.cg``): other programs wrote the partials."""
    acc = tl.zeros_like(offs).to(tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(b_ptrs, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def split_fixup(p_ptr, b_ptr, o_ptr, cnt_ptr, tile, splits, M, N, stride_om, rm, rn, HAS_BIAS: tl.constexpr,
                KIND_X: tl.constexpr):
    """The split-K sum inside the launch: called by every program of a split launch after it
    stored its fp32 partials (``[splits, M, N]``) for rows ``rm`` x columns ``rn`` of output
    tile ``tile``. The program counts itself in on the tile's counter; the last of the tile's
    ``splits`` programs to arrive adds the partials in split order and the bias and rounds once
    to ``o_ptr`` (``_split_total``, as ``_reduce_kernel``), then sets the counter back to 0 for
    the next launch. The barrier and the counter's acquire-release order every program's
    partial stores before the last one's loads."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:
        ok = (rm < M)[:, None] & (rn < N)[None, :]
        offs = rm[:, None] * N + rn[None, :]
        acc = _split_total(p_ptr, offs, ok, M * N, splits, b_ptr + rn[None, :] + 0 * offs, HAS_BIAS)
        tl.store(o_ptr + rm[:, None] * stride_om + rn[None, :], round_to(acc, KIND_X).to(o_ptr.dtype.element_ty),
                 mask=ok)
        tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _fma_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_om, s_ptr, stride_sn,
                HAS_BIAS: tl.constexpr, KIND_X: tl.constexpr, SPLIT: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                FP8: tl.constexpr = False, SBN: tl.constexpr = 1, SBK: tl.constexpr = 1, FP8_HW: tl.constexpr = True,
                PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0, FIXUP: tl.constexpr = False,
                out_ptr=None, cnt_ptr=None, SPLITS=1):
    """16-bit weights, or (``FP8``: ``kernels.fp8_gemm.fma_matmul``) E4M3 codes whose step sums are
    multiplied by their block scale ``s[n // SBN, k // SBK]`` (``BK`` divides ``SBK``). ``FIXUP``
    (with ``SPLIT``): the partials are summed into ``out_ptr`` inside this launch
    (``split_fixup`` over ``SPLITS`` programs per tile, counters at ``cnt_ptr``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m0 = pid_m * ROWS
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_ok = rn < N
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    pdl.enter_streaming(PDL, w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn + k_lo, k_lo, k_hi, PREFETCH)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_lo + rk)[None, :]
    s_ptrs = s_ptr + (rn // SBN) * stride_sn
    x_ptrs = x_ptr + m0 * stride_xm + k_lo + rk
    # rows past M (the last group of M % ROWS rows) read row M - 1 again; their sums are not stored
    d1 = (tl.minimum(m0 + 1, M - 1) - m0) * stride_xm
    d2 = (tl.minimum(m0 + 2, M - 1) - m0) * stride_xm
    d3 = (tl.minimum(m0 + 3, M - 1) - m0) * stride_xm
    d4 = (tl.minimum(m0 + 4, M - 1) - m0) * stride_xm
    d5 = (tl.minimum(m0 + 5, M - 1) - m0) * stride_xm
    d6 = (tl.minimum(m0 + 6, M - 1) - m0) * stride_xm
    d7 = (tl.minimum(m0 + 7, M - 1) - m0) * stride_xm
    acc0 = tl.zeros((BN,), dtype=tl.float32)
    acc1 = tl.zeros((BN,), dtype=tl.float32)
    acc2 = tl.zeros((BN,), dtype=tl.float32)
    acc3 = tl.zeros((BN,), dtype=tl.float32)
    acc4 = tl.zeros((BN,), dtype=tl.float32)
    acc5 = tl.zeros((BN,), dtype=tl.float32)
    acc6 = tl.zeros((BN,), dtype=tl.float32)
    acc7 = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = k0 + rk < k_hi
        if FP8:  # the codes' exact values; each step's sums times the block's scale
            w = e4m3_f16(_load_tile(w_ptrs, n_ok, k_ok, EVEN_N, EVEN_K), FP8_HW).to(tl.float32)
            sc = tl.load(s_ptrs + k0 // SBK, mask=n_ok, other=0.0)
        else:
            w = _load_tile(w_ptrs, n_ok, k_ok, EVEN_N, EVEN_K).to(tl.float32)
            sc = 1.0  # exact: the 16-bit form's sums unchanged
        acc0 += sc * _row_sum(w, x_ptrs, k_ok, EVEN_K)
        if ROWS > 1:
            acc1 += sc * _row_sum(w, x_ptrs + d1, k_ok, EVEN_K)
        if ROWS > 2:
            acc2 += sc * _row_sum(w, x_ptrs + d2, k_ok, EVEN_K)
        if ROWS > 3:
            acc3 += sc * _row_sum(w, x_ptrs + d3, k_ok, EVEN_K)
        if ROWS > 4:
            acc4 += sc * _row_sum(w, x_ptrs + d4, k_ok, EVEN_K)
        if ROWS > 5:
            acc5 += sc * _row_sum(w, x_ptrs + d5, k_ok, EVEN_K)
        if ROWS > 6:
            acc6 += sc * _row_sum(w, x_ptrs + d6, k_ok, EVEN_K)
        if ROWS > 7:
            acc7 += sc * _row_sum(w, x_ptrs + d7, k_ok, EVEN_K)
        w_ptrs += BK
        x_ptrs += BK
    _store_row(o_ptr, b_ptr, acc0, m0, M, N, rn, n_ok, pid_k, stride_om, SPLIT, HAS_BIAS, KIND_X)
    if ROWS > 1:
        _store_row(o_ptr, b_ptr, acc1, m0 + 1, M, N, rn, n_ok, pid_k, stride_om, SPLIT, HAS_BIAS, KIND_X)
    if ROWS > 2:
        _store_row(o_ptr, b_ptr, acc2, m0 + 2, M, N, rn, n_ok, pid_k, stride_om, SPLIT, HAS_BIAS, KIND_X)
    if ROWS > 3:
        _store_row(o_ptr, b_ptr, acc3, m0 + 3, M, N, rn, n_ok, pid_k, stride_om, SPLIT, HAS_BIAS, KIND_X)
    if ROWS > 4:
        _store_row(o_ptr, b_ptr, acc4, m0 + 4, M, N, rn, n_ok, pid_k, stride_om, SPLIT, HAS_BIAS, KIND_X)
    if ROWS > 5:
        _store_row(o_ptr, b_ptr, acc5, m0 + 5, M, N, rn, n_ok, pid_k, stride_om, SPLIT, HAS_BIAS, KIND_X)
    if ROWS > 6:
        _store_row(o_ptr, b_ptr, acc6, m0 + 6, M, N, rn, n_ok, pid_k, stride_om, SPLIT, HAS_BIAS, KIND_X)
    if ROWS > 7:
        _store_row(o_ptr, b_ptr, acc7, m0 + 7, M, N, rn, n_ok, pid_k, stride_om, SPLIT, HAS_BIAS, KIND_X)
    if SPLIT and FIXUP:
        r = tl.arange(0, 8)  # FMA_ROWS_MAX
        rm = tl.where(r < ROWS, m0 + r, M)  # rows past this program's group: masked out
        split_fixup(o_ptr, b_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(1) + pid_n, SPLITS, M, N, stride_om,
                    rm, rn, HAS_BIAS, KIND_X)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_om,
                HAS_BIAS: tl.constexpr, KIND_X: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    pdl.enter_streaming(PDL, w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn + k_lo, k_lo, k_hi, PREFETCH)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_lo + rk)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = k0 + rk < k_hi
        x = _load_tile(x_ptrs, m_ok, k_ok, False, EVEN_K)
        w = _load_tile(w_ptrs, n_ok, k_ok, EVEN_N, EVEN_K)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        x_ptrs += BK
        w_ptrs += BK
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        o_ptr += pid_k.to(tl.int64) * M * N
        tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr + rm[:, None] * stride_om + rn[None, :], round_to(acc, KIND_X).to(o_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _reduce_kernel(p_ptr, b_ptr, o_ptr, MN, N, SPLITS, HAS_BIAS: tl.constexpr, KIND_X: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``o = round(sum_s p[s] + bias)``: the partials added in split order, one rounding."""
    pdl.enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = _split_total(p_ptr, offs, ok, MN, SPLITS, b_ptr + offs % N, HAS_BIAS)
    tl.store(o_ptr + offs, round_to(acc, KIND_X).to(o_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_count(tiles: int, k: int, bk: int, device: torch.device) -> int:
    """K splits for a launch of ``tiles`` output tiles: enough programs for ``PROGRAMS_PER_SM``
    per SM, each split at least ``MIN_SPLIT_STEPS`` K steps; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(PROGRAMS_PER_SM * sms, tiles)
    return max(1, min(want, triton.cdiv(k, bk) // MIN_SPLIT_STEPS))


def supports(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear(x, w, bias)`` belongs to this kernel: 2-D ``x [M <= MAX_TOKENS, K]`` and
    ``w [N, K]`` of one dtype (fp32 / bf16 / fp16) with unit last strides, on one CUDA device (or
    the CPU under ``TRITON_INTERPRET=1``), the bias ``[N]`` of that dtype if any."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return False
    if x.dtype != w.dtype or x.dtype not in KIND or x.device != w.device:
        return False
    if not (x.is_cuda or (INTERPRET and x.device.type == "cpu")):
        return False
    if x.shape[0] > MAX_TOKENS or x.stride(-1) != 1 or w.stride(-1) != 1:
        return False
    return bias is None or (bias.shape == (w.shape[0],) and bias.dtype == x.dtype and bias.device == x.device)


def _check_args(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"linear takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match a weight of {tuple(w.shape)}")
    if x.dtype not in KIND:
        raise ValueError(f"activations must be fp32 / bf16 / fp16, got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"weight dtype {w.dtype} differs from the activations' {x.dtype}")
    if w.device != x.device:
        raise ValueError(f"x on {x.device} and w on {w.device}")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be {x.dtype} [{w.shape[0]}] on {x.device}, "
                         f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")


def _power_of_two(name: str, value: int | None, least: int) -> None:
    if value is not None and (value < least or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value}")


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
           split_k: int | None = None, variant: str = "auto", block_k: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """The Triton kernel: ``x [M, K] @ w [N, K].T + bias [N]`` as ``[M, N]`` in x's dtype (fp32
    accumulation). ``variant`` one of ``VARIANTS``; ``block_n`` / ``block_k`` (powers of two
    >= 16) the output columns per program and the K step (defaults ``DEFAULT_BLOCK_N`` /
    ``DEFAULT_BLOCK_K``); ``split_k`` the programs along K (default ``split_count``; above 1 the
    result depends on it by the fp32 summation order only); ``num_warps`` / ``num_stages``
    Triton's launch options (Triton's defaults if None). Any M works (``"dot"`` in tiles of 16
    rows, ``"fma"`` in groups of ``FMA_ROWS``), but above ``MAX_TOKENS`` torch's GEMM is the
    better choice (``supports``). Inputs with a non-unit last stride are copied."""
    _check_args(x, w, bias)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    _power_of_two("block_n", block_n, 16)
    _power_of_two("block_k", block_k, 16)
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    m, k = x.shape
    n = w.shape[0]
    if variant == "auto":
        variant = "fma" if m <= FMA_MAX_TOKENS else "dot"
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    bn = block_n or DEFAULT_BLOCK_N[variant]
    bk = block_k or DEFAULT_BLOCK_K[variant]
    rows = DOT_BM if variant == "dot" else min(m, FMA_ROWS)
    tiles_m, tiles_n = triton.cdiv(m, rows), triton.cdiv(n, bn)
    steps = triton.cdiv(k, bk)
    split = min(split_k or split_count(tiles_m * tiles_n, k, bk, x.device), max(steps, 1))
    k_per = max(triton.cdiv(steps, split), 1) * bk  # whole BK steps per split
    split = max(1, triton.cdiv(k, k_per))  # K = 0: one split that adds nothing
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    opts = {}
    if num_warps is not None:
        opts["num_warps"] = num_warps
    if num_stages is not None:
        opts["num_stages"] = num_stages
    launch = pdl.streaming_kwargs(x.device)
    common = dict(HAS_BIAS=bias is not None, KIND_X=KIND[x.dtype], SPLIT=split > 1, EVEN_N=n % bn == 0,
                  EVEN_K=k % bk == 0, BN=bn, BK=bk, **opts, **launch)
    args = (x, w, bias if bias is not None else x, target, m, n, k, k_per, x.stride(0), w.stride(0), out.stride(0))
    grid = (tiles_m, tiles_n, split)
    if variant == "dot":
        _dot_kernel[grid](*args, IEEE=x.dtype == torch.float32 or INTERPRET, BM=rows, **common)
    else:
        _fma_kernel[grid](*args, x, 0, ROWS=rows, **common)
    if split > 1:
        reduce_splits(target, bias, out)
    return out


def fixup_enabled() -> bool:
    """``FIXUP_ENV``: unset or "0" off, "1" on (ValueError otherwise)."""
    value = os.environ.get(FIXUP_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{FIXUP_ENV}={value!r}: use 1 (split-K sums inside the GEMM launch) or 0")
    return value == "1"


def fixup_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's tile counters for split-K sums inside the launch (``split_fixup``; all zero
    between launches: the last program of a tile resets its own), or None where the sum takes
    its own launch (``reduce_splits``): ``FIXUP_ENV`` is not "1", the device is neither CUDA nor
    the interpreter's CPU, the launch has more than ``FIXUP_SLOTS`` tiles, or the counters do
    not exist yet while a CUDA graph is being captured (the graph would own them). One GEMM
    runs at a time per device (the engine's compute is on one stream at a time): the counters
    are shared by every launch."""
    if not fixup_enabled() or tiles > FIXUP_SLOTS:
        return None
    if not (device.type == "cuda" or (INTERPRET and device.type == "cpu")):
        return None
    key = (device.type, device.index)
    counters = _COUNTERS.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[key] = torch.zeros(FIXUP_SLOTS, dtype=torch.int32, device=device)
    return counters


def reduce_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = round(sum_s partials[s] + bias)`` in one launch (``_reduce_kernel``): fp32 partial
    sums ``[splits, M, N]`` added in split order, the bias, one rounding to ``out``'s dtype."""
    splits, m, n = partials.shape
    _reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
        partials, bias if bias is not None else out, out, m * n, n, splits, HAS_BIAS=bias is not None,
        KIND_X=KIND[out.dtype], BLOCK=REDUCE_BLOCK, **pdl.launch_kwargs(out.device, "linear"))
