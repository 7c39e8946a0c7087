"""Plain-attention families: ``llama`` (SmolLM2 too), ``qwen2`` (q/k/v bias), ``qwen3``
(per-head q/k RMSNorm). Sliding-window attention is refused (not implemented) when some
layer would use it by HF's rule (``sliding_window_layers``); a config that sets
``use_sliding_window`` with every layer below ``max_window_layers`` is full attention."""

from __future__ import annotations

from typing import Any

from deepwell.engine_service.layers.attention import AttentionSpec
from deepwell.engine_service.layers.rope import RopeSpec
from deepwell.engine_service.models.registry import Family, register
from deepwell.engine_service.models.spec import FULL, ModelArgs, UnsupportedModelError, cfg_get, check_silu


def _dense_args(
    cfg: dict[str, Any], arch: str, *, qkv_bias: bool, o_bias: bool, qk_norm: bool
) -> ModelArgs:
    check_silu(cfg)
    hidden = int(cfg_get(cfg, "hidden_size"))
    heads = int(cfg_get(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    layers = int(cfg_get(cfg, "num_hidden_layers"))
    windowed = sliding_window_layers(cfg, layers)
    if windowed:
        raise UnsupportedModelError(f"sliding-window attention is not supported: {len(windowed)} of {layers} layers (from "
                         f"layer {windowed[0]}) would attend within a window of {cfg.get('sliding_window', 4096)} "
                         f"tokens by this config (layer_types, or use_sliding_window from max_window_layers="
                         f"{cfg.get('max_window_layers', 28)} on); serve a config whose layers all use full attention")
    return ModelArgs(
        architecture=arch,
        vocab_size=int(cfg_get(cfg, "vocab_size")),
        hidden=hidden,
        layer_types=(FULL,) * layers,
        attention=AttentionSpec(
            hidden=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, eps=eps,
        ),
        gdn=None,
        rope=RopeSpec.from_config(cfg, head_dim),
        intermediate=int(cfg_get(cfg, "intermediate_size")),
        moe=None,
        moe_layers=frozenset(),
        rms_eps=eps,
        zero_centered_norm=False,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_context=int(cfg.get("max_position_embeddings", 2048)),
    )


def sliding_window_layers(cfg: dict[str, Any], layers: int) -> list[int]:
    """The layers HF would run with sliding-window attention (its qwen2/qwen3 rule): those
    an explicit ``layer_types`` marks ``sliding_attention``; else, when ``use_sliding_window``
    and a ``sliding_window`` (HF default 4096) are set, the layers from ``max_window_layers``
    (HF default 28) on. ``max_window_layers >= num_hidden_layers`` leaves every layer full."""
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return [i for i, t in enumerate(types[:layers]) if t == "sliding_attention"]
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window", 4096):
        return []
    first = cfg.get("max_window_layers")
    first = 28 if first is None else int(first)
    return list(range(max(first, 0), layers))


def llama_args(cfg: dict[str, Any]) -> ModelArgs:
    bias = bool(cfg.get("attention_bias", False))
    return _dense_args(cfg, "llama", qkv_bias=bias, o_bias=bias, qk_norm=False)


def qwen2_args(cfg: dict[str, Any]) -> ModelArgs:
    return _dense_args(cfg, "qwen2", qkv_bias=True, o_bias=False, qk_norm=False)


def qwen3_args(cfg: dict[str, Any]) -> ModelArgs:
    bias = bool(cfg.get("attention_bias", False))
    return _dense_args(cfg, "qwen3", qkv_bias=bias, o_bias=bias, qk_norm=True)


register(Family("llama", ("llama",), ("LlamaForCausalLM",), llama_args))
register(Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), qwen2_args))
register(Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), qwen3_args))
