"""Token ledgers, their digests, and the index that shortlists cache entries for a prompt.

Digests only shortlist; every match is confirmed on exact tokens (``common_prefix``). A
*scope* names everything besides the tokens that must be equal for two ledgers to match
(tenant and per-token metadata digest; one engine serves one model and KV layout, so the
model fingerprint is the same for every resident entry). Page digests are chained:
``d_i = BLAKE2b-128(d_{i-1} || tokens of page i)`` with ``d_{-1}`` the scope, so equal digests at
page ``i`` mean (up to a 2^-128 collision) equal scopes and equal first ``i + 1`` pages, and
entries of different scopes never share a digest (``deepwell.ledger``, shared with the
daemon's index).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from deepwell.ledger import chain_digests, common_prefix, discard


def scope_key(tenant: str, metadata_digest: bytes) -> bytes:
    """A 32-byte key for (tenant, per-token metadata digest)."""
    h = hashlib.blake2b(digest_size=32, person=b"dw-rescope")
    for part in (tenant.encode(), metadata_digest):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class Owner:
    """Whose tokens: the tenant and per-token metadata digest (the scope: ledgers of different
    scopes never match) and the session key (which conversation; tenant-namespaced)."""

    tenant: str = ""
    metadata_digest: bytes = b""
    session: str = ""

    @cached_property
    def scope(self) -> bytes:
        return scope_key(self.tenant, self.metadata_digest)


def is_prefix(short: np.ndarray, short_digests: Sequence[bytes], long: np.ndarray, long_digests: Sequence[bytes]) -> bool:
    """Is ``short`` a prefix of ``long``? The chained digest of its last full page shortlists,
    the tokens decide."""
    if len(short) > len(long):
        return False
    k = len(short_digests)
    if k and (len(long_digests) < k or short_digests[k - 1] != long_digests[k - 1]):
        return False
    return common_prefix(short, long[:len(short)]) == len(short)


@dataclass
class Ledger:
    """A token sequence prepared for matching: tokens as uint32 and their page digests."""

    tokens: np.ndarray
    digests: list[bytes]

    @classmethod
    def of(cls, scope: bytes, tokens: Sequence[int] | np.ndarray, page_size: int,
           known: Sequence[bytes] = ()) -> Ledger:
        arr = np.asarray(tokens, dtype=np.uint32)
        return cls(arr, chain_digests(scope, arr, page_size, known))

    def __len__(self) -> int:
        return len(self.tokens)


class MatchIndex:
    """Entry ids by scope and by page digest."""

    def __init__(self) -> None:
        self._by_digest: dict[bytes, set[int]] = {}
        self._short: dict[bytes, set[int]] = {}  # scope -> entries without a full page
        self._digests: dict[int, tuple[bytes, list[bytes]]] = {}

    def add(self, entry_id: int, scope: bytes, digests: list[bytes]) -> None:
        if entry_id in self._digests:
            raise KeyError(f"entry {entry_id} already indexed")
        self._digests[entry_id] = (scope, digests)
        for d in digests:
            self._by_digest.setdefault(d, set()).add(entry_id)
        if not digests:
            self._short.setdefault(scope, set()).add(entry_id)

    def remove(self, entry_id: int) -> None:
        scope, digests = self._digests.pop(entry_id)
        for d in digests:
            discard(self._by_digest, d, entry_id)
        if not digests:
            discard(self._short, scope, entry_id)

    def candidates(self, scope: bytes, digests: Sequence[bytes]) -> Iterator[tuple[int, list[int]]]:
        """``(pages, ids)`` with the most shared pages first: ids whose first ``pages`` full pages
        equal the prompt's and no more (found by bisection: chained digests agree up to the
        first differing page, never after it), then the scope's entries shorter than a page
        (``pages`` 0). Entries that differ from the prompt inside its first page are not listed."""
        by_depth: dict[int, list[int]] = {}
        for eid in self._by_digest.get(digests[0], ()) if digests else ():
            theirs = self._digests[eid][1]
            lo, hi = 1, min(len(theirs), len(digests))  # theirs[lo - 1] == digests[lo - 1] holds
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if theirs[mid - 1] == digests[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            by_depth.setdefault(lo, []).append(eid)
        for depth in sorted(by_depth, reverse=True):
            yield depth, by_depth[depth]
        short = self._short.get(scope)
        if short:
            yield 0, sorted(short)
