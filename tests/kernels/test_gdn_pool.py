"""``gated_delta_rule_pool``: the gated delta rule over B sequences x T tokens with the recurrent
states read from and written back to the state pool by slot (``kernels.gdn.pool_recurrent``, a
Triton kernel) against its plain-torch meaning (``kernels.gdn.pool_reference``).

- CPU, Triton interpreter (small sizes): kernel vs reference (fp32 within summation-order
  rounding; outputs and written states), lengths 0..T per sequence, outputs only / states only,
  strided 16-bit inputs (views of a fused projection, as the GDN layer passes them), grouped
  value heads; pool rows not named by ``slots`` (and every row without ``write_back``, and a
  ``lengths`` 0 row) untouched bit for bit.
- CPU, plain torch: the reference is ``ReferenceBackend.gated_delta_rule_multi`` bit for bit (a
  gather, T decode steps, a scatter), the state after ``lengths[b]`` tokens that of the shorter
  run; the backends' ``gated_delta_rule_pool`` on CPU is the reference bit for bit; argument
  validation (``ValueError`` naming the problem).
- CUDA (``-m gpu``): the Qwen3.5-27B head shape (Hk 16, Hv 48, Dk = Dv = 128), B 8, T 1 and 5,
  fp32 and bf16 inputs, vs the reference and vs fla's fused recurrent kernel (when fla
  imports); captured in a CUDA graph and replayed with new lengths; a timing print (``-s``).
"""

from __future__ import annotations

import os

import pytest
import torch

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.cuda_backend import CudaBackend
from deepwell.kernels.gdn import fla_ops, pool_recurrent
from deepwell.kernels.gdn import pool_reference as ref

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
REF = ReferenceBackend()
F32, BF16 = torch.float32, torch.bfloat16


def inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, seed: int, slots_total: int = 7,
           dtype: torch.dtype = F32, device: str = "cpu", fused: bool = False):
    """Random q, k, v (``fused``: strided views of one ``[B, T, 2 Hk Dk + Hv Dv]`` tensor, as the
    GDN layer's split of its conv output), g < 0, beta in (0, 1), a pool of ``slots_total`` states
    and B distinct slots in random order."""
    gen = torch.Generator().manual_seed(seed)
    if fused:
        mixed = torch.randn(b, t, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv)
    else:
        q, k = (torch.randn(b, t, hk, dk, generator=gen).to(dtype) for _ in range(2))
        v = torch.randn(b, t, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(b, t, hv, generator=gen) * 0.5
    beta = torch.rand(b, t, hv, generator=gen).to(dtype)
    pool = torch.randn(slots_total, hv, dk, dv, generator=gen) * 0.3
    slots = torch.randperm(slots_total, generator=gen)[:b]
    out = (q, k, v, g, beta, pool, slots)
    return tuple(x.to(device) for x in out)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    # fp32 throughout: the kernel's sums run in another order than torch's einsum
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


# ----------------------------------------------------------------------------- interpreter: kernel vs reference
@needs_interpreter
@pytest.mark.parametrize(("b", "t", "hk", "dk", "dv", "lengths", "dtype", "fused", "block_v"), [
    (3, 5, 2, 16, 16, [0, 5, 2], F32, False, 8),  # a row of 0 (untouched), one of all T, one partial
    (1, 1, 2, 32, 16, None, F32, False, 8),  # a decode step
    (2, 3, 2, 16, 32, [3, 1], BF16, True, 16),  # strided 16-bit views, int32 lengths below
    (2, 4, 2, 32, 32, None, F32, True, 32),  # one value block per head
    (1, 16, 4, 16, 16, [11], F32, False, 16),  # the most tokens; one key head per value head
])
def test_kernel_matches_reference(b, t, hk, dk, dv, lengths, dtype, fused, block_v) -> None:
    q, k, v, g, beta, pool, slots = inputs(b, t, hk, 4, dk, dv, seed=b * 100 + t, dtype=dtype, fused=fused)
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32 if dtype == BF16 else torch.int64)
    got_pool, want_pool = pool.clone(), pool.clone()
    o = pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, got_pool, slots, lens, block_v=block_v)
    want = ref.gated_delta_rule_pool(q, k, v, g, beta, want_pool, slots, lens)
    assert o.dtype == F32 and o.shape == (b, t, 4, dv)
    close(o, want)
    close(got_pool, want_pool)
    others = [i for i in range(pool.shape[0]) if i not in slots.tolist()]
    assert torch.equal(got_pool[others], pool[others])  # rows not named: bit for bit
    for i, n in enumerate(lengths or []):
        if n == 0:
            assert torch.equal(got_pool[slots[i]], pool[slots[i]])


@needs_interpreter
def test_outputs_only_and_states_only() -> None:
    """A verify step (outputs, the pool untouched) and its group commit (states after
    ``lengths[b]`` tokens, no outputs): together the reference's single call."""
    q, k, v, g, beta, pool, slots = inputs(3, 4, 2, 4, 16, 16, seed=7)
    lens = torch.tensor([2, 0, 4])
    want_pool = pool.clone()
    want = ref.gated_delta_rule_pool(q, k, v, g, beta, want_pool, slots, lens)
    work = pool.clone()
    o = pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, work, slots, write_back=False)
    close(o, want)
    assert torch.equal(work, pool)
    assert pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, work, slots, lens, out=False) is None
    close(work, want_pool)
    assert torch.equal(work[slots[1]], pool[slots[1]])


# ----------------------------------------------------------------------------- reference: the decode steps' bits
@pytest.mark.parametrize("hk", [2, 4])
def test_reference_is_gather_decode_steps_scatter_bit_for_bit(hk: int) -> None:
    q, k, v, g, beta, pool, slots = inputs(3, 5, hk, 4, 8, 6, seed=hk)
    work = pool.clone()
    o = ref.gated_delta_rule_pool(q, k, v, g, beta, work, slots)
    ro, rs = REF.gated_delta_rule_multi(q, k, v, g, beta, pool[slots])
    assert torch.equal(o, ro) and torch.equal(work[slots], rs)
    # one token: the decode path's old form (rec_state[slots] -> gated_delta_rule_decode -> scatter)
    work = pool.clone()
    o = ref.gated_delta_rule_pool(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], work, slots)
    do, ds = REF.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool[slots])
    assert torch.equal(o[:, 0], do) and torch.equal(work[slots], ds)
    others = [i for i in range(pool.shape[0]) if i not in slots.tolist()]
    assert torch.equal(work[others], pool[others])


def test_reference_lengths_write_the_shorter_runs_state() -> None:
    q, k, v, g, beta, pool, slots = inputs(3, 5, 2, 4, 8, 6, seed=3)
    lens = torch.tensor([0, 2, 5])
    work = pool.clone()
    o = ref.gated_delta_rule_pool(q, k, v, g, beta, work, slots, lens)
    assert torch.equal(o, REF.gated_delta_rule_multi(q, k, v, g, beta, pool[slots])[0])  # every token's output
    for i, n in enumerate(lens.tolist()):
        _, short = REF.gated_delta_rule_multi(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], g[i:i + 1, :n],
                                              beta[i:i + 1, :n], pool[slots[i:i + 1]])
        assert torch.equal(work[slots[i]], short[0])
    # the group commit's former masked replay (zero g and beta past lengths) gives the same bits
    keep = (torch.arange(5)[None] < lens[:, None])[..., None]
    _, masked = REF.gated_delta_rule_multi(q, k, v, torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0),
                                           pool[slots])
    assert torch.equal(work[slots], masked)
    # outputs only: the pool untouched
    again = pool.clone()
    assert torch.equal(ref.gated_delta_rule_pool(q, k, v, g, beta, again, slots, lens, write_back=False), o)
    assert torch.equal(again, pool)


def test_backends_on_cpu_are_the_reference_bit_for_bit() -> None:
    q, k, v, g, beta, pool, slots = inputs(2, 3, 2, 4, 16, 16, seed=5)
    lens = torch.tensor([1, 3])
    want_pool = pool.clone()
    want = ref.gated_delta_rule_pool(q, k, v, g, beta, want_pool, slots, lens)
    for be in (REF, CudaBackend()):
        work = pool.clone()
        assert torch.equal(be.gated_delta_rule_pool(q, k, v, g, beta, work, slots, lens), want)
        assert torch.equal(work, want_pool)
        assert be.gated_delta_rule_pool(q, k, v, g, beta, work, slots, lens, out=False) is None


# ----------------------------------------------------------------------------- validation
def test_validation_errors() -> None:
    q, k, v, g, beta, pool, slots = inputs(2, 3, 2, 4, 16, 16, seed=0)
    fns = (ref.gated_delta_rule_pool, pool_recurrent.gated_delta_rule_pool)
    bad = [
        ((q[0], k[0], v, g, beta, pool, slots), r"q and k must both be \[B, T, Hk, Dk\]"),
        ((q, k[:, :2], v, g, beta, pool, slots), "q and k must both be"),
        ((q, k, v[:1], g, beta, pool, slots), r"v must be \[B, T, Hv, Dv\]"),
        ((q, k, v[:, :, :3], g[..., :3], beta[..., :3], pool[:, :3], slots), r"Hv \(3\) must be a multiple of Hk"),
        ((q, k, v, g[:, :2], beta, pool, slots), r"g and beta must be \[B, T, Hv\]"),
        ((q, k, v, g, beta.unsqueeze(-1), pool, slots), "g and beta must be"),
        ((q, k, v, g, beta, pool[:, :, :8], slots), r"pool must be \[S, Hv, Dk, Dv\]"),
        ((q, k, v, g, beta, pool.half(), slots), "pool must be float32"),
        ((q, k, v, g, beta, pool, slots[:1]), r"slots must be int64 \[B\]"),
        ((q, k, v, g, beta, pool, slots.float()), "slots must be int64"),
        ((q, k, v, g, beta, pool, slots, torch.ones(2)), "lengths must be int64"),
        ((q, k, v, g, beta, pool, slots, torch.ones(3, dtype=torch.long)), "lengths must be int64"),
        ((q.int(), k, v, g, beta, pool, slots), "q must be a floating tensor"),
    ]
    for fn in fns:
        for args, match in bad:
            with pytest.raises(ValueError, match=match):
                fn(*args)
    kernel = pool_recurrent.gated_delta_rule_pool
    q2, k2, v2, g2, b2, p2, s2 = inputs(1, 17, 2, 4, 16, 16, seed=1)
    with pytest.raises(ValueError, match="T must be at most 16"):
        kernel(q2, k2, v2, g2, b2, p2, s2)
    q3, k3, v3, g3, b3, p3, s3 = inputs(1, 2, 2, 4, 24, 16, seed=1)
    with pytest.raises(ValueError, match="powers of two from 16 to 256"):
        kernel(q3, k3, v3, g3, b3, p3, s3)
    assert not pool_recurrent.supports(q3, v3, p3) and pool_recurrent.supports(q, v, pool)
    strided = torch.zeros(7, 4, 16, 32)[..., :16]
    with pytest.raises(ValueError, match="pool must be contiguous"):
        kernel(q, k, v, g, beta, strided, slots)
    with pytest.raises(ValueError, match="block_v"):
        kernel(q, k, v, g, beta, pool, slots, block_v=12)


# ----------------------------------------------------------------------------- CUDA
QWEN27B = dict(hk=16, hv=48, dk=128, dv=128)


def _gpu_case(t: int, dtype: torch.dtype, seed: int):
    q, k, v, g, beta, pool, slots = inputs(8, t, seed=seed, slots_total=20, dtype=dtype, device="cuda", **QWEN27B)
    gen = torch.Generator().manual_seed(seed + 1)
    lens = torch.randint(0, t + 1, (8,), generator=gen)
    lens[0], lens[-1] = 0, t
    return q, k, v, g, beta, pool, slots, lens.cuda()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gpu_qwen27b_shape_vs_reference_and_fla(t: int, dtype: torch.dtype) -> None:
    q, k, v, g, beta, pool, slots, lens = _gpu_case(t, dtype, seed=t)
    got_pool, want_pool = pool.clone(), pool.clone()
    o = pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, got_pool, slots, lens)
    want = ref.gated_delta_rule_pool(q, k, v, g, beta, want_pool, slots, lens)
    torch.testing.assert_close(o, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-4, atol=1e-4)
    others = torch.ones(pool.shape[0], dtype=torch.bool, device="cuda")
    others[slots] = False
    assert torch.equal(got_pool[others], pool[others])
    zero = slots[lens == 0]
    assert torch.equal(got_pool[zero], pool[zero])
    # through the backend, no lengths (a decode / full replay)
    bpool = pool.clone()
    ob = CudaBackend().gated_delta_rule_pool(q, k, v, g, beta, bpool, slots)
    _, rs = REF.gated_delta_rule_multi(q, k, v, g, beta, pool[slots])
    torch.testing.assert_close(ob, o)
    torch.testing.assert_close(bpool[slots], rs, rtol=1e-4, atol=1e-4)
    if fla_ops.available():
        fo, fs = fla_ops.gated_delta_rule_multi(q, k, v, g, beta, pool[slots])
        bound = 1e-4 if dtype == F32 else 5e-3  # fla's outputs come back in q's dtype
        assert _rel(ob, fo.float()) <= bound, _rel(ob, fo.float())
        assert _rel(bpool[slots], fs) <= 1e-4, _rel(bpool[slots], fs)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay() -> None:
    """Decode (T 1) and a verify step's commit (T 5, states only) captured in one graph; replays
    with new inputs and lengths give the eager results."""
    q, k, v, g, beta, pool, slots, lens = _gpu_case(5, BF16, seed=11)
    q1, k1, v1, g1, b1 = (x[:, :1].clone() for x in (q, k, v, g, beta))
    work = pool.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        pool_recurrent.gated_delta_rule_pool(q1, k1, v1, g1, b1, work, slots)
        pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, work, slots, lens, out=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o1 = pool_recurrent.gated_delta_rule_pool(q1, k1, v1, g1, b1, work, slots)
        pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, work, slots, lens, out=False)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        lens.copy_(torch.randint(0, 6, (8,), generator=gen))
        q1.copy_(torch.randn(q1.shape, generator=gen))
        work.copy_(pool)
        graph.replay()
        want_pool = pool.clone()
        want_o = ref.gated_delta_rule_pool(q1, k1, v1, g1, b1, want_pool, slots)
        ref.gated_delta_rule_pool(q, k, v, g, beta, want_pool, slots, lens, out=False)
        torch.testing.assert_close(o1, want_o, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(work, want_pool, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_timing(b: int) -> None:
    """Prints (``-s``) the kernel's time against the path it replaces (gather, fla, scatter)."""
    q, k, v, g, beta, pool, slots, lens = _gpu_case(5, BF16, seed=3)
    q, k, v, g, beta, slots, lens = (x[:b] for x in (q, k, v, g, beta, slots, lens))

    def bench(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 50 * 1000

    work = pool.clone()
    rows = [
        ("decode T=1", lambda: pool_recurrent.gated_delta_rule_pool(q[:, :1], k[:, :1], v[:, :1], g[:, :1],
                                                                     beta[:, :1], work, slots)),
        ("verify T=5 outputs", lambda: pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, work, slots,
                                                                             write_back=False)),
        ("commit T=5 states", lambda: pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, work, slots, lens,
                                                                            out=False)),
    ]
    if fla_ops.available():
        def fla_commit():
            keep = (torch.arange(5, device="cuda")[None] < lens[:, None])[..., None]
            _, s = fla_ops.gated_delta_rule_multi(q, k, v, torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0),
                                                  work.index_select(0, slots))
            work.index_copy_(0, slots, s)
        rows.append(("fla commit T=5 (where, gather, kernel, scatter)", fla_commit))
    for name, fn in rows:
        print(f"B={b} {name}: {bench(fn):.1f} us")


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
def test_self_check_passes_in_the_interpreter_and_catches_a_broken_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepwell.kernels.gdn import pool_recurrent

    assert pool_recurrent.self_check(2, 4, 16, 16, torch.float32, torch.device("cpu")) < 1e-4

    def broken(q, k, v, g, beta, pool, slots, lengths=None, out=True, write_back=True, **_):
        pool.mul_(2.0)  # writes every slot, the unnamed one too
        return torch.zeros(*v.shape, dtype=torch.float32)

    monkeypatch.setattr(pool_recurrent, "gated_delta_rule_pool", broken)
    assert pool_recurrent.self_check(2, 4, 16, 16, torch.float32, torch.device("cpu")) == float("inf")
