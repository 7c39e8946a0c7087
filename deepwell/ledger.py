"""Token ledgers: exact prefix comparison and chained page digests (numpy + hashlib, no torch).

Shared by the engine's prefix cache and the KV-cache daemon's index, which both shortlist
candidate entries by chained digests and confirm matches on exact tokens:
``d_i = BLAKE2b-128(d_{i-1} || tokens of page i as little-endian uint32)`` with ``d_{-1}`` a
caller-chosen seed (a scope key: entries of different scopes never share a digest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

import numpy as np

DIGEST_BYTES = 16


def chain_digests(seed: bytes, tokens: np.ndarray, page_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """Chained digests of every full page of ``tokens``; ``known``: digests already computed
    for a prefix of the same tokens (reused, not recomputed)."""
    full = len(tokens) // page_size
    out = list(known[:full])
    prev = out[-1] if out else seed
    raw = np.ascontiguousarray(tokens[len(out) * page_size: full * page_size], dtype="<u4").tobytes()
    step = page_size * 4
    for i in range(full - len(out)):
        h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES)
        h.update(raw[i * step:(i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def discard(table: dict[Hashable, set[int]], key: Hashable, item: int) -> None:
    """Remove ``item`` from the set ``table[key]``, and the key once its set is empty."""
    s = table.get(key)
    if s is not None:
        s.discard(item)
        if not s:
            del table[key]
