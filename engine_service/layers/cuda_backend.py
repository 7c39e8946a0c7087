"""``CudaBackend``: the layer ops on CUDA: the small elementwise chains as fused Triton kernels
(``kernels.fused``: RMSNorm with the residual add, gated RMSNorm, SwiGLU, RoPE, the GDN gating,
the attention output gate) and the Gated DeltaNet ones on fla-core's Triton kernels.

Registered as ``get_backend("cuda")``. The fused ops (``kernels.fused.ops.FusedOps``) run for
CUDA tensors in fp32 / bf16 / fp16, within 2 ulps of the reference in 16-bit (bit-identical
residual sums and RoPE; ``tests/kernels/test_fused_ops.py``). For CUDA tensors, when fla-core
imports (the optional ``deepwell[cuda]`` extra), the four GDN ops run through ``kernels.gdn`` (fla):

- ``gated_delta_rule``: fla's chunked kernels for a prefill chunk (T > 1), the fused recurrent
  kernel for T == 1 and with ``recurrent`` (any T); ``gated_delta_rule_decode``: the fused recurrent kernel over the B decode
  sequences at once (batch form, one token each); ``gated_delta_rule_multi``: the same kernel over
  B sequences of T tokens each (speculative verify steps and their group commit);
- ``gated_delta_rule_pool`` (decode steps, speculative verify steps and their group commit:
  the recurrent states read from and written back to the state pool by slot, no gather or
  scatter around the kernel): deepwell's own Triton kernel (``kernels.gdn.pool_recurrent``; it
  does not need fla) for CUDA tensors of the shapes it takes, once it has matched the reference
  at that head shape on this device (``pool_recurrent.self_check``, on the first call), else the
  reference op (whose decode steps are this backend's ``gated_delta_rule_decode``);
- ``moe_experts``: the routed experts in two grouped-GEMM Triton launches over the picks sorted
  by expert on the GPU (``kernels.moe``; no host sync, so MoE decode steps capture as graphs);
- ``causal_conv1d`` / ``causal_conv1d_decode``: fla's Triton causal conv (prefill) and its
  update kernel (decode), the engine's ``[C, K-1]`` conv state carried through fla's
  ``[C, K]`` layout with a zero column in front (``kernels.gdn.fla_ops``);
  ``causal_conv1d_decode_pool`` (decode steps): deepwell's own kernel over the conv states in the
  pool by slot in place (``kernels.gdn.pool_conv``, checked against the reference per shape on
  the first call, as the recurrent pool kernel);
- ``gated_delta_rule_varlen`` / ``causal_conv1d_varlen`` (extra ops, this backend only): N
  prefill chunks of different lengths in one launch each (tokens back to back, ``cu_seqlens``),
  states gathered from and scattered to a pool by slot. The GDN layer does not call them yet
  (it runs its multi-token slices one by one); on CPU they loop over the reference.

Every other op (attention through the KV pool's own kernels, linear layers through torch), and
every op on CPU tensors, is the reference's (same results, bit for bit); without fla the GDN ops
are too. The fla results agree with the reference within the kernels'
rounding: activations in their own dtype (bf16 in the engine on GPU), accumulation and the
recurrent state in fp32, fp32 inputs through TF32 tensor-core products (see
``tests/kernels/test_gdn_fla.py`` for the tolerances). ``default_backend(device)`` is the
runner's choice when no backend is named: "cuda" on a CUDA device (fla or not: the log says),
"reference" elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import structlog

from deepwell.engine_service.layers.backend import ReferenceBackend, register_backend
from deepwell.kernels.fused.common import KIND as FUSED_DTYPES
from deepwell.kernels.fused.ops import FusedOps
from deepwell.kernels.gdn import fla_ops, pool_conv, pool_recurrent
from deepwell.kernels.moe import reference as moe_reference, triton_kernel as moe_kernel


# relative error the Gated DeltaNet pool kernel may show against the reference at its start-up
# check (fp32 throughout: ~1e-6 is expected; only a broken build misses this)
POOL_CHECK_TOLERANCE = 1e-3


class CudaBackend(FusedOps, ReferenceBackend):
    name = "cuda"

    def __init__(self, use_fla_conv: bool = True) -> None:
        self.use_fla_conv = use_fla_conv
        # (Hk, Dk, Hv, Dv, dtype, device index) -> whether the pool kernel passed its check there
        self._pool_checked: dict[tuple, bool] = {}

    @staticmethod
    def _fla(*tensors: torch.Tensor) -> bool:
        return all(t.is_cuda for t in tensors) and fla_ops.available()

    # -- gated delta rule ---------------------------------------------------------------
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
        if not self._fla(q, state):
            return super().gated_delta_rule(q, k, v, g, beta, state, recurrent)
        chunked = q.shape[0] > 1 and not recurrent
        o, final = fla_ops.gated_delta_rule_varlen(q, k, v, g, beta, state.unsqueeze(0), chunked=chunked)
        return o.float(), final[0]

    def gated_delta_rule_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fla(q, states):
            return super().gated_delta_rule_decode(q, k, v, g, beta, states)
        o, final = fla_ops.gated_delta_rule_decode(q, k, v, g, beta, states)
        return o.float(), final

    def gated_delta_rule_multi(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fla(q, states):
            return super().gated_delta_rule_multi(q, k, v, g, beta, states)
        o, final = fla_ops.gated_delta_rule_multi(q, k, v, g, beta, states)
        return o.float(), final

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
        if q.is_cuda and pool.is_cuda and pool_recurrent.supports(q, v, pool) and self._pool_kernel_ok(q, v):
            return pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, pool, slots, lengths, out, write_back)
        return super().gated_delta_rule_pool(q, k, v, g, beta, pool, slots, lengths, out, write_back)

    def _pool_kernel_ok(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the pool kernel serves these head shapes: checked against the reference once
        per shape on this device (``pool_recurrent.self_check``, outside graph capture: the
        engine's warm-up steps come first), within ``POOL_CHECK_TOLERANCE``; a miss logs
        ``gdn_pool_kernel_fallback`` and the reference op serves that shape from then on."""
        key = (q.shape[2], q.shape[3], v.shape[2], v.shape[3], q.dtype, q.device.index)
        return self._checked(key, lambda: pool_recurrent.self_check(key[0], key[2], key[1], key[3], q.dtype, q.device),
                             "gdn_pool_kernel_fallback", "the Gated DeltaNet pool kernel disagrees with the reference "
                             "here; the torch ops serve")

    def _checked(self, key: tuple, check: Callable[[], float], event: str, detail: str) -> bool:
        """A kernel's self-check result for ``key``, run once (never during a graph capture, where
        the answer is False for now: the fallback, no host sync); a miss is logged as ``event``."""
        ok = self._pool_checked.get(key)
        if ok is None:
            if torch.cuda.is_current_stream_capturing():
                return False  # never checked before a capture: the reference op (no host sync)
            err = check()
            ok = self._pool_checked[key] = err <= POOL_CHECK_TOLERANCE
            if not ok:
                structlog.get_logger("deepwell.engine").warning(event, error=err, tolerance=POOL_CHECK_TOLERANCE,
                                                                shape=str(key[:-2]), detail=detail)
        return ok

    def gated_delta_rule_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        lengths: list[int],
        pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """N multi-token slices packed back to back (``lengths``, in order), recurrent states
        read from and written back to ``pool [slots, Hv, Dk, Dv]`` fp32 at ``slots [N]``
        (distinct). Returns o ``[T, Hv, Dv]`` fp32."""
        if len(lengths) != slots.shape[0] or sum(lengths) != q.shape[0]:
            raise ValueError(f"lengths {lengths} do not cover {q.shape[0]} tokens of {slots.shape[0]} slots")
        states = fla_ops.gather_states(pool, slots)
        if self._fla(q, pool):
            cu, cu_host = fla_ops.cu_seqlens_from_lengths(lengths, q.device)
            o, final = fla_ops.gated_delta_rule_varlen(q, k, v, g, beta, states, cu, cu_host, chunked=True)
            fla_ops.scatter_states(pool, slots, final)
            return o.float()
        outs, finals, lo = [], [], 0
        for i, n in enumerate(lengths):
            rows = slice(lo, lo + n)
            o, s = super().gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[i])
            outs.append(o)
            finals.append(s)
            lo += n
        fla_ops.scatter_states(pool, slots, torch.stack(finals))
        return torch.cat(outs)

    # -- causal conv --------------------------------------------------------------------
    def causal_conv1d(
        self, x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.use_fla_conv and self._fla(x, state, weight)):
            return super().causal_conv1d(x, state, weight)
        y, final = fla_ops.causal_conv1d_varlen(x, state.unsqueeze(0), weight)
        return y, final[0]

    def causal_conv1d_decode(
        self, x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.use_fla_conv and self._fla(x, states, weight)):
            return super().causal_conv1d_decode(x, states, weight)
        return fla_ops.causal_conv1d_decode(x, states, weight)

    def causal_conv1d_decode_pool(self, x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                                  weight: torch.Tensor) -> torch.Tensor:
        """One launch (``kernels.gdn.pool_conv``) for CUDA tensors it takes, once it has matched the
        reference at that shape on this device; else the gather, decode step and scatter."""
        if x.is_cuda and pool.is_cuda and pool_conv.supports(x, pool, weight) and self._conv_kernel_ok(x, weight):
            return pool_conv.conv_pool(x, pool, slots, weight)
        return super().causal_conv1d_decode_pool(x, pool, slots, weight)

    def _conv_kernel_ok(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """As ``_pool_kernel_ok`` for the conv pool kernel (``pool_conv.self_check``); a miss logs
        ``gdn_conv_kernel_fallback``."""
        key = ("conv", weight.shape[0], weight.shape[1], x.dtype, x.device.index)
        return self._checked(key, lambda: pool_conv.self_check(key[1], key[2], x.dtype, x.device),
                             "gdn_conv_kernel_fallback", "the conv pool kernel disagrees with the reference here; "
                             "the gather + decode + scatter serve")

    def causal_conv1d_varlen(
        self, x: torch.Tensor, lengths: list[int], pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """N slices packed back to back (``lengths``), conv states read from and written back
        to ``pool [slots, C, K-1]`` at ``slots [N]``. Returns y ``[T, C]`` in ``x.dtype``."""
        if len(lengths) != slots.shape[0] or sum(lengths) != x.shape[0]:
            raise ValueError(f"lengths {lengths} do not cover {x.shape[0]} tokens of {slots.shape[0]} slots")
        states = fla_ops.gather_states(pool, slots)
        if self.use_fla_conv and self._fla(x, pool, weight):
            cu, cu_host = fla_ops.cu_seqlens_from_lengths(lengths, x.device)
            y, final = fla_ops.causal_conv1d_varlen(x, states, weight, cu, cu_host)
            fla_ops.scatter_states(pool, slots, final)
            return y
        outs, finals, lo = [], [], 0
        for i, n in enumerate(lengths):
            y, s = super().causal_conv1d(x[lo : lo + n], states[i], weight)
            outs.append(y)
            finals.append(s)
            lo += n
        fla_ops.scatter_states(pool, slots, torch.stack(finals))
        return torch.cat(outs)

    # -- mixture of experts ---------------------------------------------------------------
    def moe_experts(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
                    topk_w: torch.Tensor, scales: moe_reference.Scales | None = None) -> torch.Tensor:
        """``kernels.moe``'s two grouped launches for CUDA tensors (16-bit experts of x's dtype,
        or FP8 ones; no host sync: MoE decode steps capture as CUDA graphs); the reference's loop
        otherwise."""
        if self._moe_kernel(x, gate_up, down, scales):
            return moe_kernel.moe_experts(x, gate_up, down, topk_idx, topk_w, scales)
        return super().moe_experts(x, gate_up, down, topk_idx, topk_w, scales)

    def _moe_kernel(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    scales: moe_reference.Scales | None) -> bool:
        if not self._fused(x) or gate_up.device != x.device:
            return False
        if scales is None:
            return gate_up.dtype == down.dtype == x.dtype
        return scales.block[1] % moe_kernel.BLOCK_K == 0

    def moe_on_device(self, dtype: torch.dtype) -> bool:
        return dtype in FUSED_DTYPES


def default_backend(device: torch.device | str) -> tuple[str, str]:
    """The layer backend for an engine on ``device`` when none is named, and why."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "reference", f"{dev.type} device"
    if not fla_ops.available():
        return "cuda", (f"CUDA device; fla-core not importable ({fla_ops.import_error()}): the Gated DeltaNet ops "
                        "run the torch reference (pip install deepwell[cuda])")
    return "cuda", "CUDA device, fla-core importable"


register_backend("cuda", CudaBackend)
