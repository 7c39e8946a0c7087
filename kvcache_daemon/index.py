"""Matching index: digest shortlist, exact token confirmation, session-key lookup.

Shortlisting uses the daemon's own chained 128-bit BLAKE2b digests over fixed pages of
``page_tokens`` tokens, seeded by the entry's *scope* (tenant, model/layout fingerprint,
metadata digest). The daemon computes them from the tokens it receives, so client-sent
digests can never poison the index; a digest hit is only a candidate: every match is
confirmed on exact tokens. Entries of different scopes can never match each other
(different seeds, and the scope itself is compared).

``usable_prefix`` defines reuse (DESIGN invariant 8): strictly shorter than the prompt and
at a position with a state image: exactly the frontier for entries with recurrent state;
any cut at or below the frontier for attention-only entries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from deepwell.ledger import DIGEST_BYTES, chain_digests, common_prefix, discard

__all__ = ["DIGEST_BYTES", "common_prefix", "page_digests", "scope_key", "usable_prefix", "MatchIndex"]


def scope_key(tenant: str, model_fingerprint: bytes, metadata_digest: bytes) -> bytes:
    """A 32-byte key naming everything that must be equal for two ledgers to match."""
    h = hashlib.blake2b(digest_size=32, person=b"dw-kv-scope")
    for part in (tenant.encode(), model_fingerprint, metadata_digest):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def page_digests(scope: bytes, tokens: np.ndarray, page_tokens: int) -> list[bytes]:
    """Chained digests of every full page: d_i = H(d_{i-1} || page_i), d_{-1} = scope."""
    return chain_digests(scope, tokens, page_tokens)


def usable_prefix(entry_tokens: np.ndarray, frontier: int, requires_state: bool, prompt: np.ndarray) -> int:
    """Tokens of ``prompt`` this entry lets the engine skip (0 = not usable)."""
    limit = len(prompt) - 1
    if limit <= 0 or frontier <= 0:
        return 0
    if requires_state:
        if frontier > limit:
            return 0
        return frontier if common_prefix(entry_tokens[:frontier], prompt[:frontier]) == frontier else 0
    return min(common_prefix(entry_tokens[:frontier], prompt), limit)


@dataclass
class Indexed:
    """What the index needs to know about a matchable entry."""

    entry_id: int
    scope: bytes
    session: str
    digests: list[bytes]
    tokens: np.ndarray
    frontier: int
    requires_state: bool


class MatchIndex:
    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self._items: dict[int, Indexed] = {}
        self._by_digest: dict[bytes, set[int]] = {}
        self._short: dict[bytes, set[int]] = {}  # scope -> entries with no full page
        self._by_session: dict[tuple[bytes, str], set[int]] = {}

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def ids(self) -> Iterable[int]:
        return self._items.keys()

    def add(self, item: Indexed) -> None:
        if item.entry_id in self._items:
            raise KeyError(f"entry {item.entry_id} already indexed")
        self._items[item.entry_id] = item
        for d in item.digests:
            self._by_digest.setdefault(d, set()).add(item.entry_id)
        if not item.digests:
            self._short.setdefault(item.scope, set()).add(item.entry_id)
        if item.session:
            self._by_session.setdefault((item.scope, item.session), set()).add(item.entry_id)

    def remove(self, entry_id: int) -> None:
        item = self._items.pop(entry_id, None)
        if item is None:
            return
        for d in item.digests:
            discard(self._by_digest, d, entry_id)
        if not item.digests:
            discard(self._short, item.scope, entry_id)
        if item.session:
            discard(self._by_session, (item.scope, item.session), entry_id)

    def session_entries(self, scope: bytes, session: str) -> list[int]:
        return sorted(self._by_session.get((scope, session), ()))

    def find(self, scope: bytes, session: str, prompt: np.ndarray,
             recency: dict[int, int]) -> tuple[int, int, bool] | None:
        """Best (entry id, usable tokens, via_session) or None; ties go to the most recent."""
        digests = page_digests(scope, prompt, self.page_tokens)
        best: tuple[int, int, int] | None = None  # (usable, recency, id)
        seen: set[int] = set()
        levels: list[set[int]] = [self._by_digest.get(d, set()) for d in reversed(digests)]
        levels.append(self._short.get(scope, set()))
        for depth, ids in enumerate(levels):
            pages = len(digests) - depth  # candidates first seen here share < (pages + 1) pages
            if best is not None and best[0] >= (pages + 1) * self.page_tokens:
                break
            best = self._evaluate(ids - seen, scope, prompt, recency, best)
            seen |= ids
        if best is not None:
            return best[2], best[0], False
        if session:
            best = self._evaluate(set(self.session_entries(scope, session)), scope, prompt, recency, None)
            if best is not None:
                return best[2], best[0], True
        return None

    def _evaluate(self, ids: set[int], scope: bytes, prompt: np.ndarray, recency: dict[int, int],
                  best: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        for eid in ids:
            item = self._items[eid]
            if item.scope != scope:
                continue
            n = usable_prefix(item.tokens, item.frontier, item.requires_state, prompt)
            if n <= 0:
                continue
            key = (n, recency.get(eid, 0), eid)
            if best is None or key > best:
                best = key
        return best
