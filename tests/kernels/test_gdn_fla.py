"""Gated DeltaNet on fla-core (``kernels.gdn``, ``engine_service.layers.cuda_backend``) against
the reference ops (``ReferenceBackend``: the meaning).

Three tiers:

- CPU, always (fla not needed): the adapter logic with fla's four entry points replaced by
  reference maths written in fla's own conventions (``[B, T, H, D]`` / varlen ``[1, T, ...]``
  with ``cu_seqlens``, explicit ``scale`` and ``use_qk_l2norm_in_kernel``, grouped value heads,
  conv state ``[N, C, K]`` whose column 0 is never read): varlen packing and ``cu_seqlens``,
  state gather / scatter by slot, chunk vs recurrent dispatch, the conv-state layout, a whole
  GDN layer step (prefill slices + a decode group) through ``CudaBackend`` == the reference,
  the CPU fallbacks (bit-identical), and the runner's backend choice.
- CPU with fla installed (``TRITON_INTERPRET=1``, tiny sizes): fla's fused recurrent kernel
  (varlen prefill and batched decode) and its causal conv (prefill and update) run in the
  Triton interpreter against the reference, fp32, within 1e-5. fla's chunked kernels do not
  run in the interpreter (``chunk_delta_h`` calls ``.to()`` on a Python loop index), so the
  chunked path is checked on the GPU only. Skipped without fla.
- CUDA (``-m gpu``, fla required): fla vs the reference (fp32 and bf16, varlen with initial
  states, GQA, real head sizes), and a tiny qwen3_5 through ``build_runner`` with backend
  "cuda" vs "reference" (prefill, chunks, decode, a mixed batch).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepwell.engine_service.layers import cuda_backend
from deepwell.engine_service.layers.backend import ReferenceBackend, get_backend
from deepwell.engine_service.layers.cuda_backend import CudaBackend, default_backend
from deepwell.kernels.gdn import fla_ops

REF = ReferenceBackend()
ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
HAS_FLA = fla_ops.available()
# GPU tests need fla too (on CPU the ``gpu`` marker already skips them, with its own reason)
needs_fla = pytest.mark.skipif(HAS_CUDA and not HAS_FLA, reason="fla-core not installed (pip install deepwell[cuda])")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gdn_inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, n: int = 1, seed: int = 0,
               device: str = "cpu", dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=g)
    k = torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    gate = -F.softplus(torch.randn(t, hv, generator=g))
    beta = torch.sigmoid(torch.randn(t, hv, generator=g))
    s0 = torch.randn(n, hv, dk, dv, generator=g) * 0.1
    act = [x.to(device, dtype) for x in (q, k, v)]
    return (*act, gate.to(device), beta.to(device, dtype), s0.to(device))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (the GPU tests' metric: rounding spread over many elements)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- fake fla
class FakeFla:
    """fla's four entry points, written from fla's documented conventions with plain torch
    (token loops, independent of the reference's formulation), recording every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def entry_points(self) -> fla_ops.FlaEntryPoints:
        return fla_ops.FlaEntryPoints(self.chunk, self.recurrent, self.conv, self.conv_update)

    def _gdn(self, name, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kw):
        self.calls.append((name, dict(q_shape=tuple(q.shape), scale=scale, l2norm=use_qk_l2norm_in_kernel,
                                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist(),
                                      cu_seqlens_cpu=cu_seqlens_cpu, final=output_final_state, **kw)))
        b, t, h, dk = q.shape
        hv, dv = v.shape[2], v.shape[3]
        if cu_seqlens is not None:
            assert b == 1
            bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
            qs, ks, vs, gs, bs = q[0], k[0], v[0], g[0], beta[0]
        else:
            bounds = [(i * t, i * t + t) for i in range(b)]
            qs, ks, vs, gs, bs = (x.flatten(0, 1) for x in (q, k, v, g, beta))
        scale = dk ** -0.5 if scale is None else scale
        o = torch.zeros(qs.shape[0], hv, dv)
        finals = []
        for n, (lo, hi) in enumerate(bounds):
            for i_hv in range(hv):
                i_h = i_hv // (hv // h)  # GVA: fla's head mapping
                s = torch.zeros(dk, dv) if initial_state is None else initial_state[n, i_hv].double()
                s = s.double()
                for tt in range(lo, hi):
                    qt, kt = qs[tt, i_h].double(), ks[tt, i_h].double()
                    if use_qk_l2norm_in_kernel:
                        qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                        kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                    s = s * math.exp(float(gs[tt, i_hv]))
                    delta = float(bs[tt, i_hv]) * (vs[tt, i_hv].double() - kt @ s)
                    s = s + torch.outer(kt, delta)
                    o[tt, i_hv] = ((qt * scale) @ s).float()
                finals.append(s.float())
        final = torch.stack(finals).view(len(bounds), hv, dk, dv) if output_final_state else None
        o = o.to(q.dtype).view(1, -1, hv, dv) if cu_seqlens is not None else o.to(q.dtype).view(b, t, hv, dv)
        return o, final

    def chunk(self, *args, **kwargs):
        return self._gdn("chunk", *args, **kwargs)

    def recurrent(self, *args, **kwargs):
        return self._gdn("recurrent", *args, **kwargs)

    def conv(self, x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
             activation=None, cu_seqlens=None, cu_seqlens_cpu=None, **kw):
        self.calls.append(("conv", dict(x_shape=tuple(x.shape), activation=activation,
                                        cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist())))
        d, w = weight.shape
        assert initial_state is None or tuple(initial_state.shape[1:]) == (d, w)  # fla keeps K columns
        bounds = ([(0, x.shape[1])] if cu_seqlens is None else
                  list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())))
        xs = x[0].double()
        y = torch.empty_like(xs)
        finals = []
        for n, (lo, hi) in enumerate(bounds):
            init = torch.zeros(d, w, dtype=torch.float64) if initial_state is None else initial_state[n].double()
            hist = torch.cat([init[:, 1:], xs[lo:hi].t()], dim=1)  # column 0 is never read
            for tt in range(hi - lo):
                y[lo + tt] = (hist[:, tt : tt + w] * weight.double()).sum(-1)
            finals.append(torch.cat([init, xs[lo:hi].t()], dim=1)[:, -w:])
        if activation == "silu":
            y = F.silu(y)
        final = torch.stack(finals).to(x.dtype) if output_final_state else None
        return y.to(x.dtype).unsqueeze(0), final

    def conv_update(self, x, cache, residual=None, weight=None, bias=None, activation=None):
        self.calls.append(("conv_update", dict(x_shape=tuple(x.shape), cache_shape=tuple(cache.shape))))
        full = torch.cat([cache[..., 1:].double(), x.double().unsqueeze(-1)], dim=-1)  # reads columns 1..K-1
        y = (full * weight.double()).sum(-1)
        if activation == "silu":
            y = F.silu(y)
        cache.copy_(full.to(cache.dtype))
        return y.to(x.dtype), cache


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFla:
    """fla's entry points replaced by ``FakeFla``; ``CudaBackend`` takes its fla path on CPU."""
    f = FakeFla()
    monkeypatch.setattr(fla_ops, "_load", f.entry_points)
    monkeypatch.setattr(CudaBackend, "_fla", staticmethod(lambda *tensors: True))
    return f


# ----------------------------------------------------------------------------- CPU: layout helpers
def test_cu_seqlens_and_packed_rows() -> None:
    cu, host = fla_ops.cu_seqlens_from_lengths([3, 1, 5], "cpu")
    assert cu.tolist() == host.tolist() == [0, 3, 4, 9] and cu.dtype == torch.long
    # slices at batch offsets 4 (3 tokens) and 0 (2 tokens), a decode row (3) between them
    rows = fla_ops.packed_rows([4, 0], [3, 2], "cpu")
    assert rows.tolist() == [4, 5, 6, 0, 1]
    with pytest.raises(ValueError, match=">= 1 token"):
        fla_ops.cu_seqlens_from_lengths([2, 0], "cpu")


def test_gather_and_scatter_states_by_slot() -> None:
    pool = torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 3)
    before = pool.clone()
    slots = torch.tensor([3, 0])
    got = fla_ops.gather_states(pool, slots)
    assert torch.equal(got, before[[3, 0]])
    got.add_(100)  # a copy: the pool is untouched until the scatter
    assert torch.equal(pool, before)
    fla_ops.scatter_states(pool, slots, got)
    assert torch.equal(pool[[3, 0]], before[[3, 0]] + 100)
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


# ----------------------------------------------------------------------------- CPU: adapter vs reference (fake fla)
def test_fake_fla_is_the_reference() -> None:
    """The substitute itself agrees with the reference (so the tests below test the adapter)."""
    f = FakeFla()
    q, k, v, g, beta, s0 = gdn_inputs(9, seed=1)
    o, s = f.chunk(q[None], k[None], v[None], g=g[None], beta=beta[None], scale=16 ** -0.5, initial_state=s0,
                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    ro, rs = REF.gated_delta_rule(q, k, v, g, beta, s0[0])
    torch.testing.assert_close(o[0], ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s[0], rs, rtol=1e-4, atol=1e-5)
    o, _ = f.chunk(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=s0, output_final_state=True)
    assert rel_err(o[0], ro) > 1e-2  # without the in-kernel l2norm the result differs


@pytest.mark.parametrize("lengths", [[5, 70, 2], [1, 64], [130]])
def test_varlen_gdn_packs_and_scatters_states_by_slot(fake: FakeFla, lengths: list[int]) -> None:
    t = sum(lengths)
    q, k, v, g, beta, _ = gdn_inputs(t, seed=len(lengths))
    pool = torch.randn(6, 4, 16, 8, generator=torch.Generator().manual_seed(9)) * 0.1
    before = pool.clone()
    slots = torch.tensor([5, 0, 3][: len(lengths)])
    o = CudaBackend().gated_delta_rule_varlen(q, k, v, g, beta, lengths, pool, slots)
    name, call = fake.calls[-1]
    assert name == "chunk" and call["cu_seqlens"] == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert call["q_shape"] == (1, t, 2, 16) and call["cu_seqlens_cpu"] is not None
    assert call["scale"] == pytest.approx(16 ** -0.5) and call["l2norm"] and call["final"]
    assert o.dtype == torch.float32 and o.shape == (t, 4, 8)
    lo = 0
    for i, n in enumerate(lengths):
        ro, rs = REF.gated_delta_rule(q[lo : lo + n], k[lo : lo + n], v[lo : lo + n], g[lo : lo + n],
                                      beta[lo : lo + n], before[slots[i]])
        torch.testing.assert_close(o[lo : lo + n], ro, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool[slots[i]], rs, rtol=1e-4, atol=1e-5)
        lo += n
    others = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(pool[others], before[others])


def test_single_sequence_dispatch_chunk_vs_recurrent(fake: FakeFla) -> None:
    be = CudaBackend()
    for t, want in [(1, "recurrent"), (2, "chunk"), (100, "chunk")]:
        q, k, v, g, beta, s0 = gdn_inputs(t, seed=t)
        o, s = be.gated_delta_rule(q, k, v, g, beta, s0[0])
        name, call = fake.calls[-1]
        assert name == want and call["cu_seqlens"] is None and call["q_shape"] == (1, t, 2, 16)
        assert call["scale"] == pytest.approx(16 ** -0.5) and call["l2norm"]
        ro, rs = REF.gated_delta_rule(q, k, v, g, beta, s0[0])
        assert o.dtype == s.dtype == torch.float32 and s.shape == s0[0].shape
        torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-5)


def test_batched_decode_uses_the_recurrent_kernel_in_batch_form(fake: FakeFla) -> None:
    q, k, v, g, beta, _ = gdn_inputs(3, seed=12)
    states = torch.randn(3, 4, 16, 8, generator=torch.Generator().manual_seed(3)) * 0.1
    o, s = CudaBackend().gated_delta_rule_decode(q, k, v, g, beta, states)
    name, call = fake.calls[-1]
    assert name == "recurrent" and call["q_shape"] == (3, 1, 2, 16) and call["cu_seqlens"] is None
    assert call["scale"] == pytest.approx(16 ** -0.5) and call["l2norm"]
    ro, rs = REF.gated_delta_rule_decode(q, k, v, g, beta, states)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-5)


def test_conv_state_layout_prefill_and_decode(fake: FakeFla) -> None:
    gen = torch.Generator().manual_seed(4)
    c, kw = 12, 4
    w = torch.randn(c, kw, generator=gen)
    x = torch.randn(20, c, generator=gen)
    state = torch.randn(c, kw - 1, generator=gen)
    be = CudaBackend()
    parts, st, rst = [], state, state
    for lo, hi in [(0, 2), (2, 3), (3, 11), (11, 20)]:  # chunks shorter and longer than K-1
        y, st = be.causal_conv1d(x[lo:hi], st, w)
        ry, rst = REF.causal_conv1d(x[lo:hi], rst, w)
        torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st, rst)
        assert st.shape == (c, kw - 1)
        parts.append(y)
    # fla's conv alone, the SiLU after it: the reference's two roundings
    assert fake.calls[0][0] == "conv" and fake.calls[0][1]["activation"] is None
    # decode: 3 sequences, their own states
    xs, states = torch.randn(3, c, generator=gen), torch.randn(3, c, kw - 1, generator=gen)
    y, new = be.causal_conv1d_decode(xs, states.clone(), w)
    ry, rnew = REF.causal_conv1d_decode(xs, states, w)
    assert fake.calls[-1] == ("conv_update", dict(x_shape=(3, c), cache_shape=(3, c, kw)))
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new, rnew)


def test_bf16_conv_rounds_before_and_after_the_silu(fake: FakeFla) -> None:
    """The prefill conv in bf16 is rounded, then its SiLU is: the reference's (and HF's)
    rounding points, not fla's fused SiLU with one rounding."""
    gen = torch.Generator().manual_seed(9)
    c, kw = 64, 4
    w = torch.randn(c, kw, generator=gen).bfloat16()
    x = torch.randn(40, c, generator=gen).bfloat16()
    state = torch.randn(c, kw - 1, generator=gen).bfloat16()
    y, _ = CudaBackend().causal_conv1d(x, state, w)
    conv, _ = fake.conv(x.unsqueeze(0), weight=w, initial_state=F.pad(state, (1, 0)).unsqueeze(0))
    fused, _ = fake.conv(x.unsqueeze(0), weight=w, initial_state=F.pad(state, (1, 0)).unsqueeze(0), activation="silu")
    assert torch.equal(y, F.silu(conv[0]))
    assert not torch.equal(y, fused[0])  # one rounding fewer is a different bf16 result here


def test_conv_varlen_reads_and_writes_its_slots(fake: FakeFla) -> None:
    gen = torch.Generator().manual_seed(5)
    c, kw, lengths = 10, 4, [2, 7, 1]
    w = torch.randn(c, kw, generator=gen)
    x = torch.randn(sum(lengths), c, generator=gen)
    pool = torch.randn(4, c, kw - 1, generator=gen)
    before = pool.clone()
    slots = torch.tensor([2, 0, 3])
    y = CudaBackend().causal_conv1d_varlen(x, lengths, pool, slots, w)
    assert fake.calls[-1][1]["cu_seqlens"] == [0, 2, 9, 10]
    lo = 0
    for i, n in enumerate(lengths):
        ry, rs = REF.causal_conv1d(x[lo : lo + n], before[slots[i]], w)
        torch.testing.assert_close(y[lo : lo + n], ry, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pool[slots[i]], rs)
        lo += n
    assert torch.equal(pool[1], before[1])


def _layer_step(backend, seed: int = 0, device: str = "cpu"):
    """One GDN layer step over a batch of two prefill slices and two decode rows (interleaved),
    states in a pool of 5 slots: returns (output, conv pool, recurrent pool)."""
    from deepwell.engine_service.layers.context import DecodeGroup, SeqInfo, StepContext
    from deepwell.engine_service.layers.gdn import GatedDeltaNet, GDNSpec

    spec = GDNSpec(hidden=32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel=4)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(spec, backend)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    layer.A_log.data.uniform_(-1, 0.5)
    gen = torch.Generator().manual_seed(seed + 1)
    conv = torch.randn(5, spec.conv_dim, 3, generator=gen)
    rec = torch.randn(5, 4, 16, 16, generator=gen) * 0.1
    # rows: [decode slot 4] [prefill slot 1: 9 tokens] [decode slot 0] [prefill slot 3: 70 tokens]
    x = torch.randn(1 + 9 + 1 + 70, 32, generator=gen)
    multi = (SeqInfo(1, 9, 5, 1, None), SeqInfo(11, 70, 0, 3, None))
    singles = (SeqInfo(0, 1, 12, 4, None), SeqInfo(10, 1, 3, 0, None))
    ctx = StepContext(
        positions=torch.zeros(x.shape[0], dtype=torch.long, device=device), kv_slots=None,
        seqs=(singles[0], multi[0], singles[1], multi[1]), multi=multi,
        decode=DecodeGroup(rows=torch.tensor([0, 10], device=device), state_slots=torch.tensor([4, 0], device=device),
                           token_index=None, lengths=None),
    )
    layer, x, conv, rec = layer.to(device), x.to(device), conv.to(device), rec.to(device)
    with torch.no_grad():
        out = layer(x, ctx, conv, rec)
    return out, conv, rec


def test_gdn_layer_step_through_cuda_backend_equals_reference(fake: FakeFla) -> None:
    out, conv, rec = _layer_step(CudaBackend())
    names = [n for n, _ in fake.calls]
    assert names.count("chunk") == 2 and names.count("conv") == 2 and "conv_update" in names
    assert names.count("recurrent") == 1  # the decode group, batched
    rout, rconv, rrec = _layer_step(ReferenceBackend())
    torch.testing.assert_close(out, rout, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(conv, rconv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec, rrec, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv[2], rconv[2]) and torch.equal(rec[2], rrec[2])  # slot 2 unused


# ----------------------------------------------------------------------------- CPU: fallbacks and selection
def test_cpu_tensors_take_the_reference_bit_for_bit() -> None:
    be = get_backend("cuda")
    assert isinstance(be, CudaBackend) and be.name == "cuda"
    q, k, v, g, beta, s0 = gdn_inputs(70, seed=2)
    for a, b in zip(be.gated_delta_rule(q, k, v, g, beta, s0[0]), REF.gated_delta_rule(q, k, v, g, beta, s0[0])):
        assert torch.equal(a, b)
    states = s0.expand(3, -1, -1, -1).contiguous()
    args = (q[:3], k[:3], v[:3], g[:3], beta[:3], states)
    for a, b in zip(be.gated_delta_rule_decode(*args), REF.gated_delta_rule_decode(*args)):
        assert torch.equal(a, b)
    w, x, st = torch.randn(6, 4), torch.randn(5, 6), torch.randn(6, 3)
    for a, b in zip(be.causal_conv1d(x, st, w), REF.causal_conv1d(x, st, w)):
        assert torch.equal(a, b)
    for a, b in zip(be.causal_conv1d_decode(x[:2], st.expand(2, -1, -1), w),
                    REF.causal_conv1d_decode(x[:2], st.expand(2, -1, -1), w)):
        assert torch.equal(a, b)
    # the varlen ops loop over the reference on CPU
    pool = s0.expand(4, -1, -1, -1).contiguous()
    o = be.gated_delta_rule_varlen(q, k, v, g, beta, [30, 40], pool, torch.tensor([2, 1]))
    ro, rs = REF.gated_delta_rule(q[30:], k[30:], v[30:], g[30:], beta[30:], s0[0])
    assert torch.equal(o[30:], ro) and torch.equal(pool[1], rs) and torch.equal(pool[0], s0[0])


def test_default_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_backend("cpu") == ("reference", "cpu device")
    monkeypatch.setattr(fla_ops, "available", lambda: False)
    monkeypatch.setattr(fla_ops, "import_error", lambda: "ModuleNotFoundError: No module named 'fla'")
    name, why = default_backend(torch.device("cuda"))
    assert name == "cuda" and "fla-core not importable" in why and "deepwell[cuda]" in why
    monkeypatch.setattr(fla_ops, "available", lambda: True)
    assert default_backend("cuda:0")[0] == "cuda"
    assert cuda_backend.default_backend("cpu")[0] == "reference"  # never fla on CPU


def test_engine_imports_without_touching_fla() -> None:
    """fla is imported on first use on CUDA only: the engine, its runner and the CUDA backend
    import (and build on CPU) without it, whether or not it is installed."""
    code = ("import sys, engine_service.runner, engine_service.layers.cuda_backend, kernels.gdn; "
            "assert not any(m == 'fla' or m.startswith('fla.') for m in sys.modules), 'fla imported'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_build_runner_backend_on_cpu(tmp_path: Path) -> None:
    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import build_runner
    from tests.engine.helpers_models import prompt, run_chunks, save_tiny

    save_tiny("qwen3_5", tmp_path)
    auto = build_runner(open_model(tmp_path), page_size=16)
    assert auto.ops.name == "reference"  # CPU: never "cuda" unless named
    named = build_runner(open_model(tmp_path), page_size=16, backend="cuda")
    assert isinstance(named.ops, CudaBackend)
    ids = prompt(20)
    outs = []
    for r in (auto, named):
        r.allocate(num_pages=4, num_state_slots=1)
        r.reset_state(0)
        outs.append(torch.stack(run_chunks(r, ids, [12, 1, 7], [0, 1], slot=0)))
    assert torch.equal(outs[0], outs[1])  # CPU tensors: the reference ops, bit for bit
    with pytest.raises(ValueError, match="unknown layer backend"):
        build_runner(open_model(tmp_path), backend="nope")


# ----------------------------------------------------------------------------- CPU + fla: Triton interpreter
interp = pytest.mark.skipif(HAS_CUDA or not HAS_FLA,
                            reason="Triton-interpreter tier: needs fla-core installed and no CUDA")


@pytest.fixture
def no_autotune_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter has no driver to benchmark autotune configs: every config times 0, so
    the first is taken (the conv kernels autotune; the results do not depend on the config)."""
    import triton.runtime.autotuner as autotuner

    monkeypatch.setattr(autotuner.Autotuner, "do_bench",
                        property(lambda self: (lambda fn, quantiles=None: [0.0, 0.0, 0.0])))


@interp
@pytest.mark.parametrize("lengths", [[1], [5, 1, 9]])
def test_interpreter_fused_recurrent_varlen(lengths: list[int]) -> None:
    t, n = sum(lengths), len(lengths)
    q, k, v, g, beta, s0 = gdn_inputs(t, n=n, seed=t)
    cu, host = fla_ops.cu_seqlens_from_lengths(lengths, "cpu")
    o, final = fla_ops.gated_delta_rule_varlen(q, k, v, g, beta, s0, cu, host, chunked=False)
    assert final.dtype == torch.float32
    lo = 0
    for i, m in enumerate(lengths):
        ro, rs = REF.gated_delta_rule(q[lo : lo + m], k[lo : lo + m], v[lo : lo + m], g[lo : lo + m],
                                      beta[lo : lo + m], s0[i])
        torch.testing.assert_close(o[lo : lo + m].float(), ro, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[i], rs, rtol=1e-5, atol=1e-5)
        lo += m


@interp
def test_interpreter_fused_recurrent_multi() -> None:
    """B sequences of T tokens (speculative verify and its commit) in one call: the reference's
    decode op token by token."""
    b, t = 2, 3
    q, k, v, g, beta, s0 = gdn_inputs(b * t, n=b, seed=11)
    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(b, t, *x.shape[1:])
    o, s = fla_ops.gated_delta_rule_multi(split(q), split(k), split(v), split(g), split(beta), s0)
    ro, rs = REF.gated_delta_rule_multi(split(q), split(k), split(v), split(g), split(beta), s0)
    torch.testing.assert_close(o.float(), ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-5)
    # the group commit's masking: a zero gate and beta past token 1 leave the state after token 1
    keep = (torch.arange(t) < 1)[None, :, None]
    _, masked = fla_ops.gated_delta_rule_multi(split(q), split(k), split(v), torch.where(keep, split(g), 0.0),
                                               torch.where(keep, split(beta), 0.0), s0)
    _, short = fla_ops.gated_delta_rule_multi(split(q)[:, :1], split(k)[:, :1], split(v)[:, :1], split(g)[:, :1],
                                              split(beta)[:, :1], s0)
    torch.testing.assert_close(masked, short, rtol=0, atol=0)


@interp
def test_interpreter_fused_recurrent_decode() -> None:
    q, k, v, g, beta, s0 = gdn_inputs(3, n=3, seed=7)
    o, s = fla_ops.gated_delta_rule_decode(q, k, v, g, beta, s0)
    ro, rs = REF.gated_delta_rule_decode(q, k, v, g, beta, s0)
    torch.testing.assert_close(o.float(), ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-5)


@interp
def test_interpreter_causal_conv(no_autotune_bench: None) -> None:
    gen = torch.Generator().manual_seed(8)
    c, kw, lengths = 12, 4, [2, 9]
    w = torch.randn(c, kw, generator=gen)
    x = torch.randn(sum(lengths), c, generator=gen)
    states = torch.randn(2, c, kw - 1, generator=gen)
    cu, host = fla_ops.cu_seqlens_from_lengths(lengths, "cpu")
    y, new = fla_ops.causal_conv1d_varlen(x, states, w, cu, host)
    lo = 0
    for i, n in enumerate(lengths):
        ry, rs = REF.causal_conv1d(x[lo : lo + n], states[i], w)
        torch.testing.assert_close(y[lo : lo + n], ry, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new[i], rs)
        lo += n
    y, new = fla_ops.causal_conv1d_decode(x[:2], states, w)
    ry, rs = REF.causal_conv1d_decode(x[:2], states, w)
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, rs)


# ----------------------------------------------------------------------------- CUDA: fla vs reference
# (Hk, Hv, Dk, Dv): GQA as in the tiny models (2 and 4 value heads per key head: the tiny
# qwen3_5_linear has 1 key head for 4 value heads), and Qwen3.5 / Qwen3-Next sized heads
GPU_SHAPES = [(2, 4, 16, 16), (1, 4, 16, 16), (4, 8, 64, 64), (16, 32, 128, 128)]
# ||fla - ref|| / ||ref|| allowed (estimates, not yet measured on a GPU): fp32 inputs go
# through TF32 tensor-core products in fla's chunked kernels; with bf16 activations fla also
# keeps its chunk intermediates (per-chunk states, corrected values) in bf16, while the
# reference computes in fp32 from the same bf16 values. The final state is fp32 in both.
TOL = {torch.float32: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("lengths", [[300], [37, 1, 64, 130]])
@pytest.mark.gpu
@needs_fla
def test_gpu_chunked_varlen_with_initial_states(lengths, shape, dtype) -> None:
    hk, hv, dk, dv = shape
    t, n = sum(lengths), len(lengths)
    q, k, v, g, beta, s0 = gdn_inputs(t, hk, hv, dk, dv, n=n, seed=t + dk, device="cuda", dtype=dtype)
    pool = torch.zeros(n + 2, hv, dk, dv, device="cuda")
    slots = torch.arange(n, device="cuda").flip(0) + 1  # slots n..1, slot 0 and n+1 untouched
    pool[slots] = s0
    o = CudaBackend().gated_delta_rule_varlen(q, k, v, g, beta, lengths, pool, slots)
    assert o.dtype == torch.float32
    lo, errs = 0, []
    for i, m in enumerate(lengths):
        r = slice(lo, lo + m)
        ro, rs = REF.gated_delta_rule(q[r], k[r], v[r], g[r], beta[r], s0[i])
        errs.append((rel_l2(o[r], ro), rel_l2(pool[slots[i]], rs)))
        lo += m
    print(f"{lengths} {shape} {dtype}: (o, state) rel err {errs}")
    assert max(max(e) for e in errs) <= TOL[dtype], errs
    assert not pool[0].any() and not pool[n + 1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.gpu
@needs_fla
def test_gpu_single_sequence_and_decode(shape, dtype) -> None:
    hk, hv, dk, dv = shape
    be = CudaBackend()
    for t in (1, 2, 65):
        q, k, v, g, beta, s0 = gdn_inputs(t, hk, hv, dk, dv, seed=t, device="cuda", dtype=dtype)
        o, s = be.gated_delta_rule(q, k, v, g, beta, s0[0])
        ro, rs = REF.gated_delta_rule(q, k, v, g, beta, s0[0])
        assert o.dtype == s.dtype == torch.float32
        assert rel_l2(o, ro) <= TOL[dtype] and rel_l2(s, rs) <= TOL[dtype], (t, rel_l2(o, ro), rel_l2(s, rs))
    q, k, v, g, beta, s0 = gdn_inputs(7, hk, hv, dk, dv, n=7, seed=3, device="cuda", dtype=dtype)
    o, s = be.gated_delta_rule_decode(q, k, v, g, beta, s0)
    ro, rs = REF.gated_delta_rule_decode(q, k, v, g, beta, s0)
    print(f"decode {shape} {dtype}: rel err o {rel_l2(o, ro):.2e} state {rel_l2(s, rs):.2e}")
    assert rel_l2(o, ro) <= TOL[dtype] and rel_l2(s, rs) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@needs_fla
def test_gpu_causal_conv(dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    be = CudaBackend()
    c, kw, lengths = 2 * 2 * 128 + 4 * 128, 4, [1, 2, 3, 70, 300]
    w = (torch.randn(c, kw, generator=gen) * 0.5).to("cuda", dtype)
    x = torch.randn(sum(lengths), c, generator=gen).to("cuda", dtype)
    pool = torch.randn(len(lengths) + 1, c, kw - 1, generator=gen).to("cuda", dtype)
    before = pool.clone()
    slots = torch.arange(1, len(lengths) + 1, device="cuda")
    y = be.causal_conv1d_varlen(x, lengths, pool, slots, w)
    singles = [be.causal_conv1d(x[a:b], before[slots[i]], w) for i, (a, b) in enumerate(_bounds(lengths))]
    y_dec, new_dec = be.causal_conv1d_decode(x[:5], before[1:], w)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # the reference conv in true fp32
        refs = [REF.causal_conv1d(x[a:b], before[slots[i]], w) for i, (a, b) in enumerate(_bounds(lengths))]
        ry_dec, rnew_dec = REF.causal_conv1d_decode(x[:5], before[1:], w)
    # prefill: fla's conv (fp32 accumulation) rounded, then SiLU rounded, as the reference;
    # decode: fla's update kernel, SiLU in fp32 and one rounding
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for i, (a, b) in enumerate(_bounds(lengths)):
        ry, rs = refs[i]
        torch.testing.assert_close(y[a:b], ry, **tol)
        assert torch.equal(pool[slots[i]], rs)  # the state is the inputs themselves: exact
        torch.testing.assert_close(singles[i][0], ry, **tol)
        assert torch.equal(singles[i][1], rs)
    assert torch.equal(pool[0], before[0])
    torch.testing.assert_close(y_dec, ry_dec, **tol)
    assert torch.equal(new_dec, rnew_dec)


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [(e - n, e) for e, n in zip(ends, lengths)]


@pytest.mark.gpu
@needs_fla
def test_gpu_cuda_backend_routes_to_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    fla = fla_ops.entry_points()
    called: list[str] = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            called.append(name)
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(fla_ops, "_load", lambda: fla_ops.FlaEntryPoints(
        spy("chunk", fla.chunk_gated_delta_rule), spy("recurrent", fla.fused_recurrent_gated_delta_rule),
        spy("conv", fla.causal_conv1d), spy("conv_update", fla.causal_conv1d_update)))
    out, conv, rec = _layer_step_cuda()
    assert called.count("chunk") == 2 and called.count("conv") == 2
    # the decode group's recurrence and conv run on the state pool in place (kernels.gdn.pool_recurrent,
    # pool_conv), not fla's
    assert called.count("recurrent") == 0 and called.count("conv_update") == 0
    rout, rconv, rrec = _layer_step_cuda(ReferenceBackend())
    assert rel_l2(out, rout) <= 5e-3 and rel_l2(rec, rrec) <= 5e-3, (rel_l2(out, rout), rel_l2(rec, rrec))
    torch.testing.assert_close(conv, rconv, rtol=0, atol=0)


def _layer_step_cuda(backend=None):
    return _layer_step(backend or CudaBackend(), device="cuda")


def _tiny_logits(path: Path, backend: str, dtype: torch.dtype) -> torch.Tensor:
    """Logits of a tiny qwen3_5 on CUDA: one prompt as one prefill, as chunks of 7 and token by
    token, then a mixed step (one sequence decodes while another prefills 40 tokens)."""
    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import build_runner
    from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice
    from tests.engine.helpers_models import prompt, run_chunks

    r = build_runner(open_model(path), device="cuda", dtype=dtype, page_size=16, backend=backend)
    assert r.ops.name == backend
    ids, other = prompt(64), prompt(40, seed=9)
    r.allocate(num_pages=16, num_state_slots=3)
    out = []
    for chunks in ([64], [7] * 9 + [1], [1] * 16):
        r.reset_state(1)
        out += run_chunks(r, ids[: sum(chunks)], chunks, [7, 2, 9, 4, 0], slot=1)
    r.reset_state(2)
    batch = ForwardBatch(torch.tensor([ids[16]] + other, device="cuda"),
                         [SeqSlice(1, [7, 2, 9, 4, 0], 16, 1), SeqSlice(2, [10, 11, 12], 0, 40)])
    out += list(r.forward(batch))
    return torch.stack(out).float()


@pytest.mark.gpu
@needs_fla
def test_gpu_tiny_qwen35_cuda_backend_equals_reference(tmp_path: Path) -> None:
    """fp32: the "cuda" backend's logits == the reference's within TF32 rounding. bf16: both
    against the reference in fp32, the "cuda" backend's error at most twice the reference's
    own bf16 error (bf16 logits of a tiny random model differ by a few % from ulp flips alone)."""
    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import build_runner
    from tests.engine.helpers_models import save_tiny

    save_tiny("qwen3_5", tmp_path)
    assert build_runner(open_model(tmp_path), device="cuda").ops.name == "cuda"  # the default on CUDA
    ref32 = _tiny_logits(tmp_path, "reference", torch.float32)
    fla32 = _tiny_logits(tmp_path, "cuda", torch.float32)
    ref16 = _tiny_logits(tmp_path, "reference", torch.bfloat16)
    fla16 = _tiny_logits(tmp_path, "cuda", torch.bfloat16)
    e32, e16_fla, e16_ref = rel_l2(fla32, ref32), rel_l2(fla16, ref32), rel_l2(ref16, ref32)
    top1 = (fla16.argmax(-1) == ref16.argmax(-1)).float().mean().item()
    print(f"tiny qwen3_5: fp32 cuda vs reference {e32:.2e}; bf16 vs fp32 reference: cuda {e16_fla:.2e}, "
          f"reference {e16_ref:.2e}; bf16 top-1 cuda == reference {top1:.3f}")
    assert e32 <= 5e-3, e32
    assert e16_fla <= 2 * e16_ref + 1e-3, (e16_fla, e16_ref)
