"""``ModelArgs``: everything the generic decoder needs, derived from an HF text config.

Family modules (``llama``, ``qwen3_5``, ...) turn a ``config.json`` dict into ModelArgs;
the decoder (``decoder.py``) builds layers from it alone. ``cfg_get`` reads a required
key with a clear error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepwell.engine_service.layers.attention import AttentionSpec
from deepwell.engine_service.layers.gdn import GDNSpec
from deepwell.engine_service.layers.rope import RopeSpec


class UnsupportedModelError(ValueError):
    """A checkpoint this engine cannot serve (its architecture, activation, attention pattern or a
    config key it needs): the engine refuses it at start with this reason."""

FULL = "full_attention"
LINEAR = "linear_attention"

_MISSING = object()


def cfg_get(cfg: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    val = cfg.get(key, default)
    if val is _MISSING or (val is None and default is _MISSING):
        raise UnsupportedModelError(f"config.json is missing {key!r}")
    return val


def check_silu(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate: int
    shared_intermediate: int
    norm_topk_prob: bool


@dataclass(frozen=True)
class ModelArgs:
    architecture: str  # the registry key that built it
    vocab_size: int
    hidden: int
    layer_types: tuple[str, ...]
    attention: AttentionSpec
    gdn: GDNSpec | None
    rope: RopeSpec
    intermediate: int
    moe: MoESpec | None
    moe_layers: frozenset[int]  # layers whose MLP is the sparse MoE
    rms_eps: float
    zero_centered_norm: bool
    mlp_bias: bool
    tie_embeddings: bool
    max_context: int
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in (FULL, LINEAR)]
        if bad:
            raise ValueError(f"unsupported layer types {sorted(set(bad))}")
        if LINEAR in self.layer_types and self.gdn is None:
            raise ValueError("linear_attention layers need the linear_* config fields")
        if self.moe_layers and self.moe is None:
            raise ValueError("MoE layers without MoE config")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]
