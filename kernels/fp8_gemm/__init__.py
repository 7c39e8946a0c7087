"""Block-scaled FP8 weights (DeepSeek-V3 / Qwen FP8 layout) times 16-bit activations.

``quantize(w, block)`` turns a float weight ``[N, K]`` into E4M3 codes and fp32 block scales
``[ceil(N / bn), ceil(K / bk)]`` (scale = block amax / 448, so the block's largest magnitude
is exactly representable); ``reference.w8a16_matmul`` is the meaning (dequantize, then a
matmul in the activation dtype with fp32 accumulation); ``triton_kernel.w8a16_matmul`` is
the CUDA kernel (weights read as one byte each, dequantized per tile in registers, bf16 /
fp16 tensor-core products, fp32 accumulation). ``matmul`` picks the kernel for CUDA tensors
(and, under ``TRITON_INTERPRET=1``, for CPU ones when asked) and the reference otherwise.
"""

from deepwell.kernels.fp8_gemm.reference import FP8_MAX, dequantize, quantize, w8a16_matmul as reference_matmul
from deepwell.kernels.fp8_gemm.triton_kernel import matmul

__all__ = ["FP8_MAX", "dequantize", "matmul", "quantize", "reference_matmul"]
