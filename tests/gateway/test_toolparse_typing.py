"""Tool-call parsing: CRLF-framed values, schema typing of JSON-form arguments (streamed or
not), recovered calls missing a required argument, and streamed == non-streamed for a
split at every position (and random multi-way splits)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepwell.gateway.chat_types import ToolCallArgsDelta, ToolCallEnd, ToolCallStart, ToolDef, ToolParseFailure
from deepwell.gateway.toolparse import PARSERS, get_parser
from tests.gateway.toolparse_corpus import fold

TYPED = ToolDef("typed", "all the types", {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
                   "z": {"type": "null"}, "o": {"type": "object"}, "a": {"type": "array"},
                   "s": {"type": "string"}, "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                   "m": {"type": ["integer", "null"]}},
    "required": ["n"],
})
READ = ToolDef("read", "read a file", {"type": "object", "properties": {"path": {"type": "string"}},
                                       "required": ["path"]})
TOOLS = [TYPED, READ]
MODES = [(name, tolerant) for name in sorted(PARSERS) for tolerant in (True, False)]


def run(name: str, tolerant: bool, chunks: list[str], finish: str = "stop") -> list:
    ids = iter(range(1000))
    p = get_parser(name)(TOOLS, tolerant, id_factory=lambda: f"call_{next(ids)}")
    events = []
    for c in chunks:
        events += p.feed(c)
    return events + p.finish(finish)


def check_fragments(events: list) -> None:
    frags: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallArgsDelta):
            frags.setdefault(e.index, []).append(e.json_fragment)
        elif isinstance(e, ToolCallEnd):
            assert json.loads("".join(frags[e.index])) == e.call.arguments
        elif isinstance(e, ToolParseFailure):
            assert e.reason != "internal_error"


def every_split(name: str, tolerant: bool, text: str) -> dict:
    """The folded result of ``text`` fed whole; asserts every 2-way split gives the same."""
    whole = fold(run(name, tolerant, [text]))
    for i in range(len(text) + 1):
        events = run(name, tolerant, [text[:i], text[i:]])
        check_fragments(events)
        assert fold(events) == whole, (name, tolerant, i)
    return whole


def calls(folded: dict) -> list[tuple[str, dict]]:
    return [(n, a) for n, a, _ in folded["calls"]]


# ---------------------------------------------------------------------------- CRLF
CRLF_XML = ("<tool_call>\r\n<function=read>\r\n<parameter=path>\r\n/tmp/a b.txt\r\n</parameter>\r\n</function>\r\n"
            "</tool_call>")


@pytest.mark.parametrize("tolerant", [True, False])
def test_crlf_framed_value_has_no_stray_cr(tolerant):
    got = every_split("qwen_xml", tolerant, CRLF_XML)
    assert calls(got) == [("read", {"path": "/tmp/a b.txt"})] and got["content"] == ""
    # inner CRLFs are the value's own; one framing CRLF (or LF) on each side is removed
    text = CRLF_XML.replace("/tmp/a b.txt", "l1\r\nl2\r\n")
    assert calls(every_split("qwen_xml", tolerant, text)) == [("read", {"path": "l1\r\nl2\r\n"})]
    mixed = "<tool_call>\n<function=read>\n<parameter=path>\r\nv\n</parameter>\n</function>\n</tool_call>"
    assert calls(every_split("qwen_xml", tolerant, mixed)) == [("read", {"path": "v"})]
    lone_cr = "<tool_call>\n<function=read>\n<parameter=path>\nv\r</parameter>\n</function>\n</tool_call>"
    assert calls(every_split("qwen_xml", tolerant, lone_cr)) == [("read", {"path": "v\r"})]  # not a framing


def test_crlf_typed_xml_values():
    text = ("<tool_call>\r\n<function=typed>\r\n<parameter=n>\r\n3\r\n</parameter>\r\n<parameter=s>\r\n3\r\n"
            "</parameter>\r\n</function>\r\n</tool_call>")
    assert calls(every_split("qwen_xml", False, text)) == [("typed", {"n": 3, "s": "3"})]


# ---------------------------------------------------------------------------- JSON-form typing
HERMES_ARGS = {"n": "3", "x": "2.5", "b": "true", "z": "null", "o": '{"k": [1]}', "a": "[1, \"2\"]", "s": "7",
               "u": "8", "m": "null"}
TYPED_ARGS = {"n": 3, "x": 2.5, "b": True, "z": None, "o": {"k": [1]}, "a": [1, "2"], "s": "7", "u": "8", "m": None}


def hermes(args: dict | str, name: str = "typed", args_first: bool = False) -> str:
    if args_first:
        body = '{"arguments": ' + json.dumps(args) + ', "name": "' + name + '"}'
    else:
        body = json.dumps({"name": name, "arguments": args})
    return "<tool_call>\n" + body + "\n</tool_call>"


@pytest.mark.parametrize(("name", "tolerant"), MODES)
@pytest.mark.parametrize("form", ["streamed", "arguments_first", "string_arguments"])
def test_json_form_arguments_are_typed_by_schema(name, tolerant, form):
    if form == "streamed":
        text = hermes(HERMES_ARGS)
    elif form == "arguments_first":
        text = hermes(HERMES_ARGS, args_first=True)
    else:
        text = hermes(json.dumps(HERMES_ARGS))
    if name == "qwen_xml" and not tolerant:
        pytest.skip("strict qwen_xml reads no JSON bodies")
    assert calls(every_split(name, tolerant, text)) == [("typed", TYPED_ARGS)]


def test_streamed_json_arguments_stream_and_stay_conservative():
    # what does not parse is left as written; non-string values are never touched
    args = {"n": "three", "x": "1e999", "b": "yes", "o": "[1]", "a": "{}", "s": 5, "m": "", "n2": "4"}
    text = hermes({**args, "z": 0})
    got = every_split("hermes_json", False, text)
    assert calls(got) == [("typed", {**args, "z": 0})]
    # string values of string parameters stream as they arrive (before the call is complete)
    p = get_parser("hermes_json")([TYPED], False)
    full = hermes({"s": "abcdef", "n": "1"})
    early = p.feed(full[: full.index(', "n"')])
    frags = "".join(e.json_fragment for e in early if isinstance(e, ToolCallArgsDelta))
    assert any(isinstance(e, ToolCallStart) for e in early) and '"s": "abcdef"' in frags


def test_duplicate_and_escaped_keys():
    raw = '<tool_call>\n{"name": "typed", "arguments": {"n": "1", "\\u006e": "2", "s": "x"}}\n</tool_call>'
    got = every_split("hermes_json", False, raw)
    assert calls(got) == [("typed", {"n": 2, "s": "x"})]


# ---------------------------------------------------------------------------- required arguments
def test_recovered_call_missing_a_required_argument_is_text():
    unwrapped = "<function=read>\n<parameter=other>\nx\n</parameter>\n</function>"  # no wrapper, no path
    got = every_split("qwen_xml", True, unwrapped)
    assert got["calls"] == [] and got["content"] == unwrapped
    assert [r for r, _ in got["failures"]] == ["missing_required_argument"]
    unclosed = "<tool_call>\n<function=typed>\n<parameter=s>\nv\n</parameter>\n"  # missing closers and "n"
    got = every_split("qwen_xml", True, unclosed)
    assert got["calls"] == [] and got["content"] == unclosed
    # the same calls with their required argument are recovered as before
    assert calls(every_split("qwen_xml", True, unwrapped.replace("other", "path"))) == [("read", {"path": "x"})]
    assert calls(every_split("qwen_xml", True, unclosed.replace("=s>", "=n>").replace("v", "4"))) == [
        ("typed", {"n": 4})]
    # hermes tolerant: an XML body is a recovery too
    xml_in_hermes = "<tool_call>\n<function=read>\n</function>\n</tool_call>"
    got = every_split("hermes_json", True, xml_in_hermes)
    assert got["calls"] == [] and got["failures"][0][0] == "missing_required_argument"


def test_well_formed_call_missing_a_required_argument_is_still_a_call():
    text = "<tool_call>\n<function=read>\n</function>\n</tool_call>"
    for tolerant in (True, False):
        assert calls(every_split("qwen_xml", tolerant, text)) == [("read", {})]
    assert calls(every_split("hermes_json", False, hermes({}, "read"))) == [("read", {})]


def test_later_calls_still_parse_after_a_refused_recovery():
    text = ("<function=read>\n<parameter=other>\nx\n</parameter>\n</function>\n"
            "<tool_call>\n<function=read>\n<parameter=path>\np\n</parameter>\n</function>\n</tool_call>")
    got = every_split("qwen_xml", True, text)
    assert calls(got) == [("read", {"path": "p"})]
    assert got["content"].startswith("<function=read>")


# ---------------------------------------------------------------------------- random splits
SAMPLES = [CRLF_XML, hermes(HERMES_ARGS), hermes(HERMES_ARGS, args_first=True), hermes(json.dumps(HERMES_ARGS)),
           "<function=read>\n<parameter=other>\nx\n</parameter>\n</function>",
           "Sure.\r\n" + CRLF_XML + "\r\n" + hermes({"n": "5", "s": "q"}) + "\r\nDone.",
           hermes({"n": "1", "o": '{"a": "}"}', "s": "<tool_call>\r\n"})]


@settings(max_examples=200, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_splits_equal_whole(data):
    text = data.draw(st.sampled_from(SAMPLES))
    name, tolerant = data.draw(st.sampled_from(MODES))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=30))))
    bounds = [0, *cuts, len(text)]
    events = run(name, tolerant, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    check_fragments(events)
    assert fold(events) == fold(run(name, tolerant, [text]))
