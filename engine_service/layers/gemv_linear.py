"""Decode-step linear layers through the split-K GEMV (``--linear-kernel gemv``, CUDA).

A decode step multiplies a few rows (one per sequence, or k + 1 per verify slice) by every
weight of the model once, so its time is the weight bytes over the HBM bandwidth; cuBLAS reads
those weights at ~2.3 of an H100's ~3.0 TB/s (docs/kernels.md). ``GemvLinear`` is an
``nn.Linear`` whose calls with at most ``kernels.gemv.MAX_TOKENS`` rows (``kernels.gemv.supports``)
run ``kernels.gemv.linear``, and every other call (prefill chunks) torch's GEMM. The choice
depends on shapes alone, so a CUDA graph captures it. ``use_gemv(model)`` converts the model's
16-bit ``nn.Linear`` layers in place (FP8 layers keep their own kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine_service.layers.mlp import replace_linears
from deepwell.kernels import gemv

LINEAR_KERNELS = ("auto", "torch", "gemv")


class GemvLinear(nn.Linear):
    """``nn.Linear`` through ``kernels.gemv.linear`` for few rows (``use_gemv``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if gemv.supports(rows, self.weight, self.bias):
            return gemv.linear(rows, self.weight, self.bias).view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def use_gemv(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a ``GemvLinear``; returns how many."""
    return replace_linears(model, GemvLinear)


def resolve(linear_kernel: str, device: torch.device) -> str:
    """``linear_kernel`` ("auto", "torch" or "gemv") for ``device``: auto is torch (cuBLAS) until a
    GPU run shows the GEMV faster end to end; gemv needs CUDA (or ``TRITON_INTERPRET=1`` for tests)."""
    if linear_kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {linear_kernel!r}")
    if linear_kernel == "gemv" and device.type != "cuda" and not gemv.triton_kernel.INTERPRET:
        raise ValueError(f"linear_kernel=gemv needs a CUDA device, not {device}")
    return "torch" if linear_kernel == "auto" else linear_kernel
