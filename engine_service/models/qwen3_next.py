"""Qwen3-Next: the hybrid of ``qwen3_5`` with MoE on layers ``(i + 1) % decoder_sparse_step
== 0`` outside ``mlp_only_layers`` (dense SwiGLU elsewhere), ``norm_topk_prob`` routing,
and GDN projections stored interleaved per key-head group:

- ``in_proj_qkvz``: per group ``[q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)]``, r = Hv / Hk;
- ``in_proj_ba``: per group ``[b (r) | a (r)]``.

``adapt`` de-interleaves them once at load into ``in_proj_qkv`` ([all q | all k | all v],
the conv channel order) + ``in_proj_z`` and ``in_proj_b`` + ``in_proj_a``, so the GDN
layer is shared with Qwen3.5.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from deepwell.engine_service.models.registry import Adapter, Family, register
from deepwell.engine_service.models.qwen3_5 import hybrid_args, moe_spec
from deepwell.engine_service.models.spec import ModelArgs, cfg_get


def qwen3_next_args(cfg: dict[str, Any]) -> ModelArgs:
    n = int(cfg_get(cfg, "num_hidden_layers"))
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe = moe_spec(cfg, bool(cfg.get("norm_topk_prob", True)))
    layers = frozenset(
        i for i in range(n) if i not in dense_only and moe.num_experts > 0 and (i + 1) % step == 0
    )
    return hybrid_args(cfg, "qwen3_next", moe if layers else None, layers)


def make_adapter(cfg: dict[str, Any]) -> Adapter:
    hk = int(cfg.get("linear_num_key_heads", 16))
    hv = int(cfg.get("linear_num_value_heads", 32))
    dk = int(cfg.get("linear_key_head_dim", 128))
    dv = int(cfg.get("linear_value_head_dim", 128))
    r = hv // hk

    def adapt(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            g = t.reshape(hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
            cols = t.shape[-1]
            qkv = torch.cat([x.reshape(-1, cols) for x in (q, k, v)], dim=0)
            yield base + "in_proj_qkv.weight", qkv
            yield base + "in_proj_z.weight", z.reshape(-1, cols)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            g = t.reshape(hk, 2 * r, -1)
            b, a = torch.split(g, [r, r], dim=1)
            yield base + "in_proj_b.weight", b.reshape(hv, -1)
            yield base + "in_proj_a.weight", a.reshape(hv, -1)
        else:
            yield name, t

    return adapt


register(
    Family(
        "qwen3_next", ("qwen3_next",), ("Qwen3NextForCausalLM",), qwen3_next_args, make_adapter
    )
)
