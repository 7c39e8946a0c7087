"""nvfp4 / fp8 / int8 pages -> fp16 workspace (``kernels.kv_dequant``): Triton bytes == reference bytes,
the workspace's values == the cache's dequantized values, and prefill over the workspace ==
prefill over the packed pages to fp32 rounding (the backend's path for long chunks), split or whole
batches."""

from __future__ import annotations

import pytest
import torch

from deepwell.kernels.backend import KVCacheLayer, TritonBackend
from deepwell.kernels.kv_append import reference as append_ref
from deepwell.kernels.kv_dequant import reference as dq_ref
from deepwell.kernels.kv_dequant import triton_kernel as dq_tk
from deepwell.kernels.kv_formats import KVLayout
from deepwell.kernels.paged_attention import triton_kernel as attn_tk
from deepwell.kernels.paged_attention.reference import rotate_q
from tests.kernels.helpers import build_case, rel_l2

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8"])
@pytest.mark.parametrize("d,h", [(64, 3), (256, 1)])
def test_triton_workspace_bytes_equal_reference_and_dequantized_cache(d, h, fmt):
    # fragmented tables, a sequence shorter than the table (its tail entries are not written),
    # poisoned bytes past each context (the last page's tail rows decode whatever they hold)
    case = build_case(KVLayout.make(fmt, h, d), [130, 40, 0], seed=d, device=DEV, magnitude=3.0)
    tables, lens = case.block_tables, case.context_lens
    a = dq_ref.allocate(case.layout, tables).fill_(0x5A)
    b = dq_ref.allocate(case.layout, tables).fill_(0x5A)
    dq_ref.dequantize(case.cache, case.layout, tables, lens, a)
    dq_tk.dequantize(case.cache, case.layout, tables, lens, b)
    assert torch.equal(a, b)
    w = tables.shape[1]
    vals = a.view(torch.float16).view(tables.shape[0], w, 2, h, 64, d)
    for seq, n in enumerate(lens.tolist()):
        k, v = append_ref.gather(case.cache, case.layout, tables[seq], max(n, 1), case.scales)
        for kv, want in ((0, k[:n]), (1, v[:n])):
            got = vals[seq, :, kv].permute(0, 2, 1, 3).reshape(w * 64, h, d)[:n].float()
            if fmt == "int8":  # code x token scale rounded to fp16 (the global scales are ignored)
                assert torch.equal(got, want.to(torch.float16).float())
            else:  # exact
                assert torch.equal(got * case.scales[kv][None, :, None] / dq_ref.VALUE_SHIFT, want)
        untouched = vals[seq, (n + 63) // 64 :].reshape(-1).view(torch.uint8)
        assert bool((untouched == 0x5A).all())  # pages past the context are not written


@pytest.mark.parametrize("fmt,rot", [("nvfp4", None), ("fp8", None), ("int8", None), ("nvfp4", 16)])
def test_prefill_over_the_workspace_equals_the_packed_pages(fmt, rot):
    # rot: K's Hadamard (None: the format's default; 16: one transform per 16-element block)
    layout = KVLayout.make(fmt, 2, 64, rot)
    case = build_case(layout, [150, 70], seed=3, device=DEV)
    gen = torch.Generator().manual_seed(4)
    ql = [40, 70]  # the second chunk is its whole context (no prefix)
    q = torch.randn(sum(ql), 6, 64, generator=gen).to(torch.bfloat16).to(DEV)
    layer = KVCacheLayer(layout, case.cache, case.scales)
    direct = TritonBackend(prefill_workspace_bytes=0)
    page = dq_ref.workspace_layout(layout).page_bytes
    w = case.block_tables.shape[1]

    def fp32_out():
        return dict(sm_scale=0.125, out=torch.full(q.shape, float("nan"), device=DEV))

    want = direct.prefill_attention(q, layer, case.block_tables, case.context_lens, ql, **fp32_out())
    # the Triton kernel over the workspace (on a Hopper GPU the backend would send these chunks to
    # cuDNN over dense K / V instead: tests/kernels/test_prefill_cudnn.py)
    for be in (TritonBackend(prefill_dequant_min_rows=1, prefill_dense=False),  # the whole batch in one workspace
               TritonBackend(prefill_dequant_min_rows=1, prefill_workspace_bytes=w * page,
                             prefill_dense=False)):  # one sequence at a time
        got = be.prefill_attention(q, layer, case.block_tables, case.context_lens, ql, **fp32_out())
        # same fp16 values (int8: rounded to fp16 in the workspace); row blocks of 128 vs 64
        assert rel_l2(got.cpu(), want.cpu()) <= (5e-4 if fmt == "int8" else 1e-6)
    # and both agree with the fp64 evaluation over the dequantized cache
    from tests.kernels.test_attention import _oracle

    starts = torch.tensor([0, ql[0]], dtype=torch.int32, device=DEV)
    ref = _oracle(case, rotate_q(q, layout), starts, torch.tensor(ql, dtype=torch.int32, device=DEV))
    assert rel_l2(want.cpu(), ref) <= 1e-3


# Segments (and splits) restart the running maximum, and the fp16 probabilities are rounded
# against it: one pass and segments round a few of them differently (H200: 4.5e-5 on the
# first case below; the CPU interpreter computes in fp32 and agrees to ~1e-7).
SEGMENTS_VS_ONE_PASS = 1e-4


def test_a_context_over_the_budget_is_attended_in_segments(monkeypatch):
    # the first sequence's context (7 pages) needs more workspace than the budget holds: its
    # pages go through the workspace three at a time ([0, 3), [3, 6), [6, 7): the chunk's
    # causal pages 5-6 straddle a boundary), the partial results folded together; the
    # second sequence's table row is as wide (over the budget) but its 2 pages fit one workspace;
    # both equal the packed pages' prefill and the fp64 oracle
    import deepwell.kernels.backend as kernels_backend

    monkeypatch.setattr(kernels_backend, "PREFILL_SEGMENT_MIN_PAGES", 2)
    layout = KVLayout.make("nvfp4", 2, 64)
    case = build_case(layout, [400, 70], seed=8, device=DEV)
    ql = [40, 30]
    q = torch.randn(sum(ql), 6, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEV)
    layer = KVCacheLayer(layout, case.cache, case.scales)
    page = dq_ref.workspace_layout(layout).page_bytes
    partials = 2 * ql[0] * 6 * 65 * 4
    calls = []
    real = attn_tk.paged_attention

    def spy(*args, **kw):
        calls.append(kw.get("key_pages"))
        return real(*args, **kw)

    monkeypatch.setattr(attn_tk, "paged_attention", spy)
    be = TritonBackend(prefill_dequant_min_rows=1, prefill_workspace_bytes=partials + 3 * page + 100,
                       prefill_dense=False)  # the Triton kernel's segments (cuDNN's: test_prefill_cudnn.py)
    got = be.prefill_attention(q, layer, case.block_tables, case.context_lens, ql, sm_scale=0.125,
                               out=torch.full(q.shape, float("nan"), device=DEV))
    assert calls == [(0, 3), (3, 6), (6, 7), None]
    monkeypatch.setattr(attn_tk, "paged_attention", real)
    want = TritonBackend(prefill_workspace_bytes=0).prefill_attention(
        q, layer, case.block_tables, case.context_lens, ql, sm_scale=0.125, out=torch.empty(q.shape, device=DEV))
    assert rel_l2(got.cpu(), want.cpu()) <= SEGMENTS_VS_ONE_PASS
    from tests.kernels.test_attention import _oracle

    starts = torch.tensor([0, ql[0]], dtype=torch.int32, device=DEV)
    ref = _oracle(case, rotate_q(q, layout), starts, torch.tensor(ql, dtype=torch.int32, device=DEV))
    assert rel_l2(got.cpu(), ref) <= 1e-3
    # an 8-token chunk (one row block per KV head) over 10 pages on a GPU of four SMs: each
    # segment's keys are split as well (splits of one page allowed here; the budget holds a
    # running partial and one per split, and three pages)
    monkeypatch.setattr(kernels_backend, "_sm_count", lambda device: 4)
    monkeypatch.setattr(kernels_backend, "PREFILL_SPLIT_MIN_PAGES", 1)
    short = build_case(layout, [640], seed=10, device=DEV)
    q8 = torch.randn(8, 6, 64, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16).to(DEV)
    layer8 = KVCacheLayer(layout, short.cache, short.scales)
    want8 = TritonBackend(prefill_workspace_bytes=0).prefill_attention(
        q8, layer8, short.block_tables, short.context_lens, [8], sm_scale=0.125, out=torch.empty(q8.shape, device=DEV))
    monkeypatch.setattr(attn_tk, "paged_attention", lambda *a, **kw: calls.append(kw.get("num_splits")) or real(*a, **kw))
    calls.clear()
    be4 = TritonBackend(prefill_dequant_min_rows=1, prefill_workspace_bytes=5 * 8 * 6 * 65 * 4 + 3 * page + 100,
                        prefill_dense=False)
    got8 = be4.prefill_attention(q8, layer8, short.block_tables, short.context_lens, [8], sm_scale=0.125,
                                 out=torch.full(q8.shape, float("nan"), device=DEV))
    assert calls == [3, 3, 3, 3]  # segments of 3, 3, 3, 1 pages, each in three splits
    monkeypatch.setattr(attn_tk, "paged_attention", real)
    assert rel_l2(got8.cpu(), want8.cpu()) <= SEGMENTS_VS_ONE_PASS
    # segments of fewer pages than the minimum are refused (the caller then reads the packed
    # pages), before anything is written
    monkeypatch.setattr(kernels_backend, "PREFILL_SEGMENT_MIN_PAGES", 4)
    untouched = torch.full((ql[0], 6, 64), float("nan"), device=DEV)
    assert not be._prefill_segments(rotate_q(q[: ql[0]], layout), layer, case.block_tables[:1], case.context_lens[:1],
                                    0.125, untouched, be._workspace_budget(q.device))
    assert bool(untouched.isnan().all())


def test_partial_outputs_fold_into_the_whole_attention():
    # key windows' partial results (one split, and two splits of a window) folded by
    # merge_partials into a running result == one pass over all keys
    layout = KVLayout.make("bf16", 1, 64)
    case = build_case(layout, [300], seed=2, device=DEV)
    q = torch.randn(20, 3, 64, generator=torch.Generator().manual_seed(5)).to(DEV)
    args = (q, case.cache, layout, case.scales, case.block_tables, case.context_lens,
            torch.zeros(1, dtype=torch.int32, device=DEV), torch.tensor([20], dtype=torch.int32, device=DEV), 0.125)
    whole = attn_tk.paged_attention(*args, out=torch.empty(q.shape, device=DEV))
    o, lse = torch.zeros(q.shape, device=DEV), torch.full(q.shape[:2], float("-inf"), device=DEV)
    for (lo, hi), splits in (((0, 2), 1), ((7, 9), 1), ((2, 5), 2)):  # (7, 9) lies past the context
        part = (torch.empty(20, 3, splits, 64, device=DEV), torch.empty(20, 3, splits, device=DEV))
        attn_tk.paged_attention(*args, key_pages=(lo, hi), partial=part, num_splits=splits)
        if lo == 7:
            assert bool(torch.isinf(part[1]).all()) and not bool(part[0].any())
        attn_tk.merge_partials(o, lse, *part)
    assert rel_l2(o.cpu(), whole.cpu()) <= 1e-6
    with pytest.raises(ValueError, match="partial must be"):  # one split's buffers for two splits
        attn_tk.paged_attention(*args, num_splits=2, partial=(torch.empty(20, 3, 1, 64, device=DEV),
                                                              torch.empty(20, 3, 1, device=DEV)))
    with pytest.raises(ValueError, match="key_pages"):
        attn_tk.paged_attention(*args, key_pages=(3, 1))


@pytest.mark.parametrize("min_rows", [1 << 30, 1])  # over the packed pages / over the workspace
def test_short_chunk_over_a_long_prefix_is_split(min_rows, monkeypatch):
    # one row block per KV head would leave the GPU idle: the backend splits the prefix (on
    # CPU it plans for one SM, so pretend to have eight)
    import deepwell.kernels.backend as kernels_backend

    monkeypatch.setattr(kernels_backend, "_sm_count", lambda device: 8)
    layout = KVLayout.make("nvfp4", 2, 64)
    case = build_case(layout, [1100], seed=6, device=DEV)
    q = torch.randn(8, 6, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    be = TritonBackend(prefill_dequant_min_rows=min_rows, prefill_dense=False)
    assert be.prefill_splits(1, 2, case.block_tables.shape[1], 8 * 6, 64, 8, 1) == 2  # 18 pages: 8+ per split
    assert be.prefill_splits(1, 2, 1000, 8 * 6, 64, 8, 1) == 8  # two waves of 8 SMs
    assert be.prefill_splits(64, 2, 1000, 8 * 6, 64, 8, 1) == 1  # enough row blocks
    layer = KVCacheLayer(layout, case.cache, case.scales)
    out = torch.full(q.shape, float("nan"), device=DEV)
    be.prefill_attention(q, layer, case.block_tables, case.context_lens, [8], sm_scale=0.125, out=out)
    from tests.kernels.test_attention import _oracle

    one = torch.tensor([8], dtype=torch.int32, device=DEV)
    ref = _oracle(case, rotate_q(q, layout), torch.zeros(1, dtype=torch.int32, device=DEV), one)
    assert rel_l2(out.cpu(), ref) <= 1e-3


def test_the_workspace_threshold_is_per_format():
    from deepwell.kernels.backend import PREFILL_DEQUANT_MIN_ROWS
    from deepwell.kernels.kv_formats.layout import KVFormat

    nv, f8, i8, bf = (KVLayout.make(f, 4, 256) for f in ("nvfp4", "fp8", "int8", "bf16"))
    be = TritonBackend()
    assert be._dequantizes(nv, 1024) and not be._dequantizes(nv, 768)
    assert be._dequantizes(i8, 768) and be._dequantizes(f8, 768)
    assert not be._dequantizes(f8, 767) and not be._dequantizes(bf, 1 << 20)
    assert set(PREFILL_DEQUANT_MIN_ROWS) == {KVFormat.NVFP4, KVFormat.FP8, KVFormat.INT8}
    one = TritonBackend(prefill_dequant_min_rows=5)  # one threshold for every format
    assert one._dequantizes(nv, 5) and not one._dequantizes(i8, 4)
    assert not TritonBackend(prefill_workspace_bytes=0)._dequantizes(i8, 1 << 20)


def test_bad_input_is_refused():
    layout = KVLayout.make("nvfp4", 2, 64)
    case = build_case(layout, [70], seed=1)
    tables, lens = case.block_tables, case.context_lens
    ws = dq_ref.allocate(layout, tables)
    with pytest.raises(ValueError, match="only nvfp4, fp8 and int8"):
        dq_ref.workspace_layout(KVLayout.make("bf16", 2, 64))
    with pytest.raises(ValueError, match="workspace must be"):
        dq_ref.dequantize(case.cache, layout, tables, lens, ws[:1])
    with pytest.raises(ValueError, match="block_tables must be int32"):
        dq_ref.dequantize(case.cache, layout, tables.long(), lens, ws)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        dq_tk.dequantize(case.cache, layout, tables, lens.long(), ws)
    with pytest.raises(ValueError, match="bf16 page geometry"):
        q = torch.zeros(4, 6, 64)
        attn_tk.paged_attention(q, case.cache, layout, case.scales, tables, lens, torch.zeros(1, dtype=torch.int32),
                                torch.full((1,), 4, dtype=torch.int32), 0.125, dequantized=True)
    with pytest.raises(ValueError, match="prefill_workspace_bytes"):
        TritonBackend(prefill_workspace_bytes=-1)
    with pytest.raises(ValueError, match="prefill_dequant_min_rows"):
        TritonBackend(prefill_dequant_min_rows=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8"])
def test_full_size_workspace_bytes_and_prefill_on_the_gpu(fmt):
    """27B layout: a 4k chunk over a 33k prefix and a 1000-token chunk over nothing, through the
    backend's workspace path (bytes equal to the reference's; attention within 1e-3 of fp64).
    ``prefill_dense=False``: such chunks go through cuDNN by default on Hopper
    (tests/kernels/test_prefill_cudnn.py covers that path, within 2e-3 of fp64)."""
    from tests.kernels.test_gpu_large import _oracle_gpu

    layout = KVLayout.make(fmt, 4, 256)
    case = build_case(layout, [32768 + 4096, 1000], seed=13, device="cuda")
    tables, lens = case.block_tables, case.context_lens
    a = dq_ref.dequantize(case.cache, layout, tables, lens, dq_ref.allocate(layout, tables).zero_())
    b = dq_tk.dequantize(case.cache, layout, tables, lens, dq_ref.allocate(layout, tables).zero_())
    assert torch.equal(a, b)
    ql = [4096, 1000]
    q = torch.randn(sum(ql), 24, 256, device="cuda").to(torch.bfloat16)
    layer = KVCacheLayer(layout, case.cache, case.scales)
    out = torch.empty(q.shape, device="cuda")
    TritonBackend(prefill_dense=False).prefill_attention(q, layer, tables, lens, ql, sm_scale=256**-0.5, out=out)
    starts = torch.tensor([0, ql[0]], dtype=torch.int32, device="cuda")
    ref = _oracle_gpu(case, rotate_q(q, layout), starts, torch.tensor(ql, dtype=torch.int32, device="cuda"))
    assert rel_l2(out, ref) <= 1e-3


@pytest.mark.gpu
def test_full_size_segmented_prefill_on_the_gpu():
    """27B layout: a 4k chunk over a 40k context through a workspace budget that holds a third
    of it (three segments): within 1e-5 of the one-workspace path and 1e-3 of fp64 (both through
    the Triton kernel: ``prefill_dense=False``, as above)."""
    from tests.kernels.test_gpu_large import _oracle_gpu

    layout = KVLayout.make("nvfp4", 4, 256)
    ctx, n = 40000, 4096
    case = build_case(layout, [ctx], seed=14, device="cuda")
    q = torch.randn(n, 24, 256, device="cuda").to(torch.bfloat16)
    layer = KVCacheLayer(layout, case.cache, case.scales)
    page = dq_ref.workspace_layout(layout).page_bytes
    budget = 2 * n * 24 * 257 * 4 + (ctx // 64 // 3 + 1) * page
    seg = torch.empty(q.shape, device="cuda")
    TritonBackend(prefill_workspace_bytes=budget, prefill_dense=False).prefill_attention(
        q, layer, case.block_tables, case.context_lens, [n], sm_scale=256**-0.5, out=seg)
    whole = torch.empty(q.shape, device="cuda")
    TritonBackend(prefill_dense=False).prefill_attention(q, layer, case.block_tables, case.context_lens, [n],
                                                         sm_scale=256**-0.5, out=whole)
    assert rel_l2(seg, whole) <= SEGMENTS_VS_ONE_PASS
    one = torch.tensor([n], dtype=torch.int32, device="cuda")
    ref = _oracle_gpu(case, rotate_q(q, layout), torch.zeros(1, dtype=torch.int32, device="cuda"), one)
    assert rel_l2(seg, ref) <= 1e-3
