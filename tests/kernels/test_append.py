"""KV append: reference semantics (page boundaries, untouched bytes, chunking invariance) and
the Triton kernel's byte-identity with the reference (interpreter on CPU, full size on GPU)."""

from __future__ import annotations

import pytest
import torch

from deepwell.kernels.kv_append import reference as ref
from deepwell.kernels.kv_formats import KVLayout, e4m3, feedback, nvfp4
from tests.kernels.helpers import POISON, fragmented_tables

FORMATS = ["bf16", "fp8", "int8", "nvfp4"]


def _edge_rows(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Rows mixing the codec edge cases: zeros, E2M1/E4M3 ties, saturation, tiny values,
    constant blocks (ties in the nvfp4 scale search)."""
    x = torch.randn(n, d, generator=gen) * torch.exp2(torch.randint(-12, 10, (n, 1), generator=gen).float())
    blocks = x.view(n, d // 16, 16)
    kind = torch.randint(0, 6, (n, d // 16), generator=gen)
    blocks[kind == 0] = 0.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    blocks[kind == 1] = ties * torch.where(torch.rand(16, generator=gen) < 0.5, -1.0, 1.0)
    blocks[kind == 2] = torch.full((16,), 1e-7)
    blocks[kind == 3] = blocks[kind == 3] * 1e4
    # constant blocks: several candidate scales put them exactly on the grid (error ties)
    blocks[kind == 4] = blocks[kind == 4][:, :1].expand(-1, 16)
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("length", [63, 64, 65])
def test_page_boundaries_and_untouched_bytes(fmt, length):
    lay = KVLayout.make(fmt, 2, 64)
    gen = torch.Generator().manual_seed(length)
    tables, num_pages = fragmented_tables([length, 130], gen)
    cache = torch.full((num_pages, 2, 2, lay.head_page_bytes), POISON, dtype=torch.uint8)
    k = torch.randn(length, 2, 64, generator=gen)
    v = torch.randn(length, 2, 64, generator=gen)
    slots = ref.slots_from_positions(tables, torch.zeros(length, dtype=torch.long), torch.arange(length))
    ref.append(cache, lay, k, v, slots, lay.default_scales())
    kk, vv = ref.gather(cache, lay, tables[0], length, lay.default_scales())
    ek, _ = ref.encode_rows(k, lay, 0, lay.default_scales())
    # the bytes of every written row are the codec's; everything else is still poison
    written = torch.zeros(num_pages, 64, dtype=torch.bool)
    written[slots // 64, slots % 64] = True
    rows = cache[..., : lay.scale_offset].view(num_pages, 2, 2, 64, lay.code_bytes)
    assert torch.equal(rows[slots // 64, 0, :, slots % 64], ek)
    assert bool((rows.permute(0, 3, 1, 2, 4)[~written] == POISON).all())
    if lay.scale_bytes:
        region = cache[..., lay.scale_offset :]  # [pages, 2, heads, 64 * scale_bytes]
        for kv in (0, 1):
            srows = region[:, kv][..., lay.scale_index(kv, torch.arange(64))]  # [pages, heads, 64, sb]
            assert bool((srows.permute(0, 2, 1, 3)[~written] == POISON).all())
            _, want = ref.encode_rows(v if kv else k, lay, kv, lay.default_scales())
            assert torch.equal(ref.read_scales(cache, lay, kv, slots // 64, slots % 64), want)
    assert kk.shape == (length, 2, 64) and bool(torch.isfinite(kk).all() and torch.isfinite(vv).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunked_prefill_equals_token_by_token(fmt):
    lay = KVLayout.make(fmt, 2, 64)
    gen = torch.Generator().manual_seed(7)
    n = 300
    tables, num_pages = fragmented_tables([n], gen)
    k = torch.randn(n, 2, 64, generator=gen)
    v = torch.randn(n, 2, 64, generator=gen)
    pos = torch.arange(n)
    slots = ref.slots_from_positions(tables, torch.zeros(n, dtype=torch.long), pos)
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]]) if fmt in ("fp8", "nvfp4") else lay.default_scales()
    caches = []
    for chunk in (n, 128, 17, 1):
        c = torch.full((num_pages, 2, 2, lay.head_page_bytes), POISON, dtype=torch.uint8)
        for s in range(0, n, chunk):
            ref.append(c, lay, k[s : s + chunk], v[s : s + chunk], slots[s : s + chunk], scales)
        caches.append(c)
    for c in caches[1:]:
        assert torch.equal(c, caches[0])


def test_append_rejects_bad_input():
    lay = KVLayout.make("nvfp4", 2, 64)
    cache = lay.allocate(2)
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="powers of two"):
        ref.append(cache, lay, k, k, torch.arange(3), torch.full((2, 2), 0.3))
    with pytest.raises(ValueError, match="outside the cache"):
        ref.append(cache, lay, k, k, torch.tensor([0, 1, 128]), lay.default_scales())
    with pytest.raises(ValueError, match="must be"):
        ref.append(cache, lay, k[:, :1], k, torch.arange(3), lay.default_scales())


def _random_feedback(h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Feedback matrices of random (anisotropic, correlated) queries: ``from_block_covariance``."""
    q = torch.randn(400, 2 * h, d, generator=gen) * torch.linspace(0.2, 3.0, d)
    q = q @ torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    prod, count = feedback.block_covariance(q, h)
    return feedback.from_block_covariance(prod / count)


def _parity(fmt: str, d: int, hadamard: bool | int, n: int, seed: int, device: str, k_offset: bool = False,
            k_feedback: bool = False, block_t: int | None = None, impl: str = "auto", num_warps: int | None = None,
            zero_rows: int = 0) -> None:
    from deepwell.kernels.kv_append import triton_kernel

    lay = KVLayout.make(fmt, 3, d, hadamard)
    gen = torch.Generator().manual_seed(seed)
    pages = (n + 63) // 64 + 2
    perm = torch.randperm(pages * 64, generator=gen)[:n]
    slots = perm.clone()
    slots[torch.rand(n, generator=gen) < 0.05] = -1
    k = _edge_rows(n * 3, d, gen).view(n, 3, d).to(torch.bfloat16)
    v = _edge_rows(n * 3, d, gen).view(n, 3, d).to(torch.bfloat16)
    k[:2, 0] = 0.0  # whole zero rows (int8's zero token scales)
    v[2:4, 1] = 0.0
    k[:zero_rows] = 0.0  # whole programs of zeros (their counts must not overflow a packed field)
    v[:zero_rows] = 0.0
    slots[:zero_rows] = perm[:zero_rows]  # all kept
    scales = torch.exp2(torch.randint(-4, 4, (2, 3), generator=gen).float())
    if fmt in ("bf16", "int8"):
        scales = lay.default_scales()
    off = torch.randn(3, d, generator=gen) * 3.0 if k_offset else None
    fb = _random_feedback(3, d, gen) if k_feedback else None
    c_ref = torch.full((pages, 2, 3, lay.head_page_bytes), POISON, dtype=torch.uint8)
    n_ref = torch.zeros(2, 3, 3, dtype=torch.int64)
    ref.append(c_ref, lay, k, v, slots, scales, off, n_ref, fb)
    c_tri = torch.full_like(c_ref, POISON).to(device)
    n_tri = torch.full((2, 3, 3), 5, dtype=torch.int64, device=device)  # counts add to what is there
    triton_kernel.append(c_tri, lay, k.to(device), v.to(device), slots.to(device), scales.to(device),
                         None if off is None else off.to(device), n_tri, None if fb is None else fb.to(device),
                         block_t=block_t, impl=impl, num_warps=num_warps)
    diff = (c_tri.cpu() != c_ref).nonzero()
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at {diff[:5].tolist()}"
    if fmt != "bf16":  # block-scale health counts: the reference's numbers exactly
        from deepwell.kernels.calibration import count_scales

        kept = slots >= 0
        want = count_scales(lay, ref.stored_rows(k[kept], lay, 0, off), v[kept], scales) if not lay.hadamard else None
        if want is not None:  # without rotation count_scales sees the stored rows directly
            tot = n_ref.sum(1)
            assert tot[:, 0].tolist() == [want["k"].zero, want["v"].zero]
            assert tot[:, 1].tolist() == [want["k"].subnormal, want["v"].subnormal]
            assert tot[:, 2].tolist() == [want["k"].saturated, want["v"].saturated]
        assert int(n_ref.sum()) > 0  # the edge rows hit every kind somewhere
        assert torch.equal(n_tri.cpu() - 5, n_ref), (n_tri.cpu() - 5, n_ref)
    else:
        assert bool((n_ref == 0).all()) and bool((n_tri.cpu() == 5).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d,hadamard", [(64, True), (128, False), (256, True), (128, 16)])  # 16: per 16-block
def test_triton_append_byte_identical(fmt, d, hadamard):
    _parity(fmt, d, hadamard, 70 if d < 256 else 33, seed=d + len(fmt), device="cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d,hadamard", [(64, True), (128, False)])
def test_triton_append_with_k_offset_byte_identical(fmt, d, hadamard):
    _parity(fmt, d, hadamard, 40, seed=5 * d + len(fmt), device="cuda" if torch.cuda.is_available() else "cpu",
            k_offset=True)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("d,hadamard", [(64, True), (128, False), (256, 16)])
def test_triton_append_with_k_feedback_byte_identical(fmt, d, hadamard):
    _parity(fmt, d, hadamard, 24, seed=7 * d + len(fmt), device="cuda" if torch.cuda.is_available() else "cpu",
            k_offset=True, k_feedback=True)


@pytest.mark.parametrize("fmt,block_t,feedback", [("nvfp4", 2, True), ("fp8", 4, False)])
def test_triton_append_byte_identical_at_the_gpu_tokens_per_program(fmt, block_t, feedback):
    """The tokens per program the GPU runs by default (the interpreter's own default is 64,
    cheaper there); 5 tokens, so the last program is partial."""
    _parity(fmt, 64, True, 5, seed=11 + block_t, device="cuda" if torch.cuda.is_available() else "cpu",
            k_offset=True, k_feedback=feedback, block_t=block_t)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_k_feedback_lowers_the_query_weighted_error(fmt):
    """Zero feedback writes nearest rounding's bytes (nvfp4: under the block scales of the
    feedback's three-code list); calibrated feedback changes only K and lowers K's error as the
    queries see it (mean of (q . e)^2 over fresh queries of the same distribution), while
    raising its plain squared error."""
    lay = KVLayout.make(fmt, 1, 64, False)
    gen = torch.Generator().manual_seed(21)
    # strongly anisotropic inside each 16-block (the feedback works within blocks)
    mix = torch.block_diag(*[torch.linalg.qr(torch.randn(16, 16, generator=gen))[0] for _ in range(4)])
    spread = torch.linspace(0.05, 3.0, 16).repeat(4)

    def queries(n: int) -> torch.Tensor:
        return (torch.randn(n, 2, 64, generator=gen) * spread) @ mix

    prod, count = feedback.block_covariance(queries(2000), 1)
    fb = feedback.from_block_covariance(prod / count)
    k, v = torch.randn(256, 1, 64, generator=gen), torch.randn(256, 1, 64, generator=gen)
    slots, g = torch.arange(256), torch.full((2, 1), 0.0625)
    near, zero, fed = lay.allocate(4), lay.allocate(4), lay.allocate(4)
    ref.append(near, lay, k, v, slots, g)
    ref.append(zero, lay, k, v, slots, g, k_feedback=torch.zeros_like(fb))
    ref.append(fed, lay, k, v, slots, g, k_feedback=fb)
    if fmt == "nvfp4":  # K's block scales from the three-code list, elements to nearest
        assert torch.equal(near[:, 1], zero[:, 1])
        x, gk = k.reshape(256, 64), g[0].expand(256)
        want = nvfp4.decode(*nvfp4.encode_with_scales(x, gk, nvfp4.choose_scale_codes(x, gk, feedback=True)), gk)
        assert torch.equal(ref.gather(zero, lay, torch.arange(4), 256, g)[0].reshape(256, 64), want)
    else:
        assert torch.equal(near, zero)
    assert torch.equal(near[:, 1], fed[:, 1]) and not torch.equal(near[:, 0], fed[:, 0])
    table = torch.arange(4)
    e_near = ref.gather(near, lay, table, 256, g)[0] - k
    e_fed = ref.gather(fed, lay, table, 256, g)[0] - k
    qt = queries(2000).reshape(-1, 64)
    w_near, w_fed = float(((e_near[:, 0] @ qt.T) ** 2).mean()), float(((e_fed[:, 0] @ qt.T) ** 2).mean())
    assert w_fed < 0.85 * w_near, (w_fed, w_near)  # measured 0.58 (fp8), 0.73 (nvfp4)
    assert float((e_fed**2).sum()) > float((e_near**2).sum())


def test_k_feedback_is_checked():
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(3, 2, 64, generator=gen)
    for fmt in ("bf16", "int8"):
        lay = KVLayout.make(fmt, 2, 64)
        with pytest.raises(ValueError, match="applies to fp8 and nvfp4"):
            ref.append(lay.allocate(1), lay, k, k, torch.arange(3), lay.default_scales(),
                       k_feedback=torch.zeros(2, 4, 16, 16))
    lay = KVLayout.make("nvfp4", 2, 64)
    for bad, why in ((torch.zeros(2, 2, 16, 16), "must be contiguous float32"),
                     (torch.zeros(2, 4, 16, 16, dtype=torch.float64), "float32"),
                     (torch.full((2, 4, 16, 16), float("inf")), "finite")):
        with pytest.raises(ValueError, match=why):
            ref.append(lay.allocate(1), lay, k, k, torch.arange(3), lay.default_scales(), k_feedback=bad)
    with pytest.raises(ValueError, match="damp must be > 0"):
        feedback.from_block_covariance(torch.eye(16).expand(1, 4, 16, 16).double(), damp=0.0)
    # a head whose calibration queries were all zero gets zero feedback (nearest rounding)
    fb = feedback.from_block_covariance(torch.zeros(2, 4, 16, 16, dtype=torch.float64))
    assert fb.shape == (2, 4, 16, 16) and not bool(fb.any())


def test_k_offset_is_subtracted_from_k_only():
    """Appending K with offset mu writes the bytes of appending K - mu (fp32) without one; V
    is untouched; gather returns the stored (centered) K; bad offsets are refused."""
    lay = KVLayout.make("nvfp4", 2, 64)
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(5, 2, 64, generator=gen) + 4.0, torch.randn(5, 2, 64, generator=gen)
    mu = torch.randn(2, 64, generator=gen) + 4.0
    slots, g = torch.tensor([0, 1, 63, 64, 70]), lay.default_scales()
    with_off, shifted = lay.allocate(2), lay.allocate(2)
    ref.append(with_off, lay, k, v, slots, g, mu)
    ref.append(shifted, lay, k - mu, v, slots, g)
    assert torch.equal(with_off, shifted)
    plain = lay.allocate(2)
    ref.append(plain, lay, k, v, slots, g)
    assert not torch.equal(plain[:, 0], with_off[:, 0]) and torch.equal(plain[:, 1], with_off[:, 1])
    gk, _ = ref.gather(with_off, lay, torch.tensor([0, 1]), 2, g)
    from deepwell.kernels.hadamard import fwht

    assert float((gk - fwht(k[:2] - mu)).norm() / fwht(k[:2] - mu).norm()) < 0.2  # nvfp4 error, not the 4.0 shift
    for bad, why in ((torch.zeros(2, 32), "must be contiguous float32"), (torch.zeros(2, 64, dtype=torch.float64), "float32"),
                     (torch.full((2, 64), float("nan")), "finite")):
        with pytest.raises(ValueError, match=why):
            ref.append(lay.allocate(2), lay, k, v, slots, g, bad)


def test_edge_rows_hit_edge_cases():
    from deepwell.kernels.calibration import count_scales

    lay = KVLayout.make("nvfp4", 1, 64, False)
    x = _edge_rows(400, 64, torch.Generator().manual_seed(3)).view(400, 1, 64)
    c = count_scales(lay, x, x, lay.default_scales())["k"]
    assert c.zero > 0 and c.subnormal > 0 and c.saturated > 0
    assert e4m3.E4M3_MAX == 448.0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_triton_append_byte_identical_full_size(fmt, d):
    # >= 1e6 random 16-value blocks per format and head dim (plus the edge-case blocks);
    # with a K offset (centering) for d = 256
    n = (1 << 20) * 16 // (3 * d) + 1
    _parity(fmt, d, True, n, seed=100 + d, device="cuda", k_offset=d == 256)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("d", [64, 256])
def test_triton_append_with_k_feedback_byte_identical_full_size(fmt, d):
    n = (1 << 20) * 16 // (3 * d) + 1
    _parity(fmt, d, True, n, seed=200 + d, device="cuda", k_offset=True, k_feedback=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("impl", ["triton", "gluon"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("fed", [False, True])
def test_gluon_and_triton_append_kernels_byte_identical_full_size(fmt, impl, d, fed):
    # both nvfp4 / fp8 kernels on the GPU (``auto`` picks Gluon on Hopper): >= 1e6 blocks, K
    # offset, with and without K feedback; without the rotation at d = 128
    n = (1 << 20) * 16 // (3 * d) + 1
    _parity(fmt, d, d != 128, n, seed=300 + d + fed, device="cuda", k_offset=True, k_feedback=fed, impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("impl", ["triton", "gluon"])
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("fed", [False, True])
def test_append_with_16_block_rotation_byte_identical(fmt, impl, d, fed):
    # K rotated by one Hadamard transform per 16-element block (KVLayout.hadamard_block)
    _parity(fmt, d, 16, 4099, seed=400 + d + fed, device="cuda", k_offset=True, k_feedback=fed, impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65])
def test_gluon_append_any_token_count(fmt, n):
    # partial programs (rows past N) at every head dim, with and without K feedback
    for d in (64, 128, 256):
        _parity(fmt, d, True, n, seed=400 + n + d, device="cuda", impl="gluon")
        _parity(fmt, d, True, n, seed=500 + n + d, device="cuda", impl="gluon", k_offset=True, k_feedback=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fed", [False, True])
def test_gluon_fp8_append_counts_any_program_size(fed):
    # four warps hold 1024 fp8 elements per program (the wide counts), the first programs all zeros
    for d in (64, 128, 256):
        _parity("fp8", d, True, 300, seed=600 + d + fed, device="cuda", impl="gluon", k_offset=True, k_feedback=fed,
                num_warps=4, zero_rows=32)


def test_append_impl_is_checked():
    from deepwell.kernels.kv_append import triton_kernel

    lay = KVLayout.make("fp8", 1, 64)
    k = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="impl must be"):
        triton_kernel.append(lay.allocate(1), lay, k, k, torch.zeros(1, dtype=torch.long), lay.default_scales(),
                             impl="cuda")
    with pytest.raises(ValueError, match="Gluon append needs nvfp4 or fp8"):
        triton_kernel.append(lay.allocate(1), lay, k, k, torch.zeros(1, dtype=torch.long), lay.default_scales(),
                             impl="gluon")
    nv = KVLayout.make("nvfp4", 1, 64)
    cpu = torch.device("cpu")
    assert triton_kernel.append_kernel(nv, cpu) == "triton"  # Gluon only on Hopper
    assert triton_kernel.append_kernel(nv, cpu, impl="triton") == "triton"
    with pytest.raises(ValueError, match="on a Hopper GPU"):
        triton_kernel.append_kernel(nv, cpu, impl="gluon")
