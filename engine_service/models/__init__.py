"""deepwell.engine_service.models — architecture registry and the decoder every family builds.

``build_model(config, device, dtype, backend)`` resolves the family from ``config.json``
(see ``registry``), allocates the model once on ``device`` in ``dtype`` (uninitialised),
and ``load_weights(model, family, text_config, tensors)`` streams checkpoint tensors into
it (``loader``). Supported: llama (SmolLM2), qwen2, qwen3, qwen3_5 (+ ``_text``),
qwen3_5_moe (+ ``_text``), qwen3_next.
"""

from deepwell.engine_service.models.loader import build_model, load_weights, random_weights
from deepwell.engine_service.models.registry import resolve, supported

__all__ = ["build_model", "load_weights", "random_weights", "resolve", "supported"]
