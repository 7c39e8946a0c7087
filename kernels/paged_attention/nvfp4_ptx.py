"""PTX that turns nvfp4 code words into fp16, shared by the Triton and the Gluon attention kernels.

A 32-bit word of code bytes holds four "low" and four "high" E2M1 elements (page layout 3,
``kernels.kv_formats.nvfp4``: byte bits 7 = low sign, 1-3 = low index, 4-6 = high index,
0 = high sign). Each set becomes four fp16 high bytes (sign at bit 7, index at bits 1-3, so
the fp16 value is the E2M1 value times 2**-14): the low set with one mask, the high set with
two shifts, a mask and a merge. Byte permutes then place two high bytes in the fp16 lanes
of a register (the low bytes zero). The kernels fold the 2**14 into their global scales.
"""

from __future__ import annotations


def high_bytes(dst: str, src: str, low: bool) -> str:
    """PTX leaving in ``dst`` the fp16 high bytes of code word ``src``'s low (``low``) or high
    elements; the high set uses the scratch registers ``a`` and ``b``."""
    if low:
        return f"and.b32 {dst}, {src}, 0x8E8E8E8E; "
    return (f"shr.b32 a, {src}, 3; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, {src}, 7; "
            f"lop3.b32 {dst}, b, 0x80808080, a, 0xEA; ")


def scaled_half(low: bool) -> str:
    """Inline asm: ``$0``, ``$1`` = the fp16 pairs of code word ``$2``'s low (``low``) or high
    elements (bytes 0-1, then 2-3), times the fp16 scale pairs ``$3``, ``$4`` (exact)."""
    return ("{ .reg .b32 a, b, x, z, t; " + high_bytes("x", "$2", low) + "mov.b32 z, 0; "
            "prmt.b32 t, x, z, 0x1404; mul.rn.f16x2 $0, t, $3; "
            "prmt.b32 t, x, z, 0x3424; mul.rn.f16x2 $1, t, $4; }")


def pairs() -> str:
    """Inline asm: ``$0``, ``$1`` = the fp16 pairs of code word ``$4``'s low elements, ``$2``,
    ``$3`` those of its high elements (9 instructions per 8 values)."""
    return ("{ .reg .b32 a, b, x, y; " + high_bytes("x", "$4", True) + high_bytes("y", "$4", False)
            + "mov.b32 b, 0; prmt.b32 $0, x, b, 0x1404; prmt.b32 $1, x, b, 0x3424; "
            "prmt.b32 $2, y, b, 0x1404; prmt.b32 $3, y, b, 0x3424; }")
