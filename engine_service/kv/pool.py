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
copy-on-write page, a state image), ``export_rows`` / ``import_rows`` (to / from a byte
``Region``: one flat buffer, or the scatter list of extents of an entry in the KV-cache
daemon's arena). Export byte order is *row-major*: row after row in the order given, each
row the concatenation of that row in every tensor (in the pool's order) — so the first ``k``
rows of an export are its first ``k * row_nbytes`` bytes, and a restore may take a prefix.
Rows move through a bounded staging buffer (``CHUNK_BYTES``) on the tensors' device, so a
large export never allocates its whole size there. Bytes are copied verbatim: a restored
page or slot is bit-identical to what was exported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from deepwell.engine_service.layers.context import StepContext

CHUNK_BYTES = 256 << 20  # staging per step of an export / import (at least one row)


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


class Region:
    """A logical byte range over one or more 1-D uint8 CPU tensors (arena extents), in order."""

    def __init__(self, segments: Sequence[torch.Tensor]) -> None:
        for s in segments:
            if s.dtype != torch.uint8 or s.dim() != 1 or not s.is_contiguous():
                raise ValueError("region segments must be contiguous 1-D uint8 tensors")
        self.segments = list(segments)
        self.nbytes = sum(s.numel() for s in segments)

    def _pieces(self, pos: int, n: int) -> list[tuple[torch.Tensor, int]]:
        """(segment slice, offset into the caller's n bytes) covering [pos, pos + n)."""
        if pos < 0 or pos + n > self.nbytes:
            raise ValueError(f"bytes [{pos}, {pos + n}) outside a region of {self.nbytes}")
        out, start, done = [], 0, 0
        for s in self.segments:
            end = start + s.numel()
            lo, hi = max(pos, start), min(pos + n, end)
            if lo < hi:
                out.append((s[lo - start:hi - start], done))
                done += hi - lo
            start = end
            if start >= pos + n:
                break
        return out

    def write(self, pos: int, src: torch.Tensor) -> None:
        """Copy the uint8 tensor ``src`` (any device) to bytes ``[pos, pos + len(src))``."""
        for piece, off in self._pieces(pos, src.numel()):
            piece.copy_(src[off:off + piece.numel()], non_blocking=True)

    def read(self, pos: int, n: int, device: torch.device) -> torch.Tensor:
        """Bytes ``[pos, pos + n)`` as one uint8 tensor on ``device``."""
        pieces = self._pieces(pos, n)
        if len(pieces) == 1:
            return pieces[0][0].to(device, non_blocking=True)
        return torch.cat([p for p, _ in pieces]).to(device, non_blocking=True)


def as_region(buf: torch.Tensor | Region) -> Region:
    return buf if isinstance(buf, Region) else Region([buf])


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


def _chunks(rows: Sequence[int], row: int, device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """(first row, row ids on ``device``) per staging step; the ids go to the device in one copy
    (a copy per step would make the host wait for the device between steps)."""
    step = max(1, CHUNK_BYTES // max(1, row))
    idx = _index(rows, device)
    return [(i, idx[i:i + step]) for i in range(0, len(rows), step)]


def _check_size(region: Region, need: int, start: int) -> None:
    if start < 0 or start + need > region.nbytes:
        raise ValueError(f"the byte buffer holds {region.nbytes} bytes, the rows need {need} from {start}")


def export_rows(tensors: Sequence[torch.Tensor], rows: Sequence[int], out: torch.Tensor | Region,
                start: int = 0) -> None:
    """Write ``rows`` of every tensor, row-major, into ``out`` from byte ``start``."""
    region, row = as_region(out), row_nbytes(tensors)
    _check_size(region, len(rows) * row, start)
    if not rows or not tensors:
        return
    dev = tensors[0].device
    for i, idx in _chunks(rows, row, dev):
        k, off = idx.numel(), 0
        stage = torch.empty(k, row, dtype=torch.uint8, device=dev)
        for t in tensors:
            rb = t[0].numel() * t.element_size()
            stage[:, off:off + rb] = t.index_select(0, idx).reshape(k, -1).view(torch.uint8)
            off += rb
        region.write(start + i * row, stage.view(-1))


def import_rows(tensors: Sequence[torch.Tensor], rows: Sequence[int], src: torch.Tensor | Region,
                start: int = 0) -> None:
    """Fill ``rows`` of every tensor from ``src`` (the layout ``export_rows`` writes) from byte ``start``."""
    region, row = as_region(src), row_nbytes(tensors)
    _check_size(region, len(rows) * row, start)
    if not rows or not tensors:
        return
    dev = tensors[0].device
    for i, idx in _chunks(rows, row, dev):
        k, off = idx.numel(), 0
        stage = region.read(start + i * row, k * row, dev).view(k, row)
        for t in tensors:
            rb = t[0].numel() * t.element_size()
            col = stage[:, off:off + rb]
            try:  # read the staging columns in place (one pass less over the bytes)
                vals = col.view(t.dtype).view(k, *t.shape[1:])
            except RuntimeError:  # a column offset the dtype cannot start at
                vals = col.contiguous().view(t.dtype).view(k, *t.shape[1:])
            t.index_copy_(0, idx, vals)
            off += rb
