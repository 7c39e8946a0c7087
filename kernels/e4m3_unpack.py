"""E4M3 bytes to fp16 inside Triton kernels, on every CUDA GPU the kernels support.

Triton's ``fp8e4nv`` type (the hardware's ``cvt``) exists from compute capability 8.9 (Ada,
Hopper) on; an A100 (8.0) or A10 (8.6) refuses to compile a kernel that names it. The E4M3
bytes the Triton kernels read (fp8 codes, nvfp4 block scales) therefore go through
``e4m3_f16``, which takes the hardware's conversion where ``has_fp8_conversion`` says so and
integer operations otherwise — the same fp16 values either way (E4M3 is exact in fp16).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepwell.kernels.cuda_arch import capability

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def fp8_conversion_for(capability: tuple[int, int]) -> bool:
    """Whether Triton's ``fp8e4nv`` type builds for a GPU of this compute capability (8.9 on)."""
    return capability >= (8, 9)


def has_fp8_conversion(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use Triton's ``fp8e4nv`` type (E4M3 to fp16 by the
    hardware): CUDA compute capability 8.9 or later (Triton refuses the type below it), and
    the interpreter; A100-class GPUs (8.0, 8.6) take ``e4m3_f16``'s integer path."""
    if device.type != "cuda" or INTERPRET:
        return True
    return fp8_conversion_for(capability(device))


@triton.jit
def e4m3_f16(c, FP8_HW: tl.constexpr):
    """E4M3 bytes (uint8, never NaN) -> their exact fp16 values. ``FP8_HW``: Triton's own
    conversion (the ``fp8e4nv`` type: the hardware's ``cvt``, sm_89 and later); else integer
    operations (sm_80 / sm_86): the byte's exponent and mantissa moved into fp16's places give
    the value times 2**-8 (fp16's exponent bias is 15, E4M3's 7; E4M3's subnormals become fp16
    subnormals of the same digits), which one exact multiplication by 256 restores."""
    if FP8_HW:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b = c.to(tl.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return (bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(tl.float16)
