"""The meaning of the block-scaled FP8 weight format and of ``x @ w.T`` with it (plain torch)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest finite E4M3 magnitude


def _check(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> None:
    n, k = codes.shape
    grid = (-(-n // block[0]), -(-k // block[1]))
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight codes must be float8_e4m3fn, got {codes.dtype}")
    if tuple(scales.shape) != grid or scales.dtype != torch.float32:
        raise ValueError(f"block scales must be fp32 {grid} for a [{n}, {k}] weight in {block} blocks, "
                         f"got {scales.dtype} {tuple(scales.shape)}")


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``w [N, K]`` -> (E4M3 codes ``[N, K]``, fp32 scales ``[ceil(N/bn), ceil(K/bk)]``):
    each block's scale is its amax / 448 (1 for an all-zero block), codes round to nearest."""
    if w.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    wf = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
    blocks = wf.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(gn * bn, gk * bk)[:n, :k].contiguous(), scales.contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale`` of each element's block, in ``dtype`` (the product formed in fp32)."""
    _check(codes, scales, block)
    n, k = codes.shape
    s = scales.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (codes.float() * s).to(dtype)


def w8a16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128),
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ w.T`` with ``w`` the dequantized weight rounded to x's dtype (what the kernel
    multiplies), accumulated in fp32; out ``[M, N]`` in x's dtype."""
    w = dequantize(codes, scales, block, x.dtype)
    out = torch.matmul(x.float(), w.float().t())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
