"""KV settings of one engine (``--kv-dtype``, ``--kv-hadamard``, ``--kv-center-k``,
``--kv-k-rounding``) resolved against one model: ``resolve`` checks every combination and
answers ``KVSettingsError`` (a ``ValueError``) saying what to change, before any weight loads.

``KVSpec`` is what the rest of the engine reads: the float pool's layout (the serving pool for
float KV dtypes; the calibration's scratch pool, in the model dtype, for quantized ones), the
quantized layout (``kernels`` ``KVLayout``, None for float), and the derived switches:
K centered (``center_k``; per page: ``center_page``), K rounded with query-weighted feedback
(``k_feedback``), K's rotation chosen per layer at calibration (``per_layer_rotation``).

A bf16 cache on CUDA is held in the kernels' paged bf16 layout (``KVSettings.paged``) so the
same Triton decode / verify / prefill kernels read it as the quantized formats, with no
gather: ``quant_layout`` is then the bf16 ``KVLayout`` (no scales, no rotation, nothing to
calibrate) and ``paged_float`` is true; ``name`` says ``bf16`` either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepwell.engine_service.kv.float_pool import KVLayout as FloatKVLayout
from deepwell.engine_service.kv.float_pool import resolve_kv_dtype
from deepwell.engine_service.kv.quant_pool import (
    CENTER_K_MODES,
    QUANT_FORMATS,
    FEEDBACK_BY_DEFAULT,
    K_ROUNDING_MODES,
    SCALED_FORMATS,
    KVSettingsError,
    QuantKVPool,
    is_quantized,
    quant_layout,
    resolve_hadamard,
)
from deepwell.kernels.kv_formats.layout import HEAD_DIMS, PAGE_SIZE, KVLayout


@dataclass(frozen=True)
class KVSettings:
    kv_dtype: str = "auto"  # auto | bf16 | fp16 | fp32 | fp8 | int8 | nvfp4
    hadamard: str = "auto"  # auto | on | off | layer
    center_k: str = "auto"  # auto | on | off | page
    k_rounding: str = "auto"  # auto | nearest | feedback
    # a bf16 cache in the kernels' paged layout, read by the Triton decode / verify / prefill
    # kernels with no gather (on), or the float pool gathered into contiguous tensors (off);
    # auto: on for CUDA where the kernels take the model (page 64, head_dim 64/128/256)
    paged: str = "auto"  # auto | on | off


PAGED_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class KVSpec:
    settings: KVSettings
    float_layout: FloatKVLayout
    quant_layout: KVLayout | None
    center_k: bool
    center_page: bool
    k_feedback: bool
    per_layer_rotation: bool

    @property
    def quantized(self) -> bool:
        return self.quant_layout is not None

    @property
    def paged_float(self) -> bool:
        """A bf16 cache served by the paged kernels (no gather)."""
        return self.quant_layout is not None and self.quant_layout.fmt.value == "bf16"

    @property
    def name(self) -> str:
        """The KV format as reported in ModelInfo: ``nvfp4``/``fp8``/``int8`` or the float dtype."""
        if self.quant_layout is not None:
            return self.quant_layout.fmt.value
        return str(self.float_layout.dtype).removeprefix("torch.")

    @property
    def bytes_per_page(self) -> int:
        """True bytes of one page over every attention layer (K and V, all KV heads)."""
        if self.quant_layout is not None:
            return QuantKVPool.page_bytes(self.quant_layout, self.float_layout.num_layers)
        return self.float_layout.bytes_per_page


def page_bytes_by_kv_dtype(float_layout: FloatKVLayout) -> tuple[tuple[str, int], ...]:
    """What one page over every attention layer costs in bf16 and in each quantized format the
    model's head_dim and page size allow (bytes; for sizing logs and errors)."""
    lay = float_layout
    out = [("bf16", 2 * 2 * lay.num_layers * lay.page_size * lay.num_kv_heads * lay.head_dim)]
    for fmt in QUANT_FORMATS:
        try:
            out.append((fmt, QuantKVPool.page_bytes(quant_layout(fmt, lay.num_kv_heads, lay.head_dim, lay.page_size,
                                                                 "off"), lay.num_layers)))
        except KVSettingsError:  # this model's head_dim / page size rules the format out
            continue
    return tuple(out)


def resolve(settings: KVSettings, *, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int,
            page_size: int, device_type: str = "cpu") -> KVSpec:
    """Check ``settings`` for this model and derive the pool layouts (``KVSettingsError``); a bf16
    cache on ``device_type`` "cuda" gets the kernels' paged layout where it fits (``paged``)."""
    s = settings
    if s.paged not in PAGED_MODES:
        raise KVSettingsError(f"kv paged mode {s.paged!r} must be one of {', '.join(PAGED_MODES)}")
    quantized = is_quantized(s.kv_dtype)
    if not quantized and s.hadamard in ("on", "layer"):
        raise KVSettingsError(f"kv_hadamard {s.hadamard!r} needs a quantized kv dtype (fp8, int8, nvfp4), "
                              f"not {s.kv_dtype!r}: use auto or off")
    if s.center_k not in CENTER_K_MODES:
        raise KVSettingsError(f"kv_center_k {s.center_k!r} must be one of {', '.join(CENTER_K_MODES)}")
    if s.center_k in ("on", "page") and s.kv_dtype not in SCALED_FORMATS:
        raise KVSettingsError(f"kv_center_k {s.center_k!r} needs a calibrated kv dtype "
                              f"({', '.join(SCALED_FORMATS)}), not {s.kv_dtype!r}: use auto or off")
    if s.k_rounding not in K_ROUNDING_MODES:
        raise KVSettingsError(f"kv_k_rounding {s.k_rounding!r} must be one of {', '.join(K_ROUNDING_MODES)}")
    if s.k_rounding == "feedback" and s.kv_dtype not in SCALED_FORMATS:
        raise KVSettingsError(f"kv_k_rounding 'feedback' needs a calibrated kv dtype ({', '.join(SCALED_FORMATS)}), "
                              f"not {s.kv_dtype!r}: use auto or nearest")
    scaled = s.kv_dtype in SCALED_FORMATS
    # float pools: the KV dtype; quantized: the model dtype (the calibration's scratch pool)
    float_dtype = model_dtype if quantized else resolve_kv_dtype(s.kv_dtype, model_dtype)
    flt = FloatKVLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                        dtype=float_dtype)
    qlay = quant_layout(s.kv_dtype, num_kv_heads, head_dim, page_size, s.hadamard) if quantized and num_layers else None
    if not quantized and num_layers and _paged_bf16(s.paged, float_dtype, head_dim, page_size, device_type):
        qlay = KVLayout.make("bf16", num_kv_heads, head_dim, False)
    return KVSpec(
        settings=s, float_layout=flt, quant_layout=qlay,
        center_k=s.center_k != "off" and scaled,
        # auto: per page (kernels.page_center; KL to the unquantized cache -33% / -36% for nvfp4 / fp8 on
        # SmolLM2, decode a few % slower: docs/kernels.md); on: one fixed offset
        center_page=s.center_k in ("auto", "page") and scaled,
        k_feedback=s.k_rounding == "feedback" or (s.k_rounding == "auto" and s.kv_dtype in FEEDBACK_BY_DEFAULT),
        # layer: the calibration chooses each attention layer's K rotation (auto for fp8 / nvfp4)
        per_layer_rotation=qlay is not None and resolve_hadamard(s.kv_dtype, s.hadamard) == "layer",
    )


def _paged_bf16(mode: str, dtype: torch.dtype, head_dim: int, page_size: int, device_type: str) -> bool:
    """Whether a float cache of ``dtype`` is the kernels' paged bf16 cache (``KVSettings.paged``)."""
    fits = dtype == torch.bfloat16 and page_size == PAGE_SIZE and head_dim in HEAD_DIMS
    if mode == "on" and not fits:
        why = (f"its dtype is {str(dtype).removeprefix('torch.')}" if dtype != torch.bfloat16 else
               f"page_size {page_size} is not {PAGE_SIZE}" if page_size != PAGE_SIZE else
               f"head_dim {head_dim} is not one of {HEAD_DIMS}")
        raise KVSettingsError(f"a paged float KV cache needs bf16, page_size {PAGE_SIZE} and head_dim in {HEAD_DIMS}: "
                              f"{why}; use --kv-paged auto or off")
    return fits and (mode == "on" or (mode == "auto" and device_type == "cuda"))
