"""Lone UTF-16 surrogates in request JSON: found and named before anything else runs.

JSON allows ``"\\ud800"`` (an escaped surrogate with no partner); Python decodes it to a
``str`` that cannot be encoded as UTF-8, so a tokenizer, a hash or a protobuf field would
fail on it deep inside the request path. The gateway refuses such a request up front
with a 400 naming the field (``messages[0].content[1].text``) — see ``docs/gateway.md``.

:func:`find_lone_surrogate` walks a decoded JSON value (iteratively: no recursion limit)
and returns where the first one is; :func:`may_contain_surrogate` is a cheap pre-check on
the body text (a surrogate can only come from a ``\\uD800``-``\\uDFFF`` escape once the
body was decoded strictly: ``json.loads(bytes)`` itself would let UTF-8-encoded
surrogates through, so the gateway decodes the bytes first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


@dataclass(frozen=True, slots=True)
class SurrogateAt:
    path: str  # e.g. "messages[0].content" ("" = the value itself)
    offset: int  # character offset of the surrogate in that string
    code: int  # the surrogate's code point
    in_key: bool = False  # the surrogate is in an object key at ``path``

    def message(self, where: str = "") -> str:
        field = ".".join(p for p in (where, self.path) if p) or "the request body"
        what = "an object key in " + field if self.in_key else field
        return (f"{what} contains a lone UTF-16 surrogate (\\u{self.code:04x}) at character {self.offset}, which is "
                f"not valid Unicode: send well-formed text (pair the surrogate or replace it, e.g. with U+FFFD)")


def may_contain_surrogate(raw: str) -> bool:
    """False when ``raw`` (a JSON text, strictly decoded) certainly parses without surrogates."""
    return _ESCAPE.search(raw) is not None


def _in(text: str) -> re.Match[str] | None:
    return None if text.isascii() else _SURROGATE.search(text)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def find_lone_surrogate(value: Any) -> SurrogateAt | None:
    """Where the first lone surrogate of a decoded JSON value is (depth-first), or None."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            m = _in(v)
            if m is not None:
                return SurrogateAt(path, m.start(), ord(m.group()))
        elif isinstance(v, dict):
            items = list(v.items())
            for k, _ in items:
                m = _in(k) if isinstance(k, str) else None
                if m is not None:
                    return SurrogateAt(path, m.start(), ord(m.group()), in_key=True)
            stack.extend((_join(path, k if isinstance(k, str) else str(k)), x) for k, x in reversed(items))
        elif isinstance(v, list):
            stack.extend((_join(path, i), x) for i, x in reversed(list(enumerate(v))))
    return None


def safe_utf8(text: str) -> bytes:
    """``text`` as UTF-8 even when it holds lone surrogates (hashing, logging)."""
    return text.encode("utf-8", "surrogatepass")
