"""Fused elementwise ops of the model layers: one Triton launch where the torch reference
(``references``) makes several, for the CUDA layer backend (``ops.FusedOps``, a mixin).

- ``norm``: ``rms_norm`` (zero-centered ``(1 + w)`` or plain ``w``), ``add_rms_norm`` (residual
  add + norm), ``gated_rms_norm`` (``w * norm(x) * silu(gate)``, optionally casting x first);
- ``activation``: ``silu_mul`` / ``silu_and_mul`` (SwiGLU), ``sigmoid_gate_mul`` (attention
  output gate);
- ``rotary``: ``rope``, NeoX rotary embedding of q and k in one launch, partial rotary dims, in place or not;
- ``gdn``: ``gdn_gating``, Gated DeltaNet ``g`` and ``beta``.

Every kernel repeats its reference's torch expression with each intermediate rounded to the
dtype torch holds it in (``common.round_to``): rope is bit-identical, the others differ only
where an fp32 transcendental or a reduction order differs by an ulp before a rounding
(tolerances in ``tests/kernels/test_fused_ops.py``).
"""

from deepwell.kernels.fused.activation import sigmoid_gate_mul, silu_and_mul, silu_mul
from deepwell.kernels.fused.gdn import gdn_gating
from deepwell.kernels.fused.norm import add_rms_norm, gated_rms_norm, rms_norm
from deepwell.kernels.fused.ops import FusedOps
from deepwell.kernels.fused.rotary import rope

__all__ = [
    "FusedOps", "add_rms_norm", "gated_rms_norm", "gdn_gating", "rms_norm", "rope",
    "sigmoid_gate_mul", "silu_and_mul", "silu_mul",
]
