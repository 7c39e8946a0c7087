"""Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next linear-attention layers).

Per token: ``in_proj_qkv`` -> causal depthwise conv (width K, SiLU, state = last K-1
inputs) -> split q [Hk,Dk], k [Hk,Dk], v [Hv,Dv]; ``beta = sigmoid(in_proj_b)``,
``g = -exp(A_log) * softplus(in_proj_a + dt_bias)``; gated delta rule with the sequence's
fp32 recurrent state; ``out_proj(gated_rmsnorm(o, in_proj_z))``. Qwen3-Next checkpoints
store the projections interleaved per key-head group (``in_proj_qkvz``/``in_proj_ba``);
the loader de-interleaves them into this layout once (see ``models.qwen3_next``).

State invariant: a slot's (conv, recurrent) rows hold the state after exactly ``start``
tokens of its sequence; ``forward`` advances it by the slice's tokens in place, except for a
speculative verify slice, whose slot is advanced by its commit (``context.VerifyRecord``)
once the accepted length is known.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.context import SeqInfo, StepContext
from deepwell.engine_service.layers.mlp import linear
from deepwell.engine_service.layers.norm import GatedRMSNorm
from deepwell.engine_service.layers.projections import FusesProjections, fuse_group


@dataclass(frozen=True)
class GDNSpec:
    hidden: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class Conv1dWeight(nn.Module):
    """Holds ``conv1d.weight`` with HF's shape ``[C, 1, K]``."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


def conv_after(states: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The conv states ``[B, C, K-1]`` after each sequence's first ``lengths[b]`` of the tokens
    ``x [B, T, C]``: the last K-1 inputs, stored as ``causal_conv1d_decode`` stores them (cast
    to the weight's dtype, then to the state's)."""
    km1 = states.shape[-1]
    window = torch.cat([states.to(weight.dtype), x.transpose(1, 2).to(weight.dtype)], dim=-1)  # [B, C, K-1+T]
    idx = (lengths.unsqueeze(1) + torch.arange(km1, device=x.device).unsqueeze(0))  # [B, K-1]
    return window.gather(2, idx.unsqueeze(1).expand(-1, window.shape[1], -1)).to(states.dtype)


# the projections of the layer's input, in the order ``_project`` returns them
PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class GatedDeltaNet(nn.Module, FusesProjections):
    def __init__(self, spec: GDNSpec, backend: ReferenceBackend) -> None:
        super().__init__()
        self.fused_proj: nn.ModuleList | None = None  # after fuse_projections: PROJECTIONS in fewer GEMMs
        self.spec = spec
        self.backend = backend
        self.in_proj_qkv = linear(spec.hidden, spec.conv_dim)
        self.in_proj_z = linear(spec.hidden, spec.value_dim)
        self.in_proj_b = linear(spec.hidden, spec.num_v_heads)
        self.in_proj_a = linear(spec.hidden, spec.num_v_heads)
        self.conv1d = Conv1dWeight(spec.conv_dim, spec.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(spec.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(spec.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(spec.head_v_dim, spec.eps, backend)
        self.out_proj = linear(spec.value_dim, spec.hidden)

    def fuse_projections(self) -> int:
        """The four projections in one GEMM (16-bit weights), else q/k/v with z and b with a (FP8
        weights keep ``b`` / ``a`` 16-bit); returns the launches saved (``layers.projections``)."""
        if self.fused_proj is not None:
            return 0
        groups = fuse_group([getattr(self, n) for n in PROJECTIONS], ([[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0], [1], [2, 3]]))
        if groups is None:
            return 0
        self.fused_proj = nn.ModuleList(groups)
        for name in PROJECTIONS:
            delattr(self, name)
        return len(PROJECTIONS) - len(groups)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x)`` (columns of fewer GEMMs'
        outputs once fused)."""
        if self.fused_proj is None:
            return tuple(getattr(self, n)(x) for n in PROJECTIONS)
        return tuple(part for proj in self.fused_proj for part in proj(x))

    def forward(
        self, x: torch.Tensor, ctx: StepContext, conv_state: torch.Tensor, rec_state: torch.Tensor
    ) -> torch.Tensor:
        s = self.spec
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        z = z.view(t, s.num_v_heads, s.head_v_dim)
        g, beta = self.backend.gdn_gating(a, b, self.A_log, self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)
        if ctx.verify_group is not None:  # every row belongs to it, sequence-major
            core = self._verify_group(mixed, g, beta, ctx, conv_state, rec_state)
            out = self.backend.gated_rms_norm_cast(core, z, self.norm.weight, self.norm.eps, x.dtype)
            return self.out_proj(out.reshape(t, s.value_dim))
        dec = ctx.decode
        core = (torch.empty(t, s.num_v_heads, s.head_v_dim, dtype=torch.float32, device=x.device)
                if dec is None or dec.rows.shape[0] < t else None)  # only decodes: the pool op's output
        for seq in ctx.multi:
            rows = slice(seq.offset, seq.offset + seq.num_tokens)
            if seq.verify:
                core[rows] = self._verify(seq, mixed[rows], g[rows], beta[rows], ctx, conv_state, rec_state)
                continue
            slot = seq.state_slot
            conv_out, conv_state[slot] = self.backend.causal_conv1d(
                mixed[rows], conv_state[slot], weight
            )
            n = seq.num_tokens
            q, k, v = torch.split(conv_out, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
            o, rec_state[slot] = self.backend.gated_delta_rule(
                q.reshape(n, s.num_k_heads, s.head_k_dim),
                k.reshape(n, s.num_k_heads, s.head_k_dim),
                v.reshape(n, s.num_v_heads, s.head_v_dim),
                g[rows],
                beta[rows],
                rec_state[slot],
            )
            core[rows] = o
        if dec is not None:
            slots, n = dec.state_slots, dec.rows.shape[0]
            # only decodes (a decode step, graphed or not): rows 0..t-1 in order, so the rows are
            # taken as they are and the output is the core itself (no gathers, no scatter)
            rows = slice(None) if n == t else dec.rows
            # the conv states read from and written back to their slots in place
            conv_out = self.backend.causal_conv1d_decode_pool(mixed[rows], conv_state, slots, weight)
            q, k, v = torch.split(conv_out, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
            # one token each, the states read from and written back to their slots in place
            o = self.backend.gated_delta_rule_pool(
                q.reshape(n, 1, s.num_k_heads, s.head_k_dim),
                k.reshape(n, 1, s.num_k_heads, s.head_k_dim),
                v.reshape(n, 1, s.num_v_heads, s.head_v_dim),
                g[rows].unsqueeze(1),
                beta[rows].unsqueeze(1),
                rec_state,
                slots,
            )
            if core is None:
                core = o[:, 0]
            else:
                core[rows] = o[:, 0]
        out = self.backend.gated_rms_norm_cast(core, z, self.norm.weight, self.norm.eps, x.dtype)
        return self.out_proj(out.reshape(t, s.value_dim))

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, n = self.spec, conv_out.shape[0]
        q, k, v = torch.split(conv_out, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        return (q.reshape(n, s.num_k_heads, s.head_k_dim), k.reshape(n, s.num_k_heads, s.head_k_dim),
                v.reshape(n, s.num_v_heads, s.head_v_dim))

    def _verify_group(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ctx: StepContext,
                      conv_state: torch.Tensor, rec_state: torch.Tensor) -> torch.Tensor:
        """B verify slices of T tokens from their slots' states, the slots left untouched: the
        outputs token by token through the decode ops' arithmetic (``causal_conv1d_multi``,
        ``gated_delta_rule_pool`` without write-back), and a group commit that replays each
        slice's first L_b tokens from the slots' states and writes them back in place
        (``gated_delta_rule_pool`` with ``lengths``; the conv states by ``conv_after``)."""
        assert ctx.verify is not None and ctx.verify_group is not None
        s, grp = self.spec, ctx.verify_group
        b, t = len(grp.slots), grp.tokens_per_seq
        slots, weight = grp.state_slots, self.conv1d.weight.squeeze(1)
        x = mixed.view(b, t, -1)
        conv0 = conv_state.index_select(0, slots)
        conv_out, _ = self.backend.causal_conv1d_multi(x, conv0, weight)
        q, k, v = torch.split(conv_out, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = q.reshape(b, t, s.num_k_heads, s.head_k_dim)
        k = k.reshape(b, t, s.num_k_heads, s.head_k_dim)
        v = v.reshape(b, t, s.num_v_heads, s.head_v_dim)
        gb, betab = g.view(b, t, -1), beta.view(b, t, -1)
        o = self.backend.gated_delta_rule_pool(q, k, v, gb, betab, rec_state, slots, write_back=False)

        def commit(lengths: torch.Tensor) -> None:
            self.backend.gated_delta_rule_pool(q, k, v, gb, betab, rec_state, slots, lengths, out=False,
                                               write_back=True)
            conv_state.index_copy_(0, slots, conv_after(conv_state.index_select(0, slots), x, weight, lengths))

        ctx.verify.add_group(commit)
        return o.reshape(b * t, s.num_v_heads, s.head_v_dim)

    def _verify(self, seq: SeqInfo, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ctx: StepContext,
                conv_state: torch.Tensor, rec_state: torch.Tensor) -> torch.Tensor:
        """A verify slice beside other slices: a group of one (``*_multi``, the decode ops'
        arithmetic token by token), the slot left untouched; the commit (``VerifyRecord``) replays
        the first L tokens from the same inputs, so the state it writes is the one the L-th output
        was computed with, and the one L decode steps would have left."""
        assert ctx.verify is not None
        slot, weight = seq.state_slot, self.conv1d.weight.squeeze(1)
        # copies of this slice's rows: the commit outlives the step, and views would keep the
        # whole step's projection output alive (every layer's, with a prefill chunk beside it)
        x = mixed.unsqueeze(0).clone()
        conv_out, _ = self.backend.causal_conv1d_multi(x, conv_state[slot].unsqueeze(0), weight)
        q, k, v = (t.unsqueeze(0) for t in self._qkv(conv_out[0]))
        gb, betab = g.unsqueeze(0).clone(), beta.unsqueeze(0).clone()
        o, _ = self.backend.gated_delta_rule_multi(q, k, v, gb, betab, rec_state[slot].unsqueeze(0))

        def commit(n: int) -> None:
            if n == 0:  # nothing accepted: the slot stays at the slice's start
                return
            _, conv = self.backend.causal_conv1d_multi(x[:, :n], conv_state[slot].unsqueeze(0), weight)
            _, rec = self.backend.gated_delta_rule_multi(q[:, :n], k[:, :n], v[:, :n], gb[:, :n], betab[:, :n],
                                                         rec_state[slot].unsqueeze(0))
            conv_state[slot], rec_state[slot] = conv[0], rec[0]

        ctx.verify.add(slot, commit)
        return o[0]
