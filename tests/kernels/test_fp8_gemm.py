"""Block-scaled FP8 weights: the quantizer's format, and the W8A16 Triton kernel against its
reference (CPU through the Triton interpreter at small sizes; CUDA at model sizes)."""

from __future__ import annotations

import os

import pytest
import torch

from deepwell.kernels import fp8_gemm
from deepwell.kernels.fp8_gemm import reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def test_quantize_roundtrip_and_scales() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.linspace(0.01, 3, 300)
    codes, scales = reference.quantize(w, (128, 128))
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (200, 300) and scales.shape == (2, 3)
    back = reference.dequantize(codes, scales)
    # E4M3 keeps 3 mantissa bits: each element within half an ulp of its block's grid
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + scales.max() * 2 ** -9).all()
    # the block's largest magnitude is exactly 448 codes
    assert torch.allclose(codes.float().abs().amax(), torch.tensor(reference.FP8_MAX))
    z_codes, z_scales = reference.quantize(torch.zeros(3, 5), (128, 128))
    assert torch.equal(z_scales, torch.ones(1, 1)) and not z_codes.float().any()
    # a re-quantized FP8 weight gets its own codes and scales back
    c2, s2 = reference.quantize(back, (128, 128))
    assert torch.equal(c2.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(s2, scales)
    with pytest.raises(ValueError, match="block scales must be fp32"):
        reference.dequantize(codes, scales[:1])


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias"), [
    (1, 70, 128, torch.float32, False), (5, 128, 256, torch.bfloat16, True), (33, 64, 200, torch.float16, False),
])
def test_kernel_matches_reference_in_the_interpreter(m: int, n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    g = torch.Generator().manual_seed(m + n)
    codes, scales = reference.quantize(torch.randn(n, k, generator=g), (128, 128))
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = fp8_gemm.matmul(x, codes, scales, bias=b, kernel_on_cpu=True)
    want = reference.w8a16_matmul(x, codes, scales, bias=b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(("split", "bias"), [(2, False), (3, True), (64, False)])
def test_split_k_matches_reference_in_the_interpreter(split: int, bias: bool) -> None:
    from deepwell.kernels.fp8_gemm.triton_kernel import w8a16_matmul

    g = torch.Generator().manual_seed(split)
    codes, scales = reference.quantize(torch.randn(40, 448, generator=g), (128, 128))  # K not a multiple of 128
    x = torch.randn(2, 448, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    got = w8a16_matmul(x, codes, scales, bias=b, split_k=split)  # 64: more splits than K steps (capped)
    want = reference.w8a16_matmul(x, codes, scales, bias=b)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="split_k"):
        w8a16_matmul(x, codes, scales, split_k=0)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(("m", "split", "bias", "dtype", "block_k"), [
    (1, 1, False, torch.float32, None), (5, 2, True, torch.bfloat16, 32), (17, 3, False, torch.float16, 128)])
def test_swapped_operands_match_reference_in_the_interpreter(m: int, split: int, bias: bool, dtype: torch.dtype,
                                                              block_k: int | None) -> None:
    """``swap=True`` (weight as the MMA's first operand): the reference's product, partial tiles
    on both sides (N = 40, K = 448, 17 rows over two 16-row tiles)."""
    from deepwell.kernels.fp8_gemm.triton_kernel import w8a16_matmul

    g = torch.Generator().manual_seed(m)
    codes, scales = reference.quantize(torch.randn(40, 448, generator=g), (128, 128))
    x = torch.randn(m, 448, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    got = w8a16_matmul(x, codes, scales, bias=b, split_k=split, swap=True, block_k=block_k)
    want = reference.w8a16_matmul(x, codes, scales, bias=b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="block_k"):
        w8a16_matmul(x, codes, scales, swap=True, block_k=48)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_kernel_gives_the_reference_bits(dtype: torch.dtype) -> None:
    from deepwell.kernels.fp8_gemm.triton_kernel import dequantize

    g = torch.Generator().manual_seed(3)
    codes, scales = reference.quantize(torch.randn(130, 200, generator=g) * 5, (128, 128))
    assert torch.equal(dequantize(codes, scales, dtype=dtype), reference.dequantize(codes, scales, dtype=dtype))


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
def test_many_tokens_take_the_dequantized_gemm() -> None:
    from deepwell.kernels.fp8_gemm.triton_kernel import DEQUANT_MIN_TOKENS

    g = torch.Generator().manual_seed(4)
    codes, scales = reference.quantize(torch.randn(48, 256, generator=g), (128, 128))
    x = torch.randn(DEQUANT_MIN_TOKENS, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    got = fp8_gemm.matmul(x, codes, scales, bias=b, kernel_on_cpu=True)
    want = reference.w8a16_matmul(x, codes, scales, bias=b)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), [(1, 5120, 5120), (8, 17408, 5120), (300, 5120, 17408)])
def test_kernel_matches_reference_on_cuda(m: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    codes, scales = reference.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, (128, 128))
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    got = fp8_gemm.matmul(x, codes, scales).float()
    want = reference.w8a16_matmul(x, codes, scales).float()
    assert ((got - want).norm() / want.norm()) < 5e-3


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias", "split"), [
    (1, 70, 128, torch.float32, False, None), (3, 128, 448, torch.bfloat16, True, 2),
    (6, 64, 256, torch.float16, False, 64), (5, 40, 300, torch.float32, True, 3),
    (11, 32, 128, torch.float32, False, None),
])
def test_fma_form_matches_reference_in_the_interpreter(m: int, n: int, k: int, dtype: torch.dtype, bias: bool,
                                                       split: int | None) -> None:
    """The scale after each step's sum: fp32 activations agree to fp32 summation order (the
    reference's weights are exact fp32 products then), 16-bit ones within the weights' one
    rounding; 5 to 8 rows in one program (every unrolled row), more than one program serves
    (11), K not a multiple of 128, splits."""
    from deepwell.kernels.fp8_gemm.triton_kernel import fma_matmul

    g = torch.Generator().manual_seed(m * n + k)
    codes, scales = reference.quantize(torch.randn(n, k, generator=g), (128, 128))
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = fma_matmul(x, codes, scales, bias=b, split_k=split)
    want = reference.w8a16_matmul(x, codes, scales, bias=b)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    with pytest.raises(ValueError, match="block_n"):
        fma_matmul(x, codes, scales, block_n=48)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), [(1, 5120, 5120), (4, 17408, 5120), (7, 5120, 17408),
                                           (13, 5120, 5120)])
def test_fma_form_matches_reference_on_cuda(m: int, n: int, k: int) -> None:
    from deepwell.kernels.fp8_gemm.triton_kernel import fma_matmul, w8a16_matmul

    g = torch.Generator(device="cuda").manual_seed(2)
    codes, scales = reference.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, (128, 128))
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    want = reference.w8a16_matmul(x, codes, scales).float()
    got = fma_matmul(x, codes, scales).float()
    assert ((got - want).norm() / want.norm()) < 5e-3
    for bn, bk in ((64, 64), (128, 128)):  # the swapped tensor-core form: the reference's weights
        got = w8a16_matmul(x, codes, scales, swap=True, block_n=bn, block_k=bk).float()
        assert ((got - want).norm() / want.norm()) < 5e-3, (bn, bk)


def test_tune_keeps_the_fastest_kernel_per_shape_and_row_count() -> None:
    """``tune.choose``: per weight shape and row count the fastest kernel (the first listed on a
    tie), every candidate timed at every row count; ``apply`` installs the table (``matmul``
    picks by the weight's shape and the rows) and checks it; ``summary`` names the runs."""
    from deepwell.kernels.fp8_gemm import triton_kernel, tune

    def timer(kind: str, m: int, n: int, k: int) -> float:  # fma 10 us a row; swap wins at 3..5 rows on 2000
        if kind == "fma":
            return 10e-6 * m
        if kind == "swap" and n == 2000:
            return 25e-6 if 3 <= m <= 5 else 90e-6
        return 35e-6 if kind == "w8a16" else 40e-6

    choice, times = tune.choose([(1000, 128), (2000, 256), (1000, 128)], timer, max_rows=6)
    assert choice == {(1000, 128): ("fma", "fma", "fma", "w8a16", "w8a16", "w8a16"),
                      (2000, 256): ("fma", "fma", "swap", "swap", "swap", "w8a16")}
    assert all(sorted(t) == list(range(1, 7)) and all(len(r) == len(tk_names()) for r in t.values())
               for t in times.values())
    assert tune.summary(choice) == {"1000x128": "fma x3, w8a16 x3", "2000x256": "fma x2, swap x3, w8a16 x1"}
    before = triton_kernel.FMA_MAX_TOKENS, triton_kernel.KERNEL_BY_SHAPE
    try:
        tune.apply(0, {(64, 256): ["fma", "swap"]})
        assert triton_kernel.FMA_MAX_TOKENS == 0 and triton_kernel.KERNEL_BY_SHAPE == {(64, 256): ("fma", "swap")}
        assert [triton_kernel.few_row_kernel((64, 256), m) for m in (1, 2, 3)] == ["fma", "swap", "w8a16"]
        assert triton_kernel.few_row_kernel((32, 256), 1) == "w8a16"
        tune.apply(3)
        assert triton_kernel.FMA_MAX_TOKENS == 3 and triton_kernel.KERNEL_BY_SHAPE == {}
        assert [triton_kernel.few_row_kernel((32, 256), m) for m in (3, 4)] == ["fma", "w8a16"]
        with pytest.raises(ValueError, match="FMA max tokens"):
            tune.apply(triton_kernel.DEQUANT_MIN_TOKENS)
        with pytest.raises(ValueError, match="kernels of"):
            tune.apply(0, {(64, 256): ["fast"]})
    finally:
        triton_kernel.FMA_MAX_TOKENS, triton_kernel.KERNEL_BY_SHAPE = before


def tk_names() -> tuple[str, ...]:
    from deepwell.kernels.fp8_gemm.triton_kernel import FEW_ROW_KERNELS

    return FEW_ROW_KERNELS


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
def test_matmul_takes_the_kernel_its_shape_and_rows_were_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``matmul`` (kernel on CPU) routes a call by its weight's shape and row count: the table's
    kernel, "w8a16" past it and for other shapes; every named kernel gives the reference's result."""
    from deepwell.kernels.fp8_gemm import triton_kernel

    calls: list[str] = []
    real = triton_kernel.few_row_matmul

    def spy(kind: str, *a: object, **k: object) -> torch.Tensor:
        calls.append(kind)
        return real(kind, *a, **k)

    monkeypatch.setattr(triton_kernel, "few_row_matmul", spy)
    monkeypatch.setattr(triton_kernel, "KERNEL_BY_SHAPE", {(64, 256): ("fma", "swap128", "swap")})
    monkeypatch.setattr(triton_kernel, "FMA_MAX_TOKENS", 0)
    codes, scales = reference.quantize(torch.randn(64, 256), (128, 128))
    other, other_scales = reference.quantize(torch.randn(32, 256), (128, 128))
    for m in (1, 2, 3, 4):
        x = torch.randn(m, 256)
        got = triton_kernel.matmul(x, codes, scales, kernel_on_cpu=True)
        assert torch.allclose(got, reference.w8a16_matmul(x, codes, scales), rtol=1e-5, atol=1e-5), m
    triton_kernel.matmul(torch.randn(1, 256), other, other_scales, kernel_on_cpu=True)
    assert calls == ["fma", "swap128", "swap", "w8a16", "w8a16"]
    with pytest.raises(ValueError, match="unknown few-token kernel"):
        real("fast", torch.randn(1, 256), codes, scales)


def test_fp8_tune_is_pinned_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fp8_linear.tune``: nothing off CUDA or without FP8 layers; ``DEEPWELL_FP8_FMA_MAX_TOKENS``
    pins the FMA kernel's row limit without timing anything, and a bad value names the variable."""
    from deepwell.engine_service.layers.fp8_linear import FMA_ENV, FP8Linear, tune
    from deepwell.kernels.fp8_gemm import triton_kernel

    model = torch.nn.Sequential(FP8Linear.from_linear(torch.nn.Linear(256, 128)))
    cuda = torch.device("cuda")  # a device object only: the pinned path touches no GPU
    assert tune(model, torch.device("cpu"), torch.bfloat16) is None
    assert tune(torch.nn.Sequential(torch.nn.Linear(4, 4)), cuda, torch.bfloat16) is None
    before = triton_kernel.FMA_MAX_TOKENS
    try:
        monkeypatch.setenv(FMA_ENV, "3")
        assert tune(model, cuda, torch.bfloat16) == {"fma_max_tokens": 3, "source": FMA_ENV}
        assert triton_kernel.FMA_MAX_TOKENS == 3
        monkeypatch.setenv(FMA_ENV, "many")
        with pytest.raises(ValueError, match=FMA_ENV):
            tune(model, cuda, torch.bfloat16)
    finally:
        triton_kernel.FMA_MAX_TOKENS = before


@pytest.mark.gpu
def test_few_row_kernels_timed_on_cuda() -> None:
    from deepwell.kernels.fp8_gemm import tune

    errors = tune.check((5120, 5120), torch.device("cuda"), torch.bfloat16)
    assert all(err < tune.CHECK_TOLERANCE for err in errors.values()), errors
    choice, times, rejected = tune.tune_kernels([(5120, 5120), (17408, 5120)], torch.device("cuda"), torch.bfloat16)
    assert not rejected
    for shape, kinds in choice.items():
        # every candidate builds, captures and replays: a finite time from the graph timer
        assert len(kinds) == tune.MAX_ROWS and all(0 < s < 1e-2 for row in times[shape].values() for s in row.values())
        print(f"{shape}: {tune.summary({shape: kinds})}; us per row count: "
              + "; ".join(f"{m}: " + "/".join(f"{k} {s * 1e6:.1f}" for k, s in row.items())
                          for m, row in times[shape].items()))
    timer = tune.graph_timer(torch.device("cuda"), torch.bfloat16, (128, 128))
    assert timer("no-such-kernel", 1, 1024, 512) == float("inf")  # a candidate that raises is never chosen
    assert 0 < timer("fma", 1, 1024, 512) < 1e-2  # and the timer still works after it


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
def test_fma_check_passes_in_the_interpreter() -> None:
    """The start-up check ``tune_kernels`` runs before timing: each kernel's error against the
    tensor-core kernel is at most the weights' one rounding to bf16 (FMA), far inside the bound."""
    from deepwell.kernels.fp8_gemm import tune

    for dtype, bound in ((torch.bfloat16, tune.CHECK_TOLERANCE / 2), (torch.float32, 1e-5)):
        errors = tune.check((64, 256), torch.device("cpu"), dtype)
        assert set(errors) == set(tk_names()) and max(errors.values()) < bound, errors


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
def test_a_kernel_that_raises_is_rejected_not_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate this Triton / GPU cannot build fails ``check`` (error inf) instead of stopping
    the engine's start; ``tune_kernels`` then times only the others."""
    from deepwell.kernels.fp8_gemm import triton_kernel, tune

    real = triton_kernel.few_row_matmul

    def broken(kind: str, *a: object, **k: object) -> torch.Tensor:
        if kind == "swap128":
            raise RuntimeError("out of resources: shared memory")
        return real(kind, *a, **k)

    monkeypatch.setattr(triton_kernel, "few_row_matmul", broken)
    errors = tune.check((64, 256), torch.device("cpu"), torch.float32, rows=(1,))
    assert errors["swap128"] == float("inf") and errors["swap"] < 1e-5
    timed: list[str] = []
    monkeypatch.setattr(tune, "graph_timer", lambda *a: lambda kind, m, n, k: timed.append(kind) or 1e-5)
    choice, _, rejected = tune.tune_kernels([(64, 256)], torch.device("cpu"), torch.float32)
    assert set(rejected) == {"swap128"} and "swap128" not in timed and choice[(64, 256)] == ("w8a16",) * tune.MAX_ROWS


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["w8a16", "swap", "swap128", "fma"])
def test_split_sum_inside_the_launch_gives_the_reduce_launchs_bits(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """``DEEPWELL_SPLITK_FIXUP=1``: the last program of each output tile sums the split-K partials
    (``gemv.triton_kernel.split_fixup``) with the bits the separate reduce launch gives, and
    leaves every tile counter at zero for the next launch."""
    from deepwell.kernels.fp8_gemm import triton_kernel as tk
    from deepwell.kernels.gemv import triton_kernel as gemv

    g = torch.Generator().manual_seed(11)
    codes, scales = reference.quantize(torch.randn(200, 512, generator=g) * 0.05, (128, 128))
    bias = torch.randn(200, generator=g).to(torch.bfloat16)
    calls = {"w8a16": lambda x, b: tk.w8a16_matmul(x, codes, scales, bias=b, split_k=3),
             "swap": lambda x, b: tk.w8a16_matmul(x, codes, scales, bias=b, split_k=3, swap=True),
             "swap128": lambda x, b: tk.w8a16_matmul(x, codes, scales, bias=b, split_k=2, swap=True, block_n=128),
             "fma": lambda x, b: tk.fma_matmul(x, codes, scales, bias=b, split_k=4)}
    reduced: list[int] = []
    real_reduce = gemv.reduce_splits
    monkeypatch.setattr(tk, "reduce_splits", lambda *a: reduced.append(1) or real_reduce(*a))
    for rows, b in ((1, None), (5, bias), (11, bias)):  # fma: 11 rows = a group of 8 and one of 3
        x = torch.randn(rows, 512, generator=g).to(torch.bfloat16)
        monkeypatch.delenv(gemv.FIXUP_ENV, raising=False)
        want = calls[kind](x, b)
        assert reduced == [1]  # the partials were summed by their own launch
        monkeypatch.setenv(gemv.FIXUP_ENV, "1")
        got = calls[kind](x, b)
        assert reduced == [1]  # ... and now inside the GEMM's launch
        assert torch.equal(got, want), (kind, rows)
        assert not gemv.fixup_counters(torch.device("cpu"), 1).any()
        reduced.clear()


def test_fixup_counters_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepwell.kernels.gemv import triton_kernel as gemv

    monkeypatch.delenv(gemv.FIXUP_ENV, raising=False)
    assert gemv.fixup_counters(torch.device("cpu"), 4) is None  # off by default
    monkeypatch.setenv(gemv.FIXUP_ENV, "1")
    assert gemv.fixup_counters(torch.device("cpu"), gemv.FIXUP_SLOTS + 1) is None  # more tiles than counters
    if not INTERPRET:
        assert gemv.fixup_counters(torch.device("cpu"), 4) is None  # no kernel runs on this CPU


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["swap_f16", "swap128_f16"])
def test_block_scale_after_the_product_in_fp16(kind: str) -> None:
    """``F16``: the codes' exact values times each row's activations scaled by a power of two
    into fp16, the block scale and the row's scale after the product. Rows far outside fp16's
    range (1e6, 1e-30) and a zero row come out as the exact product does; the result differs
    from the plain swapped kernel's (which rounds every scaled weight to bf16), and fp32
    activations take the plain kernel."""
    from deepwell.kernels.fp8_gemm import triton_kernel as tk

    g = torch.Generator().manual_seed(12)
    codes, scales = reference.quantize(torch.randn(256, 384, generator=g) * 0.05, (128, 128))
    x = torch.randn(5, 384, generator=g)
    x[0] *= 1e6
    x[1] = 0
    x[2] *= 1e-30
    x = x.bfloat16()
    exact = x.double() @ reference.dequantize(codes, scales).double().T
    got = tk.few_row_matmul(kind, x, codes, scales)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and not got[1].any()
    for i in (0, 2, 3, 4):
        err = ((got[i].double() - exact[i]).norm() / exact[i].norm()).item()
        assert err < 5e-3, (i, err)  # the output's rounding to bf16
    unswapped = tk.w8a16_matmul(x, codes, scales, f16=True)  # the same form with x as the first operand
    assert not unswapped[1].any()
    for i in (0, 2, 3, 4):
        assert ((unswapped[i].double() - exact[i]).norm() / exact[i].norm()).item() < 5e-3, i
    plain = kind.removesuffix("_f16")
    assert not torch.equal(got, tk.few_row_matmul(plain, x, codes, scales))
    x32 = torch.randn(3, 384, generator=g)
    assert torch.equal(tk.few_row_matmul(kind, x32, codes, scales), tk.few_row_matmul(plain, x32, codes, scales))
