"""Routed experts (``kernels.moe``): the tile plan covers every pick once, the Triton kernels
(16-bit and FP8 block-scaled experts) match ``reference.moe_experts_summed`` (the interpreter on CPU at small sizes; compiled on a
GPU at a Qwen3.6-35B-A3B layer's shape, and captured in a CUDA graph whose replays follow new
routings), the engine's loop (``reference.moe_experts``) agrees with both, and the kernels
build offline for sm_90.

Tolerances: under the interpreter the 16-bit tiles are widened to fp32 (exact products, fp32
sums, as tensor cores); the sums' order differs from torch's GEMM, so now and then a bf16
rounding of an intermediate flips (``_close16``: >= 95% of the elements bit-identical on CPU);
fp32 within fp32 rounding; the loop adds the k picks in the output dtype, so it is within a few
bf16 ulps of either.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.cuda_backend import CudaBackend
from deepwell.engine_service.layers.moe import FP8Experts, SparseMoE
from deepwell.kernels.fp8_gemm import reference as fp8_ref
from deepwell.kernels.moe import reference, triton_kernel
from tests.kernels.offline import has_ptxas, run_offline_build

DEV = "cuda" if torch.cuda.is_available() else "cpu"
kernel_runs = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs the Triton interpreter (CPU) or a GPU")


def _case(n: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int = 0, device: str = DEV,
          idx: torch.Tensor | None = None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(dtype)
    gu = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    dn = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    if idx is None:
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]) if n else torch.empty(0, k)
    w = torch.rand(n, k, generator=gen).to(dtype)
    return [t.to(device) for t in (x, gu, dn, idx.long(), w)]


def _close16(got: torch.Tensor, want: torch.Tensor) -> None:
    """16-bit results: the GEMMs' fp32 sums run in another order than torch's, which flips a
    rounding of g, u, h or y now and then; most elements are bit-identical (all, under the
    interpreter, at one K step), the rest close."""
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got == want).float().mean().item() >= (0.95 if DEV == "cpu" else 0.5)


# -- the plan ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "e", "k", "bm"), [(1, 8, 2, 16), (5, 64, 8, 16), (40, 4, 3, 16), (300, 16, 4, 64),
                                                 (33, 2, 1, 16)])
def test_plan_tiles_every_pick_once_with_its_expert(n: int, e: int, k: int, bm: int) -> None:
    gen = torch.Generator().manual_seed(n)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    p = triton_kernel.plan(idx, e, bm)
    flat = idx.reshape(-1)
    assert p.tile_expert.numel() == triton_kernel.max_tiles(n * k, e, bm)
    seen = []
    for t in range(p.tile_expert.numel()):
        ex, r0, r1 = int(p.tile_expert[t]), int(p.tile_row0[t]), int(p.tile_row1[t])
        if ex < 0:
            continue
        assert 0 < r1 - r0 <= bm
        picks = p.order[r0:r1]
        assert bool((flat[picks] == ex).all())
        seen += picks.tolist()
    assert sorted(seen) == list(range(n * k))
    # the tiles in use come first: a tile past the last one has expert -1
    used = (p.tile_expert >= 0).int()
    assert bool((used[:-1] >= used[1:]).all())


@kernel_runs
@pytest.mark.parametrize(("n", "e", "k", "bm"), [(1, 8, 2, 16), (5, 64, 8, 16), (40, 4, 3, 16), (16, 256, 8, 16),
                                                 (33, 2, 1, 16), (7, 3, 3, 4), (1, 256, 8, 16)])
def test_plan_in_one_launch_equals_the_torch_plan(n: int, e: int, k: int, bm: int) -> None:
    """The one-program plan (decode steps' few picks): the same order and tiles as ``plan``;
    tiles past the last have expert -1 and no rows."""
    gen = torch.Generator().manual_seed(n + e)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    idx[n // 2 :] = idx[: n - n // 2].clone()  # repeated routings: experts picked by several tokens
    want = triton_kernel.plan(idx, e, bm)
    got = triton_kernel.plan_one_launch(idx.to(DEV), e, bm)
    assert torch.equal(got.order.cpu().long(), want.order.cpu())
    assert torch.equal(got.tile_expert.cpu(), want.tile_expert.cpu())
    live = want.tile_expert.cpu() >= 0
    for a, b in ((got.tile_row0, want.tile_row0), (got.tile_row1, want.tile_row1)):
        assert torch.equal(a.cpu()[live], b.cpu()[live])
        assert not bool(a.cpu()[~live].any())


def test_plan_in_one_launch_is_bounded() -> None:
    with pytest.raises(ValueError, match="1..128 picks"):
        triton_kernel.plan_one_launch(torch.zeros(17, 8, dtype=torch.long), 8, 16)


def test_plan_bound_is_tight_when_every_pick_has_its_own_expert() -> None:
    idx = torch.arange(32).view(4, 8)
    p = triton_kernel.plan(idx, 256, 16)
    assert p.tile_expert.numel() == 32 and bool((p.tile_expert >= 0).all())


# -- the kernels against the references -------------------------------------------------------

CASES = [  # n tokens, experts, top-k, hidden, intermediate
    (1, 8, 2, 64, 32),
    (5, 8, 3, 48, 40),      # H, I not multiples of the blocks
    (37, 6, 2, 64, 32),     # more picks than experts: tiles of several picks
    (20, 3, 3, 32, 16),     # 60 picks over 3 experts: several tiles per expert (BM 16)
    (200, 8, 2, 32, 16),    # prefill tiles (BM 64)
]


@kernel_runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_kernel_matches_the_summed_reference_and_the_loop(case: tuple, dtype: torch.dtype) -> None:
    x, gu, dn, idx, w = _case(*case, dtype)
    got = triton_kernel.moe_experts(x, gu, dn, idx, w)
    want = reference.moe_experts_summed(x, gu, dn, idx, w)
    loop = reference.moe_experts(x, gu, dn, idx, w)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loop, want, rtol=1e-5, atol=1e-5)
    else:
        _close16(got, want)
        torch.testing.assert_close(loop.float(), want.float(), rtol=3e-2, atol=3e-2)


def _fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert block-scaled E4M3 codes and scales of float experts ``[E, N, K]``."""
    pairs = [fp8_ref.quantize(w[e].float(), block) for e in range(w.shape[0])]
    return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


FP8_CASES = [  # n tokens, experts, top-k, hidden, intermediate, scale block
    (1, 8, 2, 128, 64, (128, 128)),
    (5, 8, 3, 192, 96, (32, 64)),     # blocks smaller than a tile: a scale per 32 rows
    (37, 6, 2, 160, 80, (16, 128)),   # partial scale blocks at the edges
]


@kernel_runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: "x".join(map(str, c[:5])))
def test_fp8_experts_match_their_dequantized_weights(case: tuple, dtype: torch.dtype) -> None:
    n, e, k, h, i, block = case
    x, gu, dn, idx, w = _case(n, e, k, h, i, torch.float32)
    x, w = x.to(dtype), w.to(dtype)
    (gc, gs), (dc, ds) = _fp8(gu, block), _fp8(dn, block)
    scales = reference.Scales(gs.to(DEV), ds.to(DEV), block)
    got = triton_kernel.moe_experts(x, gc.to(DEV), dc.to(DEV), idx, w, scales)
    want = reference.moe_experts_summed(x, gc.to(DEV), dc.to(DEV), idx, w, scales)
    # the same as 16-bit experts holding the dequantized weights
    deq = [torch.stack([fp8_ref.dequantize(c[j], s[j], block, dtype) for j in range(e)]).to(DEV)
           for c, s in ((gc, gs), (dc, ds))]
    assert torch.equal(want, reference.moe_experts_summed(x, deq[0], deq[1], idx, w))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        _close16(got, want)
    loop = reference.moe_experts(x, gc.to(DEV), dc.to(DEV), idx, w, scales=scales)
    torch.testing.assert_close(loop.float(), want.float(), rtol=3e-2, atol=3e-2)


@kernel_runs
def test_fp8_scales_are_checked() -> None:
    x, gu, dn, idx, w = _case(3, 4, 2, 128, 64, torch.float32)
    (gc, gs), (dc, ds) = _fp8(gu, (128, 128)), _fp8(dn, (128, 128))
    with pytest.raises(ValueError, match="need their block scales"):
        triton_kernel.moe_experts(x, gc, dc, idx, w)
    with pytest.raises(ValueError, match="gate_up block scales"):
        triton_kernel.moe_experts(x, gc, dc, idx, w, reference.Scales(gs[:2], ds, (128, 128)))
    with pytest.raises(ValueError, match="not E4M3"):
        triton_kernel.moe_experts(x, gu, dn, idx, w, reference.Scales(gs, ds, (128, 128)))
    (gc, gs), (dc, ds) = _fp8(gu, (128, 32)), _fp8(dn, (128, 32))
    with pytest.raises(ValueError, match="multiple of 64"):
        triton_kernel.moe_experts(x, gc, dc, idx, w, reference.Scales(gs, ds, (128, 32)))


@kernel_runs
@pytest.mark.parametrize("spec", ["16x16x128", "32x64x64x2x2", "16x32x32x1x1", "16x32x64p"])
def test_other_launch_shapes_give_the_same_result(spec: str) -> None:
    """The benchmark's swept tile shapes: fp32 within fp32 rounding, FP8 (128-wide scale blocks)
    too; a K step that does not divide the scale block is refused."""
    tiles = triton_kernel.Tiles.parse(spec)
    x, gu, dn, idx, w = _case(7, 5, 2, 256, 128, torch.float32, seed=3)
    torch.testing.assert_close(triton_kernel.moe_experts(x, gu, dn, idx, w, tiles=tiles),
                               reference.moe_experts_summed(x, gu, dn, idx, w), rtol=1e-5, atol=1e-5)
    (gc, gs), (dc, ds) = _fp8(gu, (128, 128)), _fp8(dn, (128, 128))
    scales = reference.Scales(gs.to(DEV), ds.to(DEV), (128, 128))
    torch.testing.assert_close(triton_kernel.moe_experts(x, gc.to(DEV), dc.to(DEV), idx, w, scales, tiles),
                               reference.moe_experts_summed(x, gc.to(DEV), dc.to(DEV), idx, w, scales),
                               rtol=1e-5, atol=1e-5)


def test_tiles_are_checked() -> None:
    assert triton_kernel.Tiles.parse("16x32x128x8x2") == triton_kernel.Tiles(16, 32, 128, 8, 2)
    assert triton_kernel.Tiles.parse("16x32x64P") == triton_kernel.Tiles(16, 32, per_pick=True)
    assert triton_kernel.Tiles.parse("16x32x64p").name == "16x32x64x4x3p"
    # one token: a tile per pick; more: the plan
    assert triton_kernel.tiles_for(8, 1).per_pick and not triton_kernel.tiles_for(16, 2).per_pick
    # K steps of 128 unless an FP8 scale block is narrower; FP8 keeps the narrow tiles longer
    assert triton_kernel.tiles_for(16, 2).bk == 128 and triton_kernel.tiles_for(16, 2, 64).bk == 64
    assert triton_kernel.tiles_for(512, 64) == triton_kernel.Tiles(64, 64)
    assert triton_kernel.tiles_for(512, 64, 128) == triton_kernel.Tiles(16, 32, 128)
    for bad, why in (("16x32", "BMxBNxBK"), ("16x24x64", "power of two"), ("8x32x64", "power of two"),
                     ("16x32x64x3", "warps"), ("16x32x64x4x0", "stages")):
        with pytest.raises(ValueError, match=why):
            triton_kernel.Tiles.parse(bad)
    x, gu, dn, idx, w = _case(3, 4, 2, 256, 128, torch.float32)
    (gc, gs), (dc, ds) = _fp8(gu, (128, 128)), _fp8(dn, (128, 128))
    with pytest.raises(ValueError, match="must divide the FP8 scale block"):
        triton_kernel.moe_experts(x, gc, dc, idx, w, reference.Scales(gs, ds, (128, 128)),
                                  triton_kernel.Tiles(16, 32, 256))


@kernel_runs
def test_all_picks_on_one_expert_and_experts_without_picks() -> None:
    idx = torch.full((40, 1), 2)
    x, gu, dn, idx, w = _case(40, 6, 1, 32, 16, torch.float32, idx=idx)
    torch.testing.assert_close(triton_kernel.moe_experts(x, gu, dn, idx, w),
                               reference.moe_experts_summed(x, gu, dn, idx, w), rtol=1e-5, atol=1e-5)


@kernel_runs
def test_long_chunks_run_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_kernel, "MAX_PICKS", 16)  # 40 tokens x 2 picks: slices of 8 tokens
    x, gu, dn, idx, w = _case(40, 6, 2, 32, 16, torch.float32)
    torch.testing.assert_close(triton_kernel.moe_experts(x, gu, dn, idx, w),
                               reference.moe_experts_summed(x, gu, dn, idx, w), rtol=1e-5, atol=1e-5)


@kernel_runs
def test_no_tokens_and_bad_shapes() -> None:
    x, gu, dn, idx, w = _case(0, 4, 2, 32, 16, torch.float32)
    assert triton_kernel.moe_experts(x, gu, dn, idx, w).shape == (0, 32)
    x, gu, dn, idx, w = _case(3, 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="expert shapes"):
        triton_kernel.moe_experts(x, gu, dn[:, :16], idx, w)
    with pytest.raises(ValueError, match="topk_idx"):
        triton_kernel.moe_experts(x, gu, dn, idx[:2], w)
    with pytest.raises(ValueError, match="one dtype"):
        triton_kernel.moe_experts(x, gu.to(torch.bfloat16), dn, idx, w)


@kernel_runs
@pytest.mark.parametrize("fp8", [False, True], ids=["16bit", "fp8"])
def test_the_cuda_backend_serves_a_moe_layer_through_the_kernel(monkeypatch: pytest.MonkeyPatch, fp8: bool) -> None:
    """A SparseMoE layer (with a shared expert; 16-bit or FP8 experts) on the CUDA backend (the
    kernels under the interpreter on CPU) agrees with the reference backend, through the kernel."""
    calls = []
    real = triton_kernel.moe_experts
    monkeypatch.setattr(triton_kernel, "moe_experts", lambda *a: calls.append(1) or real(*a))
    layers = []
    for backend in (ReferenceBackend(), CudaBackend()):
        backend.fused_on_cpu = True
        torch.manual_seed(0)
        layer = SparseMoE(hidden=32, num_experts=6, top_k=2, intermediate=16, shared_intermediate=24,
                          norm_topk_prob=True, backend=backend)
        for prm in layer.parameters():
            prm.data.normal_(0, 0.2)
        if fp8:
            layer.experts = FP8Experts.from_experts(layer.experts, (16, 64))
        layers.append(layer.to(DEV))
    x = torch.randn(9, 32, device=DEV)
    torch.testing.assert_close(layers[1](x), layers[0](x), rtol=1e-5, atol=1e-5)
    assert calls


# -- on a GPU: full-size routing, and inside a CUDA graph ---------------------------------------

QWEN36_A3B = (256, 8, 2048, 512)  # experts, top-k, hidden, expert intermediate


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4, 300])
def test_full_size_layer_on_the_gpu(n: int) -> None:
    e, k, h, i = QWEN36_A3B
    x, gu, dn, idx, w = _case(n, e, k, h, i, torch.bfloat16, device="cuda")
    got = triton_kernel.moe_experts(x, gu, dn, idx, w)
    want = reference.moe_experts_summed(x.float(), gu.float(), dn.float(), idx, w.float())
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel <= 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 300])
def test_full_size_fp8_layer_on_the_gpu(n: int) -> None:
    e, k, h, i = QWEN36_A3B
    x, gu, dn, idx, w = _case(n, e, k, h, i, torch.bfloat16, device="cuda")
    (gc, gs), (dc, ds) = _fp8(gu, (128, 128)), _fp8(dn, (128, 128))
    scales = reference.Scales(gs, ds, (128, 128))
    got = triton_kernel.moe_experts(x, gc, dc, idx, w, scales)
    want = reference.moe_experts_summed(x, gc, dc, idx, w, scales)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel <= 1e-2, rel


@pytest.mark.gpu
def test_captured_moe_follows_new_routings() -> None:
    e, k, h, i = QWEN36_A3B
    x, gu, dn, idx, w = _case(4, e, k, h, i, torch.bfloat16, device="cuda")
    triton_kernel.moe_experts(x, gu, dn, idx, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_kernel.moe_experts(x, gu, dn, idx, w)
    for seed in range(3):
        _, _, _, new_idx, new_w = _case(4, e, k, h, i, torch.bfloat16, seed=seed + 1, device="cuda")
        new_idx[0, :] = new_idx[1, :]  # two tokens on the same experts: tiles of two picks
        idx.copy_(new_idx)
        w.copy_(new_w)
        x.normal_()
        graph.replay()
        assert torch.equal(out, triton_kernel.moe_experts(x, gu, dn, idx, w))


# -- the compiled kernels build, offline --------------------------------------------------------

def hopper_launches() -> None:
    """The calls whose launches ``test_kernels_build_for_hopper`` builds: decode and prefill
    tiles of bf16 and FP8 experts (one token: a tile per pick; more: the plan's tiles)."""
    e, k, h, i = QWEN36_A3B
    for n in (1, 300):  # fp32 experts are a CPU case: the interpreter tests cover them
        triton_kernel.moe_experts(*_case(n, e, k, h, i, torch.bfloat16, device="cpu"))
    for n in (1, 2):
        x, gu, dn, idx, w = _case(n, 2 * k, k, h, i, torch.bfloat16, device="cpu")
        (gc, gs), (dc, ds) = _fp8(gu, (128, 128)), _fp8(dn, (128, 128))
        triton_kernel.moe_experts(x, gc, dc, idx, w, reference.Scales(gs, ds, (128, 128)))
    # the one-launch plan at its largest (16 tokens x top-8: [128, 128] pairwise counts)
    triton_kernel.plan_one_launch(torch.randint(0, e, (16, k)), e, 16)


@pytest.mark.skipif(not has_ptxas(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_kernels_build_for_hopper(tmp_path: Path) -> None:
    out = run_offline_build("tests.kernels.test_moe", "hopper_launches", 90, tmp_path)
    assert out.count(": ok (") == 10, out
