"""E4M3 (float8_e4m3fn) rounding for non-negative fp32 values, defined with exact fp32 steps.

``encode_magnitude(v)`` rounds ``v >= 0`` to the nearest E4M3 value with ties to even and
saturation at 448 (the largest finite E4M3; code 0x7E) and returns ``(code, value)``:
the 7-bit code (sign bit clear) and the rounded value as fp32.

Every step is exact in fp32 except the one intended rounding, so the Triton kernels that
repeat these steps produce the same bits on any device:

1. ``v = min(v, 448)``;
2. ``e = max(exponent(v), -6)`` read from the fp32 bits (-6 is E4M3's smallest normal
   exponent, so values below 2**-6 land on the subnormal grid of step 2**-9);
3. ``y = v * 2**(3 - e)`` (a power of two: exact), ``r = (y + 1.5*2**23) - 1.5*2**23``
   (round-half-even to an integer, ``0 <= r <= 16``);
4. ``code = ((e + 7) << 3) + r - 8`` — this one formula covers normals, subnormals
   (``e == -6``) and the carry when ``r == 16``; ``value = r * 2**(e - 3)``.

Inputs must be finite; NaN is outside the contract.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
_RNE_MAGIC = 12582912.0  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to an integer, ties to even


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as fp32 for int32 exponents in the normal range, built from the bits."""
    return ((exponent + 127) << 23).to(torch.int32).view(torch.float32)


def encode_magnitude(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round fp32 ``v >= 0`` to E4M3 (RNE, saturating). Returns (uint8 code, fp32 value)."""
    if v.dtype != torch.float32:
        raise TypeError(f"encode_magnitude expects float32, got {v.dtype}")
    v = torch.clamp(v, max=E4M3_MAX)
    e = torch.clamp((v.view(torch.int32) >> 23) - 127, min=-6)
    y = v * _pow2(3 - e)
    r = (y + _RNE_MAGIC) - _RNE_MAGIC
    code = ((e + 7) << 3) + r.to(torch.int32) - 8
    value = r * _pow2(e - 3)
    return code.to(torch.uint8), value


def decode(code: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8, never 0x7F/0xFF) to fp32 values."""
    if code.dtype != torch.uint8:
        raise TypeError(f"decode expects uint8 codes, got {code.dtype}")
    return code.view(torch.float8_e4m3fn).to(torch.float32)


def encode_signed(x: torch.Tensor) -> torch.Tensor:
    """Signed fp32 to E4M3 codes; values rounding to zero encode as +0 (code 0)."""
    code, _ = encode_magnitude(x.abs())
    negative = (x < 0) & (code != 0)
    return code | (negative.to(torch.uint8) << 7)
