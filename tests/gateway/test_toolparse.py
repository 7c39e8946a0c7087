"""Tool-call parser conformance suite: every registered parser, both modes, the corpus.

- exact expected results for the corpus cases (tests/gateway/toolparse_corpus.py);
- streaming over any chunking (hypothesis splits, incl. multi-char chunks) equals the
  non-streaming result; no input (hypothesis fuzz over tag fragments) makes a parser
  raise; argument fragments concatenate to each call's final arguments.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepwell.gateway.chat_types import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, ToolParseFailure
from deepwell.gateway.toolparse import COUNTERS, PARSERS, get_parser, parser_for_template
from deepwell.gateway.toolparse.pipeline import OutputParser
from tests.gateway import toolparse_corpus as corpus

MODES = [(name, tolerant) for name in sorted(PARSERS) for tolerant in (True, False)]


def run(name: str, tolerant: bool, chunks: list[str], finish_reason: str = "stop") -> list:
    ids = iter(range(10_000))
    p = get_parser(name)(corpus.TOOLS, tolerant, id_factory=lambda: f"call_{next(ids)}")
    events = []
    for c in chunks:
        events += p.feed(c)
    events += p.finish(finish_reason)
    return events


def check_invariants(events: list) -> None:
    frags: dict[int, list[str]] = {}
    started: set[int] = set()
    ended: set[int] = set()
    for i, e in enumerate(events):
        if isinstance(e, ToolCallStart):
            assert e.index not in started
            started.add(e.index)
        elif isinstance(e, ToolCallArgsDelta):
            assert e.index in started and e.index not in ended
            frags.setdefault(e.index, []).append(e.json_fragment)
        elif isinstance(e, ToolCallEnd):
            assert e.index in started and e.index not in ended
            ended.add(e.index)
            assert json.loads("".join(frags.get(e.index, []))) == e.call.arguments
        elif isinstance(e, ToolParseFailure):
            assert e.reason != "internal_error", e
            nxt = events[i + 1]
            assert isinstance(nxt, ContentDelta) and nxt.text == e.raw_text
    assert sorted(ended) == list(range(len(ended))) or ended <= started


def expected_for(case, name: str, tolerant: bool):
    return case.expect.get((name, tolerant)) or case.expect.get(("*", tolerant))


EXACT = [
    (case, name, tolerant)
    for case in corpus.CASES
    for name, tolerant in MODES
    if expected_for(case, name, tolerant) is not None
]


@pytest.mark.parametrize(("case", "name", "tolerant"), EXACT, ids=[f"{c.name}-{n}-{'tol' if t else 'strict'}" for c, n, t in EXACT])
def test_corpus_exact(case, name: str, tolerant: bool) -> None:
    exp = expected_for(case, name, tolerant)
    events = run(name, tolerant, [case.text], case.finish_reason)
    check_invariants(events)
    got = corpus.fold(events)
    assert got["content"] == exp.content
    assert [(n, a) for n, a, _ in got["calls"]] == exp.calls
    assert [r for r, _ in got["failures"]] == exp.failures
    assert [n for n, _, declared in got["calls"] if not declared] == exp.undeclared


@pytest.mark.parametrize(("name", "tolerant"), MODES)
@pytest.mark.parametrize("case", corpus.CASES, ids=[c.name for c in corpus.CASES])
def test_char_by_char_equals_whole(case, name: str, tolerant: bool) -> None:
    whole = corpus.fold(run(name, tolerant, [case.text], case.finish_reason))
    events = run(name, tolerant, list(case.text), case.finish_reason)
    check_invariants(events)
    assert corpus.fold(events) == whole


@st.composite
def chunked(draw, text: str) -> list[str]:
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=40))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_chunking_equals_whole(data) -> None:
    case = data.draw(st.sampled_from(corpus.CASES))
    name, tolerant = data.draw(st.sampled_from(MODES))
    whole = corpus.fold(run(name, tolerant, [case.text], case.finish_reason))
    chunks = data.draw(chunked(case.text))
    events = run(name, tolerant, chunks, case.finish_reason)
    check_invariants(events)
    assert corpus.fold(events) == whole


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=write_file>", "<function=>", "</function>",
    "</function_invocation>", "<parameter=city>", "<parameter=days>", "<parameter=content>", "</parameter>",
    "<parameter=", "<function=", "<tool_", "</", "<", ">", "\n", "\n\n", " ", "```", "~~~", "{", "}", "[", "]", '"',
    "\\", ":", ",", '{"name": "get_weather", "arguments": {"city": "x"}}', '"name"', '"arguments"', "abc", "42",
    "true", "é😀", "<think>", "</think>",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=40),
    mode=st.sampled_from(MODES),
    reason=st.sampled_from(["stop", "length"]),
    data=st.data(),
)
def test_fuzz_never_raises_and_is_chunking_independent(parts, mode, reason, data) -> None:
    text = "".join(parts)
    name, tolerant = mode
    whole_events = run(name, tolerant, [text], reason)
    check_invariants(whole_events)
    events = run(name, tolerant, data.draw(chunked(text)), reason)
    check_invariants(events)
    assert corpus.fold(events) == corpus.fold(whole_events)


@pytest.mark.parametrize(("name", "tolerant"), MODES)
def test_long_string_argument_streams_as_it_arrives(name: str, tolerant: bool) -> None:
    if name == "hermes_json" and not tolerant:
        pytest.skip("hermes strict mode accepts only the JSON body, which is emitted per call")
    p = get_parser(name)(corpus.TOOLS, tolerant)
    events = p.feed("<tool_call>\n<function=write_file>\n<parameter=content>\n")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta]
    assert events[1].json_fragment == '{"content": "'
    got = []
    for piece in ["line one\n", "line </para", "meter> two\n", "<"]:
        got.append("".join(e.json_fragment for e in p.feed(piece) if isinstance(e, ToolCallArgsDelta)))
    # a trailing newline and a possible closer prefix are held back, nothing else
    assert got == ["line one", "\\nline ", "</parameter> two", ""]
    rest = p.feed("/parameter>\n</function>\n</tool_call>") + p.finish("stop")
    end = [e for e in rest if isinstance(e, ToolCallEnd)][0]
    assert end.call.arguments == {"content": "line one\nline </parameter> two"}


@pytest.mark.parametrize("tolerant", [True, False])
def test_hermes_arguments_stream_as_they_arrive(tolerant: bool) -> None:
    p = get_parser("hermes_json")(corpus.TOOLS, tolerant)
    events = p.feed('<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": "li')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta]
    assert events[0].name == "write_file" and events[1].json_fragment == '{"path": "a", "content": "li'
    assert p.feed('ne </tool_call> two"') == [ToolCallArgsDelta(0, 'ne </tool_call> two"')]
    rest = p.feed("}}\n</tool_call>") + p.finish("stop")
    assert rest[0] == ToolCallArgsDelta(0, "}")
    assert rest[1].call.arguments == {"path": "a", "content": "line </tool_call> two"}


def test_counters_record_outcomes() -> None:
    before = COUNTERS.snapshot()
    p = get_parser("qwen_xml")(corpus.TOOLS, True)
    p.feed("x\n<tool_call>\ngarbage\n" + corpus.xml_call("launch", {}))
    p.finish("stop")
    after = COUNTERS.snapshot()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta[("qwen_xml", "failure:no_function_after_tool_call")] == 1
    assert delta[("qwen_xml", "call")] == 1
    assert delta[("qwen_xml", "undeclared")] == 1
    assert p.outcomes == ["failure:no_function_after_tool_call", "call", "undeclared"]


def test_registry() -> None:
    assert set(PARSERS) == {"qwen_xml", "hermes_json"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        get_parser("nope")
    assert parser_for_template("...<tool_call>\n<function=x>\n<parameter=y>...", "") == "qwen_xml"
    assert parser_for_template('{{ "<tool_call>" }}{"name": ...}', "") == "hermes_json"
    assert parser_for_template("{{ messages }}", "qwen3_5") == "qwen_xml"
    assert parser_for_template("{{ messages }}", "llama") is None


@pytest.mark.parametrize(("case_name", "text", "start_in_reasoning", "exp", "reasoning"), corpus.THINK_CASES, ids=[c[0] for c in corpus.THINK_CASES])
def test_think_policy(case_name, text, start_in_reasoning, exp, reasoning) -> None:
    def go(chunks):
        op = OutputParser(corpus.TOOLS, "qwen_xml", start_in_reasoning=start_in_reasoning)
        ev = []
        for c in chunks:
            ev += op.feed(c)
        return ev + op.finish("stop")

    whole = go([text])
    check_invariants(whole)
    got = corpus.fold(whole)
    assert got["content"] == exp.content
    assert [(n, a) for n, a, _ in got["calls"]] == exp.calls
    assert got["reasoning"] == reasoning
    assert corpus.fold(go(list(text))) == got


ROUNDTRIP_ARGS = [
    {"city": "Paris", "days": 3, "zip": "02134", "metric": True, "ratio": 0.25},
    {"city": "", "opts": {"nested": {"a": [1, "x"]}, "ü": None}, "tags": ["a", "b"]},
    {"city": "\nleading and trailing newlines\n\n", "maybe": None, "code": "0042"},
    {"city": "value with </parameter> and </function>\n</tool_call> and <tool_call> inside"},
    {"city": "```python\nprint('<parameter=x>')\n```\n<parameter=y>\n1\n</parameter>"},
]


@pytest.mark.parametrize("args", ROUNDTRIP_ARGS)
@pytest.mark.parametrize(("template", "parser"), [("qwen3_5_xml", "qwen_xml"), ("qwen3_hermes", "hermes_json")])
def test_template_rendered_calls_parse_back(template: str, parser: str, args: dict) -> None:
    """What the model's own template writes for an assistant tool call is what the
    parser reads back, with schema-typed arguments (the XML form is text only)."""
    from deepwell.gateway.templates import ChatTemplate

    src = (pathlib.Path(__file__).parent / "templates" / f"{template}.jinja").read_text()
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
             {"id": "c2", "type": "function", "function": {"name": "list_files", "arguments": {}}}]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Checking.", "tool_calls": calls}]
    text = ChatTemplate(src).render(msgs)
    body = text.split("<|im_start|>assistant\n", 1)[1].rsplit("<|im_end|>", 1)[0]
    body = body.split("</think>\n\n", 1)[-1]
    for tolerant in (True, False):
        events = run(parser, tolerant, [body])
        check_invariants(events)
        got = corpus.fold(events)
        assert got["content"] == "Checking."
        assert [(n, a) for n, a, _ in got["calls"]] == [("get_weather", args), ("list_files", {})]
        assert corpus.fold(run(parser, tolerant, list(body))) == got


@pytest.mark.parametrize("window", [1, 3, 17])
def test_results_do_not_depend_on_the_scan_window(window: int, monkeypatch) -> None:
    """Steps see a bounded window of pending text and retry with a larger one when they
    must wait; a tiny window exercises every retry path."""
    from deepwell.gateway.toolparse import tagged

    expected = {
        (c.name, n, t): corpus.fold(run(n, t, [c.text], c.finish_reason)) for c in corpus.CASES for n, t in MODES
    }
    monkeypatch.setattr(tagged, "_WINDOW", window)
    for c in corpus.CASES:
        for n, t in MODES:
            events = run(n, t, [c.text], c.finish_reason)
            check_invariants(events)
            assert corpus.fold(events) == expected[(c.name, n, t)], (c.name, n, t)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=30), mode=st.sampled_from(MODES), data=st.data())
def test_fuzz_small_window(parts, mode, data, monkeypatch) -> None:
    from deepwell.gateway.toolparse import tagged

    text = "".join(parts)
    name, tolerant = mode
    whole = corpus.fold(run(name, tolerant, [text]))
    with monkeypatch.context() as m:
        m.setattr(tagged, "_WINDOW", 2)
        events = run(name, tolerant, data.draw(chunked(text)))
    check_invariants(events)
    assert corpus.fold(events) == whole


THINK_FRAGMENTS = FRAGMENTS + ["<think>\n", "\n</think>\n\n", corpus.xml_call("list_files", {}), corpus.json_call("list_files", {})]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.sampled_from(THINK_FRAGMENTS), max_size=20),
    start=st.booleans(),
    name=st.sampled_from(sorted(PARSERS)),
    reason=st.sampled_from(["stop", "length"]),
    data=st.data(),
)
def test_output_parser_is_chunking_independent(parts, start, name, reason, data) -> None:
    text = "".join(parts)

    def go(chunks):
        op = OutputParser(corpus.TOOLS, name, start_in_reasoning=start)
        ev = []
        for c in chunks:
            ev += op.feed(c)
        return ev + op.finish(reason)

    whole = go([text])
    check_invariants(whole)
    events = go(data.draw(chunked(text)))
    check_invariants(events)
    assert corpus.fold(events) == corpus.fold(whole)
    check_indices(events)


def check_indices(events: list) -> None:
    """Every started call takes the next index (dense over starts, each call once); a
    started call that never ends was abandoned (``base.py``): a failure reports it, and its
    index is not reused by a later call."""
    started = [e.index for e in events if isinstance(e, ToolCallStart)]
    ended = [e.index for e in events if isinstance(e, ToolCallEnd)]
    assert started == list(range(len(started)))
    assert ended == sorted(set(ended)) and set(ended) <= set(started)
    failures = sum(isinstance(e, ToolParseFailure) for e in events)
    assert len(started) - len(ended) <= failures


def test_abandoned_call_keeps_its_index() -> None:
    # found by the property test above: a tolerant XML call whose parameter never closes is
    # started, then returned as text at finish; the complete call after it takes index 1
    text = ('<function=get_weather><parameter=city></tool_call><tool_call>\n'
            '{"name": "list_files", "arguments": {}}\n</tool_call>')
    op = OutputParser(corpus.TOOLS, "hermes_json")
    events = op.feed(text) + op.finish("stop")
    check_invariants(events)
    check_indices(events)
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(e.index, e.call.name, e.call.arguments) for e in ends] == [(1, "list_files", {})]
    fail = next(e for e in events if isinstance(e, ToolParseFailure))
    assert fail.raw_text == "<function=get_weather><parameter=city></tool_call>"
