"""Engine selection: rendezvous (highest-random-weight) hashing on the session key.

Every engine gets the score ``blake2b(key | address)``; the healthy engine with the
highest score wins. A session therefore sticks to one engine while it is up, moves only
when that engine goes away, and comes back when it returns (minimal disruption: removing
one engine remaps only the sessions it held). Requests without a session key hash their
request id (spreading them). No healthy engine -> ``NoHealthyEngine`` (HTTP 503 with
``Retry-After`` / gRPC UNAVAILABLE).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol

from deepwell.gateway.surrogates import safe_utf8


class Routable(Protocol):
    address: str

    @property
    def healthy(self) -> bool: ...


class NoHealthyEngine(Exception):
    def __init__(self, retry_after_s: int, detail: str = "") -> None:
        super().__init__(f"no healthy engine is available{': ' + detail if detail else ''}")
        self.retry_after_s = retry_after_s


def score(key: str, address: str) -> int:
    # surrogatepass: a key is any str (a lone surrogate must not make routing fail)
    digest = hashlib.blake2b(safe_utf8(f"{key}\x00{address}"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, engines: Iterable[Routable]) -> list[Routable]:
    """Engines ordered by rendezvous score for ``key`` (best first), ties by address."""
    return sorted(engines, key=lambda e: (-score(key, e.address), e.address))


class Router:
    def __init__(self, engines: Sequence[Routable], retry_after_s: int = 2) -> None:
        if not engines:
            raise ValueError("Router needs at least one engine")
        self.engines = list(engines)
        self.retry_after_s = retry_after_s

    def healthy(self) -> list[Routable]:
        return [e for e in self.engines if e.healthy]

    def pick(self, key: str, exclude: Iterable[str] = ()) -> Routable:
        skip = set(exclude)
        for engine in rank(key, self.engines):
            if engine.healthy and engine.address not in skip:
                return engine
        raise NoHealthyEngine(self.retry_after_s, f"{len(self.engines)} configured, none healthy")
