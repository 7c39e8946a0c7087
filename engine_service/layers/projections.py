"""Projections of one input fused into one GEMM after the weights are loaded.

A layer that projects the same activations several times (the Gated DeltaNet's ``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``) costs one GEMM launch per projection; a decode step
is launch-bound on the small ones (``b`` and ``a`` are ``Hv`` rows each). ``concat_linears``
stacks the weights of such layers into one layer when their kinds allow it, and ``SplitLinear``
returns its output cut back into the projections (views: columns of one ``[T, sum N]`` tensor,
which the consumers read with their strides). Each output column is the same dot product as
before; only the GEMM the library picks for the wider weight may sum in another order.

What can be stacked: plain ``nn.Linear`` layers (not subclasses: the batch-invariant mode's
row-padded ones stay apart) of one dtype and device, with biases on all or none; or ``FP8Linear``
layers of one block size whose output sizes, but the last, are whole scale blocks (their codes
and block scales then stack as they are). The engine fuses after loading and after FP8
quantization (``fuse_projections``), so the checkpoint's tensor names and the FP8 choice of
which layers stay 16-bit are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepwell.engine_service.layers.fp8_linear import FP8Linear


class SplitLinear(nn.Module):
    """One linear layer whose output is several projections side by side: ``forward`` returns
    them as views, in order."""

    def __init__(self, layer: nn.Module, sizes: Sequence[int]) -> None:
        super().__init__()
        self.layer = layer
        self.sizes = tuple(sizes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.layer(x)
        return torch.split(y, self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


def _out(layer: nn.Module) -> int:
    return int(layer.out_features)  # type: ignore[arg-type]


def concat_linears(layers: Sequence[nn.Module]) -> nn.Module | None:
    """One layer computing ``cat([l(x) for l in layers], -1)``, or None where they cannot be one
    (module doc). The new layer owns new tensors; the old layers are left as they were."""
    if len(layers) < 2:
        return None
    first = layers[0]
    k = first.in_features
    if any(layer.in_features != k for layer in layers) or len({layer.bias is None for layer in layers}) != 1:
        return None
    has_bias = first.bias is not None
    if all(type(layer) is nn.Linear for layer in layers):
        w = first.weight
        if any(layer.weight.dtype != w.dtype or layer.weight.device != w.device for layer in layers):
            return None
        fused = nn.Linear(k, sum(_out(layer) for layer in layers), bias=has_bias, device="meta", dtype=w.dtype)
        fused.weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]), requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)
        return fused
    if all(isinstance(layer, FP8Linear) for layer in layers):
        block = first.block
        if any(layer.block != block for layer in layers) or any(_out(layer) % block[0] for layer in layers[:-1]):
            return None
        codes = torch.cat([layer.weight.detach() for layer in layers])
        scales = torch.cat([layer.weight_scale_inv.detach() for layer in layers])
        bias = torch.cat([layer.bias.detach() for layer in layers]) if has_bias else None
        return FP8Linear(codes, scales, bias, block)
    return None


def fuse_group(layers: Sequence[nn.Module], plans: Sequence[Sequence[Sequence[int]]]) -> list[SplitLinear] | None:
    """``layers`` as ``SplitLinear``s by the first of ``plans`` (each a partition of the layer
    indices into runs, in order) whose every run of two or more stacks (``concat_linears``);
    None when no plan saves a launch."""
    for plan in plans:
        out: list[SplitLinear] = []
        for run in plan:
            parts = [layers[i] for i in run]
            fused = concat_linears(parts) if len(parts) > 1 else parts[0]
            if fused is None:
                break
            out.append(SplitLinear(fused, [_out(p) for p in parts]))
        else:
            if len(out) < len(layers):
                return out
    return None


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projections of every layer that offers it (a ``fuse_projections()`` method);
    returns the GEMM launches a forward saves."""
    return sum(m.fuse_projections() for m in list(model.modules()) if isinstance(m, FusesProjections))


class FusesProjections:
    """A layer whose projections of one input ``fuse_projections()`` may stack into fewer GEMMs
    (returns the launches saved; idempotent)."""

    def fuse_projections(self) -> int:
        raise NotImplementedError
