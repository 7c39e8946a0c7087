"""Architecture registry: ``config.json`` -> the family that builds the model.

A family names the ``model_type`` values and ``architectures`` class names it serves, a
``build_args(text_config) -> ModelArgs`` and an optional ``adapter_for(text_config)``
returning ``adapt(name, tensor)``, which turns
checkpoint tensors into parameter-layout tensors (e.g. de-interleaving Qwen3-Next's fused
projections). Lookup order: the text config's ``model_type`` (``text_config`` for VLM
checkpoints), the top-level ``model_type``, then each ``architectures`` entry. Unknown
architectures fail listing the supported ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deepwell.engine_service.models.spec import ModelArgs, UnsupportedModelError

Adapter = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def identity_adapter(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield name, tensor


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    build_args: Callable[[dict[str, Any]], ModelArgs]
    adapter_for: Callable[[dict[str, Any]], Adapter] = field(default=lambda cfg: identity_adapter)


_FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    _FAMILIES.append(family)
    return family


_LOADED = False


def _ensure_loaded() -> None:
    """Import every family module (each registers itself) once. Until all of them imported, a
    later call tries again, so a failed import raises its own error every time instead of
    leaving the families that did load looking like the whole list."""
    global _LOADED
    if not _LOADED:
        from deepwell.engine_service.models import llama, qwen3_5, qwen3_next  # noqa: F401

        _LOADED = True


def families() -> list[Family]:
    _ensure_loaded()
    return list(_FAMILIES)


def supported() -> list[str]:
    return sorted({t for f in families() for t in f.model_types})


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    tc = config.get("text_config")
    if isinstance(tc, dict):
        merged = dict(tc)
        if "architectures" not in merged and "architectures" in config:
            merged["architectures"] = config["architectures"]
        if "tie_word_embeddings" in config:  # HF ties the wrapper's lm_head by the top level
            merged["tie_word_embeddings"] = config["tie_word_embeddings"]
        return merged
    return config


def resolve(config: dict[str, Any]) -> tuple[Family, dict[str, Any]]:
    """The family serving ``config`` and its text config."""
    tc = text_config(config)
    keys = [tc.get("model_type"), config.get("model_type")]
    fams = families()
    for key in keys:
        for fam in fams:
            if key in fam.model_types:
                return fam, tc
    for arch in config.get("architectures") or []:
        for fam in fams:
            if arch in fam.architectures:
                return fam, tc
    raise UnsupportedModelError(
        f"unsupported architecture (model_type={config.get('model_type')!r}, "
        f"architectures={config.get('architectures')!r}); supported model types: "
        f"{', '.join(supported())}"
    )
