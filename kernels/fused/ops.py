"""``FusedOps``: the fused elementwise ops as a mixin for a layer backend.

    class CudaBackend(FusedOps, ReferenceBackend): ...

overrides ``rms_norm`` / ``gated_rms_norm`` (same signatures as ``ReferenceBackend``) and adds
``add_rms_norm``, ``gated_rms_norm_cast``, ``silu_mul``, ``silu_and_mul``, ``rope``,
``gdn_gating`` and ``sigmoid_gate_mul``. Each runs its Triton kernel when its tensors are on
CUDA in float32 / bfloat16 / float16 (or, for tests, on CPU when ``fused_on_cpu`` is set and
``TRITON_INTERPRET=1``), else ``kernels.fused.references`` (the engine's exact torch
expressions). The maths and the dtype rule of each op are in its kernel module's docstring.
"""

from __future__ import annotations

import torch

from deepwell.kernels.fused import activation, gdn, norm, references, rotary
from deepwell.kernels.fused.common import INTERPRET, supported


class FusedOps:
    #: run the kernels on CPU tensors too (only under ``TRITON_INTERPRET=1``; for tests)
    fused_on_cpu: bool = False

    def _fused(self, *tensors: torch.Tensor) -> bool:
        dev = tensors[0].device
        if not supported(*tensors) or any(t.device != dev for t in tensors):
            return False
        return dev.type == "cuda" or (self.fused_on_cpu and INTERPRET and dev.type == "cpu")

    # -- ReferenceBackend ops ----------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
        if self._fused(x, weight):
            return norm.rms_norm(x, weight, eps, zero_centered)
        return references.rms_norm(x, weight, eps, zero_centered)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._fused(x, gate, weight):
            return norm.gated_rms_norm(x, gate, weight, eps)
        return references.gated_rms_norm(x, gate, weight, eps)

    # -- new ops -----------------------------------------------------------------------------
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     zero_centered: bool, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``; ``inplace``: the sum is written into
        ``residual`` (contiguous, of the sum's dtype) and ``residual`` is returned."""
        if self._fused(x, residual, weight):
            return norm.add_rms_norm(x, residual, weight, eps, zero_centered, inplace)
        normed, new_res = references.add_rms_norm(x, residual, weight, eps, zero_centered)
        if inplace:
            return normed, residual.copy_(new_res)
        return normed, new_res

    def gated_rms_norm_cast(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                            dtype: torch.dtype) -> torch.Tensor:
        """``gated_rms_norm(x.to(dtype), gate, weight, eps)`` with the cast fused (GDN's fp32 core)."""
        if self._fused(x, gate, weight) and dtype in (torch.float32, torch.bfloat16, torch.float16):
            return norm.gated_rms_norm(x, gate, weight, eps, dtype)
        return references.gated_rms_norm(x.to(dtype), gate, weight, eps)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``F.silu(gate) * up``."""
        if self._fused(gate, up):
            return activation.silu_mul(gate, up)
        return references.silu_mul(gate, up)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``F.silu(g) * u`` for ``g, u = gate_up.chunk(2, -1)``."""
        if self._fused(gate_up):
            return activation.silu_and_mul(gate_up)
        return references.silu_and_mul(gate_up)

    def rope(self, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(apply_rope(q, cos, sin), apply_rope(k, cos, sin))``; ``inplace`` rotates q and k
        themselves (their dtype must be the result's) and returns them."""
        if self._fused(q, cos, sin, *(() if k is None else (k,))):
            return rotary.rope(q, k, cos, sin, inplace)
        q_out, k_out = references.rope(q, k, cos, sin)
        if inplace:
            q_out = q.copy_(q_out)
            k_out = k.copy_(k_out) if k is not None and k_out is not None else None
        return q_out, k_out

    def gdn_gating(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g = -exp(A_log) * softplus(a + dt_bias) fp32, beta = sigmoid(b))``."""
        if self._fused(a, b, A_log, dt_bias):
            return gdn.gdn_gating(a, b, A_log, dt_bias)
        return references.gdn_gating(a, b, A_log, dt_bias)

    def sigmoid_gate_mul(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``o * sigmoid(gate)`` in ``o``'s shape (``gate`` may be a strided ``[T, H, D]`` view)."""
        if self._fused(o, gate):
            return activation.sigmoid_gate_mul(o, gate)
        return references.sigmoid_gate_mul(o, gate)
