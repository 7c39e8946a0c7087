"""Context extension by YaRN (``--rope-scaling``): serve a model past the context it was trained on.

``--rope-scaling`` (``EngineConfig.rope_scaling``):

- ``model``: the checkpoint's own RoPE and context, as its config says.
- ``yarn:<factor>[:<attention_factor>]``: YaRN (``engine_service.layers.rope``) over the trained
  context: the config's ``rope_parameters`` become ``rope_type: yarn`` with that ``factor`` (and
  ``attention_factor`` when given; YaRN's default is ``0.1 ln(factor) + 1``) and
  ``original_max_position_embeddings`` = the trained context (a checkpoint that already uses
  YaRN keeps its original and takes the new factor), and ``max_position_embeddings`` becomes
  ``factor x`` the trained context. The KV-cache fingerprint covers the config, so host entries
  written under one scaling never match another.
- ``auto``: ``yarn:4:1`` for the embedded default model (SmolLM2-135M, trained on 8192 tokens,
  served at 32768: the system prompt and tool schemas of a coding agent alone are 12-15k
  tokens), ``model`` for every other model. The attention factor 1 keeps its short-context
  answers those of the unextended model (greedy, identical on the prompts checked); YaRN's
  default 1.14 sharpens every attention score and this small model, never trained with it,
  answers worse (asked for France's capital it rambles in French).

Returns a new config dict; the source's own dict is not modified.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Yarn:
    factor: float
    attention_factor: float | None = None  # None: YaRN's default


DEFAULT_MODEL_YARN = Yarn(4.0, 1.0)
_ACCEPTED = "must be auto, model or yarn:<factor>[:<attention_factor>] with a factor > 1 (e.g. yarn:4)"


def parse(value: str) -> Yarn | None:
    """The ``Yarn`` of a ``yarn:...`` value, None for ``model`` / ``auto``; ValueError saying
    what is accepted otherwise."""
    if value in ("model", "auto"):
        return None
    kind, *nums = value.split(":")
    try:
        parsed = [float(x) for x in nums]
    except ValueError:
        parsed = []
    if kind != "yarn" or len(parsed) not in (1, 2) or not parsed[0] > 1.0 or (len(parsed) == 2 and not parsed[1] > 0):
        raise ValueError(_ACCEPTED)
    return Yarn(*parsed)


def for_model(value: str, default_model: bool) -> Yarn | None:
    """The YaRN extension ``value`` asks for (``auto`` resolved)."""
    if value == "auto":
        return DEFAULT_MODEL_YARN if default_model else None
    return parse(value)


def _trained_context(cfg: dict[str, Any]) -> int:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    orig = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if orig and (params.get("rope_type") or params.get("type")) == "yarn":
        return int(orig)
    return int(cfg.get("max_position_embeddings") or 2048)


def with_yarn(config: dict[str, Any], yarn: Yarn) -> dict[str, Any]:
    """``config`` (HF ``config.json`` semantics; a VLM's ``text_config`` is the one changed)
    extended by ``yarn`` over its trained context."""
    out = copy.deepcopy(config)
    cfg = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    trained = _trained_context(cfg)
    params = dict(cfg.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters cannot be extended with YaRN")
    legacy = cfg.pop("rope_scaling", None) or {}
    for key, val in legacy.items():
        params.setdefault(key, val)
    params.pop("type", None)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.update(rope_type="yarn", factor=yarn.factor, original_max_position_embeddings=trained)
    if yarn.attention_factor is not None:
        params["attention_factor"] = yarn.attention_factor
    cfg["rope_parameters"] = params
    cfg.pop("original_max_position_embeddings", None)
    cfg["max_position_embeddings"] = int(trained * yarn.factor)
    return out
