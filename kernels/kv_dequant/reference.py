"""nvfp4 / fp8 / int8 pages -> an fp16 workspace: the dequantization a long prefill chunk reads instead.

A prefill chunk of many query rows reads every cached page once per 64-row block, so the
Triton attention kernel would unpack each quantized page that many times; for a long chunk it is
cheaper to unpack every page once into an fp16 **workspace** and let the attention read plain
fp16 (``paged_attention.triton_kernel.paged_attention(..., dequantized=True)``).

Workspace (``workspace_layout``): the bf16 page geometry of the same head layout, uint8
``[B * W, 2, Hkv, 64 * 2d]``, each (page, K|V, head) block 64 rows of ``d`` fp16 values in
head-dim order. Workspace page ``b * W + i`` holds page ``block_tables[b, i]`` of sequence ``b``
(``W`` = the table's width), so the workspace's own block table is ``arange(B * W).view(B, W)``;
pages at or past ``cdiv(context_lens[b], 64)`` are not written (never read either: the
attention masks keys past the context). A value is the nvfp4 element times its E4M3 block
scale times ``2**-14``, without the global scale (applied by the attention as for the cache
itself): exact in fp16 (every E2M1 x E4M3 product is ``k * 2**-24`` with ``k < 2**11`` or a
normal number with at most 8 significant bits), the same fp16 numbers the attention kernels
unpack in registers; fp8: the E4M3 value times ``2**-14``, exact too (E4M3 values are
multiples of ``2**-9`` with at most 4 significant bits, so their ``2**-14`` multiples are
fp16 numbers, subnormal below ``2**-14``), so the attention reads both the same way. Rows
past the context inside the last page hold whatever their bytes decode to (finite for pages
written by the append or zero-allocated; an fp8 NaN byte stays NaN, its bits unspecified).

int8: a value is its code times its token's fp32 scale rounded to fp16 (``value_shift`` 1; not
exact — the path's one rounding, at most 2**-11 relative, against the packed path's bf16 Q),
and the attention reads the workspace with global scales of ``2**-14`` (``workspace_scales``:
int8 ignores its global scales, and the attention's ``2**14`` for a workspace cancels).
"""

from __future__ import annotations

import torch

from deepwell.kernels.kv_append.reference import _regions, _scale_index
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout

VALUE_SHIFT = 2.0**-14  # workspace value = nvfp4 / fp8 value / g * VALUE_SHIFT
FORMATS = (KVFormat.NVFP4, KVFormat.FP8, KVFormat.INT8)


def value_shift(layout: KVLayout) -> float:
    """Workspace value / dequantized value (before the global scale): ``VALUE_SHIFT``, int8 1."""
    return 1.0 if layout.fmt is KVFormat.INT8 else VALUE_SHIFT


def workspace_scales(layout: KVLayout, scales: torch.Tensor) -> torch.Tensor:
    """The global scales the attention reads a workspace of ``layout``'s pages with: the cache's
    own, or for int8 ``2**-14`` everywhere (module doc)."""
    return torch.full_like(scales, VALUE_SHIFT) if layout.fmt is KVFormat.INT8 else scales


def workspace_layout(layout: KVLayout) -> KVLayout:
    """The workspace's page geometry: bf16's for the same heads (64 rows of 2d bytes)."""
    if layout.fmt not in FORMATS:
        raise ValueError(f"only nvfp4, fp8 and int8 caches are dequantized into a workspace, got {layout.fmt.value}")
    return KVLayout.make("bf16", layout.num_kv_heads, layout.head_dim, hadamard=layout.hadamard_size)


def check(cache: torch.Tensor, layout: KVLayout, block_tables: torch.Tensor, context_lens: torch.Tensor,
          workspace: torch.Tensor) -> None:
    """ValueError unless the shapes and dtypes fit (see the module doc)."""
    layout.check_cache(cache)
    ws = workspace_layout(layout)
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [B, W], got {block_tables.dtype} {list(block_tables.shape)}")
    b, w = block_tables.shape
    if context_lens.shape != (b,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32 [{b}], got {context_lens.dtype} {list(context_lens.shape)}")
    want = (b * w, 2, ws.num_kv_heads, ws.head_page_bytes)
    if workspace.dtype != torch.uint8 or tuple(workspace.shape) != want or not workspace.is_contiguous():
        raise ValueError(f"workspace must be contiguous uint8 {list(want)}, got {workspace.dtype} "
                         f"{list(workspace.shape)}")


def allocate(layout: KVLayout, block_tables: torch.Tensor) -> torch.Tensor:
    """An uninitialised workspace for ``block_tables`` [B, W]."""
    ws = workspace_layout(layout)
    b, w = block_tables.shape
    return torch.empty(b * w, 2, ws.num_kv_heads, ws.head_page_bytes, dtype=torch.uint8, device=block_tables.device)


def workspace_tables(block_tables: torch.Tensor) -> torch.Tensor:
    """The workspace's block table: page ``b * W + i`` for entry ``(b, i)``."""
    b, w = block_tables.shape
    return torch.arange(b * w, dtype=torch.int32, device=block_tables.device).view(b, w)


def center_values(layout: KVLayout, scales: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """K's page offsets ``centers`` (fp32 ``[W, Hkv, d]``, ``page_center.workspace_centers``) in
    workspace units: divided by ``2**14`` times the workspace's K global scales (a workspace
    value times ``2**14`` times its global scale is the key)."""
    gk = workspace_scales(layout, scales)[0].to(device=centers.device, dtype=torch.float32)
    return (centers * VALUE_SHIFT / gk[None, :, None]).contiguous()


def check_centers(layout: KVLayout, block_tables: torch.Tensor, centers: torch.Tensor | None) -> None:
    if centers is None:
        return
    want = (block_tables.shape[1], layout.num_kv_heads, layout.head_dim)
    if (centers.dtype != torch.float32 or tuple(centers.shape) != want or not centers.is_contiguous()
            or centers.device != block_tables.device):
        raise ValueError(f"centers must be contiguous float32 {list(want)} on {block_tables.device}, got "
                         f"{centers.dtype} {list(centers.shape)}")


def dequantize(cache: torch.Tensor, layout: KVLayout, block_tables: torch.Tensor, context_lens: torch.Tensor,
               workspace: torch.Tensor, centers: torch.Tensor | None = None) -> torch.Tensor:
    """Write the pages of every sequence's context into ``workspace`` (module doc); returns it.
    ``centers`` (fp32 ``[W, Hkv, d]``, workspace units: ``center_values``): K is centered per
    page, and table column ``i``'s row is added in fp32 to its page's fp16 K values, the sum
    rounded to fp16 (nvfp4 / fp8 values are exact before it, so this is their one rounding)."""
    check(cache, layout, block_tables, context_lens, workspace)
    check_centers(layout, block_tables, centers)
    b, w = block_tables.shape
    h, d, ps = layout.num_kv_heads, layout.head_dim, layout.page_size
    codes_r, scales_r = _regions(cache, layout)
    out = workspace.view(torch.float16).view(b * w, 2, h, ps, d)
    used = torch.arange(w, device=cache.device)[None, :] < (context_lens.long()[:, None] + ps - 1) // ps
    dst = torch.nonzero(used.reshape(-1)).squeeze(1)  # workspace pages to write
    src = block_tables.reshape(-1).long()[dst]
    if dst.numel() == 0:
        return workspace
    pages = src.repeat_interleave(ps)  # [n * ps]: every row of every page to write
    offs = torch.arange(ps, device=cache.device).repeat(dst.numel())
    ones = torch.ones(dst.numel() * ps * h, dtype=torch.float32, device=cache.device)
    for kv in (0, 1):
        codes = codes_r[pages, kv, :, offs]  # [n * ps, H, cb]
        scales = scales_r[_scale_index(layout, kv, pages, offs)]  # [n * ps, H, sb]
        rows = dst.numel() * ps * h  # (fp8 has no scale bytes: a [rows, 0] tensor)
        vals = layout.codec.decode(codes.reshape(rows, codes.shape[-1]), scales.reshape(rows, scales.shape[-1]), ones)
        vals = (vals * value_shift(layout)).to(torch.float16).view(dst.numel(), ps, h, d)
        if kv == 0 and centers is not None:  # the fp16 value plus the offset in fp32, rounded to fp16
            vals = (vals.float() + centers[dst % w][:, None]).to(torch.float16)
        out[dst, kv] = vals.transpose(1, 2)
    return workspace


def dense_scales(layout: KVLayout, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[2, Hkv]`` factors that turn workspace values into the cache's dequantized values:
    ``workspace_scales / 2**-14`` (nvfp4 / fp8: the global scale times ``2**14``; int8: 1). Powers
    of two for nvfp4 / fp8 (their global scales are), so the product is exact in fp16 unless it
    leaves fp16's range (``dense_fits``)."""
    return (workspace_scales(layout, scales).float() / VALUE_SHIFT).contiguous()


def dense_fits(layout: KVLayout, scales: torch.Tensor) -> bool:
    """Whether every value a cache of ``layout`` with global ``scales`` can hold is finite in
    fp16 once scaled (``dense_scales``): the largest code times its largest block scale times
    the global scale below fp16's 65504 (nvfp4 6 x 448 x g, fp8 448 x g; int8 stores its values
    in fp16 already). Reads ``scales`` back to the host."""
    if layout.fmt is KVFormat.INT8:
        return True
    top = 6.0 * 448.0 if layout.fmt is KVFormat.NVFP4 else 448.0
    return float(scales.float().max()) * top < 65504.0


def check_dense(layout: KVLayout, block_table: torch.Tensor, context_len: torch.Tensor,
                out_scales: torch.Tensor | None, out: torch.Tensor) -> None:
    """ValueError unless ``block_table`` is int32 ``[1, W]``, ``context_len`` int32 ``[1]``,
    ``out_scales`` fp32 ``[2, Hkv]`` (or None) and ``out`` contiguous fp16 ``[2, Hkv, W * 64, d]``."""
    if block_table.dim() != 2 or block_table.shape[0] != 1 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [1, W], got {block_table.dtype} {list(block_table.shape)}")
    w, h, d = block_table.shape[1], layout.num_kv_heads, layout.head_dim
    want = (2, h, w * layout.page_size, d)
    if out.dtype != torch.float16 or tuple(out.shape) != want or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float16 {list(want)}, got {out.dtype} {list(out.shape)}")
    if out_scales is not None and (out_scales.dtype != torch.float32 or tuple(out_scales.shape) != (2, h)
                                   or not out_scales.is_contiguous()):
        raise ValueError(f"out_scales must be contiguous float32 [2, {h}], got {out_scales.dtype} "
                         f"{list(out_scales.shape)}")


def dequantize_dense(cache: torch.Tensor, layout: KVLayout, block_table: torch.Tensor, context_len: torch.Tensor,
                     out: torch.Tensor, out_scales: torch.Tensor | None = None,
                     centers: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's pages as dense K and V, ``out`` fp16 ``[2, Hkv, W * 64, d]`` (key ``i`` of
    head ``h`` at ``out[0, h, i]``), the layout dense attention (cuDNN's) reads: the workspace
    values of ``dequantize`` in key order, each multiplied in fp32 by ``out_scales[kv, h]``
    (``dense_scales``: then they are the cache's dequantized values) and rounded to fp16. Rows
    of pages at or past the context are not written. Returns ``out``."""
    check_dense(layout, block_table, context_len, out_scales, out)
    w, h, ps, d = block_table.shape[1], layout.num_kv_heads, layout.page_size, layout.head_dim
    ws = dequantize(cache, layout, block_table, context_len, allocate(layout, block_table), centers)
    vals = ws.view(torch.float16).view(w, 2, h, ps, d).permute(1, 2, 0, 3, 4)  # [2, H, W, 64, d]
    if out_scales is not None:
        vals = (vals.float() * out_scales.to(vals.device)[:, :, None, None, None]).to(torch.float16)
    used = -(-int(context_len[0]) // ps)
    out.view(2, h, w, ps, d)[:, :, :used] = vals[:, :, :used]
    return out
