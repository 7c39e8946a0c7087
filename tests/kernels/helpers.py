"""Shared builders for kernel tests: random paged caches with fragmented block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepwell.kernels.kv_append import reference as append_ref
from deepwell.kernels.kv_formats import KVLayout

POISON = 0xA5


@dataclass
class PagedCase:
    layout: KVLayout
    cache: torch.Tensor
    scales: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_pages]
    context_lens: torch.Tensor  # int32 [B]
    k: list[torch.Tensor]  # per sequence [ctx, H, d] (bf16)
    v: list[torch.Tensor]


def fragmented_tables(ctx_lens: list[int], gen: torch.Generator, spare: int = 3, device="cpu") -> tuple[torch.Tensor, int]:
    max_pages = max(1, max((c + 63) // 64 for c in ctx_lens))
    num_pages = len(ctx_lens) * max_pages + spare
    perm = torch.randperm(num_pages, generator=gen)
    return perm[: len(ctx_lens) * max_pages].view(len(ctx_lens), max_pages).to(torch.int32).to(device), num_pages


def random_scales(layout: KVLayout, gen: torch.Generator) -> torch.Tensor:
    if layout.fmt.value in ("fp8", "nvfp4"):
        return torch.exp2(torch.randint(-3, 3, (2, layout.num_kv_heads), generator=gen).float())
    return layout.default_scales()


def build_case(layout: KVLayout, ctx_lens: list[int], seed: int, *, device="cpu", magnitude: float = 2.0) -> PagedCase:
    """Cache filled through the reference append (poisoned bytes elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_pages = fragmented_tables(ctx_lens, gen, device=device)
    cache = torch.full((num_pages, 2, layout.num_kv_heads, layout.head_page_bytes), POISON, dtype=torch.uint8, device=device)
    scales = random_scales(layout, gen).to(device)
    ks, vs = [], []
    h, d = layout.num_kv_heads, layout.head_dim
    for b, n in enumerate(ctx_lens):
        k = (torch.randn(n, h, d, generator=gen) * magnitude).to(torch.bfloat16).to(device)
        v = (torch.randn(n, h, d, generator=gen) * magnitude).to(torch.bfloat16).to(device)
        pos = torch.arange(n, device=device)
        slots = append_ref.slots_from_positions(tables, torch.full((n,), b, device=device), pos)
        append_ref.append(cache, layout, k, v, slots, scales)
        ks.append(k)
        vs.append(v)
    return PagedCase(layout, cache, scales, tables, torch.tensor(ctx_lens, dtype=torch.int32, device=device), ks, vs)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
