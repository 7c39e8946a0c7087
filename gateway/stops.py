"""Stop strings matched on the detokenized text stream, with minimal hold-back.

Contract:
- ``push(text)`` returns ``(emit, matched)``. ``emit`` is text that can no longer be part
  of a stop string; the matcher holds back only the longest tail of the stream that is a
  proper prefix of some stop string. When a stop string completes, ``emit`` is the text
  before it, ``matched`` is that stop string, and the matcher is done: later pushes return
  ``("", None)``.
- Rule when several stops could match: the one that completes first in the stream wins
  (ties: the one that starts first). This is chunking-independent, so streaming equals
  matching the whole text at once.
- ``flush()`` returns the held-back tail (the stream ended without a match).
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = list(dict.fromkeys(stops))
        self._max = max((len(s) for s in self._stops), default=0)
        self._buf = ""
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> tuple[str, str | None]:
        if self.done:
            return "", None
        if not self._stops:
            return text, None
        buf = self._buf + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            self._buf = ""
            self.matched = best[2]
            return buf[: best[1]], best[2]
        hold = len(buf)
        for i in range(max(0, len(buf) - self._max + 1), len(buf)):
            tail = buf[i:]
            if any(s.startswith(tail) for s in self._stops):
                hold = i
                break
        self._buf = buf[hold:]
        return buf[:hold], None

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out
