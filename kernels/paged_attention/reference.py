"""Reference paged attention over the dequantized cache (defines decode, verify and prefill).

Inputs (shared with the Triton kernels):

- ``q``: ``[total_q, Hq, d]`` query tokens of all sequences concatenated; sequence ``b``
  owns rows ``q_start[b] .. q_start[b] + q_len[b]``. Q must already be in the cache's K
  space (``rotate_q`` when the layout rotates K; ``backend`` does this).
- ``cache``/``layout``/``global_scales``: one layer's paged cache (see ``kv_formats``).
  The new tokens' K/V must already be appended.
- ``block_tables``: int32 ``[B, max_pages]``; ``context_lens``: int32 ``[B]`` = tokens in the
  cache for each sequence *including* its ``q_len`` new ones.

Query token ``t`` of sequence ``b`` sits at position ``context_lens[b] - q_len[b] + t`` and
attends to cached positions ``<=`` its own (causal among the new tokens, everything
before them). GQA: query head ``h`` reads KV head ``h // (Hq // H)``. Output ``[total_q,
Hq, d]`` = softmax(q k^T * sm_scale) v, computed in ``compute_dtype`` (fp64 for oracles).
"""

from __future__ import annotations

import torch

from deepwell.kernels.kv_append.reference import gather
from deepwell.kernels.kv_formats.layout import KVLayout
from deepwell.kernels.page_center import PageCenter


def rotate_q(q: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Q into the K space: the Hadamard transform in fp32, back to q's dtype (both backends)."""
    return layout.rotate(q).to(q.dtype) if layout.hadamard else q


def check_inputs(
    q: torch.Tensor,
    cache: torch.Tensor,
    layout: KVLayout,
    global_scales: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    q_start: torch.Tensor | None,
    q_len: torch.Tensor | None,
) -> None:
    """Shapes, dtypes and devices of the attention inputs (both backends; metadata only, so
    it never waits on the device and is safe inside CUDA-graph capture). A kernel handed an
    int64 block table or a short ``context_lens`` would read the wrong pages or out of
    bounds instead of failing."""
    if q.dim() != 3 or q.shape[2] != layout.head_dim or q.shape[1] % layout.num_kv_heads:
        raise ValueError(f"q must be [tokens, Hq, {layout.head_dim}] with Hq a multiple of "
                         f"{layout.num_kv_heads}, got {list(q.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    layout.check_cache(cache)
    if global_scales.dtype != torch.float32 or tuple(global_scales.shape) != (2, layout.num_kv_heads):
        raise ValueError(f"global scales must be float32 [2, {layout.num_kv_heads}], got "
                         f"{global_scales.dtype} {list(global_scales.shape)}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be int32 [B, max_pages] with contiguous rows, got "
                         f"{block_tables.dtype} {list(block_tables.shape)}")
    b = block_tables.shape[0]
    named = [("context_lens", context_lens), ("q_start", q_start), ("q_len", q_len)]
    for name, t in named:
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (b,) or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous int32 [{b}] (one per block-table row), got "
                             f"{t.dtype} {list(t.shape)}")
    for name, t in [("cache", cache), ("global scales", global_scales), ("block_tables", block_tables)] + named:
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: every input must be on one device")


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layout: KVLayout,
    global_scales: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    sm_scale: float,
    *,
    compute_dtype: torch.dtype = torch.float32,
    page_center: PageCenter | None = None,
) -> torch.Tensor:
    """``page_center``: the cache holds K centered per page (``kernels.page_center``); each key's
    page offset is added back (rotated like K) before the scores are taken."""
    check_inputs(q, cache, layout, global_scales, block_tables, context_lens, q_start, q_len)
    total, hq, d = q.shape
    h = layout.num_kv_heads
    group = hq // h
    out = torch.zeros(total, hq, d, dtype=compute_dtype, device=q.device)
    for b in range(block_tables.shape[0]):
        n_q, ctx, s0 = int(q_len[b]), int(context_lens[b]), int(q_start[b])
        if n_q == 0:
            continue
        if n_q > ctx:
            raise ValueError(f"sequence {b}: q_len {n_q} > context_len {ctx}")
        k, v = gather(cache, layout, block_tables[b], ctx, global_scales)
        if page_center is not None:
            # one offset per page (every key of a page has its page's), rotated like K, per key
            first = torch.arange(0, ctx, layout.page_size, device=page_center.table.device)
            c = page_center.offsets(first)
            c = layout.rotate(c).to(k.device)
            k = k + c.repeat_interleave(layout.page_size, dim=0)[:ctx]
        k, v = k.to(compute_dtype), v.to(compute_dtype)  # [ctx, H, d]
        # softmax(q k^T * sm_scale, causal: new token i at position ctx - n_q + i) v, each query
        # head over its group's KV head (query head h * group + g uses KV head h)
        qb = q[s0 : s0 + n_q].to(compute_dtype).transpose(0, 1)  # [Hq, n_q, d]
        qpos = torch.arange(ctx - n_q, ctx, device=q.device)[:, None]
        seen = torch.arange(ctx, device=q.device)[None, :] <= qpos  # [n_q, ctx]
        o = torch.nn.functional.scaled_dot_product_attention(
            qb[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=seen, scale=sm_scale,
            enable_gqa=group > 1)
        out[s0 : s0 + n_q] = o[0].transpose(0, 1)
    return out
