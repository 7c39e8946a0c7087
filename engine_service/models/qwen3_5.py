"""Qwen3.5 / Qwen3.6 hybrids: ``qwen3_5`` (dense) and ``qwen3_5_moe`` (sparse MoE with a
gated shared expert), text model of the VLM checkpoints (vision weights are skipped).

Layer ``i`` is full (gated, q/k-normed, partial-RoPE) attention or Gated DeltaNet per
``layer_types`` (default: every ``full_attention_interval``-th layer is attention). All
RMSNorms except the GDN output norm are zero-centered ``(1 + w)``. MoE routing always
renormalises the top-k weights.
"""

from __future__ import annotations

from typing import Any

from deepwell.engine_service.layers.attention import AttentionSpec
from deepwell.engine_service.layers.gdn import GDNSpec
from deepwell.engine_service.layers.rope import RopeSpec
from deepwell.engine_service.models.registry import Family, register
from deepwell.engine_service.models.spec import FULL, LINEAR, ModelArgs, MoESpec, cfg_get, check_silu


def hybrid_layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    n = int(cfg_get(cfg, "num_hidden_layers"))
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if len(types) < n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    return tuple(types[:n])


def hybrid_args(
    cfg: dict[str, Any], arch: str, moe: MoESpec | None, moe_layers: frozenset[int]
) -> ModelArgs:
    check_silu(cfg)
    cfg = dict(cfg)
    cfg.setdefault("partial_rotary_factor", 0.25)
    hidden = int(cfg_get(cfg, "hidden_size"))
    heads = int(cfg_get(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or 256)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    types = hybrid_layer_types(cfg)
    gdn = GDNSpec(
        hidden=hidden,
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        head_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        head_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        eps=eps,
    )
    bias = bool(cfg.get("attention_bias", False))
    return ModelArgs(
        architecture=arch,
        vocab_size=int(cfg_get(cfg, "vocab_size")),
        hidden=hidden,
        layer_types=types,
        attention=AttentionSpec(
            hidden=hidden, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_zero_centered=True,
            output_gate=True, eps=eps,
        ),
        gdn=gdn,
        rope=RopeSpec.from_config(cfg, head_dim),
        intermediate=int(cfg.get("intermediate_size") or 0),
        moe=moe,
        moe_layers=moe_layers,
        rms_eps=eps,
        zero_centered_norm=True,
        mlp_bias=False,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_context=int(cfg.get("max_position_embeddings", 32768)),
        mtp_layers=int(cfg.get("mtp_num_hidden_layers", 0) or 0),
    )


def moe_spec(cfg: dict[str, Any], norm_topk_prob: bool) -> MoESpec:
    return MoESpec(
        num_experts=int(cfg_get(cfg, "num_experts")),
        top_k=int(cfg_get(cfg, "num_experts_per_tok")),
        intermediate=int(cfg_get(cfg, "moe_intermediate_size")),
        shared_intermediate=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=norm_topk_prob,
    )


def qwen3_5_args(cfg: dict[str, Any]) -> ModelArgs:
    return hybrid_args(cfg, "qwen3_5", None, frozenset())


def qwen3_5_moe_args(cfg: dict[str, Any]) -> ModelArgs:
    n = int(cfg_get(cfg, "num_hidden_layers"))
    return hybrid_args(cfg, "qwen3_5_moe", moe_spec(cfg, True), frozenset(range(n)))


register(
    Family(
        "qwen3_5",
        ("qwen3_5", "qwen3_5_text"),
        ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
        qwen3_5_args,
    )
)
register(
    Family(
        "qwen3_5_moe",
        ("qwen3_5_moe", "qwen3_5_moe_text"),
        ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
        qwen3_5_moe_args,
    )
)
