"""The hot ops of the model layers behind one small interface.

Every layer module does its maths through a :class:`Backend`; ``ReferenceBackend`` is the
plain-torch definition of each op (it runs on CPU and CUDA alike and is what parity tests
hold against HF transformers). ``kernels/`` can later register a faster implementation
(``register_backend("triton", factory)``) that must agree with the reference within the
kernel's stated tolerance. The reference ops never assume a device.

Shapes (T = tokens of one sequence unless stated, H* = heads, D = head dim):

- ``rms_norm(x[..., N], w[N], eps, zero_centered)``: fp32 maths, result in ``x.dtype``;
  ``zero_centered`` scales by ``(1 + w)`` computed in fp32 (Qwen3.5/Next), else by ``w``
  after casting back to ``x.dtype`` (Llama/Qwen2/Qwen3).
- ``gated_rms_norm(x[..., N], gate[..., N], w, eps)``: ``w * norm(x) * silu(gate)``.
- ``write_kv(k_cache, v_cache, slots[T_batch], k[T_batch,Hkv,D], v)``: scatter into the
  flat ``[num_pages * page_size, Hkv, D]`` views.
- ``paged_attention(q[T,Hq,D], k_cache, v_cache, token_index[L], start, scale)``: causal
  attention of the T new queries (positions ``start .. start+T-1``) over the L = start+T
  cached keys gathered at ``token_index``; GQA by head groups; fp32 softmax.
- ``causal_conv1d(x[T,C], state[C,K-1], w[C,K])``: depthwise causal conv + SiLU over the
  state followed by x; returns ``(y[T,C], new_state[C,K-1])``.
- ``gated_delta_rule(q[T,Hk,Dk], k, v[T,Hv,Dv], g[T,Hv], beta[T,Hv], state[Hv,Dk,Dv])``:
  l2-normalised q/k, q scaled by ``Dk**-0.5``; chunked form for T > 1, recurrent for
  T == 1; fp32 state; returns ``(o[T,Hv,Dv] fp32, new_state fp32)``.
- ``paged_decode_attention``, ``causal_conv1d_decode``, ``gated_delta_rule_decode``: the
  same maths for B single-token sequences at once (decode steps), batched.
- ``gated_delta_rule_pool(q[B,T,Hk,Dk], k, v[B,T,Hv,Dv], g[B,T,Hv], beta, pool[S,Hv,Dk,Dv],
  slots[B], lengths[B] | None, out, write_back)``: ``gated_delta_rule_decode`` token by token
  on the states ``pool[slots]``, written back in place (after each sequence's first
  ``lengths[b]`` tokens) — decode steps, speculative verify steps and their group commit.
- ``moe_experts(x[N,H], gate_up[E,2I,H], down[E,H,I], topk_idx[N,k], topk_w[N,k], scales)``
  (``scales``: FP8 experts' block scales, ``kernels.moe.reference.Scales``, or None).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepwell.kernels.fused import references as fused_ref
from deepwell.kernels.gdn import pool_reference
from deepwell.kernels.moe import reference as moe_reference

GDN_CHUNK = 64
ATTN_SCORE_BYTES = 256 << 20  # fp32 score block budget of the reference attention


class ReferenceBackend:
    """Plain torch: the meaning of every op."""

    name = "reference"

    # -- norms (the definitions live beside their fused kernels: kernels.fused.references) ---
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
    ) -> torch.Tensor:
        return fused_ref.rms_norm(x, weight, eps, zero_centered)

    def gated_rms_norm(
        self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return fused_ref.gated_rms_norm(x, gate, weight, eps)

    # -- attention ----------------------------------------------------------------------
    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        token_index: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        t, hq, d = q.shape
        keys = k_cache.index_select(0, token_index)  # [L, Hkv, D]
        vals = v_cache.index_select(0, token_index)
        length, hkv, _ = keys.shape
        groups = hq // hkv
        kf = keys.float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
        vf = vals.float().permute(1, 0, 2).unsqueeze(1)
        kpos = torch.arange(length, device=q.device)
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
        # query tiles keep the fp32 score block under ATTN_SCORE_BYTES at any context length
        tile = max(1, ATTN_SCORE_BYTES // (4 * hq * length))
        for lo in range(0, t, tile):
            hi = min(t, lo + tile)
            qf = q[lo:hi].float().reshape(hi - lo, hkv, groups, d).permute(1, 2, 0, 3)
            scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [Hkv, G, tile, L]
            qpos = torch.arange(start + lo, start + hi, device=q.device).unsqueeze(1)
            scores = scores.masked_fill(kpos.unsqueeze(0) > qpos, float("-inf"))
            res = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [Hkv, G, tile, D]
            out[lo:hi] = res.permute(2, 0, 1, 3).reshape(hi - lo, hq, d).to(q.dtype)
        return out

    def verify_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        token_index: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """A speculative verify slice's T queries (``paged_attention``'s arguments): causal
        attention, as a prefill chunk (``layers.invariant`` runs them as decode rows)."""
        return self.paged_attention(q, k_cache, v_cache, token_index, start, scale)

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        token_index: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence: ``q[B,Hq,D]`` over ``token_index[B,Lmax]`` rows, the
        first ``lengths[b]`` of which are real."""
        b, hq, d = q.shape
        lmax = token_index.shape[1]
        keys = k_cache.index_select(0, token_index.reshape(-1)).float()  # [B*L, Hkv, D]
        vals = v_cache.index_select(0, token_index.reshape(-1)).float()
        hkv = keys.shape[1]
        groups = hq // hkv
        kf = keys.view(b, lmax, hkv, d).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        vf = vals.view(b, lmax, hkv, d).permute(0, 2, 1, 3)
        qf = q.float().view(b, hkv, groups, d)
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
        pad = torch.arange(lmax, device=q.device).unsqueeze(0) >= lengths.unsqueeze(1)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [B, Hkv, G, D]
        return out.reshape(b, hq, d).to(q.dtype)

    # -- gated deltanet ---------------------------------------------------------------
    def causal_conv1d(
        self, x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, c = x.shape
        km1 = state.shape[-1]
        full = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)  # [C, K-1+T]
        y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=c).squeeze(0)  # [C, T]
        new_state = full[:, full.shape[-1] - km1 :] if km1 > 0 else full[:, :0]
        return F.silu(y).t().to(x.dtype), new_state.to(state.dtype)

    def causal_conv1d_decode(
        self, x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each of B sequences: ``x[B,C]``, ``states[B,C,K-1]``
        (``kernels.gdn.pool_reference.conv_decode_step``: the one place of this arithmetic)."""
        return pool_reference.conv_decode_step(x, states, weight)

    def causal_conv1d_decode_pool(self, x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                                  weight: torch.Tensor) -> torch.Tensor:
        """``causal_conv1d_decode`` with the states read from and written back to ``pool [S, C,
        K-1]`` at ``slots [B]`` (distinct, on the device): returns y ``[B, C]``. A gather, this
        backend's decode step and a scatter (``kernels.gdn.pool_conv.conv_pool_reference``). No
        host sync (CUDA-graph capturable)."""
        from deepwell.kernels.gdn.pool_conv import conv_pool_reference

        return conv_pool_reference(x, pool, slots, weight, decode=self.causal_conv1d_decode)

    def gated_delta_rule_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each of B sequences: q,k ``[B,Hk,Dk]``, v ``[B,Hv,Dv]``, g/beta
        ``[B,Hv]``, states ``[B,Hv,Dk,Dv]`` fp32 -> (o ``[B,Hv,Dv]`` fp32, new states)
        (``kernels.gdn.pool_reference.decode_step``: the one place of this arithmetic)."""
        return pool_reference.decode_step(q, k, v, g, beta, states)

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        recurrent: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hk, hv = q.shape[1], v.shape[1]
        if hk != hv:
            q = q.repeat_interleave(hv // hk, dim=1)
            k = k.repeat_interleave(hv // hk, dim=1)
        # [H, T, D] fp32
        q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
        g, beta = g.t().float(), beta.t().float()
        q = _l2norm(q)
        k = _l2norm(k)
        q = q * (q.shape[-1] ** -0.5)
        s = state.float()
        if q.shape[1] == 1 or recurrent:
            out, s = _delta_recurrent(q, k, v, g, beta, s)
        else:
            out, s = _delta_chunked(q, k, v, g, beta, s, GDN_CHUNK)
        return out.transpose(0, 1), s

    def causal_conv1d_multi(
        self, x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """T tokens for each of B sequences, ``x [B, T, C]``, token by token through
        ``causal_conv1d_decode`` (so each output is bit for bit a decode step's) -> (y ``[B, T, C]``,
        the states after all T)."""
        ys = []
        for t in range(x.shape[1]):
            y, states = self.causal_conv1d_decode(x[:, t], states, weight)
            ys.append(y)
        return (torch.stack(ys, 1) if ys else torch.empty_like(x)), states

    def gated_delta_rule_multi(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """T tokens for each of B sequences: q, k ``[B, T, Hk, Dk]``, v ``[B, T, Hv, Dv]``, g, beta
        ``[B, T, Hv]``, states ``[B, Hv, Dk, Dv]`` fp32 -> (o ``[B, T, Hv, Dv]`` fp32, the states after
        all T), token by token through ``gated_delta_rule_decode`` (a speculative verify step and
        its commit: outputs and states bit for bit those of T decode steps)."""
        outs = []
        for t in range(q.shape[1]):
            o, states = self.gated_delta_rule_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], states)
            outs.append(o)
        if not outs:
            return v.new_empty(v.shape, dtype=torch.float32), states
        return torch.stack(outs, 1), states

    def gated_delta_rule_pool(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        pool: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor | None = None,
        out: bool = True,
        write_back: bool = True,
    ) -> torch.Tensor | None:
        """T tokens for each of B sequences (``gated_delta_rule_multi``'s q, k, v, g, beta) from the
        states ``pool [S, Hv, Dk, Dv]`` fp32 at ``slots [B]`` (distinct, on the device): returns o
        ``[B, T, Hv, Dv]`` fp32 (None unless ``out``); with ``write_back``, ``pool[slots[b]]``
        becomes the state after the first ``lengths[b]`` tokens (None: all T; 0: unchanged).
        ``gated_delta_rule_decode`` token by token (``kernels.gdn.pool_reference``): the bits of
        a gather, T decode steps and a scatter. No host sync (CUDA-graph capturable)."""
        return pool_reference.gated_delta_rule_pool(q, k, v, g, beta, pool, slots, lengths, out, write_back,
                                                    step=self.gated_delta_rule_decode)

    # -- the small elementwise chains (one fused kernel each on CUDA: kernels.fused) ---------
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     zero_centered: bool, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``: the residual add and the next norm
        (``inplace`` lets a fast backend write the sum into ``residual``)."""
        return fused_ref.add_rms_norm(x, residual, weight, eps, zero_centered)

    def gated_rms_norm_cast(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                            dtype: torch.dtype) -> torch.Tensor:
        """``gated_rms_norm(x.to(dtype), gate, weight, eps)`` (the GDN output norm of its fp32 core)."""
        return self.gated_rms_norm(x.to(dtype), gate, weight, eps)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return fused_ref.silu_mul(gate, up)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(g) * u`` for ``g, u = gate_up.chunk(2, -1)``."""
        return fused_ref.silu_and_mul(gate_up)

    def rope(self, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """NeoX rotary embedding of q ``[T, Hq, D]`` and k over the first ``cos.shape[-1]`` dims
        (``inplace`` lets a fast backend rotate q and k themselves)."""
        return fused_ref.rope(q, k, cos, sin)

    def gdn_gating(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g = -exp(A_log) * softplus(a + dt_bias) fp32, beta = sigmoid(b))``."""
        return fused_ref.gdn_gating(a, b, A_log, dt_bias)

    def sigmoid_gate_mul(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``o * sigmoid(gate)`` in ``o``'s shape (the attention output gate)."""
        return fused_ref.sigmoid_gate_mul(o, gate)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        """``torch.sigmoid`` (the MoE shared expert's gate)."""
        return torch.sigmoid(x)

    # -- mixture of experts -------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` of the products outside ``nn.Linear`` modules (MoE router, experts)."""
        return F.linear(x, weight, bias)

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_w: torch.Tensor,
        scales: moe_reference.Scales | None = None,
    ) -> torch.Tensor:
        """The routed experts' SwiGLU per pick, weighted and added per token
        (``kernels.moe.reference``: one GEMM pair per expert with picks, through this backend's
        ``linear`` and ``silu_and_mul``; FP8 experts with ``scales`` dequantized as picked)."""
        return moe_reference.moe_experts(x, gate_up, down, topk_idx, topk_w, self.linear, self.silu_and_mul,
                                         scales)

    def moe_on_device(self, dtype: torch.dtype) -> bool:
        """Whether ``moe_experts`` routes on the device without a host sync for CUDA tensors of
        ``dtype`` (so MoE decode steps can be captured as CUDA graphs): not this loop."""
        return False


_l2norm = pool_reference.l2norm  # x * rsqrt(sum(x^2) + 1e-6), the decode step's and the kernels'


def _delta_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    s: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule. q,k: [H,T,Dk]; v: [H,T,Dv]; s: [H,Dk,Dv]."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        kt = k[:, t]
        pred = torch.einsum("hk,hkv->hv", kt, s)
        delta = (v[:, t] - pred) * beta[:, t, None]
        s = s + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = torch.einsum("hk,hkv->hv", q[:, t], s)
    return out, s


def _delta_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    s: torch.Tensor, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (UT-transform) gated delta rule, same maths as the recurrent form."""
    h, t, dk = k.shape
    pad = (chunk - t % chunk) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g = g.reshape(h, n, chunk)
    beta = beta.reshape(h, n, chunk)
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    cum = g.cumsum(-1)  # [H, N, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    a = (k_beta @ k.transpose(-1, -2)) * decay  # includes the unit diagonal
    u = torch.linalg.solve_triangular(a, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        a, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, n * chunk, -1)[:, :t], s


Backend = ReferenceBackend
_FACTORIES: dict[str, Callable[[], ReferenceBackend]] = {"reference": ReferenceBackend}


def register_backend(name: str, factory: Callable[[], ReferenceBackend]) -> None:
    """Make another implementation (e.g. Triton from ``kernels/``) selectable by name."""
    _FACTORIES[name] = factory


def get_backend(name: str = "reference") -> ReferenceBackend:
    if name not in _FACTORIES:
        raise ValueError(f"unknown layer backend {name!r}; available: {sorted(_FACTORIES)}")
    return _FACTORIES[name]()
