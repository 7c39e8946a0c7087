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

from kernels.hadamard.reference import fwht
from kernels.kv_append.reference import gather
from kernels.kv_formats.layout import KVLayout


def rotate_q(q: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Q into the K space: the Hadamard transform in fp32, back to q's dtype (both backends)."""
    return fwht(q).to(q.dtype) if layout.hadamard else q


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
) -> torch.Tensor:
    total, hq, d = q.shape
    h = layout.num_kv_heads
    if hq % h:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {h}")
    group = hq // h
    out = torch.zeros(total, hq, d, dtype=compute_dtype, device=q.device)
    for b in range(block_tables.shape[0]):
        n_q, ctx, s0 = int(q_len[b]), int(context_lens[b]), int(q_start[b])
        if n_q == 0:
            continue
        if n_q > ctx:
            raise ValueError(f"sequence {b}: q_len {n_q} > context_len {ctx}")
        k, v = gather(cache, layout, block_tables[b], ctx, global_scales)
        k, v = k.to(compute_dtype), v.to(compute_dtype)  # [ctx, H, d]
        qb = q[s0 : s0 + n_q].to(compute_dtype).view(n_q, h, group, d)
        scores = torch.einsum("thgd,khd->hgtk", qb, k) * sm_scale
        qpos = torch.arange(ctx - n_q, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s0 : s0 + n_q] = torch.einsum("hgtk,khd->thgd", probs, v).reshape(n_q, hq, d)
    return out
