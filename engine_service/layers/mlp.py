"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with HF parameter names."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from deepwell.engine_service.layers.backend import ReferenceBackend


def linear(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    """An uninitialised, frozen linear layer (weights come from the checkpoint)."""
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
    return layer


def replace_linears(model: nn.Module, cls: type[nn.Linear]) -> int:
    """Make every plain ``nn.Linear`` of ``model`` (the LM head and the MTP module included) an
    instance of the subclass ``cls`` in place (the same parameters: its ``forward`` is all that
    changes); returns how many."""
    found = [m for m in model.modules() if type(m) is nn.Linear]
    for m in found:
        m.__class__ = cls
    return len(found)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 backend: ReferenceBackend | None = None) -> None:
        super().__init__()
        if backend is None:
            from deepwell.engine_service.layers.backend import ReferenceBackend

            backend = ReferenceBackend()
        self.backend = backend
        self.gate_proj = linear(hidden, intermediate, bias)
        self.up_proj = linear(hidden, intermediate, bias)
        self.down_proj = linear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_mul(self.gate_proj(x), self.up_proj(x)))
