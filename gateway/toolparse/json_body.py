"""JSON call bodies (``{"name": ..., "arguments": {...}}``) for the tag-scanning parser.

A mixin of :class:`gateway.toolparse.tagged.TaggedToolParser`.

- The object is scanned string-aware and resumably (``JsonScan``), so ``</tool_call>``
  inside a string is value text; a ``<`` outside a string ends the block as
  ``invalid_json`` (the rest is parsed again as content).
- Streaming: when ``"name"`` (a string) comes before an ``"arguments"``/``"parameters"``
  object, ``ToolCallStart`` is emitted as soon as the name is complete and the raw text
  of the arguments object streams as it arrives (the model's own JSON; fragments
  concatenate to it). Such streamed arguments are kept as the model typed them.
- Otherwise the call is emitted once its object is complete: arguments given as a JSON
  string are decoded and string values of non-string parameters are coerced by schema.
- When the object completes, the streamed name and arguments must be what the whole
  object says (no duplicate keys changing them), else the call fails
  (``inconsistent_json_call``) and its text is returned.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.chat_types import Event, ToolCallArgsDelta
from gateway.toolparse.coerce import coerce_json_arguments
from gateway.toolparse.grammar import AFTER_FUNC

_ARG_KEYS = ("arguments", "parameters")


class JsonBodyMixin:
    _view: str
    _call: Any
    _state: int
    tools: dict[str, Any]

    def _json_top_string(self, s: str, out: list[Event]) -> None:
        """A complete string at depth 1 of the call object: a key, or a value."""
        c = self._call
        js = c.js
        try:
            value = json.loads(s)
        except ValueError:
            value = None
        if js.mode == "key":
            js.key = value if isinstance(value, str) else None
            js.mode = "colon"
        elif js.mode == "value" and js.key == "name" and c.index < 0 and js.args_start < 0:
            if isinstance(value, str) and value.strip():
                self._announce(value.strip(), out)

    def _step_json(self, final: bool, out: list[Event]) -> bool:
        c = self._call
        assert c is not None
        js = c.js
        buf = self._view
        end = None
        i, depth, in_str, esc = js.pos, js.depth, js.in_str, js.esc
        n = len(buf)
        while i < n:
            ch = buf[i]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
                    if depth == 1 and js.str_start >= 0:
                        self._json_top_string(buf[js.str_start : i + 1], out)
                        js.str_start = -1
            elif ch == '"':
                in_str = True
                if depth == 1:
                    js.str_start = i
            elif ch in "{[":
                if depth == 1 and ch == "{" and js.mode == "value" and js.key in _ARG_KEYS and c.index >= 0 and js.args_start < 0:
                    js.args_start = js.args_emitted = i
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 1 and js.args_start >= 0 and js.args_end < 0:
                    js.args_end = i + 1
                if depth <= 0:
                    end = i + 1
                    break
            elif ch == "<":
                self._consume(i)
                self._fail_call("invalid_json", out)
                return True
            elif depth == 1:
                if ch == ":":
                    js.mode = "value"
                elif ch == ",":
                    js.mode = "key"
            i += 1
        js.pos, js.depth, js.in_str, js.esc = i, depth, in_str, esc
        if js.args_start >= 0:
            upto = js.args_end if js.args_end >= 0 else (end if end is not None else i)
            if upto > js.args_emitted:
                out.append(ToolCallArgsDelta(c.index, buf[js.args_emitted : upto]))
                js.args_emitted = upto
        if end is None:
            return False
        text = self._consume(end)
        parsed = self._parse_json_call(text)
        if isinstance(parsed, str):
            self._fail_call(parsed, out)
            return True
        name, raw_args, args = parsed
        if c.index < 0:
            self._announce(name, out)
        elif name != c.name:
            self._fail_call("inconsistent_json_call", out)
            return True
        if js.args_end >= 0:
            try:
                streamed = json.loads(text[js.args_start : js.args_end])
            except ValueError:
                streamed = None
            if streamed != raw_args:
                self._fail_call("inconsistent_json_call", out)
                return True
            c.args = streamed
        else:
            c.args = args
            out.append(ToolCallArgsDelta(c.index, json.dumps(args, ensure_ascii=False)))
        c.args_done = True
        self._state = AFTER_FUNC
        return True

    def _parse_json_call(self, text: str) -> tuple[str, Any, dict[str, Any]] | str:
        """(name, arguments as written, schema-coerced arguments) or a failure reason."""
        try:
            obj = json.loads(text)
        except ValueError:
            return "invalid_json"
        if not isinstance(obj, dict):
            return "invalid_json"
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            return "missing_name"
        raw = obj.get("arguments", obj.get("parameters", {}))
        args = raw
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return "arguments_not_json"
        if not isinstance(args, dict):
            return "arguments_not_object"
        name = name.strip()
        tool = self.tools.get(name)
        return name, raw, coerce_json_arguments(args, tool.parameters if tool else None)
