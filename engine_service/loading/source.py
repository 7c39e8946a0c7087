"""ModelSource: what every checkpoint format turns into before the model sees it.

A loader (HF safetensors directory, GGUF file, ...) produces a ``ModelSource``: an HF-style
``config`` dict (``config.json`` semantics, including ``text_config`` for multimodal
checkpoints), a stream of tensors under their Hugging Face names (dequantized, with any
format-specific permutation undone), and the files a gateway needs (tokenizer.json,
tokenizer_config.json, chat template, generation_config.json) as bytes. Models load from
this alone, so every format shares one weight-loading path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TensorStream = Iterator[tuple[str, torch.Tensor]]


@dataclass
class ModelSource:
    """A checkpoint opened but not yet loaded.

    ``iter_tensors()`` yields ``(hf_name, tensor)`` one at a time (streaming: callers copy
    each into its parameter and drop it, so peak memory stays ~1x the model).
    ``iter_fp8`` (FP8 block-scaled checkpoints only): the same stream with each quantized
    linear's codes and scales joined, undequantized (``loading.fp8.pair_stream``), for native
    FP8 serving (``models.loader.load_weights``).
    ``files`` maps a file name (e.g. ``"tokenizer.json"``) to a callable returning its
    bytes, so large files are read only when asked for.
    """

    path: Path
    format: str  # "hf" | "gguf"
    config: dict[str, Any]
    iter_tensors: Callable[[], TensorStream]
    iter_fp8: Callable[[], Iterator[tuple[str, Any]]] | None = None
    files: Mapping[str, Callable[[], bytes]] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    model_id: str = ""

    def text_config(self) -> dict[str, Any]:
        """The language-model config (``text_config`` for VLM checkpoints)."""
        tc = self.config.get("text_config")
        if isinstance(tc, dict):
            merged = dict(tc)
            merged.setdefault("architectures", self.config.get("architectures"))
            return merged
        return self.config
