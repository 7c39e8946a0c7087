"""Full-size GPU checks (``gpu`` marker): attention numerics at 4k-128k contexts and batch up
to 64 on the Qwen3.5-27B head layout (24 query heads, 4 KV heads, d=256), fragmented tables."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_formats import KVLayout
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
    from kernels.paged_attention import reference as attn_ref

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
@pytest.mark.parametrize("nv_load", [0, 1, 2])
def test_nvfp4_unpack_variants(asm, nv_load):
    case = build_case(KVLayout.make("nvfp4", 4, 256), [20000, 65, 3000], seed=8, device="cuda")
    ql = [4, 4, 4]
    q = torch.randn(sum(ql), 24, 256, device="cuda").to(torch.bfloat16)
    out, starts, lens = _run(case, q, ql, 8, unpack_asm=asm, nv_load=nv_load)
    assert rel_l2(out, _oracle_gpu(case, q, starts, lens)) <= 1e-3
