"""``x @ w.T`` with block-scaled FP8 weights in one Triton kernel (W8A16).

Grid: one program per ``[BM, BN]`` output tile. Per ``BK`` step (``BK`` divides the scale
block's ``bk``, so one scale per row of the tile and step) the program loads the activation
tile in its dtype and the weight tile as E4M3 bytes (one byte per weight: the bandwidth
half of bf16's that makes decode faster), turns the bytes into their exact values
(``kernels.e4m3_unpack.e4m3_f16``), multiplies by the block scale in fp32 and rounds to the
activation dtype (ties to even: the hardware's cast on a GPU, ``kernels.fused.common.round_to``
in the interpreter, whose bf16 cast truncates),
and accumulates ``tl.dot`` products in fp32 (fp32 activations, and every dtype in the
interpreter, whose 16-bit dot misreads its inputs: IEEE fp32 products of the same values, no
TF32). So the
kernel multiplies exactly the weight ``reference.w8a16_matmul`` dequantizes; results differ
from it by the fp32 summation order only. Bias added in fp32; output in the activation dtype.

Few tokens (decode) leave few output tiles, so the K axis is split over more programs
(``split_count``) whose fp32 partial sums are added after the launch. From
``DEQUANT_MIN_TOKENS`` tokens (prefill chunks) ``matmul`` instead dequantizes the weight into
the activation dtype (``dequantize``, the same bits as the reference's) and runs torch's GEMM,
which is compute-bound there and several times faster than this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.e4m3_unpack import INTERPRET, e4m3_f16, has_fp8_conversion
from deepwell.kernels.fp8_gemm import reference
from deepwell.kernels.fused.common import KIND, round_to
from deepwell.kernels.gemv.triton_kernel import _fma_kernel, fixup_counters, reduce_splits, split_fixup


@triton.jit
def _f16_row_scale(amax):
    """Per row, a power of two ``r`` with ``amax * r < 2**15`` and ``1 / r``, exact fp32 powers
    of two built from ``amax``'s exponent (a zero row gets 2**126): the row times ``r`` fits
    fp16, and a bf16 / fp16 value keeps its bits there unless it is below 2**-28 of the row's
    largest (fp16's subnormals)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent: amax < 2**(e - 126)
    field = tl.minimum(tl.maximum(268 - e, 1), 253)  # r = 2**(14 - (e - 127)), kept normal
    r = (field << 23).to(tl.float32, bitcast=True)
    inv = ((254 - field) << 23).to(tl.float32, bitcast=True)
    return r, inv


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, o_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_sn, stride_om,
                  SBN: tl.constexpr, SBK: tl.constexpr, HAS_BIAS: tl.constexpr, KIND_X: tl.constexpr,
                  FP8_HW: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr = False, PDL: tl.constexpr = False,
                  PREFETCH: tl.constexpr = 0, FIXUP: tl.constexpr = False, out_ptr=None, cnt_ptr=None, SPLITS=1,
                  F16: tl.constexpr = False):
    """``SWAP``: the operands swapped, ``out.T [BN, BM] = w [BN, BK] @ x.T [BK, BM]``, so the
    dequantized weight is the MMA's first operand (Hopper's wgmma takes that one from registers,
    no shared-memory round trip) and the few tokens its N side; same products, same sums.
    ``F16`` (16-bit activations): the block scale after the product instead of on every weight.
    Per K step the E4M3 codes as their exact fp16 values times the step's activations in fp16
    (each row times a power of two into fp16's range, ``_f16_row_scale``), fp32 sums,
    then times each row's ``1 / r`` and each column's block scale: one conversion per weight
    where the default forms code x scale in fp32 and rounds it to x's dtype, and the products
    of the codes themselves (the default rounds each scaled weight once).
    ``FIXUP`` (with ``SPLIT``): the partials are summed into ``out_ptr`` inside this launch
    (``gemv.triton_kernel.split_fixup``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    pdl.enter_streaming(PDL, w_ptr + tl.minimum(rn, N - 1) * stride_wn + pid_k * K_PER, pid_k * K_PER,
                        tl.minimum(K, pid_k * K_PER + K_PER), PREFETCH)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + rk
        k_ok = k < k_hi
        c = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        s = tl.load(s_ptr + (rn // SBN) * stride_sn + k0 // SBK, mask=n_ok, other=0.0)
        if F16:
            wh = e4m3_f16(c, FP8_HW)
            xf = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            r, inv = _f16_row_scale(tl.max(tl.abs(xf), axis=1))
            xh = (xf * r[:, None]).to(tl.float16)
            if SWAP:
                if IEEE:  # the interpreter: the same fp16 values, fp32 products
                    part = tl.dot(wh.to(tl.float32), tl.trans(xh.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(wh, tl.trans(xh))
                acc += part * s[:, None] * inv[None, :]
            else:
                if IEEE:
                    part = tl.dot(xh.to(tl.float32), tl.trans(wh.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(xh, tl.trans(wh))
                acc += part * inv[:, None] * s[None, :]
        elif SWAP:
            w = e4m3_f16(c, FP8_HW).to(tl.float32) * s[:, None]
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + k[:, None], mask=m_ok[None, :] & k_ok[:, None],
                         other=0.0)
            if IEEE:
                acc += tl.dot(round_to(w, KIND_X), xt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(w.to(xt.dtype), xt)
        else:
            w = e4m3_f16(c, FP8_HW).to(tl.float32) * s[:, None]
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(round_to(w, KIND_X)), input_precision="ieee")
            else:  # a GPU (the interpreter takes IEEE): the hardware's round-to-nearest-even cast,
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # the bits round_to gives, in 1/6 the instructions
    if SWAP:  # stored through the transposed view
        acc = tl.trans(acc)
    if SPLIT:  # fp32 partial sums [splits, M, N]: summed (and the bias added) after the launch or by FIXUP
        tl.store(o_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
        if FIXUP:
            split_fixup(o_ptr, b_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(1) + pid_n, SPLITS, M, N, stride_om,
                        rm, rn, HAS_BIAS, KIND_X)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, o_ptr, N, K, stride_sn, SBN: tl.constexpr, SBK: tl.constexpr,
                    KIND_X: tl.constexpr, FP8_HW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    HW_ROUND: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = (rn < N)[:, None] & (k < K)[None, :]
    c = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=ok, other=0)
    s = tl.load(s_ptr + (rn // SBN)[:, None] * stride_sn + (k // SBK)[None, :], mask=ok, other=0.0)
    w = e4m3_f16(c, FP8_HW).to(tl.float32) * s
    if not HW_ROUND:  # the interpreter's bf16 cast truncates; a GPU's rounds to nearest even
        w = round_to(w, KIND_X)
    tl.store(o_ptr + rn[:, None] * K + k[None, :], w.to(o_ptr.dtype.element_ty), mask=ok)


# Token counts from which ``matmul`` dequantizes the weight into the activation dtype and runs
# torch's GEMM: at a 4k-token chunk the W8A16 kernel took 4.5x bf16's time on the H100 (MLP down
# 4,185 against 928 us), while writing the bf16 weight costs three bytes per weight (~0.1 ms for
# that layer at 3 TB/s). The crossing point has not been measured: 128 is a guess from the same
# table (at 32 tokens the kernel took 155 us against 77 + ~90 us for dequantize + bf16).
DEQUANT_MIN_TOKENS = 128
# Split K until a launch has this many programs per SM: one token's N / 64 output tiles alone
# (MLP down: 80) leave most of an H100's 132 SMs idle while each walks all of K.
PROGRAMS_PER_SM = 4
MIN_SPLIT_STEPS = 4  # BK steps per split at least
# ``fma_matmul`` (no tensor cores, the block scale applied after each step's sum): rows per
# program, output columns per program, K step.
FMA_ROWS = 8  # one program's rows: a verify step of K = 4 drafts (5 rows) reads the weight once
FMA_BLOCK_N = 64
FMA_BLOCK_K = 128
# The few-token kernels ``matmul`` chooses from below ``DEQUANT_MIN_TOKENS`` rows, by name:
# "w8a16" (tensor cores, 16-row tiles, 64 x 64 weight tiles), "swap" / "swap128" (the same with
# the weight as the MMA's first operand, 64 x 64 / 128 x 128 weight tiles), "fma" (no tensor
# cores), "swap_f16" / "swap128_f16" (the swapped forms with the block scale after each step's
# product: ``_w8a16_kernel``'s ``F16``; for fp32 activations the plain swapped forms).
FEW_ROW_KERNELS = ("w8a16", "swap", "swap128", "fma", "swap_f16", "swap128_f16")
# per weight shape (N, K): the kernel for 1, 2, ... rows, what ``tune`` timed fastest at load on
# the serving GPU; row counts past the tuple "w8a16"; shapes not listed: "fma" up to
# FMA_MAX_TOKENS rows, "w8a16" above
KERNEL_BY_SHAPE: dict[tuple[int, int], tuple[str, ...]] = {}
FMA_MAX_TOKENS = 0


def few_row_kernel(shape: tuple[int, int], rows: int) -> str:
    """The few-token kernel ``matmul`` runs for ``rows`` rows times a weight of ``shape``."""
    table = KERNEL_BY_SHAPE.get(shape)
    if table is not None:
        return table[rows - 1] if 1 <= rows <= len(table) else "w8a16"
    return "fma" if rows <= FMA_MAX_TOKENS else "w8a16"


def few_row_matmul(kind: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   block: tuple[int, int] = (128, 128), bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` through the few-token kernel named ``kind`` (``FEW_ROW_KERNELS``)."""
    if kind == "fma":
        return fma_matmul(x, codes, scales, block, bias)
    if kind == "swap":
        return w8a16_matmul(x, codes, scales, block, bias, swap=True)
    if kind in ("swap128", "swap128_f16"):
        return w8a16_matmul(x, codes, scales, block, bias, block_n=128, swap=True,
                            block_k=128 if block[1] % 128 == 0 else None, f16=kind == "swap128_f16")
    if kind == "swap_f16":
        return w8a16_matmul(x, codes, scales, block, bias, swap=True, f16=True)
    if kind == "w8a16":
        return w8a16_matmul(x, codes, scales, block, bias)
    raise ValueError(f"unknown few-token kernel {kind!r}: one of {', '.join(FEW_ROW_KERNELS)}")


def _tiles(m: int, block: tuple[int, int], block_n: int | None) -> tuple[int, int, int]:
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bk = min(64, block[1])
    return bm, block_n or 64, bk


def split_count(tiles: int, k: int, bk: int, device: torch.device) -> int:
    """K splits for a launch of ``tiles`` output tiles: enough programs for ``PROGRAMS_PER_SM``
    per SM, each split at least ``MIN_SPLIT_STEPS`` K steps; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(PROGRAMS_PER_SM * sms, tiles)
    return max(1, min(want, triton.cdiv(k, bk) // MIN_SPLIT_STEPS))


def _check_args(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> None:
    reference._check(codes, scales, block)
    if x.dim() != 2 or x.shape[1] != codes.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match a weight of {tuple(codes.shape)}")
    if x.dtype not in KIND:
        raise ValueError(f"activations must be fp32 / bf16 / fp16, got {x.dtype}")


def w8a16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
                 bias: torch.Tensor | None = None, block_n: int | None = None, split_k: int | None = None,
                 swap: bool = False, block_k: int | None = None, num_warps: int = 4, f16: bool = False) -> torch.Tensor:
    """The Triton kernel: ``x [M, K]`` (fp32 / bf16 / fp16) times the FP8 weight ``[N, K]``;
    ``block_n`` (a power of two >= 16, default 64) the output columns per program; ``split_k``
    the programs along K (default ``split_count``; above 1 each writes fp32 partial sums that are
    then added, so the result depends on the split by the fp32 summation order only); ``swap``:
    the weight as the MMA's first operand (``_w8a16_kernel``'s ``SWAP``);
    ``block_k`` (a power of two >= 16 dividing the scale block's K side, default 64) the K step;
    ``num_warps`` per program; ``f16``: the block scale after each step's product in fp16
    (``_w8a16_kernel``'s ``F16``; ignored for fp32 activations)."""
    _check_args(x, codes, scales, block)
    m, k = x.shape
    n = codes.shape[0]
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    bm, bn, bk = _tiles(m, block, block_n)
    if block_k is not None:
        if block_k < 16 or block_k & (block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
        bk = block_k
    if block[1] % bk:
        raise ValueError(f"scale block {block} needs its K side a multiple of {bk}")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles_m, tiles_n = triton.cdiv(m, bm), triton.cdiv(n, bn)
    split = split_k or split_count(tiles_m * tiles_n, k, bk, x.device)
    k_per = triton.cdiv(triton.cdiv(k, bk), split) * bk  # whole BK steps (BK divides the scale block)
    split = triton.cdiv(k, k_per)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    counters = fixup_counters(x.device, tiles_m * tiles_n) if split > 1 else None
    _w8a16_kernel[(tiles_m, tiles_n, split)](
        x, codes.contiguous().view(torch.uint8), scales.contiguous(), bias if bias is not None else scales, target,
        m, n, k, k_per, x.stride(0), k, scales.shape[1], out.stride(0), SBN=block[0], SBK=block[1],
        HAS_BIAS=bias is not None, KIND_X=KIND[x.dtype], FP8_HW=has_fp8_conversion(x.device),
        IEEE=x.dtype == torch.float32 or INTERPRET, SPLIT=split > 1, BM=bm, BN=bn, BK=bk, SWAP=swap,
        F16=f16 and x.dtype != torch.float32, num_warps=num_warps, **_fixup_kwargs(out, counters, split),
        **pdl.streaming_kwargs(x.device))
    if split > 1 and counters is None:  # one launch: the partials in split order, the bias, one rounding
        reduce_splits(target, bias, out)
    return out


def _fixup_kwargs(out: torch.Tensor, counters: torch.Tensor | None, splits: int) -> dict:
    """The kernels' in-launch split-K sum arguments (``gemv.triton_kernel.split_fixup``)."""
    if counters is None:
        return {"FIXUP": False}
    return {"FIXUP": True, "out_ptr": out, "cnt_ptr": counters, "SPLITS": splits}


def fma_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
               bias: torch.Tensor | None = None, block_n: int = FMA_BLOCK_N, split_k: int | None = None,
               num_warps: int = 4) -> torch.Tensor:
    """Few tokens without tensor cores, the scale applied after the sum: per ``BK`` step each
    row's ``sum_k x * code`` in fp32 (the code's exact value), times the weight block's scale,
    added up; so a weight is never rounded to x's dtype, and the result differs from the
    reference's (which multiplies rounded ``code * scale`` weights) by one such rounding per
    weight at most, well inside the format's error. One E4M3 conversion and one FMA per weight
    byte (``w8a16_matmul`` also scales and rounds each weight): meant to read the weight at HBM
    speed. Rows in groups of ``FMA_ROWS`` (more rows: more programs, each reading the weight
    again); K split as ``w8a16_matmul`` does, partial sums added in split order by one launch;
    ``num_warps`` per program (Triton's launch option)."""
    _check_args(x, codes, scales, block)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    m, k = x.shape
    n = codes.shape[0]
    bk = min(FMA_BLOCK_K, block[1])
    if block[1] % bk:
        raise ValueError(f"scale block {block} needs its K side a multiple of {bk}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    rows = min(m, FMA_ROWS)
    tiles_m, tiles_n = triton.cdiv(m, rows), triton.cdiv(n, block_n)
    steps = triton.cdiv(k, bk)
    split = min(split_k or split_count(tiles_m * tiles_n, k, bk, x.device), max(steps, 1))
    k_per = max(triton.cdiv(steps, split), 1) * bk
    split = max(1, triton.cdiv(k, k_per))
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    counters = fixup_counters(x.device, tiles_m * tiles_n) if split > 1 else None
    _fma_kernel[(tiles_m, tiles_n, split)](  # gemv's FMA form, reading E4M3 codes (FP8=True)
        x, codes.contiguous().view(torch.uint8), bias if bias is not None else x, target,
        m, n, k, k_per, x.stride(0), k, out.stride(0), scales.contiguous(), scales.shape[1],
        HAS_BIAS=bias is not None, KIND_X=KIND[x.dtype], SPLIT=split > 1, EVEN_N=n % block_n == 0,
        EVEN_K=k % bk == 0, ROWS=rows, BN=block_n, BK=bk, FP8=True, SBN=block[0], SBK=block[1],
        FP8_HW=has_fp8_conversion(x.device), num_warps=num_warps, **_fixup_kwargs(out, counters, split),
        **pdl.streaming_kwargs(x.device))
    if split > 1 and counters is None:
        reduce_splits(target, bias, out)
    return out


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``reference.dequantize`` in one Triton launch: every weight ``code * scale`` formed in fp32
    and rounded to ``dtype`` (the same bits)."""
    reference._check(codes, scales, block)
    if dtype not in KIND:
        raise ValueError(f"dtype must be fp32 / bf16 / fp16, got {dtype}")
    n, k = codes.shape
    out = torch.empty(n, k, dtype=dtype, device=codes.device)
    if out.numel():
        _dequant_kernel[(triton.cdiv(n, 64), triton.cdiv(k, 64))](
            codes.contiguous().view(torch.uint8), scales.contiguous(), out, n, k, scales.shape[1],
            SBN=block[0], SBK=block[1], KIND_X=KIND[dtype], FP8_HW=has_fp8_conversion(codes.device), BN=64, BK=64,
            HW_ROUND=not INTERPRET)
    return out


def dequant_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Many tokens: the weight dequantized into x's dtype (``dequantize``), then torch's GEMM
    (fp32 accumulation; fp32 activations in full fp32, as the reference)."""
    _check_args(x, codes, scales, block)
    w = dequantize(codes, scales, block, x.dtype)
    if x.dtype == torch.float32:
        out = torch.matmul(x, w.t())
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, w, bias)


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
           bias: torch.Tensor | None = None, kernel_on_cpu: bool = False) -> torch.Tensor:
    """The kernel for CUDA tensors (and CPU ones under ``TRITON_INTERPRET=1`` with
    ``kernel_on_cpu``), the reference otherwise."""
    if x.is_cuda or (kernel_on_cpu and INTERPRET):
        if x.dim() == 2 and x.shape[0] >= DEQUANT_MIN_TOKENS:
            return dequant_matmul(x, codes, scales, block, bias)
        if x.dim() == 2:
            return few_row_matmul(few_row_kernel(tuple(codes.shape), x.shape[0]), x, codes, scales, block, bias)
        return w8a16_matmul(x, codes, scales, block, bias)
    return reference.w8a16_matmul(x, codes, scales, block, bias)
