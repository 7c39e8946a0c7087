"""16-bit weights (bf16 / fp16; fp32 for tests) times a few activation rows: a split-K GEMV.

Decode (1-16 tokens) reads each linear layer's weight once per step, so its time is the weight
bytes over HBM bandwidth; cuBLAS reaches about 2.3 of an H100's ~3.0 TB/s at these shapes.
``triton_kernel.linear`` is a Triton kernel built for that case (the FP8 kernel of
``kernels.fp8_gemm`` without the dequantization: K split over enough programs to fill the GPU,
fp32 partial sums added by one small deterministic launch); ``reference.linear`` is its meaning
(``torch.nn.functional.linear``). ``supports(x, w)`` says whether a call belongs to the kernel
(up to ``MAX_TOKENS`` rows, on CUDA or under ``TRITON_INTERPRET=1``); callers take the
reference (torch's GEMM) otherwise. ``bench`` compares it with cuBLAS at Qwen3.5-27B's shapes.
"""

from deepwell.kernels.gemv.reference import linear as reference_linear
from deepwell.kernels.gemv.triton_kernel import MAX_TOKENS, VARIANTS, linear, supports

__all__ = ["MAX_TOKENS", "VARIANTS", "linear", "reference_linear", "supports"]
