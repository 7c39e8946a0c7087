"""Reference KV append: (Hadamard on K) + quantize + scatter into the paged cache.

``append(cache, layout, k, v, slots, global_scales)`` writes token ``i`` of ``k``/``v``
(``[N, num_kv_heads, head_dim]``, any float dtype) into slot ``slots[i]`` (``page * 64 +
offset``; ``-1`` skips the token). K is rotated by ``layout.rotate`` (``hadamard.fwht`` of the layout's size) first when
``layout.hadamard``; V never is. The bytes written are exactly ``codec.encode`` of the
(rotated) fp32 rows (nvfp4: ``clip=True`` for K, ``clip=False`` for V), placed as ``layout``
documents. Nothing else in the cache changes. ``k_feedback`` (fp8 / nvfp4 only, fp32
``[num_kv_heads, d/16, 16, 16]``) rounds K with error feedback (``kv_formats.feedback``).

``k_offset`` (optional fp32) is subtracted from K before the rotation: ``[num_kv_heads, d]``, one
offset per head (K centering), or ``[N, num_kv_heads, d]``, one per token (K centered per page,
``kernels.page_center.PageCenter.offsets``).

``scale_counts`` (optional int64 [2, num_kv_heads, 3]: K then V, per head) accumulates the
block-scale health of what was written: zero, subnormal and saturated block scales (fp8: elements,
int8: token scales), as ``kernels.calibration.count_rows`` defines them (``head_counts``; the
total is rows x ``counted_per_row``, known to the caller); bf16 adds nothing.

``read_scales`` reads the block-scale bytes of given tokens (nvfp4's V region is
block-major: ``kv_formats.layout``).

``gather(cache, layout, block_table, length, global_scales)`` reads back the first
``length`` tokens of one sequence dequantized to fp32 ``(k, v)`` ``[length, H, d]`` (K in
the stored space: centered and rotated as written).
"""

from __future__ import annotations

import torch

from deepwell.kernels.kv_formats import feedback
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout, check_global_scales


def slots_from_positions(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, page_size: int = 64) -> torch.Tensor:
    """Slot of each token from its sequence's block table row and its position."""
    pages = block_tables[seq_index.long(), positions.long() // page_size].long()
    return pages * page_size + positions.long() % page_size


def _regions(cache: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [pages, 2, H, page_size, code_bytes], scale regions [pages, 2, H, scale bytes])."""
    p, _, h, _ = cache.shape
    codes = cache[..., : layout.scale_offset].view(p, 2, h, layout.page_size, layout.code_bytes)
    return codes, cache[..., layout.scale_offset :]


def _scale_index(layout: KVLayout, kv: int, page: torch.Tensor, off: torch.Tensor):
    """Advanced index into ``_regions``' scale regions of the scale bytes [N, H, scale_bytes]
    of tokens (page, offset) of K (0) / V (1) (``KVLayout.scale_index``)."""
    heads = torch.arange(layout.num_kv_heads, device=page.device)
    byte = layout.scale_index(kv, off)
    return page[:, None, None], kv, heads[None, :, None], byte[:, None, :]


def read_scales(cache: torch.Tensor, layout: KVLayout, kv: int, page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Scale bytes uint8 [N, H, scale_bytes] of tokens (page, offset) of K (0) / V (1), in
    block order, whatever the region's byte order."""
    return _regions(cache, layout)[1][_scale_index(layout, kv, page, off)]


def check_k_offset(k_offset: torch.Tensor, layout: KVLayout, tokens: int | None = None) -> None:
    """``k_offset`` must be finite fp32 [num_kv_heads, head_dim] (one offset per head) or, given
    the append's ``tokens``, [tokens, num_kv_heads, head_dim] (one per token: K centered per page,
    ``kernels.page_center``); ValueError saying why not."""
    want = (layout.num_kv_heads, layout.head_dim)
    shapes = [want] if tokens is None else [want, (tokens, *want)]
    if k_offset.dtype != torch.float32 or tuple(k_offset.shape) not in shapes or not k_offset.is_contiguous():
        wanted = " or ".join(str(list(w)) for w in shapes)
        raise ValueError(f"k_offset must be contiguous float32 {wanted}, got {k_offset.dtype} {list(k_offset.shape)}")
    if not bool(torch.isfinite(k_offset).all()):
        raise ValueError("k_offset must be finite")


def check_k_feedback(k_feedback: torch.Tensor, layout: KVLayout) -> None:
    """``k_feedback`` needs fp8 or nvfp4 and finite fp32 [Hkv, d/16, 16, 16]; ValueError saying why not."""
    if layout.fmt not in (KVFormat.FP8, KVFormat.NVFP4):
        raise ValueError(f"k_feedback (query-weighted rounding) applies to fp8 and nvfp4, not {layout.fmt.value}")
    feedback.check(k_feedback, layout.num_kv_heads, layout.head_dim)


SCALE_COUNT_KINDS = ("zero", "subnormal", "saturated")


def check_scale_counts(counts: torch.Tensor, layout: KVLayout) -> None:
    want = (2, layout.num_kv_heads, len(SCALE_COUNT_KINDS))
    if counts.dtype != torch.int64 or tuple(counts.shape) != want or not counts.is_contiguous():
        raise ValueError(f"scale_counts must be contiguous int64 {list(want)}, got {counts.dtype} {list(counts.shape)}")


def stored_rows(x: torch.Tensor, layout: KVLayout, kv: int, k_offset: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 rows [N, H, d] the codec encodes: K centered then rotated (as the layout says), V as is."""
    rows = x.to(torch.float32)
    if kv == 0 and k_offset is not None:
        rows = rows - k_offset.to(device=rows.device, dtype=torch.float32)
    if kv == 0 and layout.hadamard:
        rows = layout.rotate(rows)
    return rows


def encode_rows(x: torch.Tensor, layout: KVLayout, kv: int, global_scales: torch.Tensor,
                k_offset: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                k_feedback: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` [N, H, d] as K (kv=0) or V (kv=1) -> codes [N, H, cb], scales [N, H, sb]
    (``rows``: ``stored_rows`` of ``x`` when the caller has them already; ``k_feedback``:
    K's rounding feedback, ignored for V)."""
    n, h, d = x.shape
    if rows is None:
        rows = stored_rows(x, layout, kv, k_offset)
    g = global_scales[kv].to(torch.float32).expand(n, h).reshape(-1)
    # nvfp4 scales may clip K's largest values but never V's (see kv_formats.nvfp4)
    extra: dict = {"clip": kv == 0} if layout.fmt is KVFormat.NVFP4 else {}
    if kv == 0 and k_feedback is not None:
        fb = k_feedback.to(device=rows.device, dtype=torch.float32)
        extra["feedback"] = fb.expand(n, *fb.shape).reshape(n * h, *fb.shape[1:])
    codes, scales = layout.codec.encode(rows.reshape(n * h, d), g, **extra)
    return codes.view(n, h, -1), scales.view(n, h, -1)


def append(
    cache: torch.Tensor,
    layout: KVLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    global_scales: torch.Tensor,
    k_offset: torch.Tensor | None = None,
    scale_counts: torch.Tensor | None = None,
    k_feedback: torch.Tensor | None = None,
) -> None:
    layout.check_cache(cache)
    check_global_scales(global_scales, layout)
    if k_offset is not None:
        check_k_offset(k_offset, layout, k.shape[0])
    if k_feedback is not None:
        check_k_feedback(k_feedback, layout)
    if scale_counts is not None:
        check_scale_counts(scale_counts, layout)
    n = k.shape[0]
    want = (n, layout.num_kv_heads, layout.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k and v must be {list(want)}, got {list(k.shape)} and {list(v.shape)}")
    if tuple(slots.shape) != (n,):
        raise ValueError(f"slots must be [{n}], got {list(slots.shape)}")
    keep = slots >= 0
    slots = slots[keep].long()
    if slots.numel() == 0:
        return
    if int(slots.max()) >= cache.shape[0] * layout.page_size:
        raise ValueError(f"slot {int(slots.max())} is outside the cache ({cache.shape[0]} pages)")
    page, off = slots // layout.page_size, slots % layout.page_size
    codes_r, scales_r = _regions(cache, layout)
    if k_offset is not None and k_offset.dim() == 3:  # one offset per token: the kept tokens'
        k_offset = k_offset[keep.to(k_offset.device)]
    for kv, x in ((0, k[keep]), (1, v[keep])):
        rows = stored_rows(x, layout, kv, k_offset)
        codes, scales = encode_rows(x, layout, kv, global_scales, rows=rows, k_feedback=k_feedback)
        if scale_counts is not None and layout.fmt is not KVFormat.BF16:
            from deepwell.kernels.calibration import head_counts

            scale_counts[kv] += head_counts(layout, rows, global_scales[kv]).to(scale_counts.device)
        codes_r[page, kv, :, off] = codes
        if layout.scale_bytes:
            scales_r[_scale_index(layout, kv, page, off)] = scales


def gather(
    cache: torch.Tensor,
    layout: KVLayout,
    block_table: torch.Tensor,
    length: int,
    global_scales: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized fp32 (k, v) [length, H, d] of one sequence (K in the rotated space)."""
    pos = torch.arange(length, device=cache.device)
    page = block_table.to(cache.device).long()[pos // layout.page_size]
    off = pos % layout.page_size
    codes_r, scales_r = _regions(cache, layout)
    h, d = layout.num_kv_heads, layout.head_dim
    out = []
    for kv in (0, 1):
        codes = codes_r[page, kv, :, off]
        scales = scales_r[_scale_index(layout, kv, page, off)]
        g = global_scales[kv].to(torch.float32).expand(length, h).reshape(-1)
        x = layout.codec.decode(codes.reshape(length * h, -1), scales.reshape(length * h, -1), g)
        out.append(x.view(length, h, d))
    return out[0], out[1]
