"""``causal_conv1d_decode_pool``: the Gated DeltaNet causal conv's decode step with the conv
states read from and written back to the state pool by slot (``kernels.gdn.pool_conv``, a Triton
kernel) against its plain-torch meaning (``pool_conv.conv_pool_reference``: a gather,
``conv_decode_fp32``, a scatter) and the reference backend's 16-bit arithmetic.

- CPU, Triton interpreter: kernel vs its meaning (the written states bit for bit, y within one
  ulp of its dtype) and vs ``conv_decode_step`` (16-bit products: within their rounding), a pool in another dtype than the
  weights, kernel widths 2 and 4, channel counts not a multiple of the block, strided x (a row
  slice of the fused projection); rows not named by ``slots`` untouched; bad arguments.
- CPU, plain torch: the backends' pool op is the gather + their decode step + scatter bit for bit
  (the reference backend's, the batch-invariant one's).
- CUDA (``-m gpu``): the Qwen3.5-27B conv shape (10240 channels, width 4), bf16, vs the reference,
  and captured in a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.kernels.gdn import pool_conv, pool_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")


def _case(b: int, c: int, k: int, seed: int, dtype: torch.dtype, pool_dtype: torch.dtype | None = None,
          device: str = "cpu", width: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    x_all = torch.randn(b, width or c, generator=gen).to(device, dtype)
    x = x_all[:, :c]  # a row-strided view when width > c (the layer passes rows of its projection)
    weight = torch.randn(c, k, generator=gen).to(device, dtype)
    pool = torch.randn(b + 3, c, k - 1, generator=gen).to(device, pool_dtype or dtype)
    slots = torch.randperm(b + 3, generator=gen)[:b].to(device)
    return x, pool, slots, weight


@needs_interpreter
@pytest.mark.parametrize(("dtype", "pool_dtype", "k", "c"), [
    (torch.float32, None, 4, 300), (torch.bfloat16, None, 4, 96), (torch.float16, None, 2, 40),
    (torch.bfloat16, torch.float32, 4, 64)])
def test_kernel_matches_reference_in_the_interpreter(dtype: torch.dtype, pool_dtype: torch.dtype | None, k: int,
                                                     c: int) -> None:
    x, pool, slots, weight = _case(3, c, k, seed=c + k, dtype=dtype, pool_dtype=pool_dtype, width=c + 32)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = pool_conv.conv_pool_reference(x, want_pool, slots, weight)
    got = pool_conv.conv_pool(x, got_pool, slots, weight, block_c=64)
    assert got.dtype == x.dtype and got.shape == want.shape
    assert torch.equal(got_pool, want_pool)  # moved values and x through the weight dtype: exact
    # fp32 arithmetic, one rounding: torch's summation order may differ (fp32: to its rounding;
    # 16-bit: the result by one ulp)
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(1e-3)
        assert bool(((got.float() - want.float()).abs() <= ulp).all())
    # the plain-torch reference (16-bit products) within its own rounding
    ref_pool = pool.clone()
    ref = pool_conv.conv_pool_reference(x, ref_pool, slots, weight, decode=pool_reference.conv_decode_step)
    assert torch.equal(ref_pool, got_pool)
    assert torch.allclose(got.float(), ref.float(), rtol=3e-2 if dtype != torch.float32 else 1e-6, atol=1e-2)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got_pool[untouched], pool[untouched])


@needs_interpreter
def test_self_check_passes_in_the_interpreter() -> None:
    assert pool_conv.self_check(48, 4, torch.float32, torch.device("cpu")) < 1e-6
    assert pool_conv.self_check(48, 4, torch.bfloat16, torch.device("cpu")) < 1e-3


def test_backends_pool_op_is_gather_decode_scatter() -> None:
    from deepwell.engine_service.layers.invariant import BatchInvariantBackend

    for backend in (ReferenceBackend(), BatchInvariantBackend()):
        x, pool, slots, weight = _case(4, 24, 4, seed=3, dtype=torch.float32)
        states = pool[slots].clone()
        want_y, want_states = backend.causal_conv1d_decode(x, states, weight)
        got = pool.clone()
        y = backend.causal_conv1d_decode_pool(x, got, slots, weight)
        assert torch.equal(y, want_y) and torch.equal(got[slots], want_states)
    # the arithmetic the reference backend runs is pool_reference's
    y, new = ReferenceBackend().causal_conv1d_decode(x, states, weight)
    want_y, want_new = pool_reference.conv_decode_step(x, states, weight)
    assert torch.equal(y, want_y) and torch.equal(new, want_new)


def test_bad_arguments_are_refused() -> None:
    x, pool, slots, weight = _case(2, 16, 4, seed=1, dtype=torch.float32)
    for args, why in (((x[:, :8], pool, slots, weight), "disagree"), ((x, pool, slots[:1], weight), "slots must be"),
                      ((x, pool[..., :2], slots, weight), "disagree"), ((x.unsqueeze(0), pool, slots, weight), "must be")):
        with pytest.raises(ValueError, match=why):
            pool_conv.conv_pool(*args)
    with pytest.raises(ValueError, match="kernel widths"):
        pool_conv.conv_pool(x, torch.zeros(4, 16, 9), slots, torch.zeros(16, 10))
    with pytest.raises(ValueError, match="block_c"):
        pool_conv.conv_pool(x, pool, slots, weight, block_c=48)


@pytest.mark.gpu
def test_kernel_on_cuda_at_the_27b_shape_and_in_a_graph() -> None:
    x, pool, slots, weight = _case(8, 10240, 4, seed=7, dtype=torch.bfloat16, device="cuda", width=16384)
    assert pool_conv.self_check(10240, 4, torch.bfloat16, torch.device("cuda")) < 1e-2
    want_pool, got_pool = pool.clone(), pool.clone()
    want = pool_conv.conv_pool_reference(x, want_pool, slots, weight)
    got = pool_conv.conv_pool(x, got_pool, slots, weight)
    assert torch.equal(got_pool, want_pool)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    graph_pool, start = pool.clone(), pool.clone()
    pool_conv.conv_pool(x, graph_pool, slots, weight)  # compiled before the capture
    graph_pool.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pool_conv.conv_pool(x, graph_pool, slots, weight)
    graph_pool.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, got) and torch.equal(graph_pool, got_pool)


def test_a_kernel_that_fails_its_self_check_is_not_served_and_not_checked_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``CudaBackend._checked``: the first use runs the check; a miss (error over the tolerance)
    answers False from then on without checking again, a pass True."""
    from deepwell.engine_service.layers.cuda_backend import POOL_CHECK_TOLERANCE, CudaBackend

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU-only torch raises
    backend, calls = CudaBackend(), []

    def check(err: float):
        return lambda: calls.append(err) or err

    assert backend._checked(("conv", 8, 4, torch.bfloat16, 0, 0), check(float("inf")), "ev", "d") is False
    assert backend._checked(("conv", 8, 4, torch.bfloat16, 0, 0), check(0.0), "ev", "d") is False
    assert backend._checked(("conv", 16, 4, torch.bfloat16, 0, 0), check(POOL_CHECK_TOLERANCE / 2), "ev", "d") is True
    assert calls == [float("inf"), POOL_CHECK_TOLERANCE / 2]
