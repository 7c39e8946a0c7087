"""Gluon nvfp4 / fp8 / int8 decode / verify (Hopper): fp64 evaluation over the dequantized cache,
split-K invariance, verify(T=k) == k sequential decodes, bytes past the context, the backend's
dispatch; on CPU, the reduction order that Q follows and the input checks."""

from __future__ import annotations

import pytest
import torch

from deepwell.kernels.backend import KVCacheLayer, TritonBackend
from deepwell.kernels.kv_formats import KVLayout
from deepwell.kernels.kv_formats.layout import KVFormat
from deepwell.kernels.paged_attention import gluon_decode as gd
from deepwell.kernels.paged_attention import reference as attn_ref
from tests.kernels.helpers import build_case, rel_l2


def _hopper() -> bool:
    return torch.cuda.is_available() and gd.available(torch.device("cuda"))


hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (warpgroup MMA)")


@pytest.mark.parametrize("cb", [64, 128])
def test_q_order_is_the_a_operand_relabelling(cb):
    """``_k_perm`` (Q's order) is exactly the index relabelling ``_to_a_operand`` applies to the
    unpacked K bytes (reshape [4, cb/16, 2, 2], permute (1, 2, 0, 3)), and a permutation."""
    j = torch.arange(cb).reshape(4, cb // 16, 2, 2).permute(1, 2, 0, 3).reshape(cb)
    assert j.tolist() == gd._k_perm(cb)
    assert sorted(gd._k_perm(cb)) == list(range(cb))


@pytest.mark.parametrize("nb", [4, 8])
def test_v_scales_view_reads_the_block_major_slots(nb):
    """``_v_scales_view``: byte offset ``o`` of a half's scale region maps to [key, block] as
    the XOR of its set bits' bases; every (key, block) is read from byte ``64 block +
    scale_slot(key)``, where the append and the reference write it."""
    from deepwell.kernels.kv_formats.layout import scale_slot

    bases = gd._v_scales_view(nb).offset_bases
    seen = {}
    for o in range(64 * nb):
        key = blk = 0
        for bit, (kb, bb) in enumerate(bases):
            if o >> bit & 1:
                key, blk = key ^ kb, blk ^ bb
        seen[(key, blk)] = o
    assert len(seen) == 64 * nb
    assert all(seen[(i, b)] == 64 * b + scale_slot(i) for i in range(64) for b in range(nb))


def test_v_rows_relabelling_round_trips():
    """The head-dim order of ``Oᵀ``'s rows with V from registers (``_v_a_operand``: reshape
    [2, 2, 8, 2, 2], permute (3, 0, 1, 4, 2)) is undone by ``_rows_in_d_order`` (reshape
    [2, 2, 2, 2, 8], permute (1, 2, 4, 0, 3)), and each thread's four rows (lanes fixed:
    row bits 0-2, warps: bits 4-5) are four consecutive head-dim bytes."""
    d_of_row = torch.arange(128).reshape(2, 2, 8, 2, 2).permute(3, 0, 1, 4, 2).reshape(128)
    assert sorted(d_of_row.tolist()) == list(range(128))
    back = d_of_row.reshape(2, 2, 2, 2, 8).permute(1, 2, 4, 0, 3).reshape(128)
    assert back.tolist() == list(range(128))
    for lane_row in range(8):
        for warp in range(4):
            rows = [lane_row + 16 * warp + 8 * i + 64 * j for j in (0, 1) for i in (0, 1)]
            got = sorted(d_of_row[rows].tolist())
            assert got == list(range(got[0], got[0] + 4)) and got[0] % 4 == 0


def test_supported_shapes_and_bad_inputs_are_rejected_before_any_launch():
    assert gd.supported(KVLayout.make("nvfp4", 4, 256), 6, 4)
    assert not gd.supported(KVLayout.make("nvfp4", 4, 256), 6, 6)  # 36 columns > 32
    assert not gd.supported(KVLayout.make("nvfp4", 3, 64), 3)
    assert gd.supported(KVLayout.make("fp8", 4, 256), 6) and gd.supported(KVLayout.make("fp8", 2, 128), 4, 4)
    assert not gd.supported(KVLayout.make("fp8", 3, 64), 3)
    assert gd.supported(KVLayout.make("int8", 4, 256), 6) and not gd.supported(KVLayout.make("bf16", 4, 256), 6)
    assert gd.num_columns(1, 6) == 8 and gd.num_columns(4, 6) == 32 and gd.num_columns(1, 1) == 8
    assert gd.programs_per_sm(1, 6) == 3 and gd.programs_per_sm(2, 6) == 3 and gd.programs_per_sm(4, 6) == 2
    assert gd.programs_per_sm(2, 6, 128) == 2
    # fp8: no flushed accumulators (its 64 KB ring leaves a third program no room for them)
    assert gd.kernel_config(2, 6, 256, KVFormat.FP8) == (True, 0) and gd.kernel_config(2, 6, 256) == (True, 32)
    assert gd.programs_per_sm(1, 6, 256, KVFormat.FP8) == 3 and gd.programs_per_sm(2, 6, 256, KVFormat.FP8) == 2
    assert gd.programs_per_sm(1, 6, 256, KVFormat.INT8) == 3 and gd.kernel_config(2, 6, 256, KVFormat.INT8) == (True, 0)
    layout = KVLayout.make("bf16", 1, 128)
    cache = layout.allocate(2)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([70], dtype=torch.int32)
    with pytest.raises(ValueError, match="nvfp4, fp8 or int8"):
        gd.paged_decode(torch.randn(1, 4, 128), cache, layout, layout.default_scales(), tables, lens, 0.1)
    layout = KVLayout.make("nvfp4", 1, 128)
    cache = layout.allocate(2)
    with pytest.raises(ValueError, match="2 tokens per block-table row"):
        gd.paged_decode(torch.randn(1, 4, 128), cache, layout, layout.default_scales(), tables, lens, 0.1,
                        tokens_per_seq=2)
    with pytest.raises(ValueError, match="out must be"):
        gd.paged_decode(torch.randn(1, 4, 128), cache, layout, layout.default_scales(), tables, lens, 0.1,
                        out=torch.empty(1, 4, 64))
    with pytest.raises(ValueError, match="v_regs needs head_dim 256"):
        gd.paged_decode(torch.randn(1, 4, 128), cache, layout, layout.default_scales(), tables, lens, 0.1,
                        v_regs=True)
    with pytest.raises(ValueError, match="sm_scale must be positive"):  # the page maximum precedes the scale
        gd.paged_decode(torch.randn(1, 4, 128), cache, layout, layout.default_scales(), tables, lens, -0.1)
    with pytest.raises(ValueError, match="flush >= 0"):
        gd.paged_decode(torch.randn(1, 4, 128), cache, layout, layout.default_scales(), tables, lens, 0.1,
                        flush=-1)
    with pytest.raises(ValueError, match="scratch"):
        gd.paged_decode(torch.randn(1, 4, 128), cache, layout, layout.default_scales(), tables, lens, 0.1,
                        num_splits=2, scratch=(torch.empty(8), torch.empty(8)))


def _oracle(case, q, t):
    b = case.block_tables.shape[0]
    lens = torch.full((b,), t, dtype=torch.int32, device=q.device)
    starts = torch.arange(b, dtype=torch.int32, device=q.device) * t
    return attn_ref.paged_attention(q, case.cache, case.layout, case.scales, case.block_tables, case.context_lens,
                                    starts, lens, q.shape[-1] ** -0.5, compute_dtype=torch.float64)


CASES = [
    # d, Hq, Hkv, context lens, tokens per sequence
    (256, 24, 4, [1, 15, 16, 17], 1),
    (256, 24, 4, [63, 64, 65, 130, 4100], 1),
    (256, 24, 4, [4, 63, 64, 65, 129, 1000], 4),
    (256, 6, 1, [2, 65, 300], 2),
    (128, 8, 2, [1, 17, 64, 65, 700], 1),
    (128, 16, 2, [4, 64, 65, 200], 4),  # (contexts hold the T new tokens)
    (256, 32, 4, [90, 190], 1),  # 8 heads per KV head
    (256, 4, 4, [90, 190], 1),  # 1 head per KV head
    (256, 24, 4, [4096 + 37 * i for i in range(16)], 1),
    (256, 24, 4, [32768 + 5, 65, 1], 1),
    # full size, as tests/kernels/test_gpu_large.py for the Triton kernel: 128k, batch 8 and 64,
    # verify at long contexts
    (256, 24, 4, [131072], 1),
    (256, 24, 4, [131072 - 5, 4097, 70000, 16, 1, 65, 32768, 100000], 1),
    (256, 24, 4, [4096 + 37 * i for i in range(64)], 1),
    (256, 24, 4, [131072, 32768 + 3], 4),
]


# fp8 / int8: every shape up to 32k contexts, and 128k for decode and verify (the fp64 oracle
# over the full-size batches takes minutes)
BYTE_CASES = CASES[:10] + [CASES[10], CASES[13]]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("fmt,d,hq,h,ctx,t", [("nvfp4", *c) for c in CASES] + [("fp8", *c) for c in BYTE_CASES]
                         + [("int8", *c) for c in BYTE_CASES])
def test_gluon_matches_fp64_and_splits_agree(fmt, d, hq, h, ctx, t):
    case = build_case(KVLayout.make(fmt, h, d), ctx, seed=d + hq + len(ctx) + t, device="cuda")
    q = torch.randn(len(ctx) * t, hq, d, device="cuda").to(torch.bfloat16)
    ref = _oracle(case, q, t)
    for v_regs in (False, True) if d == 256 else (False, ):  # V through shared memory / registers
        outs = []
        for splits in (1, 3, 16):
            out = torch.full(q.shape, float("nan"), dtype=torch.float32, device="cuda")
            gd.paged_decode(q, case.cache, case.layout, case.scales, case.block_tables, case.context_lens,
                            d ** -0.5, tokens_per_seq=t, num_splits=splits, out=out, v_regs=v_regs)
            assert not torch.isnan(out).any()
            assert rel_l2(out, ref) <= 1e-3
            outs.append(out)
        assert rel_l2(outs[1], outs[0]) <= 1e-5 and rel_l2(outs[2], outs[0]) <= 1e-5


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_int8_rows_past_the_scale_limit_stay_finite(t):
    """int8 V rows beyond 127 * SCALE_MAX are stored saturated, so the fp16 probabilities times
    V's token scale (times 2**12) stay finite (inf before the limit, V magnitudes >= 2032)."""
    from deepwell.kernels.kv_formats import int8

    case = build_case(KVLayout.make("int8", 4, 256), [700, 65, 1 + t], seed=9 + t, device="cuda", magnitude=3000.0)
    v_scales = case.cache[:, 1, :, case.layout.scale_offset:].contiguous().view(torch.float32)
    assert float(v_scales.max()) == int8.SCALE_MAX
    q = (torch.randn(3 * t, 24, 256, device="cuda") * 0.01).to(torch.bfloat16)
    ref = _oracle(case, q, t)
    for splits in (1, 3):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device="cuda")
        gd.paged_decode(q, case.cache, case.layout, case.scales, case.block_tables, case.context_lens,
                        256 ** -0.5, tokens_per_seq=t, num_splits=splits, out=out)
        assert bool(torch.isfinite(out).all()) and rel_l2(out, ref) <= 1e-3


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8"])
def test_verify_equals_sequential_decodes(fmt):
    """T = 4 query tokens in one call == four decode steps with growing context lengths."""
    ctx = [70, 300, 4]
    case = build_case(KVLayout.make(fmt, 4, 256), ctx, seed=11, device="cuda")
    t = 4
    q = torch.randn(len(ctx), t, 24, 256, device="cuda").to(torch.bfloat16)
    out = torch.empty(len(ctx) * t, 24, 256, dtype=torch.float32, device="cuda")
    gd.paged_decode(q.reshape(-1, 24, 256), case.cache, case.layout, case.scales, case.block_tables,
                    case.context_lens, 256 ** -0.5, tokens_per_seq=t, num_splits=2, out=out)
    for i in range(t):
        lens_i = case.context_lens - (t - 1 - i)
        step = torch.empty(len(ctx), 24, 256, dtype=torch.float32, device="cuda")
        gd.paged_decode(q[:, i].contiguous(), case.cache, case.layout, case.scales, case.block_tables, lens_i,
                        256 ** -0.5, num_splits=2, out=step)
        assert rel_l2(out.view(len(ctx), t, 24, 256)[:, i], step) <= 1e-5


def _fill_past_context(case, value: int) -> torch.Tensor:
    """A copy of the cache with every byte of the rows past each sequence's context (codes and
    block scales, K and V) set to ``value``."""
    lay = case.layout
    cache = case.cache.clone()
    for b, n in enumerate(case.context_lens.tolist()):
        page = int(case.block_tables[b, (n - 1) // 64])
        r0 = n - 64 * ((n - 1) // 64)
        if r0 == 64:
            continue
        blocks = cache[page]  # [2, h, bytes]
        blocks[..., r0 * lay.code_bytes:lay.scale_offset] = value
        past = torch.arange(r0, 64, device=cache.device)
        for kv in (0, 1):  # V's scale region is block-major (kv_formats.layout)
            blocks[kv][:, lay.scale_offset + lay.scale_index(kv, past).flatten()] = value
    return cache


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8"])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_bytes_past_the_context_do_not_change_the_output(fmt, t):
    """Rows past the context are never read into a result, whatever they hold: 0xFF makes
    nvfp4's E4M3 block scales, fp8's codes and int8's fp32 token scales NaN (the kernels mask
    V's scales / codes on the last page, and K's rows only reach their own, masked, scores)."""
    from deepwell.kernels.paged_attention import triton_kernel

    ctx = [70, 65, 1 + t, 130, 64 + t - 1, 4]
    case = build_case(KVLayout.make(fmt, 4, 256), ctx, seed=5 + t, device="cuda")
    q = torch.randn(len(ctx) * t, 24, 256, device="cuda").to(torch.bfloat16)
    nan_cache = _fill_past_context(case, 0xFF)

    def run(cache, **kw):
        out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
        gd.paged_decode(q, cache, case.layout, case.scales, case.block_tables, case.context_lens, 0.0625,
                        tokens_per_seq=t, out=out, **kw)
        return out

    for kw in ({"v_regs": False}, {"v_regs": True}, {"num_splits": 3}):
        want = run(case.cache, **kw)
        assert not torch.isnan(want).any()
        assert torch.equal(run(nan_cache, **kw), want), kw

    def run_triton(cache):
        out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
        return triton_kernel.paged_attention(q, cache, case.layout, case.scales, case.block_tables,
                                             case.context_lens, None, None, 0.0625, uniform_t=t, out=out)

    want = run_triton(case.cache)
    assert not torch.isnan(want).any()
    assert torch.equal(run_triton(nan_cache), want)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8"])
def test_backend_decode_takes_the_gluon_path_and_agrees_with_the_triton_kernel(monkeypatch, fmt):
    from deepwell.kernels.paged_attention import triton_kernel

    layout = KVLayout.make(fmt, 4, 256)
    case = build_case(layout, [700, 65, 1], seed=3, device="cuda")
    layer = KVCacheLayer(layout=layout, data=case.cache, scales=case.scales)
    q = torch.randn(3, 24, 256, device="cuda").to(torch.bfloat16)
    be = TritonBackend()
    calls = []
    orig = gd.paged_decode
    monkeypatch.setattr(gd, "paged_decode", lambda *a, **k: calls.append(1) or orig(*a, **k))
    got = be.decode_attention(q, layer, case.block_tables, case.context_lens, sm_scale=0.0625,
                              out=torch.empty(3, 24, 256, dtype=torch.float32, device="cuda"))
    assert calls == [1]
    from deepwell.kernels.paged_attention.reference import rotate_q

    want = triton_kernel.paged_attention(rotate_q(q, layout), case.cache, layout, case.scales, case.block_tables,
                                         case.context_lens, None, None, 0.0625, uniform_t=1,
                                         out=torch.empty(3, 24, 256, dtype=torch.float32, device="cuda"))
    # the two round P to fp16 relative to different references (the page maximum, rounded up
    # to an integer here): ~1e-4 apart, each within 1e-3 of the fp64 oracle (above)
    assert rel_l2(got, want) <= 5e-4
