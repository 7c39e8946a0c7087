"""Dequantize FP8 block-scaled checkpoints (DeepSeek-V3 / Qwen official FP8 layout) on load.

Format (``config.json`` ``quantization_config``: ``quant_method: "fp8"``, ``fmt: "e4m3"``,
``weight_block_size: [bo, bi]``): each quantized linear stores ``<m>.weight`` as
``float8_e4m3fn`` with shape ``[..., out, in]`` and ``<m>.weight_scale_inv`` as fp32 with shape
``[..., ceil(out / bo), ceil(in / bi)]``. Despite its name the scale *multiplies*:
``w[r, c] = fp8[r, c] * scale_inv[r // bo, c // bi]``; edge blocks are partial (the last block
row/column covers the remainder). A scalar ``weight_scale_inv`` (per-tensor scaling) is also
accepted. Static activation scales (``input_scale``) are dropped: this path runs in
bf16/fp32 with no activation quantization.

``dequantize_stream(tensors, config)`` wraps a tensor stream: an FP8 weight and its scale
may arrive in either order (even in different shards), so each is held until its partner
arrives, then the dequantized weight is yielded under ``<m>.weight`` and both are dropped.
Everything else passes through unchanged. Weights come out in fp32 by default (the exact
product, computed in fp32); the model loader casts to its own dtype, one tensor at a time.

Invariants: only FP8 weights with a matching scale are rewritten; a scale shape that does
not match the weight's block grid, an FP8 weight without a scale, or a scale without a
weight fails with the tensor name and the expected shape (never a silently wrong weight).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepwell.logs import get_logger

log = get_logger(__name__)

SCALE_SUFFIX = ".weight_scale_inv"
WEIGHT_SUFFIX = ".weight"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_DROPPED_SUFFIXES = (".input_scale", ".activation_scale")


class FP8Error(ValueError):
    """An FP8 checkpoint is inconsistent (missing/mis-shaped scales, unsupported settings)."""


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The FP8 ``quantization_config`` of an HF config (top level or ``text_config``), else None."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            qc = cfg.get("quantization_config")
            if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
                return qc
    return None


def is_fp8_checkpoint(config: dict[str, Any]) -> bool:
    """True when ``config`` describes an FP8 block-scaled checkpoint."""
    return quantization_config(config) is not None


def block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """``weight_block_size`` as ``(rows, cols)``; None means per-tensor scales."""
    qc = quantization_config(config)
    if qc is None:
        raise FP8Error("config has no FP8 quantization_config (quant_method 'fp8')")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise FP8Error(f"FP8 format {fmt!r} is not supported (e4m3, e5m2)")
    raw = qc.get("weight_block_size")
    if raw is None:
        return None
    if not (isinstance(raw, list | tuple) and len(raw) == 2 and all(isinstance(v, int) and v > 0 for v in raw)):
        raise FP8Error(f"weight_block_size must be two positive integers, got {raw!r}")
    return int(raw[0]), int(raw[1])


def dequantize_weight(
    name: str,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``weight * scale_inv`` broadcast over ``block``-sized tiles of the last two dims."""
    if weight.dim() < 2:
        raise FP8Error(f"{name}: FP8 weight must be at least 2-D, got shape {tuple(weight.shape)}")
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if s.numel() == 1:
        return (w * s.reshape(())).to(dtype)
    if block is None:
        raise FP8Error(f"{name}: per-block scale {tuple(s.shape)} but no weight_block_size in quantization_config")
    rows, cols = w.shape[-2], w.shape[-1]
    bo, bi = block
    expected = (*w.shape[:-2], math.ceil(rows / bo), math.ceil(cols / bi))
    if tuple(s.shape) != expected:
        raise FP8Error(
            f"{name}{SCALE_SUFFIX}: shape {tuple(s.shape)} does not match weight {tuple(w.shape)} "
            f"with block {list(block)}; expected {expected}"
        )
    full = s.repeat_interleave(bo, dim=-2)[..., :rows, :].repeat_interleave(bi, dim=-1)[..., :cols]
    return (w * full).to(dtype)


@dataclass(frozen=True)
class FP8Weight:
    """One quantized linear's checkpoint tensors: E4M3 ``codes`` and their ``scale_inv`` (per
    block of ``weight_block_size``, or one scalar)."""

    codes: torch.Tensor
    scale_inv: torch.Tensor


def pair_stream(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | FP8Weight]]:
    """The stream with every FP8 ``weight`` / ``weight_scale_inv`` pair joined into one
    ``(<m>.weight, FP8Weight)`` item (either may come first, even in another shard; each is held
    until its partner arrives); activation scales dropped, everything else passed through."""
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(_DROPPED_SUFFIXES):
            continue
        if name.endswith(SCALE_SUFFIX):
            module = name[: -len(SCALE_SUFFIX)]
            if module in pending_weights:
                yield module + WEIGHT_SUFFIX, FP8Weight(pending_weights.pop(module), tensor)
            else:
                pending_scales[module] = tensor
            continue
        if name.endswith(WEIGHT_SUFFIX) and tensor.dtype in _FP8_DTYPES:
            module = name[: -len(WEIGHT_SUFFIX)]
            if module in pending_scales:
                yield name, FP8Weight(tensor, pending_scales.pop(module))
            else:
                pending_weights[module] = tensor
            continue
        if tensor.dtype in _FP8_DTYPES:
            raise FP8Error(f"{name}: FP8 tensor that is not a '.weight' has no scale convention")
        yield name, tensor
    if pending_weights:
        names = sorted(pending_weights)
        raise FP8Error(
            f"{len(names)} FP8 weights have no {SCALE_SUFFIX}, e.g. {names[0]}{WEIGHT_SUFFIX} "
            f"(expected {names[0]}{SCALE_SUFFIX})"
        )
    if pending_scales:
        names = sorted(pending_scales)
        raise FP8Error(f"{len(names)} scales have no FP8 weight, e.g. {names[0]}{SCALE_SUFFIX}")


def dequantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict[str, Any],
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the stream with every FP8 ``weight``/``weight_scale_inv`` pair replaced by ``dtype`` weights."""
    block = block_size(config)
    converted = 0
    for name, item in pair_stream(tensors):
        if isinstance(item, FP8Weight):
            yield name, dequantize_weight(name[: -len(WEIGHT_SUFFIX)], item.codes, item.scale_inv, block, dtype)
            converted += 1
        else:
            yield name, item
    log.info("fp8.dequantized", weights=converted, block=list(block) if block else None, dtype=str(dtype))
