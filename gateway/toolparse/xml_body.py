"""XML call bodies (``<function=NAME>`` ... ``</function>``) for the tag-scanning parser.

A mixin of :class:`gateway.toolparse.tagged.TaggedToolParser`; the decision rules (value
end by depth-matching close scan with look-ahead, tolerant recoveries) are described
there and in ``docs/tool-calls.md``.
"""

from __future__ import annotations

import json
from typing import Any

from deepwell.gateway.chat_types import Event, ToolCallArgsDelta
from deepwell.gateway.toolparse.coerce import OMIT, coerce_text, is_streamable, param_schema
from deepwell.gateway.toolparse.grammar import (
    AFTER_FUNC,
    FUNC_BODY,
    FUNC_CLOSE,
    FUNC_INV_CLOSE,
    FUNC_OPEN,
    FUNC_RE,
    NEWLINES,
    PARAM_CLOSE,
    PARAM_OPEN,
    PARAM_RE,
    TOOL_CLOSE,
    TOOL_OPEN,
    VALUE,
    WAIT,
    is_prefix,
    json_escape,
    match_tag,
)


class XmlBodyMixin:
    _view: str
    _call: Any
    _state: int
    tolerant: bool
    tools: dict[str, Any]

    def _step_func_tag(self, final: bool, out: list[Event]) -> bool:
        m = match_tag(self._view, FUNC_RE, FUNC_OPEN, final)
        if m is WAIT:
            return False
        if m is None:
            self._fail_call("malformed_function_tag", out)
            return True
        self._consume(m.end())
        self._announce(m.group(1).strip(), out)
        self._state = FUNC_BODY
        return True

    def _step_func_body(self, final: bool, out: list[Event]) -> bool:
        buf = self._view
        ws = len(buf) - len(buf.lstrip())
        if ws:
            self._consume(ws)
            return True
        c = self._call
        assert c is not None
        if buf.startswith(PARAM_OPEN):
            m = match_tag(buf, PARAM_RE, PARAM_OPEN, final)
            if m is WAIT:
                return False
            if m is not None:
                self._consume(m.end())
                self._open_param(m.group(1).strip(), out)
                return True
        elif buf.startswith(FUNC_CLOSE) or (self.tolerant and buf.startswith(FUNC_INV_CLOSE)):
            self._consume(len(FUNC_CLOSE) if buf.startswith(FUNC_CLOSE) else len(FUNC_INV_CLOSE))
            self._state = AFTER_FUNC
            return True
        elif buf.startswith(TOOL_CLOSE):
            if not self.tolerant:
                self._fail_call("missing_function_close", out)
                return True
            self._consume(len(TOOL_CLOSE))
            self._count("recovered:missing_function_close")
            self._end_call(out)
            return True
        elif not final and any(is_prefix(buf, t) for t in (PARAM_OPEN, FUNC_CLOSE, FUNC_INV_CLOSE, TOOL_CLOSE)):
            return False
        if not self.tolerant:
            self._fail_call("unexpected_text_in_function", out)
            return True
        nxt = buf.find("<", 1)
        self._consume(len(buf) if nxt < 0 else nxt)
        self._count("recovered:skipped_junk")
        return True

    def _open_param(self, name: str, out: list[Event]) -> None:
        c = self._call
        assert c is not None
        tool = self.tools.get(c.name)
        c.pname = name
        c.pschema = param_schema(tool.parameters, name) if tool else None
        c.pstream = is_streamable(c.pschema)
        c.pparts = []
        c.lead_done = False
        c.held_newline = ""
        c.line_start = True
        c.depth = 0
        if c.pstream:
            out.append(ToolCallArgsDelta(c.index, self._key_prefix(name) + '"'))
        self._state = VALUE

    def _value_bytes(self, text: str, out: list[Event]) -> None:
        c = self._call
        assert c is not None
        if not text:
            return
        c.line_start = text.endswith("\n")
        text, c.held_newline = c.held_newline + text, ""
        for nl in NEWLINES:  # held back: the value's closing framing, if a closer follows
            if text.endswith(nl):
                text, c.held_newline = text[: -len(nl)], nl
                break
        if text:
            c.pparts.append(text)
            if c.pstream:
                out.append(ToolCallArgsDelta(c.index, json_escape(text)))

    def _close_param(self, out: list[Event]) -> None:
        c = self._call
        assert c is not None
        if c.held_newline == "\r":  # a lone CR before the closer is value text, not framing
            c.pparts.append("\r")
            if c.pstream:
                out.append(ToolCallArgsDelta(c.index, json_escape("\r")))
        c.held_newline = ""
        value = "".join(c.pparts)
        if c.pstream:
            out.append(ToolCallArgsDelta(c.index, '"'))
            c.args[c.pname] = value
        else:
            typed = coerce_text(value, c.pschema)
            if typed is OMIT:
                self._count("recovered:omitted_empty_value")
            else:
                frag = self._key_prefix(c.pname) + json.dumps(typed, ensure_ascii=False)
                out.append(ToolCallArgsDelta(c.index, frag))
                c.args[c.pname] = typed
        self._state = FUNC_BODY

    def _closer_verdict(self, after: str, final: bool) -> str:
        r = after.lstrip()
        tags = (PARAM_OPEN, FUNC_CLOSE, TOOL_CLOSE) + ((FUNC_INV_CLOSE,) if self.tolerant else ())
        if not r:
            return "accept" if final else WAIT
        if any(r.startswith(t) for t in tags):
            return "accept"
        if any(is_prefix(r, t) for t in tags):
            return "accept" if final else WAIT
        return "reject"

    def _missing_param_close(self, buf: str, final: bool) -> str:
        """Tolerant: a line-start ``</function>`` at depth 0 ends the value (its
        ``</parameter>`` is missing) only when the call visibly ends there: followed by
        ``</tool_call>`` and then the end of the output or another ``<tool_call>`` (an
        unwrapped call: followed by the end of the output)."""
        c = self._call
        assert c is not None
        if not buf.startswith(FUNC_CLOSE):
            return WAIT  # a proper prefix of </function> (not final)
        r = buf[len(FUNC_CLOSE) :].lstrip()
        if not r:
            return "accept" if final and not c.wrapped else (WAIT if not final else "reject")
        if not r.startswith(TOOL_CLOSE):
            return WAIT if not final and is_prefix(r, TOOL_CLOSE) else "reject"
        r2 = r[len(TOOL_CLOSE) :].lstrip()
        if not r2:
            return "accept" if final else WAIT
        if r2.startswith(TOOL_OPEN):
            return "accept"
        return WAIT if not final and is_prefix(r2, TOOL_OPEN) else "reject"

    def _step_value(self, final: bool, out: list[Event]) -> bool:
        c = self._call
        assert c is not None
        buf = self._view
        if not c.lead_done:  # one leading "\n" or "\r\n" is framing
            if buf == "\r" and not final:
                return False
            if buf.startswith("\r\n") or buf[0] == "\n":
                self._consume(2 if buf[0] == "\r" else 1)
            c.lead_done = True
            return True
        j = buf.find("<")
        if j != 0:
            self._value_bytes(self._consume(len(buf) if j < 0 else j), out)
            return True
        if buf.startswith(PARAM_CLOSE):
            if c.depth > 0:
                c.depth -= 1
                self._value_bytes(self._consume(len(PARAM_CLOSE)), out)
                return True
            verdict = self._closer_verdict(buf[len(PARAM_CLOSE) :], final)
            if verdict is WAIT:
                return False
            if verdict == "accept":
                self._consume(len(PARAM_CLOSE))
                self._close_param(out)
            else:
                self._value_bytes(self._consume(len(PARAM_CLOSE)), out)
            return True
        if not final and is_prefix(buf, PARAM_CLOSE):
            return False
        if self.tolerant and c.depth == 0 and c.line_start and (buf.startswith(FUNC_CLOSE) or (not final and is_prefix(buf, FUNC_CLOSE))):
            verdict = self._missing_param_close(buf, final)
            if verdict is WAIT:
                return False
            if verdict == "accept":
                self._consume(len(FUNC_CLOSE))
                self._count("recovered:missing_parameter_close")
                self._close_param(out)
                self._state = AFTER_FUNC
                return True
        if c.line_start:
            m = match_tag(buf, PARAM_RE, PARAM_OPEN, final)
            if m is WAIT:
                return False
            if m is not None:
                c.depth += 1
                self._value_bytes(self._consume(m.end()), out)
                return True
        self._value_bytes(self._consume(1), out)
        return True

    def _step_after_func(self, final: bool, out: list[Event]) -> bool:
        buf = self._view
        ws = len(buf) - len(buf.lstrip())
        if ws:
            self._consume(ws)
            return True
        c = self._call
        assert c is not None
        if buf.startswith(TOOL_CLOSE):
            self._consume(len(TOOL_CLOSE))
            self._end_call(out)
            return True
        if self.tolerant:
            for closer in (FUNC_CLOSE, FUNC_INV_CLOSE):
                if buf.startswith(closer):
                    self._consume(len(closer))
                    self._count("recovered:stray_closer")
                    return True
        if not final and any(is_prefix(buf, t) for t in (TOOL_CLOSE, FUNC_CLOSE, FUNC_INV_CLOSE)):
            return False
        if c.wrapped and not self.tolerant:
            self._fail_call("missing_tool_call_close", out)
            return True
        if c.wrapped:
            self._count("recovered:trailing_text")
        self._end_call(out)
        return True
