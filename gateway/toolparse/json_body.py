"""JSON call bodies (``{"name": ..., "arguments": {...}}``) for the tag-scanning parser.

A mixin of :class:`gateway.toolparse.tagged.TaggedToolParser`.

- The object is scanned string-aware and resumably (``JsonScan``), so ``</tool_call>``
  inside a string is value text; a ``<`` outside a string ends the block as
  ``invalid_json`` (the rest is parsed again as content).
- Streaming: when ``"name"`` (a string) comes before an ``"arguments"``/``"parameters"``
  object, ``ToolCallStart`` is emitted as soon as the name is complete and the raw text
  of the arguments object streams as it arrives (the model's own JSON), except that a
  string value of a parameter whose schema does not admit a string is held until it
  closes and then sent typed (``"3"`` -> ``3`` for an integer; ``coerce.py``).
- Otherwise the call is emitted once its object is complete: arguments given as a JSON
  string are decoded, then typed the same way. Either way the fragments concatenate to
  ``ToolCallEnd.call.arguments``.
- When the object completes, the streamed name and arguments must be what the whole
  object says (no duplicate keys changing them), else the call fails
  (``inconsistent_json_call``) and its text is returned.
"""

from __future__ import annotations

import json
from typing import Any

from deepwell.gateway.chat_types import Event, ToolCallArgsDelta
from deepwell.gateway.toolparse.coerce import admits_string, coerce_json_arguments, coerce_json_value, param_schema
from deepwell.gateway.toolparse.grammar import AFTER_FUNC

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
            in_args = depth == 2 and js.args_start >= 0 and js.args_end < 0
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
                    elif in_args and js.astr_start >= 0:
                        self._json_args_string(buf, i + 1, out)
            elif ch == '"':
                in_str = True
                if depth == 1:
                    js.str_start = i
                elif in_args:
                    self._json_args_string_opens(i)
            elif ch in "{[":
                if depth == 1 and ch == "{" and js.mode == "value" and js.key in _ARG_KEYS and c.index >= 0 and js.args_start < 0:
                    js.args_start = js.args_emitted = i
                    js.amode = "key"
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
            elif in_args:
                if ch == ":":
                    js.amode = "value"
                elif ch == ",":
                    js.amode = "key"
            i += 1
        js.pos, js.depth, js.in_str, js.esc = i, depth, in_str, esc
        if js.args_start >= 0:
            upto = js.args_end if js.args_end >= 0 else (end if end is not None else i)
            if js.hold_start >= 0:
                upto = min(upto, js.hold_start)
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
            c.args = args  # what the fragments say: as written, string values typed as they closed
        else:
            c.args = args
            out.append(ToolCallArgsDelta(c.index, json.dumps(args, ensure_ascii=False)))
        c.args_done = True
        self._state = AFTER_FUNC
        return True

    def _arg_schema(self, key: str | None) -> Any:
        tool = self.tools.get(self._call.name)
        return param_schema(tool.parameters, key) if tool is not None and key is not None else None

    def _json_args_string_opens(self, i: int) -> None:
        """A string starts at the top level of the streamed arguments (at ``i``): a key, or a
        value, held back when its parameter's schema does not admit a string."""
        js = self._call.js
        js.astr_start = i
        if js.amode == "value":
            schema = self._arg_schema(js.akey)
            if schema is not None and not admits_string(schema):
                js.hold_start = i

    def _json_args_string(self, buf: str, end: int, out: list[Event]) -> None:
        """The string that opened at ``astr_start`` closed before ``end``: remember a key; emit
        a held value typed by its schema (what ``coerce_json_arguments`` makes of it)."""
        c = self._call
        js = c.js
        raw = buf[js.astr_start : end]
        js.astr_start = -1
        if js.amode == "key":
            try:
                key = json.loads(raw)
            except ValueError:
                key = None
            js.akey = key if isinstance(key, str) else None
            js.amode = "colon"
            return
        if js.hold_start < 0:
            return
        if js.hold_start > js.args_emitted:
            out.append(ToolCallArgsDelta(c.index, buf[js.args_emitted : js.hold_start]))
        try:
            typed = json.dumps(coerce_json_value(json.loads(raw), self._arg_schema(js.akey)), ensure_ascii=False)
        except ValueError:  # not a valid JSON string: sent as written (the call then fails as invalid JSON)
            typed = raw
        out.append(ToolCallArgsDelta(c.index, typed))
        js.args_emitted = end
        js.hold_start = -1

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
