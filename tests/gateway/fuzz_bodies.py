"""Hypothesis strategies of hostile HTTP request bodies for the gateway's POST endpoints,
shared by ``tests/gateway/test_fuzz_http_props.py`` and ``benchmarks/fuzz_http.py``.

A body is drawn as raw bytes (what goes on the wire) from one of:

- a *mutated* valid body of the endpoint: one to four fields (top-level or nested, e.g.
  ``messages[0].content``, ``tools[0].function.parameters``, ``metadata.user_id``) set to
  a hostile value or removed;
- a *generating* body (valid enough to reach the engine): tools with broken schemas, output
  scripts that emit tool calls, streaming or not, hostile limits (``max_tokens`` null/huge);
- *raw* bytes: deep nesting, huge number literals, NaN/Infinity, invalid UTF-8, truncation.

Hostile values: lone UTF-16 surrogates (written as ``\\ud800`` escapes, as
``json.dumps`` does), huge / negative / non-finite / null numbers, wrong types, deep
nesting, markup the parsers react to (``<tool_call>``, ``<think>``, special tokens).

``FAKE_SCRIPTS`` are the engine outputs a fuzzing gateway should serve (the triggers
appear in generated prompts).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses")

# the output the fake engine answers with when a trigger word occurs in the prompt
TRIGGERS = ("FUZZ_JSON_CALL", "FUZZ_XML_CALL", "FUZZ_EMOJI", "FUZZ_THINK", "FUZZ_BROKEN_CALL")
FAKE_OUTPUTS = {
    "FUZZ_JSON_CALL": '<tool_call>\n{"name": "f", "arguments": {"n": "3", "b": "true", "o": "{\\"k\\": 1}", '
                      '"s": "x"}}\n</tool_call>',
    "FUZZ_XML_CALL": "<tool_call>\r\n<function=f>\r\n<parameter=n>\r\n7\r\n</parameter>\r\n<parameter=s>\r\nhi\r\n"
                     "</parameter>\r\n</function>\r\n</tool_call>",
    "FUZZ_EMOJI": "😀👍🏽 日本語 — ünï " * 6,
    "FUZZ_THINK": "<think>\nhmm <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "FUZZ_BROKEN_CALL": "<tool_call>\n<function=f>\n<parameter=s>\nunterminated",
}

SURROGATES = ("\ud800", "\udfff", "a\udc00b", "\ud83d", "\ude00x", "\udbff\udbff")
MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>", "<|im_start|>", "<function=f>",
          "<parameter=n>", "\r\n", "\x00", "{{ raise_exception('x') }}", "{% for %}", *TRIGGERS)

surrogate_text = st.text(alphabet=st.characters() | st.characters(categories=["Cs"]), max_size=16)
texts = st.one_of(st.text(max_size=24), surrogate_text, st.sampled_from(SURROGATES + MARKUP),
                  st.sampled_from(("x" * 3000, "é" * 500, "")))
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from((0, -1, 1, 2**31, 2**32, 2**32 - 1, 2**63, 2**64, 10**30, -(10**30), 10**400)),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                      max_leaves=10)

BROKEN_SCHEMAS: tuple[Any, ...] = (
    None, [], "object", 5, {}, {"type": 5}, {"type": ["object", None]}, {"properties": []},
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": "n"},
    {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "zz"]},
    {"type": "object", "properties": {"n": {"anyOf": 3}, "b": {"type": "boolean"}, "o": {"type": "object"}}},
    {"type": "object", "properties": {"n": {"$ref": "#"}, "s": {"enum": [1, None, "x"]}}},
    {"type": "object", "properties": {"n": {"type": ["integer", "null"]}, "o": {"type": "array", "items": 7}}},
    {"type": "object", "properties": {"\ud800": {"type": "integer"}}},
    {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"oneOf": [{"type": "number"}]}]}}},
)
schemas = st.one_of(st.sampled_from(BROKEN_SCHEMAS), values)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "messages": _user("hi"), "max_tokens": 8},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 8},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": _user("hi")},
    "/v1/messages/count_tokens": {"model": "m", "messages": _user("hi")},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 8},
}

# Paths that may be set (created when missing); a path is a tuple of keys / list indices.
FIELDS: dict[str, tuple[tuple[Any, ...], ...]] = {
    "/v1/chat/completions": (
        ("messages",), ("messages", 0), ("messages", 0, "content"), ("messages", 0, "role"),
        ("messages", 0, "content", 0, "text"), ("messages", 1), ("messages", 1, "tool_calls"),
        ("messages", 1, "tool_calls", 0, "function", "arguments"), ("messages", 0, "name"), ("max_tokens",),
        ("max_completion_tokens",), ("temperature",), ("top_p",), ("top_k",), ("min_p",), ("seed",), ("stop",),
        ("n",), ("stream",), ("stream_options",), ("stream_options", "include_usage"), ("tools",),
        ("tools", 0, "function", "parameters"), ("tools", 0, "function", "name"), ("tool_choice",),
        ("tool_choice", "function", "name"), ("response_format",), ("chat_template_kwargs",),
        ("chat_template_kwargs", "enable_thinking"), ("reasoning_effort",), ("user",), ("prompt_cache_key",),
        ("logprobs",), ("repetition_penalty",), ("presence_penalty",), ("parallel_tool_calls",), ("model",),
    ),
    "/v1/completions": (
        ("prompt",), ("prompt", 0), ("max_tokens",), ("temperature",), ("stop",), ("stream",), ("echo",),
        ("suffix",), ("best_of",), ("user",), ("seed",), ("logprobs",), ("model",), ("stream_options",),
    ),
    "/v1/messages": (
        ("messages",), ("messages", 0), ("messages", 0, "content"), ("messages", 0, "content", 0),
        ("messages", 0, "content", 0, "text"), ("messages", 0, "role"), ("system",), ("system", 0, "text"),
        ("max_tokens",), ("stop_sequences",), ("stream",), ("temperature",), ("top_k",), ("top_p",), ("tools",),
        ("tools", 0, "input_schema"), ("tools", 0, "name"), ("tool_choice",), ("tool_choice", "type"),
        ("thinking",), ("thinking", "type"), ("metadata",), ("metadata", "user_id"), ("model",),
    ),
    "/v1/messages/count_tokens": (
        ("messages",), ("messages", 0, "content"), ("messages", 0, "content", 0), ("system",), ("tools",),
        ("tools", 0, "input_schema"), ("tool_choice",), ("thinking",), ("metadata", "user_id"), ("model",),
    ),
    "/v1/responses": (
        ("input",), ("input", 0), ("input", 0, "content"), ("input", 0, "content", 0, "text"), ("input", 0, "type"),
        ("input", 0, "arguments"), ("instructions",), ("tools",), ("tools", 0, "parameters"), ("tool_choice",),
        ("max_output_tokens",), ("temperature",), ("stream",), ("reasoning",), ("reasoning", "effort"), ("text",),
        ("user",), ("previous_response_id",), ("metadata",), ("model",),
    ),
}


def set_path(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``body`` with ``path`` set to ``value``, creating containers on the way (a list
    index past the end appends); ``value`` is ``DELETE`` to remove the field."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        items = list(body) if isinstance(body, list) else []
        child = items[key] if key < len(items) else {}
        new = set_path(child, rest, value)
        if new is DELETE:
            if key < len(items):
                del items[key]
        elif key < len(items):
            items[key] = new
        else:
            items.append(new)
        return items
    obj = dict(body) if isinstance(body, dict) else {}
    new = set_path(obj.get(key, {}), rest, value)
    if new is DELETE:
        obj.pop(key, None)
    else:
        obj[key] = new
    return obj


DELETE = object()


def dumps(body: Any) -> bytes:
    """JSON as a client library writes it: ASCII, lone surrogates as ``\\ud800`` escapes,
    non-finite floats as ``NaN``/``Infinity`` (which Python's json accepts)."""
    return json.dumps(body).encode()


@st.composite
def mutated(draw: st.DrawFn, endpoint: str) -> bytes:
    body: Any = json.loads(json.dumps(VALID[endpoint]))
    if draw(st.booleans()):
        body["stream"] = True
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(FIELDS[endpoint]))
        if draw(st.integers(0, 5)) == 0:
            body = set_path(body, path, DELETE)
        else:
            body = set_path(body, path, draw(values | st.sampled_from(BROKEN_SCHEMAS)))
    return dumps(body)


def _tools(endpoint: str, schema: Any) -> list[dict[str, Any]]:
    if endpoint.startswith("/v1/messages"):
        return [{"name": "f", "description": "fuzz", "input_schema": schema}]
    if endpoint == "/v1/responses":
        return [{"type": "function", "name": "f", "parameters": schema}]
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


@st.composite
def generating(draw: st.DrawFn, endpoint: str) -> bytes:
    """A body meant to reach the engine: prompt text with a trigger (tool-call outputs,
    multi-byte text), tools with broken schemas, hostile limits."""
    text = draw(st.sampled_from(TRIGGERS)) + " " + draw(st.text(max_size=12))
    body: dict[str, Any] = json.loads(json.dumps(VALID[endpoint]))
    if endpoint == "/v1/completions":
        body["prompt"] = text
    elif endpoint == "/v1/responses":
        body["input"] = text
    else:
        body["messages"] = _user(text)
    if endpoint != "/v1/completions" and draw(st.booleans()):
        body["tools"] = _tools(endpoint, draw(st.sampled_from(BROKEN_SCHEMAS) | schemas))
    if endpoint != "/v1/messages/count_tokens":
        body["stream"] = draw(st.booleans())
        limit = draw(st.sampled_from((None, 1, 3, 10**9, 2**64, 10**40)) | numbers)
        key = {"/v1/responses": "max_output_tokens"}.get(endpoint, "max_tokens")
        body[key] = limit
    return dumps(body)


def _nested(depth: int, opener: str, closer: str, leaf: str) -> str:
    return opener * depth + leaf + closer * depth


@st.composite
def raw(draw: st.DrawFn, endpoint: str) -> bytes:
    """Bytes that are not a sensible JSON body, or JSON at the edges of the decoder."""
    depth = draw(st.sampled_from((30, 200, 900, 5000, 200_000)))
    base = json.dumps(VALID[endpoint])
    deep_list = _nested(depth, "[", "]", "1")
    deep_obj = _nested(depth, '{"a":', "}", "1")
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return deep_list.encode()
    if choice == 1:  # deep nesting inside a field the gateway reads
        field = draw(st.sampled_from(("messages", "tools", "metadata", "prompt", "input", "system", "max_tokens")))
        return (base[:-1] + f', "{field}": ' + draw(st.sampled_from((deep_list, deep_obj))) + "}").encode()
    if choice == 2:  # number literals at the edges
        lit = draw(st.sampled_from(("1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1" * 5000, "1e-400", "-0",
                                    "1.0", "3.000000000000000001", "18446744073709551616")))
        key = draw(st.sampled_from(("max_tokens", "temperature", "top_p", "top_k", "seed", "max_output_tokens",
                                    "max_completion_tokens", "n")))
        return (base[:-1] + f', "{key}": {lit}' + "}").encode()
    if choice == 3:
        return base.encode()[: draw(st.integers(0, len(base) - 1))]  # truncated
    if choice == 4:  # invalid UTF-8 / encoded surrogates inside a string
        bad = draw(st.sampled_from((b"\xed\xa0\x80", b"\xff\xfe", b"\xc3", b"\x80abc")))
        return base.encode().replace(b'"hi"', b'"h' + bad + b'i"')
    if choice == 5:
        return draw(st.binary(max_size=64))
    if choice == 6:  # a lone surrogate escape in every spelling
        esc = draw(st.sampled_from(("\\ud800", "\\uDFFF", "\\udbff\\u0041", "\\ud83d\\ude00", "\\\\ud800")))
        return base.replace('"hi"', f'"h{esc}i"').encode()
    if choice == 7:  # duplicate keys, the last wins
        return (base[:-1] + ', "model": null, "model": "m"}').encode()
    if choice == 8:
        return dumps(draw(values))
    return (base[:-1] + ', "messages": [' + ", ".join(['{"role": "user", "content": "x"}'] * draw(
        st.integers(0, 300))) + "]}").encode()


def bodies(endpoint: str) -> st.SearchStrategy[bytes]:
    return st.one_of(mutated(endpoint), mutated(endpoint), generating(endpoint), raw(endpoint))
