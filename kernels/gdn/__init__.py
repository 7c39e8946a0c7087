"""Gated DeltaNet (gated delta rule + causal conv with carried state) on GPU kernels.

The meaning of each op is the plain-torch reference in ``engine_service.layers.backend``
(``ReferenceBackend``); this package holds thin wrappers over fla-core's Triton kernels
(flash-linear-attention, an optional dependency: ``pip install deepwell[cuda]``) that take the
engine's layouts (varlen token packing with ``cu_seqlens``, recurrent states ``[N, Hv, Dk, Dv]``
fp32, conv states ``[N, C, K-1]``, gathered from and scattered to the state pool by slot) and
return the reference's results within the kernels' rounding. See ``fla_ops`` for the
conventions; ``engine_service.layers.cuda_backend`` calls them for CUDA tensors.

``gated_delta_rule_pool`` (decode steps, speculative verify steps and their group commit) is
deepwell's own: a Triton kernel (``pool_recurrent``, not imported here: it imports triton) that
reads and writes the recurrent states in the pool by slot in place, beside its plain-torch
meaning (``pool_reference``, exported here; tests: ``tests/kernels/test_gdn_pool.py``).

Tests: ``tests/kernels/test_gdn_fla.py`` (adapter logic on CPU with fla's entry points replaced
by reference maths; the fused recurrent kernel under ``TRITON_INTERPRET=1`` where fla is
installed; fla on CUDA vs the reference, ``-m gpu``).
"""

from deepwell.kernels.gdn.fla_ops import (
    FlaEntryPoints,
    available,
    causal_conv1d_decode,
    causal_conv1d_varlen,
    cu_seqlens_from_lengths,
    entry_points,
    gated_delta_rule_decode,
    gated_delta_rule_varlen,
    gather_states,
    import_error,
    packed_rows,
    scatter_states,
)
from deepwell.kernels.gdn.pool_reference import gated_delta_rule_pool as gated_delta_rule_pool_reference

__all__ = [
    "FlaEntryPoints",
    "available",
    "causal_conv1d_decode",
    "causal_conv1d_varlen",
    "cu_seqlens_from_lengths",
    "entry_points",
    "gated_delta_rule_decode",
    "gated_delta_rule_pool_reference",
    "gated_delta_rule_varlen",
    "gather_states",
    "import_error",
    "packed_rows",
    "scatter_states",
]
