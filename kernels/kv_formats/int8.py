"""int8 KV: symmetric int8 codes with one fp32 scale per token per head (group = head_dim).

Token row of one head: ``d`` code bytes (int8, element order) and 4 scale bytes (the fp32
scale, little-endian). ``s = min(amax(|x|) * fp32(1/127), SCALE_MAX)``; ``q = clamp(rint(x /
s), -127, 127)`` with ``rint`` round-half-even and ``/`` the correctly rounded fp32 division;
an all-zero row has ``s = 0`` and codes 0. Dequantized value: ``q * s``. One scale per row
lets the attention kernels apply K's scale to the score column and V's to the probabilities,
so the integer codes go to the tensor cores unchanged. The global scale is ignored.

Saturation: the decode kernels multiply each fp16 probability (at most 1) by V's token scale
and 2**12 (``paged_attention``'s ``P_LOG2_INT8``), which must stay below fp16's 65504, so
the scale saturates at ``SCALE_MAX`` = 15 and a row's values beyond +-127 * 15 = +-1905 clamp
there (K's rows too: one rule for the format). Such rows are counted as saturated scales
(``kernels.calibration``; the engine serves the counts as
``deepwell_engine_kv_served_scales_total{kind="saturated"}``), so a model whose K or V reach
that far shows it.
"""

from __future__ import annotations

import torch

INV_127 = float(torch.tensor(1.0 / 127.0, dtype=torch.float32).item())
_RNE_MAGIC = 12582912.0
SCALE_MAX = 15.0  # 15 * 2**12 = 61440 < 65504 (see the module doc)


def code_bytes(d: int) -> int:
    return d


def scale_bytes(d: int) -> int:
    return 4


def encode(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [N, d] -> (codes uint8 [N, d], scales uint8 [N, 4])."""
    x = x.to(torch.float32)
    s = (x.abs().amax(dim=-1, keepdim=True) * INV_127).clamp(max=SCALE_MAX)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    y = x / safe
    r = (y + _RNE_MAGIC) - _RNE_MAGIC
    q = torch.where(s > 0, r.clamp(-127.0, 127.0), torch.zeros_like(r)).to(torch.int8)
    return q.view(torch.uint8), s.contiguous().view(torch.uint8)


def decode(codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    q = codes.contiguous().view(torch.int8).to(torch.float32)
    s = scales.contiguous().view(torch.float32)
    return q * s
