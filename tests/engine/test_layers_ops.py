"""Reference backend ops against independent formulations: gated delta rule (chunked ==
recurrent == HF's torch functions, with initial/final state, GQA, lengths not a multiple
of the chunk), causal conv with carried state (split == whole), paged attention over
fragmented pages == dense causal SDPA, MoE == a per-token loop, RMSNorm variants."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from deepwell.engine_service.layers import backend
from deepwell.engine_service.layers.backend import ReferenceBackend, get_backend, register_backend
from tests.engine.helpers_models import one_torch_thread

B = ReferenceBackend()

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


def _gdn_inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=g)
    k = torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    gate = -F.softplus(torch.randn(t, hv, generator=g))
    beta = torch.sigmoid(torch.randn(t, hv, generator=g))
    s0 = torch.randn(hv, dk, dv, generator=g) * 0.1
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("t", [1, 5, 64, 100, 130])
def test_gated_delta_rule_chunked_equals_recurrent_and_hf(t: int) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, s0 = _gdn_inputs(t)
    out, s = B.gated_delta_rule(q, k, v, g, beta, s0.clone())
    # token by token through the recurrent form
    st = s0.clone()
    steps = []
    for i in range(t):
        o, st = B.gated_delta_rule(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], st)
        steps.append(o)
    torch.testing.assert_close(out, torch.cat(steps), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, st, rtol=1e-4, atol=1e-5)
    # HF's plain-torch functions themselves: with fla-core installed (the GPU machine) transformers
    # binds these names to fla's Triton kernels (``use_kernel_func_from_hub_with_fallback``; the
    # torch function is the ``__wrapped__``), which cannot take CPU tensors; and transformers
    # before ~5.2x (5.17 there) expands q/k to the value heads in the layer, not in the function
    hf = inspect.unwrap(torch_chunk_gated_delta_rule if t > 1 else torch_recurrent_gated_delta_rule)
    rep = v.shape[1] // q.shape[1]
    qh, kh = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    ref_o, ref_s = hf(qh[None], kh[None], v[None], g=g[None], beta=beta[None],
                      initial_state=s0[None].clone(), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref_o[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, ref_s[0], rtol=1e-5, atol=1e-5)
    assert s.dtype == torch.float32


def test_gated_delta_rule_split_anywhere_equals_whole() -> None:
    q, k, v, g, beta, s0 = _gdn_inputs(90, seed=3)
    whole, s_whole = B.gated_delta_rule(q, k, v, g, beta, s0)
    a, s_mid = B.gated_delta_rule(q[:37], k[:37], v[:37], g[:37], beta[:37], s0)
    b, s_end = B.gated_delta_rule(q[37:], k[37:], v[37:], g[37:], beta[37:], s_mid)
    torch.testing.assert_close(torch.cat([a, b]), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_end, s_whole, rtol=1e-4, atol=1e-5)


def test_causal_conv_carries_state() -> None:
    c, kw = 12, 4
    w = torch.randn(c, kw)
    x = torch.randn(20, c)
    zero = torch.zeros(c, kw - 1)
    whole, s_whole = B.causal_conv1d(x, zero, w)
    ref = F.silu(F.conv1d(x.t()[None], w[:, None], padding=kw - 1, groups=c)[0, :, :20]).t()
    torch.testing.assert_close(whole, ref)
    parts, st = [], zero
    for lo, hi in [(0, 2), (2, 3), (3, 11), (11, 20)]:
        y, st = B.causal_conv1d(x[lo:hi], st, w)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts), whole)
    torch.testing.assert_close(st, s_whole)
    assert torch.equal(s_whole, x[-(kw - 1) :].t())


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_paged_attention_over_fragmented_pages_equals_dense(
    hq: int, hkv: int, tiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if tiled:  # query tiles of 3 rows: the long-context memory bound path
        monkeypatch.setattr(backend, "ATTN_SCORE_BYTES", 4 * hq * 23 * 3)
    ps, d, total = 4, 16, 23
    pages = [5, 0, 3, 7, 1, 6]
    k_cache = torch.full((8 * ps, hkv, d), float("nan"))  # unwritten rows must never be read
    v_cache = torch.full((8 * ps, hkv, d), float("nan"))
    k, v = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
    q = torch.randn(total, hq, d)
    pos = torch.arange(total)
    index = torch.tensor(pages)[pos // ps] * ps + pos % ps
    start = 15
    B.write_kv(k_cache, v_cache, index[:start], k[:start], v[:start])
    B.write_kv(k_cache, v_cache, index[start:], k[start:], v[start:])
    out = B.paged_attention(q[start:], k_cache, v_cache, index, start, d**-0.5)
    rep = hq // hkv
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(rep, 1).transpose(0, 1)[None],
        v.repeat_interleave(rep, 1).transpose(0, 1)[None], is_causal=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref[start:], rtol=1e-5, atol=1e-5)


def test_batched_decode_ops_equal_per_sequence_ops() -> None:
    g = torch.Generator().manual_seed(11)
    # attention: 3 sequences with different context lengths, one query each
    ps, hkv, hq, d = 4, 2, 6, 8
    k_cache, v_cache = torch.randn(40, hkv, d, generator=g), torch.randn(40, hkv, d, generator=g)
    idx = [torch.randperm(40, generator=g)[:n] for n in (7, 1, 13)]
    q = torch.randn(3, hq, d, generator=g)
    padded = torch.zeros(3, 13, dtype=torch.long)
    for i, ix in enumerate(idx):
        padded[i, : len(ix)] = ix
    lens = torch.tensor([len(ix) for ix in idx])
    batched = B.paged_decode_attention(q, k_cache, v_cache, padded, lens, d**-0.5)
    for i, ix in enumerate(idx):
        one = B.paged_attention(q[i : i + 1], k_cache, v_cache, ix, len(ix) - 1, d**-0.5)
        torch.testing.assert_close(batched[i], one[0], rtol=1e-5, atol=1e-6)
    assert ps == 4
    # conv + delta rule: B sequences, one token each, own states
    c, kw = 10, 4
    w = torch.randn(c, kw, generator=g)
    x, states = torch.randn(3, c, generator=g), torch.randn(3, c, kw - 1, generator=g)
    y, new = B.causal_conv1d_decode(x, states, w)
    for i in range(3):
        y1, s1 = B.causal_conv1d(x[i : i + 1], states[i], w)
        torch.testing.assert_close(y[i], y1[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new[i], s1)
    qs, ks, vs, gs, bs, _ = _gdn_inputs(3, seed=12)
    s0 = torch.randn(3, 4, 16, 8, generator=g)
    o, s = B.gated_delta_rule_decode(qs, ks, vs, gs, bs, s0)
    for i in range(3):
        o1, st = B.gated_delta_rule(qs[i : i + 1], ks[i : i + 1], vs[i : i + 1], gs[i : i + 1],
                                    bs[i : i + 1], s0[i])
        torch.testing.assert_close(o[i], o1[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s[i], st, rtol=1e-5, atol=1e-5)


def test_moe_experts_equal_per_token_loop() -> None:
    n, h, i, e, topk = 9, 8, 6, 5, 2
    x = torch.randn(n, h)
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    idx = torch.stack([torch.randperm(e)[:topk] for _ in range(n)])
    w = torch.rand(n, topk)
    out = B.moe_experts(x, gate_up, down, idx, w)
    ref = torch.zeros_like(x)
    for t in range(n):
        for j in range(topk):
            ex = int(idx[t, j])
            g, u = (gate_up[ex] @ x[t]).chunk(2)
            ref[t] += w[t, j] * (down[ex] @ (F.silu(g) * u))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_variants() -> None:
    x, w = torch.randn(3, 16), torch.randn(16)
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(B.rms_norm(x, w, 1e-6, zero_centered=False), normed * w)
    torch.testing.assert_close(B.rms_norm(x, w, 1e-6, zero_centered=True), normed * (1 + w))
    gate = torch.randn(3, 16)
    torch.testing.assert_close(B.gated_rms_norm(x, gate, w, 1e-6), normed * w * F.silu(gate))
    xb = x.bfloat16()
    assert B.rms_norm(xb, w.bfloat16(), 1e-6, zero_centered=True).dtype == torch.bfloat16


def test_backend_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_backend().name == "reference"

    class Other(ReferenceBackend):
        name = "other"

    monkeypatch.setattr(backend, "_FACTORIES", dict(backend._FACTORIES))
    register_backend("other", Other)
    assert get_backend("other").name == "other"
    with pytest.raises(ValueError, match="unknown layer backend 'nope'"):
        get_backend("nope")
