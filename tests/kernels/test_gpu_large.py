"""Full-size GPU checks (``gpu`` marker): attention numerics at 4k-128k contexts and batch up
to 64 on the Qwen3.5-27B head layout (24 query heads, 4 KV heads, d=256), fragmented tables."""

from __future__ import annotations

import pytest
import torch

from deepwell.kernels.kv_formats import KVLayout
from tests.kernels.helpers import build_case, rel_l2
from tests.kernels.test_attention import _run

pytestmark = pytest.mark.gpu

LARGE = [
    # fmt, context lens, tokens per sequence
    ("nvfp4", [4096], 1),
    ("nvfp4", [32768], 4),
    ("nvfp4", [131072], 1),
    ("nvfp4", [131072 - 5, 4097, 70000, 16, 1, 65, 32768, 100000], 1),
    ("nvfp4", [4096 + i * 37 for i in range(64)], 1),
    ("bf16", [131072], 1),
    ("bf16", [32768, 4096, 17, 65], 4),
    ("fp8", [32768, 65], 1),
    ("int8", [32768, 65], 16),
]


@pytest.mark.parametrize("fmt,ctx,t", LARGE)
def test_large_context_decode(fmt, ctx, t):
    case = build_case(KVLayout.make(fmt, 4, 256), ctx, seed=len(ctx) + t, device="cuda")
    ql = [t] * len(ctx)
    q = torch.randn(sum(ql), 24, 256, device="cuda").to(torch.bfloat16)
    out1, starts, lens = _run(case, q, ql, 1)
    outs, _, _ = _run(case, q, ql, 32)
    ref = _oracle_gpu(case, q, starts, lens)
    assert not torch.isnan(out1).any() and not torch.isnan(outs).any()
    assert rel_l2(out1, ref) <= 1e-3
    assert rel_l2(outs, ref) <= 1e-3
    assert rel_l2(outs, out1) <= 1e-5


def _oracle_gpu(case, q, starts, lens):
    from deepwell.kernels.paged_attention import reference as attn_ref

    return attn_ref.paged_attention(
        q, case.cache, case.layout, case.scales, case.block_tables, case.context_lens, starts, lens,
        q.shape[-1] ** -0.5, compute_dtype=torch.float64,
    )


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_prefill_chunk_over_long_prefix(fmt):
    case = build_case(KVLayout.make(fmt, 4, 256), [32768 + 512, 1000], seed=3, device="cuda")
    ql = [512, 1000]
    q = torch.randn(sum(ql), 24, 256, device="cuda").to(torch.bfloat16)
    out, starts, lens = _run(case, q, ql, 1, block_m=128)
    assert rel_l2(out, _oracle_gpu(case, q, starts, lens)) <= 1e-3


@pytest.mark.parametrize("asm", [False, True])
@pytest.mark.parametrize("nv_load", [0, 1, 2, 3, 5, 6])
def test_nvfp4_unpack_variants(asm, nv_load):
    case = build_case(KVLayout.make("nvfp4", 4, 256), [20000, 65, 3000], seed=8, device="cuda")
    ql = [4, 4, 4]
    q = torch.randn(sum(ql), 24, 256, device="cuda").to(torch.bfloat16)
    out, starts, lens = _run(case, q, ql, 8, unpack_asm=asm, nv_load_k=nv_load, nv_load_v=nv_load)
    assert rel_l2(out, _oracle_gpu(case, q, starts, lens)) <= 1e-3


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8", "bf16"])
def test_chunked_prefill_and_decode_write_identical_bytes(fmt):
    """Triton append of one 4,100-token sequence (fragmented pages) in prefill chunks of 2048
    and of 512, and token by token as decode steps, leaves identical cache bytes, equal to
    the reference append's."""
    from deepwell.kernels.kv_append import reference as append_ref
    from deepwell.kernels.kv_append import triton_kernel as append_tk
    from tests.kernels.helpers import POISON, fragmented_tables, random_scales

    lay = KVLayout.make(fmt, 4, 256)
    gen = torch.Generator().manual_seed(21)
    n = 4100
    tables, num_pages = fragmented_tables([n], gen, device="cuda")
    scales = random_scales(lay, gen).to("cuda")
    k = (torch.randn(n, 4, 256, generator=gen) * 2).to(torch.bfloat16).to("cuda")
    v = (torch.randn(n, 4, 256, generator=gen) * 2).to(torch.bfloat16).to("cuda")
    slots = append_ref.slots_from_positions(tables, torch.zeros(n, dtype=torch.long, device="cuda"),
                                            torch.arange(n, device="cuda"))
    caches = []
    for chunk in (2048, 512, 1):
        cache = torch.full((num_pages, 2, 4, lay.head_page_bytes), POISON, dtype=torch.uint8, device="cuda")
        for s in range(0, n, chunk):
            append_tk.append(cache, lay, k[s : s + chunk], v[s : s + chunk], slots[s : s + chunk], scales)
        caches.append(cache)
    ref = torch.full_like(caches[0], POISON)
    append_ref.append(ref, lay, k, v, slots, scales)
    for cache in caches:
        assert torch.equal(cache, ref)


@pytest.mark.parametrize("t", [1, 4])
def test_register_cap_changes_no_result(t):
    # max_registers only changes register allocation (ptxas maxnreg), never the arithmetic
    case = build_case(KVLayout.make("nvfp4", 4, 256), [20000, 65, 3000], seed=9, device="cuda")
    ql = [t] * 3
    q = torch.randn(sum(ql), 24, 256, device="cuda").to(torch.bfloat16)
    out, starts, lens = _run(case, q, ql, 8)
    capped, _, _ = _run(case, q, ql, 8, max_registers=168)
    assert rel_l2(out, _oracle_gpu(case, q, starts, lens)) <= 1e-3
    assert rel_l2(capped, out) <= 1e-6
