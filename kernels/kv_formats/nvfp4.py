"""NVFP4 KV: E2M1 codes, one E4M3 scale per 16 values, and a power-of-two global scale ``g``.

Token row of one head (head_dim ``d``): ``d/2`` code bytes then ``d/16`` scale bytes
(144 bytes for d = 256).

- Nibble packing ("half split"): byte ``j`` (``0 <= j < d/2``) holds element ``j`` in its
  low nibble and element ``j + d/2`` in its high nibble, so a kernel unpacks a row into its
  two contiguous halves with one mask and one shift and never interleaves.
- Nibble = E2M1: bit 3 sign, bits 0-2 index into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
- Scale byte ``b`` (``0 <= b < d/16``) is the E4M3 code of block ``b`` = elements
  ``[16b, 16b + 16)``.

Quantization of one block ``x[16]`` (fp32, after the optional Hadamard rotation):

1. ``s = E4M3_RNE_saturating(amax(|x|) * enc)`` with ``enc = fp32(1/6) * (1/g)``;
2. ``a = |x| * (1/g)`` (exact: ``g`` is a power of two);
3. the magnitude index is the number of thresholds ``t_k * s`` that ``a`` passes, for
   ``t = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)`` — "passes" is ``>`` where a tie must round
   down to the even code and ``>=`` where it must round up, which is round-half-even of
   ``a / s`` onto the E2M1 grid; ``a > 5 s`` saturates to 6. Every ``t_k * s`` is exact in
   fp32, so no division happens anywhere and the result is bit-reproducible;
4. a zero scale (all-zero block, or ``amax * enc`` below half of E4M3's smallest subnormal)
   gives all codes 0; an element rounding to magnitude 0 never carries a sign bit.

Dequantized value: ``E2M1[nibble] * s * g``. Every E2M1 x E4M3 product is exact in bf16 and
fp16, so attention kernels dequantize in registers and apply ``g`` after the dot product.
"""

from __future__ import annotations

import torch

from kernels.kv_formats import e4m3

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
INV_6 = float(torch.tensor(1.0 / 6.0, dtype=torch.float32).item())
# (threshold, inclusive): inclusive thresholds are those whose tie rounds up to the even code
THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def code_bytes(d: int) -> int:
    return d // 2


def scale_bytes(d: int) -> int:
    return d // BLOCK


def block_scale_input(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``amax(|block|) * enc`` per block: [N, d] -> [N, d/16] (the value E4M3 rounds)."""
    n, d = x.shape
    amax = x.to(torch.float32).abs().view(n, d // BLOCK, BLOCK).amax(dim=-1)
    enc = INV_6 * (1.0 / g.to(torch.float32))
    return amax * enc[:, None]


def encode(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [N, d], global scales [N] -> (codes uint8 [N, d/2], scales uint8 [N, d/16])."""
    x = x.to(torch.float32)
    n, d = x.shape
    if d % 32:
        raise ValueError(f"nvfp4 needs head_dim divisible by 32, got {d}")
    s_code, s_val = e4m3.encode_magnitude(block_scale_input(x, g))
    a = (x.abs() * (1.0 / g.to(torch.float32))[:, None]).view(n, d // BLOCK, BLOCK)
    sb = s_val[:, :, None]
    idx = torch.zeros_like(a, dtype=torch.int32)
    for t, inclusive in THRESHOLDS:
        passed = a >= t * sb if inclusive else a > t * sb
        idx += passed.to(torch.int32)
    idx = torch.where(sb > 0, idx, torch.zeros_like(idx)).view(n, d)
    nib = idx | (((x < 0) & (idx > 0)).to(torch.int32) << 3)
    packed = nib[:, : d // 2] | (nib[:, d // 2 :] << 4)
    return packed.to(torch.uint8), s_code


def decode(codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(codes [N, d/2], scales [N, d/16]) -> fp32 rows [N, d]."""
    n = codes.shape[0]
    c = codes.to(torch.int32)
    nib = torch.cat((c & 0xF, c >> 4), dim=-1)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = lut[nib & 7]
    val = torch.where(nib >= 8, -mag, mag)
    s = e4m3.decode(scales).repeat_interleave(BLOCK, dim=-1)
    return val * s * g.to(torch.float32).view(n, 1)
