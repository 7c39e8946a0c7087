"""Typed results of the KV-cache client: every call returns a ``Result``, never raises.

``Code`` extends the daemon's ``ErrorCode`` with client-side outcomes: ``UNAVAILABLE``
(daemon down, circuit open, or retries exhausted) and ``REJECTED`` (the daemon refused the
request as malformed, INVALID_ARGUMENT). The engine treats every non-OK result as a miss.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class Code(enum.IntEnum):
    OK = 0
    STALE = 1
    NOT_FOUND = 2
    RESOURCE_EXHAUSTED = 3
    QUOTA_EXCEEDED = 4
    INVALID = 5
    INCOMPLETE = 6
    UNKNOWN_CLIENT = 7
    INTERNAL = 8
    UNAVAILABLE = 100
    REJECTED = 101


@dataclass(frozen=True)
class Result(Generic[T]):
    code: Code
    message: str = ""
    reply: T | None = None

    @property
    def ok(self) -> bool:
        return self.code == Code.OK

    def __bool__(self) -> bool:
        return self.ok
