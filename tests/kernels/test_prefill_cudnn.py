"""Long prefill chunks through cuDNN over dense K / V (``paged_attention.dense_prefill``): the
dense dequantization (Triton == reference, values == the cache's), the parts-and-merge
arithmetic against the paged reference attention (plain torch, any device), and on a GPU the
backend's cuDNN path against its Triton path and the fp64 oracle."""

from __future__ import annotations

import math

import pytest
import torch

from deepwell.kernels.backend import KVCacheLayer, TritonBackend
from deepwell.kernels.kv_append import reference as append_ref
from deepwell.kernels.kv_dequant import reference as dq_ref
from deepwell.kernels.kv_dequant import triton_kernel as dq_tk
from deepwell.kernels.kv_formats import KVLayout
from deepwell.kernels.paged_attention import dense_prefill
from deepwell.kernels.paged_attention.reference import rotate_q
from tests.kernels.helpers import build_case, rel_l2

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _dense(case, seq: int, lo: int, hi: int, impl) -> torch.Tensor:
    lay = case.layout
    out = torch.full((2, lay.num_kv_heads, (hi - lo) * 64, lay.head_dim), float("nan"), dtype=torch.float16,
                     device=case.cache.device)
    clen = (case.context_lens[seq : seq + 1] - lo * 64).clamp(0, (hi - lo) * 64).to(torch.int32)
    impl(case.cache, lay, case.block_tables[seq : seq + 1, lo:hi].contiguous(), clen, out,
         dq_ref.dense_scales(lay, case.scales))
    return out


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8"])
def test_dense_kv_is_the_dequantized_cache_and_triton_equals_reference(fmt):
    case = build_case(KVLayout.make(fmt, 2, 64), [150, 70], seed=5, device=DEV, magnitude=3.0)
    for seq, n in enumerate(case.context_lens.tolist()):
        w = case.block_tables.shape[1]
        ref = _dense(case, seq, 0, w, dq_ref.dequantize_dense)
        got = _dense(case, seq, 0, w, dq_tk.dequantize_dense)
        used = -(-n // 64) * 64
        assert torch.equal(ref[:, :, :used], got[:, :, :used])
        assert bool(torch.isnan(got[:, :, used:]).all())  # pages past the context are not written
        k, v = append_ref.gather(case.cache, case.layout, case.block_tables[seq], n, case.scales)
        for kv, want in ((0, k), (1, v)):
            have = got[kv, :, :n].transpose(0, 1).float()  # [n, H, d]
            if fmt == "int8":  # code x token scale rounded to fp16
                assert torch.equal(have, want.to(torch.float16).float())
            else:  # exact: a power-of-two global scale times an fp16-exact workspace value
                assert torch.equal(have, want)
        # a window of pages starting past the first: rows 64 * lo .. of the same values
        if n > 64:
            part = _dense(case, seq, 1, w, dq_tk.dequantize_dense)
            assert torch.equal(part[:, :, : used - 64], got[:, :, 64:used])


def test_dense_checks_and_fp16_range():
    lay = KVLayout.make("nvfp4", 2, 64)
    case = build_case(lay, [70], seed=1, device=DEV)
    bad = torch.empty(2, 2, 64, 64, dtype=torch.float16, device=DEV)  # one page short
    with pytest.raises(ValueError, match="out must be contiguous float16"):
        dq_ref.dequantize_dense(case.cache, lay, case.block_tables, case.context_lens, bad)
    with pytest.raises(ValueError, match="block_table must be int32"):
        dq_ref.dequantize_dense(case.cache, lay, case.block_tables.long(), case.context_lens, bad)
    assert dq_ref.dense_fits(lay, torch.ones(2, 2))
    assert not dq_ref.dense_fits(lay, torch.full((2, 2), 32.0))  # 6 x 448 x 32 > 65504
    assert dq_ref.dense_fits(KVLayout.make("int8", 2, 64), torch.full((2, 2), 1e6))


def test_merge_of_parts_is_one_softmax():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 32, generator=gen)
    k = torch.randn(1, 2, 40, 32, generator=gen)
    v = torch.randn(1, 2, 40, 32, generator=gen)
    o_all, lse_all = dense_prefill._part_reference(q, k, v, False, 0.2)
    o_run, lse_run = dense_prefill._part_reference(q, k[:, :, 30:], v[:, :, 30:], False, 0.2)
    for lo, hi in ((0, 7), (7, 30)):
        dense_prefill.merge(o_run, lse_run, *dense_prefill._part_reference(q, k[:, :, lo:hi], v[:, :, lo:hi], False,
                                                                           0.2))
    assert torch.allclose(o_run, o_all, atol=1e-6) and torch.allclose(lse_run, lse_all, atol=1e-5)
    # a causal square: row i sees keys 0..i
    o_c, _ = dense_prefill._part_reference(q, k[:, :, :5], v[:, :, :5], True, 0.2)
    o_first, _ = dense_prefill._part_reference(q[:, :, :1], k[:, :, :1], v[:, :, :1], False, 0.2)
    assert torch.allclose(o_c[:1], o_first)


@pytest.mark.parametrize("segment_pages", [1, 2, 100])
@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_parts_and_merge_equal_the_paged_reference(fmt, segment_pages):
    """``attend(reference=True)``: the prefix in segments, the chunk's own keys causally (a chunk
    starting inside a page), merged: the paged reference attention to fp32 rounding."""
    from tests.kernels.test_attention import _oracle

    lay = KVLayout.make(fmt, 2, 64)
    case = build_case(lay, [230], seed=7, device="cpu")
    n = 90  # keys 0..139 are the prefix, the chunk starts in page 2
    q = torch.randn(n, 6, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    qr = rotate_q(q, lay)

    def dense_kv(lo, hi):
        d = _dense(case, 0, lo, hi, dq_ref.dequantize_dense)
        return d[0], d[1]

    out = torch.empty(n, 6, 64, dtype=torch.float32)
    dense_prefill.attend(qr, dense_kv, 230, 64, segment_pages, 0.125, out, reference=True)
    want = _oracle(case, qr, torch.zeros(1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32))
    assert rel_l2(out, want) <= 2e-3  # fp16 queries against the oracle's bf16 ones in fp64
    with pytest.raises(ValueError, match="cannot end a context"):
        dense_prefill.attend(qr, dense_kv, 50, 64, 1, 0.125, out, reference=True)


def test_unavailable_off_cuda_and_when_disabled(monkeypatch):
    assert not dense_prefill.available(torch.device("cpu"))
    monkeypatch.setenv(dense_prefill.ENV_DISABLE, "0")
    assert not dense_prefill.available(torch.device("cuda", 0))


# -- on a GPU -------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cudnn_probe_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip("the cuDNN path is enabled from compute capability 9.0")
    assert dense_prefill.available(torch.device("cuda"))
    unit = dense_prefill._LSE_UNIT[torch.cuda.current_device()]
    assert unit in (1.0, 1.0 / math.log(2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8", "bf16"])
@pytest.mark.parametrize("budget_pages", [0, 64])  # 0: the whole prefix in one segment
def test_cudnn_prefill_equals_triton_and_the_oracle_on_gpu(fmt, budget_pages):
    """The 27B head layout (24 query heads over 4 KV heads, d = 256): a 1,024-token chunk over a
    5,000-token prefix (in two segments with ``budget_pages``), and a whole 1,500-token context,
    in one call; cuDNN against the Triton path, and (one segment) the fp64 oracle."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not dense_prefill.available(torch.device("cuda")):
        pytest.skip("cuDNN attention not available here")
    from tests.kernels.test_attention import _oracle

    lay = KVLayout.make(fmt, 4, 256)
    case = build_case(lay, [6024, 1500], seed=11, device="cuda")
    layer = KVCacheLayer(lay, case.cache, case.scales)
    ql = [1024, 1500]
    q = (torch.randn(sum(ql), 24, 256, device="cuda") * 0.5).to(torch.bfloat16)
    page = 2 * 4 * 64 * 256 * 2
    # segments of exactly ``budget_pages`` for the first chunk (its fp32 partials and its own
    # 17 pages come off the budget first: ``_prefill_dense``); the second then falls back
    partials = 2 * 1024 * 24 * 257 * 4
    kw = {} if not budget_pages else dict(prefill_workspace_bytes=partials + (budget_pages + 17) * page)
    fast = TritonBackend(**kw)
    assert fast._dense(layer, 1024 * 6, q.device)
    got = fast.prefill_attention(q, layer, case.block_tables, case.context_lens, ql, sm_scale=1 / 16)
    base = TritonBackend(prefill_dense=False).prefill_attention(q, layer, case.block_tables, case.context_lens, ql,
                                                                sm_scale=1 / 16)
    assert torch.isfinite(got).all()
    assert rel_l2(got.float(), base.float()) <= 5e-3
    assert not fast.dense_error and fast.prefill_dense
    if budget_pages:
        return
    starts = torch.tensor([0, ql[0]], dtype=torch.int32, device="cuda")
    ref = _oracle(case, rotate_q(q, lay), starts, torch.tensor(ql, dtype=torch.int32, device="cuda"))
    assert rel_l2(got.float().cpu(), ref) <= 5e-3
