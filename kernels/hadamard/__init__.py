"""Hadamard rotation of K (after RoPE, before quantization) and of Q (before QK).

``reference.fwht`` defines the transform; ``triton_fn.fwht_rows`` is the same butterfly
sequence as a ``@triton.jit`` helper used inside the fused append kernel.
"""

from deepwell.kernels.hadamard.reference import fwht, matrix, scale

__all__ = ["fwht", "matrix", "scale"]
