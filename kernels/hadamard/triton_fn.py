"""``fwht_rows``: the reference butterfly sequence as a Triton device function.

Operates on an fp32 tile ``[R, D]`` (``D`` a power of two) and returns the normalized
transform of every row, evaluating exactly the adds/subtracts of ``reference.fwht`` in the
same order, then one multiply by ``SCALE`` (= ``reference.scale(D)``), so the bits match.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fwht_rows(x, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, SCALE: tl.constexpr):
    for i in tl.static_range(LOG2D):
        y = tl.reshape(x, [R, D // (2 << i), 2, 1 << i])
        y = tl.permute(y, (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.join(a + b, a - b)
        y = tl.permute(y, (0, 1, 3, 2))
        x = tl.reshape(y, [R, D])
    return x * SCALE
