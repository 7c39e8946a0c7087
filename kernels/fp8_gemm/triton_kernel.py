"""``x @ w.T`` with block-scaled FP8 weights in one Triton kernel (W8A16).

Grid: one program per ``[BM, BN]`` output tile. Per ``BK`` step (``BK`` divides the scale
block's ``bk``, so one scale per row of the tile and step) the program loads the activation
tile in its dtype and the weight tile as E4M3 bytes (one byte per weight: the bandwidth
half of bf16's that makes decode faster), turns the bytes into their exact values
(``kernels.e4m3_unpack.e4m3_f16``), multiplies by the block scale in fp32 and rounds to the
activation dtype (``kernels.fused.common.round_to``: ties to even, also in the interpreter),
and accumulates ``tl.dot`` products in fp32 (fp32 activations, and every dtype in the
interpreter, whose 16-bit dot misreads its inputs: IEEE fp32 products of the same values, no
TF32). So the
kernel multiplies exactly the weight ``reference.w8a16_matmul`` dequantizes; results differ
from it by the fp32 summation order only. Bias added in fp32; output in the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels.e4m3_unpack import INTERPRET, e4m3_f16, has_fp8_conversion
from deepwell.kernels.fp8_gemm import reference
from deepwell.kernels.fused.common import KIND, round_to


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, o_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                  SBN: tl.constexpr, SBK: tl.constexpr, HAS_BIAS: tl.constexpr, KIND_X: tl.constexpr,
                  FP8_HW: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        c = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        s = tl.load(s_ptr + (rn // SBN) * stride_sn + k0 // SBK, mask=n_ok, other=0.0)
        w = round_to(e4m3_f16(c, FP8_HW).to(tl.float32) * s[:, None], KIND_X)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int, block: tuple[int, int], block_n: int | None) -> tuple[int, int, int]:
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bk = min(64, block[1])
    return bm, block_n or 64, bk


def w8a16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
                 bias: torch.Tensor | None = None, block_n: int | None = None) -> torch.Tensor:
    """The Triton kernel: ``x [M, K]`` (fp32 / bf16 / fp16) times the FP8 weight ``[N, K]``;
    ``block_n`` (a power of two >= 16, default 64) the output columns per program."""
    reference._check(codes, scales, block)
    if x.dim() != 2 or x.shape[1] != codes.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match a weight of {tuple(codes.shape)}")
    if x.dtype not in KIND:
        raise ValueError(f"activations must be fp32 / bf16 / fp16, got {x.dtype}")
    m, k = x.shape
    n = codes.shape[0]
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    bm, bn, bk = _tiles(m, block, block_n)
    if block[1] % bk or block[0] % 1:
        raise ValueError(f"scale block {block} needs its K side a multiple of {bk}")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w8a16_kernel[grid](x, codes.contiguous().view(torch.uint8), scales.contiguous(),
                        bias if bias is not None else scales, out, m, n, k, x.stride(0), k, scales.shape[1],
                        out.stride(0), SBN=block[0], SBK=block[1], HAS_BIAS=bias is not None, KIND_X=KIND[x.dtype],
                        FP8_HW=has_fp8_conversion(x.device), IEEE=x.dtype == torch.float32 or INTERPRET, BM=bm, BN=bn, BK=bk)
    return out


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
           bias: torch.Tensor | None = None, kernel_on_cpu: bool = False) -> torch.Tensor:
    """The kernel for CUDA tensors (and CPU ones under ``TRITON_INTERPRET=1`` with
    ``kernel_on_cpu``), the reference otherwise."""
    if x.is_cuda or (kernel_on_cpu and INTERPRET):
        return w8a16_matmul(x, codes, scales, block, bias)
    return reference.w8a16_matmul(x, codes, scales, block, bias)
