"""bf16 KV: the value rounded to bfloat16 (RNE), two bytes per element, no scales.

Token row of one head: ``2 * d`` code bytes (little-endian bf16 in element order), 0 scale
bytes. The global scale is ignored (kept at 1.0).
"""

from __future__ import annotations

import torch


def code_bytes(d: int) -> int:
    return 2 * d


def scale_bytes(d: int) -> int:
    return 0


def encode(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [N, d] -> (codes uint8 [N, 2d], scales uint8 [N, 0])."""
    codes = x.to(torch.float32).to(torch.bfloat16).contiguous().view(torch.uint8)
    return codes, torch.empty(x.shape[0], 0, dtype=torch.uint8, device=x.device)


def decode(codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(codes [N, 2d], scales [N, 0]) -> fp32 rows [N, d]."""
    return codes.contiguous().view(torch.bfloat16).to(torch.float32)
