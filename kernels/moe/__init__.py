"""The routed experts of a mixture-of-experts layer: ``reference`` (plain torch, the meaning
and the CPU path) and ``triton_kernel`` (two grouped-GEMM launches over the picks sorted by
expert, no host sync: the CUDA path, capturable in a CUDA graph)."""

from deepwell.kernels.moe.reference import moe_experts as moe_experts_reference
from deepwell.kernels.moe.triton_kernel import moe_experts

__all__ = ["moe_experts", "moe_experts_reference"]
