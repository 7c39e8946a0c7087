"""Fused elementwise ops (``kernels.fused``): the references are the engine's layer code bit for
bit, and each Triton kernel matches its reference (interpreter on CPU at small sizes, the
compiled kernels at small and real Qwen3.5-27B sizes on a GPU); the compiled kernels also build
offline for sm_90 (Triton's bundled ptxas), so CI without a GPU compiles the GPU code paths.

Tolerances, in units in the last place of the result dtype (``_ulps``): rope and the residual
sum are bit-identical; elsewhere a 16-bit result is within 2 ulps and >= 99% of its elements
are bit-identical (an fp32 exp or square sum an ulp off flips a rounding now and then), an fp32
result within 8 ulps (``FP32_ULPS``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deepwell.engine_service.layers.attention import Attention, AttentionSpec
from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.context import SeqInfo, StepContext
from deepwell.engine_service.layers.gdn import GatedDeltaNet, GDNSpec
from deepwell.engine_service.layers.mlp import SwiGLU
from deepwell.engine_service.layers.rope import RopeSpec, RotaryEmbedding, apply_rope
from deepwell.kernels.fused import FusedOps, references as ref
from deepwell.kernels.fused import activation, gdn, norm, rotary
from tests.kernels.offline import has_ptxas, run_offline_build

DEV = "cuda" if torch.cuda.is_available() else "cpu"
kernel_runs = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs the Triton interpreter (CPU) or a GPU")
FP32_ULPS = 8
LEADING = [(1,), (7,), (2, 3)]
DTYPES = [torch.float32, torch.bfloat16]


class Ops(FusedOps):
    fused_on_cpu = True


def _rand(shape, dtype, gen, scale=1.0, device=DEV) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in representable values of ``a``'s dtype (both the same dtype and shape)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    it, lo = (torch.int32, -(1 << 31)) if a.dtype == torch.float32 else (torch.int16, -(1 << 15))
    ia, ib = (t.contiguous().view(it).long() for t in (a, b))
    ia, ib = (torch.where(i < 0, lo - i, i) for i in (ia, ib))
    return (ia - ib).abs()


def assert_close(got: torch.Tensor, want: torch.Tensor, exact: bool = False) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if got.numel() == 0:
        return
    d = _ulps(got, want)
    if exact:
        assert int(d.max()) == 0, f"{int((d > 0).sum())} of {d.numel()} elements differ"
    elif got.dtype == torch.float32:
        assert int(d.max()) <= FP32_ULPS, f"max {int(d.max())} ulps"
    else:
        assert int(d.max()) <= 2, f"max {int(d.max())} ulps"
        assert float((d == 0).float().mean()) >= 0.99, f"{int((d > 0).sum())} of {d.numel()} differ"


# -- the references are the engine's code ------------------------------------------------------

@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                          (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_norm_references_are_the_reference_backend(dtype, wdtype):
    gen = torch.Generator().manual_seed(0)
    x, h, g = (_rand((5, 96), dtype, gen, 3.0, "cpu") for _ in range(3))
    w = _rand((96,), wdtype, gen, 0.3, "cpu")
    rb = ReferenceBackend()
    for zc in (True, False):
        assert torch.equal(ref.rms_norm(x, w, 1e-6, zc), rb.rms_norm(x, w, 1e-6, zc))
        normed, res = ref.add_rms_norm(x, h, w, 1e-6, zc)  # decoder.py: h = h + x; norm(h)
        assert torch.equal(res, h + x) and res.dtype == h.dtype
        assert torch.equal(normed, rb.rms_norm(h + x, w, 1e-6, zc))
    assert torch.equal(ref.gated_rms_norm(x, g, w, 1e-6), rb.gated_rms_norm(x, g, w, 1e-6))


def _fill(module: torch.nn.Module, gen: torch.Generator, dtype: torch.dtype) -> torch.nn.Module:
    for p in module.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.3).to(dtype)
    return module


def test_swiglu_reference_is_the_mlp():
    gen = torch.Generator().manual_seed(1)
    mlp = _fill(SwiGLU(24, 40), gen, torch.bfloat16)
    x = _rand((6, 24), torch.bfloat16, gen, 1.0, "cpu")
    g, u = mlp.gate_proj(x), mlp.up_proj(x)
    assert torch.equal(mlp(x), mlp.down_proj(ref.silu_mul(g, u)))
    assert torch.equal(ref.silu_and_mul(torch.cat([g, u], -1)), ref.silu_mul(g, u))


class _RecordKV:
    """An ``AttentionKV`` that records q / k and returns a fixed attention output."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def write(self, k, v, ctx) -> None:
        self.k = k

    def attend(self, q, ctx, scale):
        self.q = q
        return self.out


def _qwen35_attention(gen: torch.Generator, dtype: torch.dtype, device: str, t: int = 5):
    """A tiny Qwen3.5 attention layer (q/k zero-centered norm, rotary 1/4, output gate) run on
    ``device`` over a recording KV store: (layer, x, (cos, sin), kv, output)."""
    spec = AttentionSpec(hidden=48, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                         qk_norm_zero_centered=True, output_gate=True)
    attn = _fill(Attention(spec, ReferenceBackend()), gen, dtype).to(device)
    emb = RotaryEmbedding(RopeSpec(head_dim=32, rotary_dim=8, theta=1e7)).to(device)  # partial 0.25
    pos = torch.arange(40, 40 + t, device=device)
    cos_sin = emb.cos_sin(pos, dtype)
    x = _rand((t, 48), dtype, gen, 1.0, device)
    kv = _RecordKV(_rand((t, 4, 32), dtype, gen, 1.0, device))
    y = attn(x, cos_sin, StepContext(positions=pos, kv_slots=None, seqs=()), kv)
    return attn, x, cos_sin, kv, y


def test_rope_and_output_gate_references_are_the_attention_layer():
    """Qwen3.5 attention: q/k norm, partial rope and the sigmoid output gate from the
    references (and apply_rope itself) reproduce the layer exactly."""
    gen = torch.Generator().manual_seed(2)
    attn, x, (cos, sin), kv, y = _qwen35_attention(gen, torch.bfloat16, "cpu")
    s, t = attn.spec, x.shape[0]
    q, gate = attn.q_proj(x).view(t, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
    k = attn.k_proj(x).view(t, s.num_kv_heads, s.head_dim)
    qn = ref.rms_norm(q, attn.q_norm.weight, s.eps, True)
    kn = ref.rms_norm(k, attn.k_norm.weight, s.eps, True)
    rq, rk = ref.rope(qn, kn, cos, sin)
    assert torch.equal(rq, kv.q) and torch.equal(rk, kv.k)
    assert torch.equal(rq, apply_rope(qn, cos, sin))
    assert torch.equal(attn.o_proj(ref.sigmoid_gate_mul(kv.out.reshape(t, -1), gate)), y)


class _RecordGates(ReferenceBackend):
    def gated_delta_rule(self, q, k, v, g, beta, state):
        self.g, self.beta = g, beta
        return super().gated_delta_rule(q, k, v, g, beta, state)


def test_gdn_gating_reference_is_the_gdn_layer():
    gen = torch.Generator().manual_seed(3)
    spec = GDNSpec(hidden=16, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_kernel=4)
    backend = _RecordGates()
    layer = _fill(GatedDeltaNet(spec, backend), gen, torch.bfloat16)
    layer.A_log.data = torch.tensor([-1.0, 2.0]).to(torch.bfloat16)
    t = 6
    x = _rand((t, 16), torch.bfloat16, gen, 4.0, "cpu")
    seq = SeqInfo(offset=0, num_tokens=t, start=0, state_slot=0, token_index=None)
    ctx = StepContext(positions=torch.arange(t), kv_slots=None, seqs=(seq,), multi=(seq,))
    conv = torch.zeros(1, spec.conv_dim, 3, dtype=torch.bfloat16)
    layer(x, ctx, conv, torch.zeros(1, 2, 8, 8))
    g, beta = ref.gdn_gating(layer.in_proj_a(x), layer.in_proj_b(x), layer.A_log, layer.dt_bias)
    assert torch.equal(g, backend.g) and torch.equal(beta, backend.beta)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16


# -- Triton kernels against the references (small sizes) -----------------------------------------

@kernel_runs
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("n", [77, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(lead, n, dtype):
    gen = torch.Generator().manual_seed(n + len(lead))
    x = _rand(lead + (n,), dtype, gen, 2.0)
    w = _rand((n,), dtype, gen, 0.3)
    for zc in (True, False):
        assert_close(norm.rms_norm(x, w, 1e-6, zc), ref.rms_norm(x, w, 1e-6, zc))


@kernel_runs
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_rms_norm_dtype_rules(dtype, wdtype):
    """A weight wider than x: the plain norm's result takes the promoted dtype (torch's rule)."""
    gen = torch.Generator().manual_seed(11)
    x = _rand((9, 50), dtype, gen, 2.0)
    w = _rand((50,), wdtype, gen, 0.3)
    for zc in (True, False):
        assert_close(norm.rms_norm(x, w, 1e-5, zc), ref.rms_norm(x, w, 1e-5, zc))


@kernel_runs
def test_rms_norm_strided_rows_and_empty():
    """Per-head q norm on the query half of ``[query | gate]`` heads (a strided view)."""
    gen = torch.Generator().manual_seed(12)
    qg = _rand((5, 3, 2 * 48), torch.bfloat16, gen, 2.0)
    q = qg.chunk(2, dim=-1)[0]
    w = _rand((48,), torch.bfloat16, gen, 0.3)
    assert_close(norm.rms_norm(q, w, 1e-6, True), ref.rms_norm(q, w, 1e-6, True))
    empty = torch.empty(0, 48, dtype=torch.bfloat16, device=DEV)
    assert norm.rms_norm(empty, w, 1e-6, True).shape == (0, 48)


@kernel_runs
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(lead, dtype):
    gen = torch.Generator().manual_seed(21 + len(lead))
    x, h = _rand(lead + (130,), dtype, gen, 2.0), _rand(lead + (130,), dtype, gen, 8.0)
    w = _rand((130,), dtype, gen, 0.3)
    for zc in (True, False):
        want, want_res = ref.add_rms_norm(x, h, w, 1e-6, zc)
        got, got_res = norm.add_rms_norm(x, h, w, 1e-6, zc)
        assert_close(got_res, want_res, exact=True)
        assert_close(got, want)
        h2 = h.clone()
        got2, res2 = norm.add_rms_norm(x, h2, w, 1e-6, zc, inplace=True)
        assert res2 is h2 and torch.equal(h2, want_res) and torch.equal(got2, got)


@kernel_runs
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm(lead, dtype):
    gen = torch.Generator().manual_seed(31 + len(lead))
    x, z = _rand(lead + (3, 40), dtype, gen, 2.0), _rand(lead + (3, 40), dtype, gen, 3.0)
    w = _rand((40,), dtype, gen, 0.3)
    assert_close(norm.gated_rms_norm(x, z, w, 1e-6), ref.gated_rms_norm(x, z, w, 1e-6))


@kernel_runs
def test_gated_rms_norm_fuses_the_cast():
    """GDN: ``norm(core.to(bf16), z)`` from the fp32 core in one launch."""
    gen = torch.Generator().manual_seed(32)
    core = _rand((4, 3, 40), torch.float32, gen, 2.0)
    z, w = _rand((4, 3, 40), torch.bfloat16, gen, 3.0), _rand((40,), torch.bfloat16, gen, 0.3)
    got = norm.gated_rms_norm(core, z, w, 1e-6, torch.bfloat16)
    assert_close(got, ref.gated_rms_norm(core.to(torch.bfloat16), z, w, 1e-6))


@kernel_runs
def test_gated_rms_norm_reads_a_gate_inside_a_wider_projection():
    """The gate as ``[T, H, N]`` columns of one fused projection ``[T, W]`` (W > H * N, the GDN's
    z beside its q / k / v): read in place (no copy), the same result as a contiguous gate."""
    gen = torch.Generator().manual_seed(33)
    core = _rand((5, 3, 32), torch.float32, gen, 2.0)
    proj = _rand((5, 200), torch.bfloat16, gen, 3.0)
    z = proj[:, 40:136].view(5, 3, 32)
    w = _rand((32,), torch.bfloat16, gen, 0.3)
    assert norm._gate_rows(z, 32)[1:] == (3, 32)
    got = norm.gated_rms_norm(core, z, w, 1e-6, torch.bfloat16)
    assert torch.equal(got, norm.gated_rms_norm(core, z.contiguous(), w, 1e-6, torch.bfloat16))
    assert_close(got, ref.gated_rms_norm(core.to(torch.bfloat16), z, w, 1e-6))


@kernel_runs
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(lead, dtype):
    gen = torch.Generator().manual_seed(41 + len(lead))
    gu = _rand(lead + (2 * 300,), dtype, gen, 4.0)  # 300: partial column blocks
    want = ref.silu_and_mul(gu)
    assert_close(activation.silu_and_mul(gu), want)
    g, u = gu.chunk(2, dim=-1)
    assert_close(activation.silu_mul(g.contiguous(), u), want)


@kernel_runs
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_mul(dtype):
    gen = torch.Generator().manual_seed(51)
    t, h, d = 7, 3, 24
    q_gate = _rand((t, h, 2 * d), dtype, gen, 4.0)
    gate = q_gate.chunk(2, dim=-1)[1]  # the layer's strided gate half, no copy
    o = _rand((t, h * d), dtype, gen, 2.0)
    assert_close(activation.sigmoid_gate_mul(o, gate), ref.sigmoid_gate_mul(o, gate))


@kernel_runs
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rd,d", [(16, 64), (24, 24)])  # partial (Qwen3.5's 1/4), full
def test_rope(dtype, rd, d):
    gen = torch.Generator().manual_seed(rd + d)
    t = 9
    qg = _rand((t, 4, 2 * d), dtype, gen, 2.0)
    q = qg.chunk(2, dim=-1)[0]  # strided rows
    k = _rand((t, 2, d), dtype, gen, 2.0)
    emb = RotaryEmbedding(RopeSpec(head_dim=d, rotary_dim=rd, theta=1e6))
    cos, sin = (c.to(DEV) for c in emb.cos_sin(torch.arange(1000, 1000 + t), dtype))
    want_q, want_k = ref.rope(q, k, cos, sin)
    got_q, got_k = rotary.rope(q, k, cos, sin)
    assert_close(got_q, want_q, exact=True)
    assert_close(got_k, want_k, exact=True)
    got_q, none = rotary.rope(q, None, cos, sin)
    assert none is None and torch.equal(got_q, want_q)
    q2, k2 = q.contiguous(), k.clone()
    out_q, out_k = rotary.rope(q2, k2, cos, sin, inplace=True)
    assert out_q is q2 and out_k is k2 and torch.equal(q2, want_q) and torch.equal(k2, want_k)


@kernel_runs
def test_rope_leading_shape_and_promotion():
    """``[B, T, H, D]`` with bf16 q/k and fp32 tables: fp32 results, as torch promotes."""
    gen = torch.Generator().manual_seed(61)
    q, k = _rand((2, 3, 4, 32), torch.bfloat16, gen, 2.0), _rand((2, 3, 1, 32), torch.bfloat16, gen, 2.0)
    ang = torch.rand((2, 3, 8), generator=gen).to(DEV) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    want_q, want_k = ref.rope(q, k, cos, sin)
    got_q, got_k = rotary.rope(q, k, cos, sin)
    assert got_q.dtype == torch.float32
    assert_close(got_q, want_q, exact=True)
    assert_close(got_k, want_k, exact=True)
    with pytest.raises(ValueError, match="in-place"):
        rotary.rope(q, k, cos, sin, inplace=True)


@kernel_runs
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gating(lead, dtype):
    gen = torch.Generator().manual_seed(71 + len(lead))
    hv = 6
    ba = _rand(lead + (2 * hv,), dtype, gen, 8.0)  # one fused projection: strided halves
    b, a = ba[..., :hv], ba[..., hv:]
    a[..., 0] = 30.0  # softplus' linear branch (> 20)
    a[..., 1] = -40.0  # exp underflows toward log1p's tiny range
    a_log, dt_bias = _rand((hv,), dtype, gen, 1.0), _rand((hv,), dtype, gen, 1.0)
    want_g, want_beta = ref.gdn_gating(a, b, a_log, dt_bias)
    got_g, got_beta = gdn.gdn_gating(a, b, a_log, dt_bias)
    assert_close(got_g, want_g)
    assert_close(got_beta, want_beta)


@kernel_runs
def test_fused_ops_dispatch():
    """The mixin: kernels where enabled (CUDA, or the interpreter with ``fused_on_cpu``), the
    references otherwise (float64, CPU without the switch) — the same values either way."""
    gen = torch.Generator().manual_seed(81)
    x, h = _rand((4, 64), torch.bfloat16, gen, 2.0), _rand((4, 64), torch.bfloat16, gen, 2.0)
    w = _rand((64,), torch.bfloat16, gen, 0.3)
    ops, plain = Ops(), FusedOps()
    assert_close(ops.rms_norm(x, w, 1e-6, True), ref.rms_norm(x, w, 1e-6, True))
    assert_close(ops.gated_rms_norm(x, h, w, 1e-6), ref.gated_rms_norm(x, h, w, 1e-6))
    assert_close(ops.gated_rms_norm_cast(x.float(), h, w, 1e-6, torch.bfloat16), ref.gated_rms_norm(x, h, w, 1e-6))
    assert_close(ops.add_rms_norm(x, h, w, 1e-6, False)[0], ref.add_rms_norm(x, h, w, 1e-6, False)[0])
    assert_close(ops.silu_and_mul(x), ref.silu_and_mul(x))
    assert_close(ops.silu_mul(x, h), ref.silu_mul(x, h))
    assert_close(ops.sigmoid_gate_mul(x, h), ref.sigmoid_gate_mul(x, h))
    assert_close(ops.gdn_gating(x, h, w, w)[0], ref.gdn_gating(x, h, w, w)[0])
    cs = _rand((4, 8), torch.bfloat16, gen)
    assert torch.equal(ops.rope(x.view(4, 2, 32), None, cs, cs)[0], ref.rope(x.view(4, 2, 32), None, cs, cs)[0])
    xd = x.double()
    assert torch.equal(ops.rms_norm(xd, w.double(), 1e-6, True), ref.rms_norm(xd, w.double(), 1e-6, True))
    if DEV == "cpu":
        assert torch.equal(plain.rms_norm(x, w, 1e-6, False), ref.rms_norm(x, w, 1e-6, False))
        h2 = h.clone()
        normed, res = plain.add_rms_norm(x, h2, w, 1e-6, True, inplace=True)
        assert res is h2 and torch.equal(h2, h + x)
        q = x.view(4, 2, 32).clone()
        out, _ = plain.rope(q, None, cs, cs, inplace=True)
        assert out is q and torch.equal(q, ref.apply_rope(x.view(4, 2, 32), cs, cs))


@kernel_runs
def test_fused_chain_matches_the_attention_layer():
    """The wiring this package is for, on the Qwen3.5 attention layer: q/k norm + one rope
    launch + the output gate through ``FusedOps`` give the layer's q, k and output."""
    gen = torch.Generator().manual_seed(91)
    attn, x, (cos, sin), kv, y = _qwen35_attention(gen, torch.bfloat16, DEV)
    s, t, ops = attn.spec, x.shape[0], Ops()
    q, gate = attn.q_proj(x).view(t, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
    k = attn.k_proj(x).view(t, s.num_kv_heads, s.head_dim)
    q = ops.rms_norm(q, attn.q_norm.weight, s.eps, True)
    k = ops.rms_norm(k, attn.k_norm.weight, s.eps, True)
    q, k = ops.rope(q, k, cos, sin, inplace=True)
    assert_close(q, kv.q)
    assert_close(k, kv.k)
    out = ops.sigmoid_gate_mul(kv.out.reshape(t, -1), gate)
    want = kv.out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
    assert_close(out, want)
    if torch.equal(out, want):  # always on CPU (numpy's exp); on a GPU unless an ulp flipped
        assert torch.equal(attn.o_proj(out), y)


# -- real sizes on the GPU (Qwen3.5-27B: hidden 5120, 24 / 4 heads of 256, rotary 64,
#    GDN 48 value heads of 128, MLP 17408) -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 1000])
def test_gpu_real_sizes(t):
    gen = torch.Generator().manual_seed(t)
    bf = torch.bfloat16
    x, h = _rand((t, 5120), bf, gen, 2.0), _rand((t, 5120), bf, gen, 8.0)
    w = _rand((5120,), bf, gen, 0.3)
    for zc in (True, False):
        assert_close(norm.rms_norm(x, w, 1e-6, zc), ref.rms_norm(x, w, 1e-6, zc))
        got, got_res = norm.add_rms_norm(x, h, w, 1e-6, zc)
        want, want_res = ref.add_rms_norm(x, h, w, 1e-6, zc)
        assert_close(got_res, want_res, exact=True)
        assert_close(got, want)
    qg = _rand((t, 24, 512), bf, gen, 2.0)
    q, gate = qg.chunk(2, dim=-1)
    k = _rand((t, 4, 256), bf, gen, 2.0)
    wq = _rand((256,), bf, gen, 0.3)
    qn, kn = norm.rms_norm(q, wq, 1e-6, True), norm.rms_norm(k, wq, 1e-6, True)
    assert_close(qn, ref.rms_norm(q, wq, 1e-6, True))
    emb = RotaryEmbedding(RopeSpec(head_dim=256, rotary_dim=64, theta=1e7)).to(DEV)
    pos = torch.randint(0, 200_000, (t,), generator=gen).to(DEV)
    cos, sin = emb.cos_sin(pos, bf)
    want_q, want_k = ref.rope(qn, kn, cos, sin)
    got_q, got_k = rotary.rope(qn, kn, cos, sin)
    assert_close(got_q, want_q, exact=True)
    assert_close(got_k, want_k, exact=True)
    rotary.rope(qn, kn, cos, sin, inplace=True)
    assert torch.equal(qn, want_q) and torch.equal(kn, want_k)
    o = _rand((t, 24 * 256), bf, gen, 2.0)
    assert_close(activation.sigmoid_gate_mul(o, gate), ref.sigmoid_gate_mul(o, gate))
    gu = _rand((t, 2 * 17408), bf, gen, 3.0)
    assert_close(activation.silu_and_mul(gu), ref.silu_and_mul(gu))
    core = _rand((t, 48, 128), torch.float32, gen, 2.0)
    z, wv = _rand((t, 48, 128), bf, gen, 3.0), _rand((128,), bf, gen, 0.3)
    assert_close(norm.gated_rms_norm(core, z, wv, 1e-6, bf), ref.gated_rms_norm(core.to(bf), z, wv, 1e-6))
    ba = _rand((t, 96), bf, gen, 6.0)
    a_log, dt_bias = _rand((48,), bf, gen), _rand((48,), bf, gen)
    got_g, got_beta = gdn.gdn_gating(ba[:, 48:], ba[:, :48], a_log, dt_bias)
    want_g, want_beta = ref.gdn_gating(ba[:, 48:], ba[:, :48], a_log, dt_bias)
    assert_close(got_g, want_g)
    assert_close(got_beta, want_beta)


# -- the compiled (not interpreted) kernels build, offline -------------------------------------

def hopper_launches() -> None:
    """The calls whose launches ``test_kernels_build_for_hopper`` builds: every kernel variant once."""
    bf = torch.bfloat16
    x, w = torch.randn(3, 5120, dtype=bf), torch.randn(5120, dtype=bf)
    norm.rms_norm(x, w, 1e-6, True)
    norm.rms_norm(x, w.float(), 1e-6, False)
    norm.add_rms_norm(x, x, w, 1e-6, True)
    z = torch.randn(3, 48, 128, dtype=bf)
    norm.gated_rms_norm(z.float(), z, w[:128], 1e-6, bf)
    activation.silu_and_mul(torch.randn(3, 2 * 1000, dtype=bf))
    activation.sigmoid_gate_mul(torch.randn(3, 4 * 256, dtype=bf), torch.randn(3, 4, 512, dtype=bf)[..., 256:])
    qk, cos = torch.randn(3, 4, 256, dtype=bf), torch.randn(3, 64, dtype=bf)
    rotary.rope(qk, qk, cos, cos, inplace=True)
    rotary.rope(qk.float(), qk.float(), cos.float(), cos.float())
    gdn.gdn_gating(z[:, :, 0], z[:, :, 1], w[:48], w[:48])


@pytest.mark.skipif(not has_ptxas(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_kernels_build_for_hopper(tmp_path: Path) -> None:
    """The compiled kernels (libdevice exp / log1p, no interpreter) build for sm_90 (~10 s)."""
    out = run_offline_build("tests.kernels.test_fused_ops", "hopper_launches", 90, tmp_path)
    assert out.count(": ok (") == 9, out
