"""The tag-scanning tool-call parser behind ``qwen_xml`` and ``hermes_json``.

Grammar (Qwen3-Coder / Qwen3.5 XML form; the template writes exactly these newlines)::

    <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>

and the Hermes JSON form ``<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>``.
A value is the text between ``<parameter=P>`` and its closer, minus one leading and one
trailing newline.

How the parser decides (each decision depends only on text already seen; when the
outcome could still change it waits, so any chunking gives the same result):
- Content: ``<tool_call>`` followed by ``<function=`` or ``{`` opens a call; a bare
  ``<tool_call>`` at a line start followed by anything else is malformed (a failure,
  the tag returned as text); mid-line it is prose. Inside a markdown code fence
  (``` or ~~~ at a line start) nothing is a call. Tolerant mode also opens a call on a
  line-start ``<function=NAME>`` followed by ``<parameter=`` or ``</function>``.
- Value end (depth-matching close scan): a line-start ``<parameter=NAME>`` inside a
  value opens a nested level and the next ``</parameter>`` closes it; a
  ``</parameter>`` at depth 0 ends the value only if what follows (after whitespace) is
  ``<parameter=``, ``</function>``, ``</tool_call>`` (tolerant: ``</function_invocation>``)
  or the end of the output. Anything else — literal closers, ``<tool_call>`` in file
  contents or fenced code — stays value bytes.
- Streaming: a parameter whose schema admits a string streams as JSON string fragments,
  holding back only a trailing newline and a ``<`` that could start a closer; other
  parameters are coerced by schema when they close (``coerce.py``).
- Recovery: a call that cannot be completed is returned as text (``ToolParseFailure``
  + ``ContentDelta``), cut at its first ``</tool_call>`` so later calls still parse.
  A call cut by ``finish_reason == "length"`` is always text. Tolerant mode accepts a
  missing ``</function>``/``</tool_call>``, stray closers and junk between parameters;
  a call shaped by such a recovery (or with no wrapper, or a body form only tolerant mode
  reads) that lacks an argument its schema requires is returned as text
  (``missing_required_argument``) instead of a call.

Layout: this module drives the scan (content, call lifecycle, failures); the XML body is
``xml_body.py``, the JSON body ``json_body.py``, shared tags/states ``grammar.py``.
"""

from __future__ import annotations

import json
from typing import Any

from deepwell.logs import get_logger
from deepwell.gateway.chat_types import ContentDelta, Event, ToolCallArgsDelta, ToolCallEnd, ToolCallSpec, ToolCallStart, ToolParseFailure
from deepwell.gateway.toolparse.base import ToolStreamParser
from deepwell.gateway.toolparse.grammar import (
    AFTER_FUNC,
    CONTENT,
    FENCE_PREFIX_RE,
    FENCE_RE,
    FUNC_BODY,
    FUNC_CLOSE,
    FUNC_INV_CLOSE,
    FUNC_OPEN,
    FUNC_RE,
    FUNC_TAG,
    JSON_BODY,
    PARAM_OPEN,
    POST_CALL,
    TOOL_CLOSE,
    TOOL_OPEN,
    VALUE,
    WAIT,
    CallState,
    is_prefix,
    match_tag,
)
from deepwell.gateway.toolparse.json_body import JsonBodyMixin
from deepwell.gateway.toolparse.xml_body import XmlBodyMixin

log = get_logger(__name__)

_WINDOW = 256  # chars of pending text a step sees at first
# recoveries that do not make the call itself a guess
_NOT_A_CALL_RECOVERY = frozenset({"recovered:stray_closer", "recovered:omitted_empty_value"})


class TaggedToolParser(XmlBodyMixin, JsonBodyMixin, ToolStreamParser):
    """Shared engine; subclasses choose which call bodies they accept."""

    formats_strict: tuple[str, ...] = ("xml",)
    formats_tolerant: tuple[str, ...] = ("xml", "json")

    def __init__(self, tools: list, tolerant: bool = True, **kw: Any) -> None:
        super().__init__(tools, tolerant, **kw)
        self._formats = self.formats_tolerant if tolerant else self.formats_strict
        self._buf = ""  # pending text: self._buf[self._pos:]
        self._pos = 0
        self._view = ""  # the window of pending text a step looks at
        self._state = CONTENT
        self._call: CallState | None = None
        self._at_line_start = True
        self._line_blank = True
        self._fence: str | None = None
        self._ws_hold = ""  # trailing whitespace of content, held until text follows
        self._hold_after_call = False  # ...and it followed a call (dropped at the end)
        self._content_seen = False
        self._reason = "stop"
        self._finished = False

    # ------------------------------------------------------------------ public
    def feed(self, text: str) -> list[Event]:
        if self._finished or not text:
            return []
        self._buf = self._buf[self._pos :] + text
        self._pos = 0
        return self._guarded(final=False)

    def finish(self, finish_reason: str = "stop") -> list[Event]:
        if self._finished:
            return []
        self._reason = finish_reason
        out = self._guarded(final=True)
        self._finished = True
        return out

    def _guarded(self, final: bool) -> list[Event]:
        out: list[Event] = []
        try:
            self._run(final, out)
            if final:
                self._finish_all(out)
        except Exception as exc:  # never raise into the stream: return what is left as text
            log.error("tool parser error; returning the rest as text", parser=self.name, error=repr(exc))
            pending = self._buf[self._pos :]
            rest = (self._call.pre_ws + "".join(self._call.raw) if self._call else "") + self._ws_hold + pending
            self._call, self._buf, self._pos, self._ws_hold, self._state = None, "", 0, "", CONTENT
            if rest:
                self._fail("internal_error", rest, out)
        return out

    # ------------------------------------------------------------------ driver
    def _run(self, final: bool, out: list[Event]) -> None:
        steps = {
            CONTENT: self._step_content,
            POST_CALL: self._step_post_call,
            FUNC_TAG: self._step_func_tag,
            FUNC_BODY: self._step_func_body,
            VALUE: self._step_value,
            AFTER_FUNC: self._step_after_func,
            JSON_BODY: self._step_json,
        }
        # Steps see a bounded window of the pending text (so consuming is O(window), not
        # O(pending)); a step that waits on a truncated window is retried with a larger
        # one, and it is told ``final`` only when it sees everything.
        while self._pos < len(self._buf):
            avail = len(self._buf) - self._pos
            width = min(avail, _WINDOW)
            while True:
                self._view = self._buf[self._pos : self._pos + width]
                truncated = width < avail
                progressed = steps[self._state](final and not truncated, out)
                if progressed or not truncated:
                    break
                width = min(avail, 2 * width)
            if not progressed:
                if final and self._call is None:
                    raise RuntimeError(f"parser state {self._state} made no progress at the end of the output")
                return

    def _finish_all(self, out: list[Event]) -> None:
        for _ in range(1_000_000):
            self._run(True, out)
            if self._call is None:
                break
            c = self._call
            if self._state in (FUNC_BODY, AFTER_FUNC) and self._pos >= len(self._buf):
                complete = self._state == AFTER_FUNC and (not c.wrapped)
                if complete or (self.tolerant and self._reason != "length"):
                    if not complete:
                        self._count("recovered:missing_closer")
                    self._end_call(out)
                    continue
            reason = "truncated" if self._reason == "length" else "unclosed_call"
            self._fail_at_finish(reason, out)
        if self._ws_hold and not self._hold_after_call:
            out.append(ContentDelta(self._ws_hold))
        self._ws_hold = ""

    # ------------------------------------------------------------------ helpers
    def _consume(self, n: int) -> str:
        t, self._view = self._view[:n], self._view[n:]
        self._pos += len(t)
        if self._call is not None:
            self._call.raw.append(t)
        return t

    def _track(self, text: str) -> None:
        if not text:
            return
        nl = text.rfind("\n")
        if nl >= 0:
            self._line_blank = not text[nl + 1 :].strip()
        else:
            self._line_blank = self._line_blank and not text.strip()
        self._at_line_start = text.endswith("\n")

    def _emit_text(self, text: str, out: list[Event]) -> None:
        self._track(text)
        text = self._ws_hold + text
        body = text.rstrip()
        self._ws_hold = text[len(body) :]
        if body:
            out.append(ContentDelta(body))
            self._content_seen = True
            self._hold_after_call = False

    def _fail(self, reason: str, text: str, out: list[Event]) -> None:
        text = self._ws_hold + text
        self._ws_hold = ""
        self._count(f"failure:{reason}")
        log.warning("tool call returned as text", parser=self.name, reason=reason, chars=len(text))
        out.append(ToolParseFailure(reason, text))
        out.append(ContentDelta(text))
        self._content_seen = True
        self._hold_after_call = False
        self._track(text)

    def _fail_call(self, reason: str, out: list[Event]) -> None:
        c = self._call
        assert c is not None
        self._call = None
        if not c.raw:  # guarantee progress (an implicit call with nothing consumed yet)
            c.raw.append(self._consume(1))
        self._state = CONTENT
        self._fail(reason, c.pre_ws + "".join(c.raw), out)

    def _fail_at_finish(self, reason: str, out: list[Event]) -> None:
        c = self._call
        assert c is not None
        raw = "".join(c.raw) + self._buf[self._pos :]
        self._pos = 0
        k = raw.find(TOOL_CLOSE, 1)
        if k >= 0 and k + len(TOOL_CLOSE) < len(raw):
            cut = k + len(TOOL_CLOSE)
            raw, self._buf = raw[:cut], raw[cut:]
        else:
            self._buf = ""
        self._call = None
        self._state = CONTENT
        self._fail(reason, c.pre_ws + raw, out)

    def _count(self, outcome: str) -> None:
        super()._count(outcome)
        if self._call is not None and outcome.startswith("recovered:") and outcome not in _NOT_A_CALL_RECOVERY:
            self._call.recovered = True

    def _start_call(self, wrapped: bool, n: int, body_state: int) -> None:
        body = "json" if body_state == JSON_BODY else "xml"
        # recovered: no <tool_call> wrapper, or a body form only tolerant mode reads
        self._call = CallState(wrapped=wrapped, pre_ws=self._ws_hold,
                               recovered=not wrapped or body not in self.formats_strict)
        self._ws_hold = ""
        if n:
            self._consume(n)
        self._state = body_state
        self._line_blank = self._at_line_start = False

    def _announce(self, name: str, out: list[Event]) -> None:
        c = self._call
        assert c is not None
        c.index = self.next_index
        self.next_index += 1
        c.id = self._new_id()
        c.name = name
        c.declared = name in self.tools
        out.append(ToolCallStart(c.index, c.id, name))

    def _key_prefix(self, name: str) -> str:
        c = self._call
        assert c is not None
        lead = "{" if c.keys_emitted == 0 else ", "
        c.keys_emitted += 1
        return lead + json.dumps(name, ensure_ascii=False) + ": "

    def _missing_required(self, c: CallState) -> list[str]:
        tool = self.tools.get(c.name)
        required = tool.parameters.get("required") if tool is not None else None
        if not isinstance(required, list):
            return []
        return [r for r in required if isinstance(r, str) and r not in c.args]

    def _end_call(self, out: list[Event]) -> None:
        c = self._call
        assert c is not None
        if c.recovered and self._missing_required(c):
            # a guess (tolerant recovery) that is not a valid call of the tool: its text, as written
            self._fail_call("missing_required_argument", out)
            return
        if not c.args_done:
            out.append(ToolCallArgsDelta(c.index, "}" if c.keys_emitted else "{}"))
        out.append(ToolCallEnd(c.index, ToolCallSpec(c.id, c.name, dict(c.args)), c.declared))
        self._count("call")
        if not c.declared:
            self._count("undeclared")
        self._call = None
        self._state = POST_CALL

    # ------------------------------------------------------------------ content
    def _opener(self, buf: str, final: bool) -> Any:
        """What a '<' in content starts: WAIT, None (literal), ("fail", reason) or
        (wrapped, consumed, state)."""
        if buf.startswith(TOOL_OPEN):
            r = buf[len(TOOL_OPEN) :].lstrip()
            n = len(buf) - len(r)
            if r.startswith(FUNC_OPEN) and "xml" in self._formats:
                return (True, n, FUNC_TAG)
            if r.startswith("{") and "json" in self._formats:
                return (True, n, JSON_BODY)
            if not final and (not r or ("xml" in self._formats and is_prefix(r, FUNC_OPEN))):
                return WAIT
            return ("fail", "no_function_after_tool_call") if self._line_blank else None
        if not final and is_prefix(buf, TOOL_OPEN):
            return WAIT
        if self.tolerant and "xml" in self._formats and self._line_blank:
            if buf.startswith(FUNC_OPEN):
                m = match_tag(buf, FUNC_RE, FUNC_OPEN, final)
                if m is WAIT or m is None:
                    return m
                after = buf[m.end() :].lstrip()
                if after.startswith(PARAM_OPEN) or after.startswith(FUNC_CLOSE):
                    return (False, 0, FUNC_TAG)
                if not final and (not after or is_prefix(after, PARAM_OPEN) or is_prefix(after, FUNC_CLOSE)):
                    return WAIT
                return None
            if not final and is_prefix(buf, FUNC_OPEN):
                return WAIT
        return None

    def _step_content(self, final: bool, out: list[Event]) -> bool:
        buf = self._view
        if self._at_line_start:
            m = FENCE_RE.match(buf)
            if m and (m.end() < len(buf) or final):
                run = m.group(1)
                if self._fence is None:
                    self._fence = run
                elif run[0] == self._fence[0] and len(run) >= len(self._fence):
                    self._fence = None
                self._emit_text(self._consume(m.end()), out)
                return True
            if not final and FENCE_PREFIX_RE.fullmatch(buf):
                return False
            self._at_line_start = False
        if self._fence is not None:
            j = buf.find("\n")
        else:
            lt, nl = buf.find("<"), buf.find("\n")
            j = lt if nl < 0 else nl if lt < 0 else min(lt, nl)
        if j != 0:
            self._emit_text(self._consume(len(buf) if j < 0 else j), out)
            return True
        if buf[0] == "\n":
            self._emit_text(self._consume(1), out)
            return True
        verdict = self._opener(buf, final)
        if verdict is WAIT:
            return False
        if verdict is None:
            self._emit_text(self._consume(1), out)
        elif verdict[0] == "fail":
            self._fail(verdict[1], self._consume(len(TOOL_OPEN)), out)
        else:
            wrapped, n, state = verdict
            if not wrapped:
                self._count("recovered:missing_tool_call_wrapper")
            self._start_call(wrapped, n, state)
        return True

    def _step_post_call(self, final: bool, out: list[Event]) -> bool:
        buf = self._view
        ws = len(buf) - len(buf.lstrip())
        if ws:
            # whitespace after a call separates it from later text; dropped when no
            # content came before or nothing follows
            text = self._consume(ws)
            if self._content_seen:
                self._ws_hold += text
                self._hold_after_call = True
            return True
        if self.tolerant:
            for closer in (TOOL_CLOSE, FUNC_CLOSE, FUNC_INV_CLOSE):
                if buf.startswith(closer):
                    self._consume(len(closer))
                    self._count("recovered:stray_closer")
                    return True
            if not final and any(is_prefix(buf, t) for t in (TOOL_CLOSE, FUNC_CLOSE, FUNC_INV_CLOSE)):
                return False
        self._state = CONTENT
        self._at_line_start = self._line_blank = True
        return True
