"""The one protocol every KV page pool and the recurrent-state pool follow, and the byte
movers written once on top of it.

A pool exposes its memory as a list of tensors whose first dimension is the page (KV pools:
``page_tensors()``) or the state slot (``StatePool.slot_tensors()``):

- float KV pool: per attention layer K and V ``[num_pages, page_size, Hkv, D]``;
- quantized KV pool: per attention layer the uint8 page bytes ``[num_pages, 2, Hkv, head_page_bytes]``
  (K then V of each head, codes then scales: ``kernels.kv_formats.layout``);
- state pool: per Gated DeltaNet layer conv ``[slots, conv_dim, K - 1]`` and recurrent
  ``[slots, Hv, Dk, Dv]`` (fp32).

Everything that moves a page's or a slot's bytes goes through the functions below, so the
float and the quantized pools behave identically: ``copy_rows`` (device to device: a
copy-on-write page, a state image), ``export_rows`` / ``import_rows`` (to / from one flat
uint8 host buffer: what a spill writes into the daemon's arena and a restore reads back).
The byte order of an export is fixed: tensor by tensor in the pool's order, and within a
tensor the rows in the order given. Bytes are copied verbatim, so a restored page or slot
is bit-identical to what was exported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine_service.layers.context import StepContext


class AttentionKV(Protocol):
    """One attention layer's KV store as the model sees it (``layers.attention``)."""

    def write(self, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None: ...

    def attend(self, q: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor: ...


class PagePool(Protocol):
    """What the runner needs of a KV page pool (float or quantized)."""

    num_pages: int

    def layer(self, i: int) -> AttentionKV: ...

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding page bytes, dim 0 = page id."""


def row_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of one row (page or slot) over every tensor."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.long, device=device)


def copy_rows(tensors: Sequence[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy rows ``src[i]`` to rows ``dst[i]`` in every tensor (on the tensors' device)."""
    if len(src) != len(dst):
        raise ValueError(f"copy of {len(src)} rows into {len(dst)}")
    if not src:
        return
    if set(src) & set(dst):
        raise ValueError("copy source and destination rows overlap")
    for t in tensors:
        s, d = _index(src, t.device), _index(dst, t.device)
        t.index_copy_(0, d, t.index_select(0, s))


def _check_buffer(buf: torch.Tensor, need: int) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("the byte buffer must be a contiguous 1-D uint8 tensor")
    if buf.numel() != need:
        raise ValueError(f"the byte buffer holds {buf.numel()} bytes, the rows {need}")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def export_rows(tensors: Sequence[torch.Tensor], rows: Sequence[int], out: torch.Tensor) -> None:
    """Write ``rows`` of every tensor into ``out`` (uint8 ``[len(rows) * row_nbytes]``, any device)."""
    _check_buffer(out, len(rows) * row_nbytes(tensors))
    off = 0
    for t in tensors:
        n = len(rows) * t[0].numel() * t.element_size()
        if n:
            out[off:off + n].copy_(_as_bytes(t.index_select(0, _index(rows, t.device))), non_blocking=True)
        off += n


def import_rows(tensors: Sequence[torch.Tensor], rows: Sequence[int], src: torch.Tensor) -> None:
    """Fill ``rows`` of every tensor from ``src`` (the layout ``export_rows`` writes)."""
    _check_buffer(src, len(rows) * row_nbytes(tensors))
    off = 0
    for t in tensors:
        per = t[0].numel() * t.element_size()
        n = len(rows) * per
        if n:
            chunk = src[off:off + n].to(t.device, non_blocking=True)
            vals = chunk.view(t.dtype).view(len(rows), *t.shape[1:])
            t.index_copy_(0, _index(rows, t.device), vals)
        off += n
