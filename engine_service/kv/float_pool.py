"""The float KV page pool of attention layers (``--kv-dtype auto | bf16 | fp16 | fp32``).

Tensors only: page allocation, block tables and refcounts belong to the scheduler's block
manager. Per attention layer, K and V each ``[num_pages, page_size, num_kv_heads, head_dim]``
in the KV dtype; layers use the flat ``[num_pages * page_size, Hkv, D]`` views, row
``page * page_size + offset``. The quantized formats (``fp8``, ``int8``, ``nvfp4``) are
``kv.quant_pool.QuantKVPool``; both pools hand each attention layer an ``AttentionKV``
(``layer(i)``) and their page bytes as ``page_tensors()`` (``kv.pool``), so neither the
model code nor the prefix cache branches on the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.context import StepContext

KV_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
QUANT_KV_DTYPES = ("fp8", "int8", "nvfp4")  # kv.quant_pool.QUANT_FORMATS


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a float KV pool (``ValueError`` for anything else)."""
    if kv_dtype == "auto":
        return model_dtype
    if kv_dtype in KV_DTYPES:
        return KV_DTYPES[kv_dtype]
    raise ValueError(
        f"unknown kv dtype {kv_dtype!r}; use auto, {', '.join(sorted(KV_DTYPES))} "
        f"or a quantized format ({', '.join(QUANT_KV_DTYPES)})"
    )


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class FloatLayerKV:
    """``AttentionKV`` over one layer's flat float K/V rows: scatter on write; per
    multi-token slice a gather + causal attention, and all decode slices batched."""

    k_cache: torch.Tensor  # [num_pages * page_size, Hkv, D]
    v_cache: torch.Tensor
    ops: ReferenceBackend

    def write(self, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None:
        assert ctx.kv_slots is not None
        self.ops.write_kv(self.k_cache, self.v_cache, ctx.kv_slots, k, v)

    def attend(self, q: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for seq in ctx.multi:
            rows = slice(seq.offset, seq.offset + seq.num_tokens)
            assert seq.token_index is not None
            attend = self.ops.verify_attention if seq.verify else self.ops.paged_attention
            out[rows] = attend(q[rows], self.k_cache, self.v_cache, seq.token_index, seq.start, scale)
        dec = ctx.decode
        if dec is not None:
            assert dec.token_index is not None and dec.lengths is not None
            out[dec.rows] = self.ops.paged_decode_attention(
                q[dec.rows], self.k_cache, self.v_cache, dec.token_index, dec.lengths, scale
            )
        return out


class KVPool:
    """The float KV pool: per attention layer K and V pages in ``layout.dtype``."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: torch.device,
        ops: ReferenceBackend | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.ops = ops or ReferenceBackend()
        shape = (num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
        n, dt = layout.num_layers, layout.dtype
        self.k = [torch.zeros(shape, dtype=dt, device=device) for _ in range(n)]
        self.v = [torch.zeros(shape, dtype=dt, device=device) for _ in range(n)]

    def layer(self, i: int) -> FloatLayerKV:
        """Layer ``i``'s store over flat ``[num_pages * page_size, Hkv, D]`` views."""
        lay = self.layout
        flat = (self.num_pages * lay.page_size, lay.num_kv_heads, lay.head_dim)
        return FloatLayerKV(self.k[i].view(flat), self.v[i].view(flat), self.ops)

    def page_tensors(self) -> list[torch.Tensor]:
        """Per layer K then V ``[num_pages, page_size, Hkv, D]`` (``kv.pool``)."""
        return [t for kv in zip(self.k, self.v, strict=True) for t in kv]
