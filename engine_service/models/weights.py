"""Streaming weight loading into pre-allocated parameters.

Each parameter is a *target* under its HF name; fused expert tensors additionally accept
per-expert tensors (``...experts.{e}.{gate,up,down}_proj.weight``, and for FP8 experts their
``.weight_scale_inv``), each a slice of the fused parameter. A tensor is copied into its target (dtype/device converted by
``copy_``) and dropped, so peak memory is the model plus one tensor. Shapes are checked
before copying; after the stream ends every required piece must have arrived, else the
error names the missing tensors and their expected shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Target:
    shape: tuple[int, ...]
    write: Callable[[torch.Tensor], None]
    covers: tuple[str, ...]  # required piece names this tensor fills


def _copy_into(dst: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def write(src: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(src)

    return write


class WeightTargets:
    """Targets for one module tree; ``prefix`` is prepended to parameter names."""

    def __init__(self) -> None:
        self.targets: dict[str, Target] = {}
        self.required: dict[str, tuple[int, ...]] = {}
        self.loaded: set[str] = set()

    def add_module(self, module: nn.Module, prefix: str = "") -> None:
        for name, param in module.named_parameters():
            full = prefix + name
            if full.endswith(("experts.gate_up_proj", "experts.gate_up_proj_scale_inv")):
                self._add_experts(full, param, gate_up=True)
            elif full.endswith(("experts.down_proj", "experts.down_proj_scale_inv")):
                self._add_experts(full, param, gate_up=False)
            else:
                self._add(full, param.data, (full,))

    def _add(self, name: str, dst: torch.Tensor, covers: tuple[str, ...]) -> None:
        self.targets[name] = Target(tuple(dst.shape), _copy_into(dst), covers)
        for c in covers:
            if c == name:
                self.required[c] = tuple(dst.shape)

    def _add_experts(self, full: str, param: torch.Tensor, gate_up: bool) -> None:
        """The fused tensor and its per-expert slices: ``<m>.{e}.{proj}.weight``, or for FP8
        experts' block scales (``*_scale_inv``, ``layers.moe.FP8Experts``) ``.weight_scale_inv``
        (the gate and up halves own whole scale blocks)."""
        base = full.rsplit(".", 1)[0]  # ...experts
        suffix = "weight_scale_inv" if full.endswith("_scale_inv") else "weight"
        num = param.shape[0]
        pieces: list[str] = []
        for e in range(num):
            if gate_up:
                inter = param.shape[1] // 2
                for j, proj in enumerate(("gate_proj", "up_proj")):
                    name = f"{base}.{e}.{proj}.{suffix}"
                    view = param.data[e, j * inter : (j + 1) * inter]
                    self.targets[name] = Target(tuple(view.shape), _copy_into(view), (name,))
                    self.required[name] = tuple(view.shape)
                    pieces.append(name)
            else:
                name = f"{base}.{e}.down_proj.{suffix}"
                view = param.data[e]
                self.targets[name] = Target(tuple(view.shape), _copy_into(view), (name,))
                self.required[name] = tuple(view.shape)
                pieces.append(name)
        self.targets[full] = Target(tuple(param.shape), _copy_into(param.data), tuple(pieces))

    def offer(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy ``tensor`` into its target; False if no target has this name."""
        target = self.targets.get(name)
        if target is None:
            return False
        if tuple(tensor.shape) != target.shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {target.shape}"
            )
        target.write(tensor)
        self.loaded.update(target.covers)
        return True

    def missing(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, s) for n, s in self.required.items() if n not in self.loaded]


def missing_error(missing: Iterable[tuple[str, tuple[int, ...]]]) -> ValueError:
    items = list(missing)
    shown = ", ".join(f"{n} (expected shape {s})" for n, s in items[:8])
    more = f" and {len(items) - 8} more" if len(items) > 8 else ""
    return ValueError(f"checkpoint is missing {len(items)} tensor(s): {shown}{more}")
