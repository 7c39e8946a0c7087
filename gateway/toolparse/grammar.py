"""Shared grammar pieces of the tag-scanning tool-call parsers: tags, states, the
per-call scan state. See ``tagged.py`` for the decision rules."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
FUNC_OPEN = "<function="
FUNC_CLOSE = "</function>"
FUNC_INV_CLOSE = "</function_invocation>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
NAME_MAX = 256
FUNC_RE = re.compile(r"<function=([^>\n]{1,256})>")
PARAM_RE = re.compile(r"<parameter=([^>\n]{1,256})>")
FENCE_RE = re.compile(r" {0,3}(`{3,}|~{3,})")
FENCE_PREFIX_RE = re.compile(r" {0,3}(`*|~*)")
WAIT = "wait"

# states
CONTENT, POST_CALL, FUNC_TAG, FUNC_BODY, VALUE, AFTER_FUNC, JSON_BODY = range(7)


def is_prefix(s: str, tag: str) -> bool:
    return len(s) < len(tag) and tag.startswith(s)


def match_tag(buf: str, regex: re.Pattern[str], opener: str, final: bool) -> re.Match[str] | str | None:
    """Match a ``<opener NAME>`` tag at the start of buf: the match, WAIT, or None."""
    m = regex.match(buf)
    if m and m.group(1).strip():
        return m
    if m or final:
        return None
    if is_prefix(buf, opener):
        return WAIT
    if buf.startswith(opener):
        rest = buf[len(opener) :]
        if len(rest) <= NAME_MAX and ">" not in rest and "\n" not in rest:
            return WAIT
    return None


NEWLINES = ("\r\n", "\n", "\r")  # value framing: one "\n" or "\r\n" (a lone "\r" may still become one)


def json_escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


@dataclass
class JsonScan:
    """Resumable string-aware scan of a JSON call object (indices into the parser buffer)."""

    pos: int = 0
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    mode: str = "key"  # at depth 1: key | colon | value
    key: str | None = None
    str_start: int = -1
    args_start: int = -1  # the streamed "arguments" object: [args_start, args_end)
    args_end: int = -1
    args_emitted: int = -1
    # inside the arguments object (depth 2): its keys, and a string value held back for typing
    amode: str = "key"  # key | colon | value
    akey: str | None = None
    astr_start: int = -1
    hold_start: int = -1  # a string value of a non-string parameter: [hold_start, closing quote]


@dataclass
class CallState:
    """Everything known about the call being parsed."""

    wrapped: bool
    pre_ws: str
    raw: list[str] = field(default_factory=list)
    index: int = -1
    id: str = ""
    name: str = ""
    declared: bool = True
    recovered: bool = False  # tolerant recovery shaped this call (then required arguments are checked)
    args: dict[str, Any] = field(default_factory=dict)
    keys_emitted: int = 0
    args_done: bool = False  # JSON form: the whole arguments object was emitted
    # current parameter (XML form)
    pname: str = ""
    pschema: Any = None
    pstream: bool = True
    pparts: list[str] = field(default_factory=list)
    lead_done: bool = False
    held_newline: str = ""  # a trailing "\n", "\r\n" or "\r" of the value so far (maybe its framing)
    line_start: bool = True
    depth: int = 0
    # JSON body scan (resumable)
    js: JsonScan = field(default_factory=JsonScan)

