"""fp8 KV: E4M3 codes of ``x / g`` with a per-(layer, KV head, K|V) power-of-two scale ``g``.

Token row of one head: ``d`` code bytes (E4M3, sign in bit 7, element order), 0 scale
bytes. ``code = E4M3_RNE_saturating(x * (1/g))`` — ``1/g`` is exact because ``g`` is a
power of two, so the only rounding is E4M3's (see ``e4m3``); values beyond ``448 * g``
saturate to ``±448 * g``; values rounding to zero encode as code 0. Dequantized value:
``decode(code) * g``.
"""

from __future__ import annotations

import torch

from deepwell.kernels.kv_formats import e4m3
from deepwell.kernels.kv_formats.feedback import round_blocks


def code_bytes(d: int) -> int:
    return d


def scale_bytes(d: int) -> int:
    return 0


def encode(x: torch.Tensor, g: torch.Tensor, *,
           feedback: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [N, d], global scales [N] -> (codes uint8 [N, d], scales uint8 [N, 0]).
    ``feedback`` [N, d/16, 16, 16]: round with error feedback (``kv_formats.feedback``)."""
    inv_g = (1.0 / g.to(torch.float32))[:, None]
    empty = torch.empty(x.shape[0], 0, dtype=torch.uint8, device=x.device)
    if feedback is None:
        return e4m3.encode_signed(x.to(torch.float32) * inv_g), empty
    gv = g.to(torch.float32)[:, None]

    def quantize(col: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        code, mag = e4m3.encode_magnitude(col.abs() * inv_g)
        negative = (col < 0) & (code != 0)
        value = mag * gv
        return (code | (negative.to(torch.uint8) << 7)).to(torch.int32), torch.where(negative, -value, value)

    return round_blocks(x, feedback, quantize).to(torch.uint8), empty


def decode(codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return e4m3.decode(codes) * g.to(torch.float32)[:, None]
