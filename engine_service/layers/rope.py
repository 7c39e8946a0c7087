"""Rotary position embedding (NeoX half-split layout, optionally partial).

``RopeSpec.from_config(cfg)`` reads HF ``rope_parameters`` (transformers >= 5) or the
legacy ``rope_theta`` + ``rope_scaling`` + ``partial_rotary_factor`` fields. Supported
``rope_type``: ``default``, ``linear``, ``yarn``, ``llama3``; anything else fails at load.
``inv_freq_and_scale`` reproduces HF's ``_compute_*_parameters`` (same float32 ops), so
cos/sin agree to ~1e-7 relative. Multimodal ``mrope_section`` is ignored: for text-only
input every M-RoPE axis has the same position, which equals plain RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from deepwell.kernels.fused import references as fused_ref

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    head_dim: int
    rotary_dim: int
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int = 0
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @staticmethod
    def from_config(cfg: dict[str, Any], head_dim: int) -> RopeSpec:
        params = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        if params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope_parameters are not supported")
        for key, val in legacy.items():
            params.setdefault(key, val)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        orig = cfg.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", max_pos
        )
        factor = params.get("factor")
        if rope_type in ("linear", "llama3") and factor is None:
            raise ValueError(f"rope_type {rope_type!r} needs a 'factor'")
        if rope_type == "yarn" and factor is None:
            factor = max_pos / orig
        return RopeSpec(
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            theta=float(theta),
            rope_type=rope_type,
            factor=float(factor if factor is not None else 1.0),
            original_max_position=int(orig),
            attention_factor=params.get("attention_factor"),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )


def _base_inv_freq(spec: RopeSpec) -> torch.Tensor:
    dim = spec.rotary_dim
    return 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base, factor = spec.rotary_dim, spec.theta, spec.factor

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = spec.attention_factor
    if att is None:
        if spec.mscale and spec.mscale_all_dim:
            att = float(mscale_of(factor, spec.mscale) / mscale_of(factor, spec.mscale_all_dim))
        else:
            att = mscale_of(factor)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(spec.original_max_position / (rot * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = corr_dim(spec.beta_fast), corr_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, float(att)


def _llama3(spec: RopeSpec) -> torch.Tensor:
    inv = _base_inv_freq(spec)
    old = spec.original_max_position
    low_wl, high_wl = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wl, inv / spec.factor, inv)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * out / spec.factor + smooth * out
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, out)


def inv_freq_and_scale(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """``(inv_freq[rotary_dim // 2] fp32, attention scaling of cos/sin)``."""
    if spec.rope_type == "default":
        return _base_inv_freq(spec), 1.0
    if spec.rope_type == "linear":
        return _base_inv_freq(spec) / spec.factor, 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec)
    return _llama3(spec), 1.0


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for given positions, applied to the first ``rotary_dim`` dims."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        with torch.device("cpu"):  # same float32 ops (and device) as HF's computation
            inv, scale = inv_freq_and_scale(spec)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scale = scale

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq
        if inv.device != positions.device:  # kept on the host at build: moved once, not per step
            inv = self.inv_freq = inv.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, rotary_dim]. Rotates the first rotary_dim dims (NeoX).
    (The definition beside its fused kernel: ``kernels.fused.references.apply_rope``.)"""
    return fused_ref.apply_rope(x, cos, sin)
