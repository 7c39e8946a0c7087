"""KV page pool (attention layers) and recurrent-state pool (Gated DeltaNet layers).

Tensors only: page allocation, block tables and refcounts belong to the scheduler's block
manager (``runner_api``). Layout:

- KV: per attention layer, K and V each ``[num_pages, page_size, num_kv_heads, head_dim]``
  in the KV dtype; layers use the flat ``[num_pages * page_size, Hkv, D]`` views, row
  ``page * page_size + offset``.
- State: per GDN layer, conv ``[slots, conv_dim, K - 1]`` in the model dtype and recurrent
  ``[slots, Hv, Dk, Dv]`` in fp32 (always: the recurrence accumulates).

KV dtypes here: ``auto`` (= model dtype), ``bf16``, ``fp16``, ``fp32``. The quantized
formats (``fp8``, ``int8``, ``nvfp4``) are ``engine_service.kv_quant.QuantKVPool`` (the
``kernels/`` paged cache); both pools hand each attention layer an ``AttentionKV``
(``layer(i)``), so the model code never branches on the format.
Snapshots are full copies of one slot's rows in every GDN layer (bit-exact restore).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_service.layers.backend import ReferenceBackend
from engine_service.layers.context import StepContext

KV_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
QUANT_KV_DTYPES = ("fp8", "int8", "nvfp4")  # engine_service.kv_quant


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
class StateLayout:
    num_layers: int
    conv_dim: int
    conv_width: int  # K - 1
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        conv_elem = torch.empty((), dtype=self.conv_dtype).element_size()
        conv = self.conv_dim * self.conv_width * conv_elem
        rec = self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
        return self.num_layers * (conv + rec)


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
            out[rows] = self.ops.paged_attention(
                q[rows], self.k_cache, self.v_cache, seq.token_index, seq.start, scale
            )
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


@dataclass
class StateSnapshotData:
    """A copy of one slot's recurrent state at ``position`` (every GDN layer)."""

    position: int
    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.recurrent))


class StatePool:
    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1 for a hybrid model, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        lay = layout
        self.conv = [
            torch.zeros(
                num_slots, lay.conv_dim, lay.conv_width, dtype=lay.conv_dtype, device=device
            )
            for _ in range(lay.num_layers)
        ]
        self.recurrent = [
            torch.zeros(
                num_slots, lay.num_v_heads, lay.head_k_dim, lay.head_v_dim,
                dtype=torch.float32, device=device,
            )
            for _ in range(lay.num_layers)
        ]

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} out of range [0, {self.num_slots})")

    def reset(self, slot: int) -> None:
        self.check_slot(slot)
        for c, r in zip(self.conv, self.recurrent, strict=True):
            c[slot].zero_()
            r[slot].zero_()

    def snapshot(self, slot: int, position: int) -> StateSnapshotData:
        self.check_slot(slot)
        return StateSnapshotData(
            position=position,
            conv=[c[slot].clone() for c in self.conv],
            recurrent=[r[slot].clone() for r in self.recurrent],
        )

    def restore(self, slot: int, snap: StateSnapshotData) -> None:
        self.check_slot(slot)
        if len(snap.conv) != len(self.conv) or len(snap.recurrent) != len(self.recurrent):
            raise ValueError("snapshot does not match this model's recurrent layers")
        for c, r, sc, sr in zip(self.conv, self.recurrent, snap.conv, snap.recurrent, strict=True):
            c[slot].copy_(sc)
            r[slot].copy_(sr)

    def copy(self, src: int, dst: int) -> None:
        self.check_slot(src)
        self.check_slot(dst)
        for c, r in zip(self.conv, self.recurrent, strict=True):
            c[dst].copy_(c[src])
            r[dst].copy_(r[src])
