"""RMSNorm modules: plain (``w * x``) and zero-centered (``(1 + w) * x``), and gated."""

from __future__ import annotations

import torch
from torch import nn

from deepwell.engine_service.layers.backend import ReferenceBackend


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, zero_centered: bool, backend: ReferenceBackend
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.zero_centered = zero_centered
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + x), residual + x)`` in one op (the residual add fused with the norm)."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)


class GatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * silu(gate)`` (the GDN output norm; plain, not zero-centered)."""

    def __init__(self, dim: int, eps: float, backend: ReferenceBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.backend.gated_rms_norm(x, gate, self.weight, self.eps)
