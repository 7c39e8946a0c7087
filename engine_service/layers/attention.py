"""Causal self-attention over the paged KV pool, covering the Llama/Qwen family variants.

Options (all from the checkpoint config): q/k/v/o bias (Qwen2: q/k/v only), per-head q/k
RMSNorm (Qwen3 plain, Qwen3.5/Next zero-centered), and the sigmoid output gate of Qwen3.5
/ Qwen3-Next, where ``q_proj`` yields ``[query | gate]`` per head. GQA: query head ``h``
reads KV head ``h // (Hq / Hkv)``.

Invariant: the new tokens' K/V are written to their pool rows *before* attention reads, so
a sequence's queries see positions ``[0, start + i]`` from the pool only.

Where K/V live is the ``AttentionKV`` the decoder hands in for this layer: the float pool
(``kv.float_pool.FloatLayerKV``: gather + reference attention) or a quantized paged cache
(``kv.quant_pool.QuantLayerKV``: ``kernels.backend`` append + decode/varlen prefill attention).
Both get Q and K after RoPE (and q/k norm) and return ``[T, Hq, D]`` in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.context import StepContext
from deepwell.engine_service.layers.mlp import linear
from deepwell.engine_service.layers.norm import RMSNorm


@dataclass(frozen=True)
class AttentionSpec:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_zero_centered: bool = False
    output_gate: bool = False
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )


class AttentionKV(Protocol):
    """One attention layer's KV store for one forward step."""

    def write(self, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None:
        """Store the step's new K/V ``[T, Hkv, D]`` (after RoPE) at ``ctx.kv_slots``."""

    def attend(self, q: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor:
        """Causal attention of every new query ``[T, Hq, D]`` over its sequence's cache."""
        ...


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec, backend: ReferenceBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        q_out = spec.num_heads * spec.head_dim * (2 if spec.output_gate else 1)
        kv_out = spec.num_kv_heads * spec.head_dim
        self.q_proj = linear(spec.hidden, q_out, spec.qkv_bias)
        self.k_proj = linear(spec.hidden, kv_out, spec.qkv_bias)
        self.v_proj = linear(spec.hidden, kv_out, spec.qkv_bias)
        self.o_proj = linear(spec.num_heads * spec.head_dim, spec.hidden, spec.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.eps, spec.qk_norm_zero_centered, backend)
            self.k_norm = RMSNorm(spec.head_dim, spec.eps, spec.qk_norm_zero_centered, backend)
        self.scale = spec.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: StepContext,
        kv: AttentionKV,
    ) -> torch.Tensor:
        s = self.spec
        t = x.shape[0]
        q = self.q_proj(x)
        gate = None
        if s.output_gate:
            q, gate = q.view(t, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)  # strided views, no copies
        q = q.reshape(t, s.num_heads, s.head_dim)
        k = self.k_proj(x).view(t, s.num_kv_heads, s.head_dim)
        v = self.v_proj(x).view(t, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = cos_sin
        q, k_rot = self.backend.rope(q, k, cos, sin, inplace=True)
        assert k_rot is not None
        kv.write(k_rot, v, ctx)
        out = kv.attend(q, ctx, self.scale)
        out = out.reshape(t, -1)
        if gate is not None:
            out = self.backend.sigmoid_gate_mul(out, gate)
        return self.o_proj(out)
