"""Plain-torch definitions of the fused ops: the meaning the Triton kernels beside them keep.

``engine_service.layers.backend.ReferenceBackend`` (the engine's CPU path and the parity
tests' subject against HF transformers) computes each of these chains by calling the function
here, so the definition exists once; ``tests/kernels/test_fused_ops.py`` checks the kernels
against them and them against the layer code that calls them:

- ``rms_norm`` / ``gated_rms_norm``: ``engine_service.layers.backend.ReferenceBackend``;
- ``add_rms_norm``: ``decoder.py``'s ``h = h + x`` then the next norm of ``h`` (the residual
  stays in the sum's dtype, the model dtype);
- ``silu_mul`` / ``silu_and_mul``: ``mlp.SwiGLU`` (and ``moe``'s ``gate_up.chunk(2, -1)``);
- ``apply_rope`` / ``rope``: ``rope.apply_rope`` on q and on k;
- ``gdn_gating``: ``gdn.GatedDeltaNet.forward``'s ``g`` and ``beta``;
- ``sigmoid_gate_mul``: ``attention.Attention.forward``'s ``out * torch.sigmoid(gate)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    out = out * F.silu(gate.float())
    return out.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``."""
    residual = residual + x
    return rms_norm(residual, weight, eps, zero_centered), residual


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, rotary_dim]. Rotates the first rotary_dim dims (NeoX)."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * c + rotated * s, rest], dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin) if k is not None else None


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` from the ``in_proj_a`` / ``in_proj_b`` outputs."""
    beta = torch.sigmoid(b)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def sigmoid_gate_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o * sigmoid(gate)``; ``gate`` reshaped to ``o``'s shape (as attention.py does)."""
    return o * torch.sigmoid(gate.reshape(o.shape))
