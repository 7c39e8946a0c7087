"""Incremental detokenization: token ids in, text deltas out.

Contract:
- ``push(ids)`` returns the new text those ids complete; it never returns a partial
  UTF-8 character (a delta never ends in U+FFFD produced by an incomplete byte
  sequence). ``flush()`` returns whatever is still held (then possibly with U+FFFD for
  genuinely invalid bytes).
- The concatenation of every ``push`` and the final ``flush`` equals
  ``tokenizer.decode(all_ids, skip_special_tokens=...)`` for the tokenizers this project
  serves (byte-level BPE and SentencePiece-style Metaspace/byte-fallback decoders).

How: the prefix-window method (as in HF TGI / vLLM): decode a short window of already
emitted tokens (``prefix``) with and without the new tokens and emit the difference, so
decoders that depend on the left context (leading-space handling) stay right. The
window is bounded, so the cost per token is constant.
"""

from __future__ import annotations

from typing import Iterable, Protocol

_REPLACEMENT = "\ufffd"
# While the decoded tail is an incomplete UTF-8 sequence (ends in U+FFFD) only the tokens
# of that tail stay unread: the text up to the last complete character is emitted (found by
# decoding up to _TAIL_SEARCH tokens fewer), so a push of any size that ends inside a
# character is held like a one-token push. Past _MAX_HELD_TOKENS unread tokens the U+FFFD
# is treated as real (invalid bytes from the model) so the decode window stays bounded.
_MAX_HELD_TOKENS = 32
_TAIL_SEARCH = 8
# How many emitted tokens stay in the left-context window.
_PREFIX_WINDOW = 6


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the left-context window
        self._read_offset = 0  # tokens before this are fully emitted
        self._pending = 0  # chars of the unread tokens' text already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _text_after(self, prefix_text: str, upto: int) -> str:
        """The text of the unread tokens before ``upto`` (in their left context)."""
        full_text = self._decode(self._ids[self._prefix_offset : upto])
        if full_text.startswith(prefix_text):
            return full_text[len(prefix_text) :]
        # the left context decoded differently: what lies beyond the common part
        common = 0
        while common < min(len(prefix_text), len(full_text)) and prefix_text[common] == full_text[common]:
            common += 1
        return full_text[max(common, len(prefix_text)) :] if len(full_text) > len(prefix_text) else ""

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new = self._text_after(prefix_text, len(self._ids))
        if final or not new.endswith(_REPLACEMENT):
            return self._emit(new, len(self._ids))
        # an incomplete UTF-8 sequence at the end: emit up to the last complete character
        for upto in range(len(self._ids) - 1, max(self._read_offset, len(self._ids) - _TAIL_SEARCH), -1):
            text = self._text_after(prefix_text, upto)
            if not text.endswith(_REPLACEMENT) and len(text) >= self._pending:
                return self._emit(text, upto)
        if len(self._ids) - self._read_offset > _MAX_HELD_TOKENS:
            return self._emit(new, len(self._ids))  # a real U+FFFD: stop holding
        stable = new.rstrip(_REPLACEMENT)
        delta = stable[self._pending :]
        self._pending = max(self._pending, len(stable))
        return delta

    def _emit(self, text: str, upto: int) -> str:
        """Emit ``text`` (the unread tokens' text up to ``upto``) and mark them read."""
        delta = text[self._pending :]
        self._pending = 0
        self._read_offset = upto
        self._prefix_offset = max(0, upto - _PREFIX_WINDOW)
        return delta
