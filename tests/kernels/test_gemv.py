"""The 16-bit split-K GEMV kernel against its reference (``F.linear``): CPU through the Triton
interpreter at small sizes (both inner-product variants, K not a multiple of the K step, split
K, bias), argument validation and ``supports``, and CUDA at model sizes (also inside a CUDA
graph)."""

from __future__ import annotations

import os

import pytest
import torch

from deepwell.kernels import gemv
from deepwell.kernels.gemv import reference
from deepwell.kernels.gemv.triton_kernel import linear

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # fp32: the summation order only; 16-bit: one rounding of the output (an ulp of bf16 is 2**-8 relative)
    return {"rtol": 1e-5, "atol": 1e-4} if dtype == F32 else {"rtol": 1e-2, "atol": 1e-2}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@needs_interpreter
@pytest.mark.parametrize("variant", ["dot", "fma"])
@pytest.mark.parametrize(("m", "n", "k", "split", "bias", "dtype"), [
    (1, 48, 64, 1, False, F32),
    (3, 96, 200, 3, True, F32),  # K = 6 * 32 + 8: a partial last K step; 3 splits of 3, 3 and 1 steps
    (5, 48, 200, 1, True, F32),  # 5 rows: fma takes two row groups, the second of one row
    (16, 96, 64, 3, False, F32),  # 2 K steps: the split is capped at 2
    (1, 96, 200, 3, True, BF16),
    (3, 48, 64, 1, False, BF16),
    (5, 96, 200, 3, False, BF16),
    (16, 48, 200, 1, True, BF16),
])
def test_kernel_matches_reference_in_the_interpreter(variant: str, m: int, n: int, k: int, split: int, bias: bool,
                                                     dtype: torch.dtype) -> None:
    x, w, b = _inputs(m, n, k, dtype, bias, seed=m * 1000 + n + k)
    got = linear(x, w, b, block_n=32, block_k=32, split_k=split, variant=variant)
    want = reference.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    assert torch.allclose(got.float(), want.float(), **_tol(dtype))


@needs_interpreter
@pytest.mark.parametrize(("m", "dtype"), [(2, F16), (7, BF16)])
def test_defaults_and_strided_inputs_in_the_interpreter(m: int, dtype: torch.dtype) -> None:
    x, w, b = _inputs(m, 80, 160, dtype, True, seed=m)
    wide = torch.zeros(m, 200, dtype=dtype)
    wide[:, :160] = x
    want = reference.linear(x, w, b)
    for xs, ws in ((x, w), (wide[:, :160], w), (x, w.t().contiguous().t())):  # a row stride; a transposed weight
        got = gemv.linear(xs, ws, b)
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **_tol(dtype))
    # the same call gives the same bits (partials added in a fixed order)
    x2, w2, _ = _inputs(m, 96, 256, dtype, False, seed=m + 1)
    first = linear(x2, w2, block_n=32, block_k=32, split_k=4)
    assert torch.equal(first, linear(x2, w2, block_n=32, block_k=32, split_k=4))
    assert linear(x[:0], w).shape == (0, 80)


def test_validation_errors() -> None:
    x, w, b = _inputs(2, 48, 64, F32, True, seed=0)
    with pytest.raises(ValueError, match="does not match"):
        linear(x, w[:, :32])
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        linear(x[None], w)
    with pytest.raises(ValueError, match="differs"):
        linear(x, w.to(BF16))
    with pytest.raises(ValueError, match="fp32 / bf16 / fp16"):
        linear(x.to(torch.float64), w.to(torch.float64))
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, b[:10])
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, b.to(BF16))
    with pytest.raises(ValueError, match="block_n"):
        linear(x, w, block_n=48)
    with pytest.raises(ValueError, match="block_k"):
        linear(x, w, block_k=8)
    with pytest.raises(ValueError, match="split_k"):
        linear(x, w, split_k=0)
    with pytest.raises(ValueError, match="variant"):
        linear(x, w, variant="wmma")


def test_supports() -> None:
    x, w, b = _inputs(gemv.MAX_TOKENS, 48, 64, BF16, True, seed=1)
    assert gemv.supports(x, w, b) == INTERPRET  # CPU tensors only through the interpreter
    big = torch.randn(gemv.MAX_TOKENS + 1, 64).to(BF16)
    assert not gemv.supports(big, w)  # more rows than the kernel is meant for
    assert not gemv.supports(x, w.float())  # dtypes differ
    assert not gemv.supports(x, w[:, :32])  # K differs
    assert not gemv.supports(x, torch.randn(64, 48).to(BF16).t())  # weight's last stride is not 1
    assert not gemv.supports(x[None], w)
    assert not gemv.supports(x.double(), w.double())
    assert not gemv.supports(x, w, b[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "dot", "fma"])
@pytest.mark.parametrize(("m", "n", "k", "dtype"), [
    (1, 5120, 5120, BF16), (3, 12288, 5120, BF16), (16, 5120, 17408, BF16), (8, 2000, 1000, F16), (2, 640, 520, F32),
])
def test_kernel_matches_f_linear_on_cuda(variant: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    assert gemv.supports(x, w, b)
    got = linear(x, w, b, variant=variant)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    err = ((got.double() - want).norm() / want.norm()).item()
    assert got.dtype == dtype and err < (1e-6 if dtype == F32 else 5e-3)
    assert torch.equal(got, linear(x, w, b, variant=variant))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dot", "fma"])
def test_kernel_in_a_cuda_graph(variant: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(4, 6144, device="cuda", generator=g).to(BF16)
    w = (torch.randn(5120, 6144, device="cuda", generator=g) * 0.02).to(BF16)
    b = torch.randn(5120, device="cuda", generator=g).to(BF16)
    linear(x, w, b, variant=variant)  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = linear(x, w, b, variant=variant)
    for _ in range(2):
        x.copy_(torch.randn(4, 6144, device="cuda", generator=g).to(BF16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, linear(x, w, b, variant=variant))
