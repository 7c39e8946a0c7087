"""Normalized Walsh-Hadamard transform (Sylvester order) along the last dimension.

``fwht(x)`` equals ``x @ H_d / sqrt(d)`` with ``H_d`` the Sylvester Hadamard matrix
(``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``); it is orthonormal and symmetric, so
it is its own inverse and preserves dot products: ``fwht(q) . fwht(k) == q . k``.

The result is *defined* by this exact fp32 evaluation order, which the Triton append kernel
repeats butterfly for butterfly (so quantized pages are bit-identical between backends):
for ``h = 1, 2, 4, ..., d/2`` view the row as ``[d / 2h, 2, h]`` and replace the pair
``(a, b)`` by ``(a + b, a - b)``; finally multiply by ``scale(d) = fp32(1 / sqrt(d))``
(exact for d = 64 and 256).

``fwht(x, size)`` with ``size`` < d is the block transform ``I (x) H_size``: each ``size``
consecutive elements through the normalized transform of that size, i.e. the first
``log2(size)`` butterfly stages above (which never pair elements of different blocks) and the
multiply by ``scale(size)`` — the rotation of a K layout with ``hadamard_block`` (one per
16-element nvfp4 block: energy evened out inside each block, not moved between blocks).
"""

from __future__ import annotations

import functools
import math

import torch

SUPPORTED_DIMS = (16, 32, 64, 128, 256, 512)


@functools.cache
def scale(d: int) -> float:
    """The normalization 1/sqrt(d), as the fp32 value both backends multiply by."""
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32).item())


def fwht(x: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Normalized Hadamard transform of the last dim, computed in fp32 (returns fp32); with
    ``size`` (dividing the last dim) of each ``size`` consecutive elements (module doc)."""
    n = x.shape[-1]
    d = n if size is None else size
    if d not in SUPPORTED_DIMS or n % d:
        raise ValueError(f"hadamard size must be one of {SUPPORTED_DIMS} and divide {n}, got {d}")
    lead = x.shape[:-1]
    y = x.to(torch.float32).reshape(-1, d)
    h = 1
    while h < d:
        pairs = y.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        h *= 2
    return (y * scale(d)).reshape(*lead, n)


def matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix (for tests and fp64 oracles)."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(d)
