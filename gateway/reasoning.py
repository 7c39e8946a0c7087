"""Split model output into reasoning (``<think>…</think>``) and content.

Contract:
- ``ReasoningSplitter(start_in_reasoning)``: when the rendered prompt already opened
  ``<think>`` (Qwen3.5/3.6 templates do), output starts inside reasoning. Otherwise an
  open tag is recognised only at the very start of the output (after whitespace); later
  it is literal content.
- ``feed(text)`` returns ``ReasoningDelta``/``ContentDelta`` events; ``finish()`` the held
  tail. Tags split across chunks are held back only as long as the tail could still be
  a tag prefix, so any chunking yields the same folded result as feeding everything.
- Whitespace right after the open tag and right after the close tag is dropped (the
  templates put newlines there); a repeated open tag at the start of reasoning is dropped.
- ``reasoning_closed`` tells whether ``</think>`` was seen; ``reasoning_text`` is all
  reasoning emitted (the tool pipeline recovers calls left inside a never-closed think).
"""

from __future__ import annotations

from deepwell.gateway.chat_types import ContentDelta, ReasoningDelta

DEFAULT_OPEN = "<think>"
DEFAULT_CLOSE = "</think>"


def prompt_opens_reasoning(prompt_text: str, open_tag: str = DEFAULT_OPEN, close_tag: str = DEFAULT_CLOSE) -> bool:
    """True when the prompt (its generation prologue) ends inside an open reasoning block,
    i.e. the model's first output token continues a ``<think>`` the template wrote."""
    return prompt_text.rstrip().endswith(open_tag)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    # states
    _START = 0  # nothing emitted yet, not in reasoning: an open tag may still come
    _REASONING = 1
    _CONTENT = 2

    def __init__(self, start_in_reasoning: bool, open_tag: str = DEFAULT_OPEN, close_tag: str = DEFAULT_CLOSE) -> None:
        if not open_tag or not close_tag:
            raise ValueError("reasoning tags must be non-empty")
        self.open_tag = open_tag
        self.close_tag = close_tag
        self._state = self._REASONING if start_in_reasoning else self._START
        self._buf = ""
        self._strip_ws = start_in_reasoning  # drop whitespace at the start of reasoning / content
        self._at_reasoning_start = start_in_reasoning
        self.reasoning_closed = False
        self.saw_reasoning = start_in_reasoning
        self._reasoning_parts: list[str] = []

    @property
    def in_reasoning(self) -> bool:
        return self._state == self._REASONING

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning_parts)

    def _emit_reasoning(self, out: list, text: str) -> None:
        if text:
            self._reasoning_parts.append(text)
            out.append(ReasoningDelta(text))

    def feed(self, text: str) -> list[ContentDelta | ReasoningDelta]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[ContentDelta | ReasoningDelta]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ContentDelta | ReasoningDelta]:
        out: list[ContentDelta | ReasoningDelta] = []
        while True:
            if self._strip_ws:
                stripped = self._buf.lstrip()
                if not stripped and not final:
                    self._buf = ""
                    return out
                self._buf = stripped
                self._strip_ws = False if stripped else self._strip_ws
            if self._state == self._START:
                probe = self._buf.lstrip()
                if probe.startswith(self.open_tag):
                    self._buf = probe[len(self.open_tag) :]
                    self._state = self._REASONING
                    self.saw_reasoning = True
                    self._strip_ws = True
                    self._at_reasoning_start = True
                    continue
                if not final and self.open_tag.startswith(probe):
                    return out  # could still become the open tag
                self._state = self._CONTENT
                continue
            if self._state == self._CONTENT:
                if self._buf:
                    out.append(ContentDelta(self._buf))
                self._buf = ""
                return out
            # reasoning
            if self._at_reasoning_start:
                if self._buf.startswith(self.open_tag):
                    self._buf = self._buf[len(self.open_tag) :]
                    self._strip_ws = True
                    continue
                if not final and self.open_tag.startswith(self._buf):
                    return out
                self._at_reasoning_start = False
            idx = self._buf.find(self.close_tag)
            if idx >= 0:
                self._emit_reasoning(out, self._buf[:idx])
                self._buf = self._buf[idx + len(self.close_tag) :]
                self._state = self._CONTENT
                self.reasoning_closed = True
                self._strip_ws = True
                continue
            hold = 0 if final else _partial_suffix(self._buf, self.close_tag)
            self._emit_reasoning(out, self._buf[: len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold :]
            return out
