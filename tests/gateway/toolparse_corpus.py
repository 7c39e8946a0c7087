"""Corpus of model outputs for the tool-call parser conformance suite.

Each :class:`Case` is one complete model output plus the expected folded result for
the parser modes it names (``expect`` maps ``(parser_name, tolerant)`` to an
:class:`Expected`; a key ``("*", tolerant)`` applies to every registered parser). Every
case, whatever its ``expect``, also runs through the chunking-equivalence and no-raise
checks for every parser and mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepwell.gateway.chat_types import ToolDef

WEATHER = ToolDef(
    "get_weather",
    "Weather for a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "zip": {"type": "string"},
            "metric": {"type": "boolean"},
            "ratio": {"type": "number"},
            "opts": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "maybe": {"type": ["integer", "null"]},
            "code": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        },
        "required": ["city"],
    },
)
WRITE = ToolDef(
    "write_file",
    "Write a file",
    {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
)
LIST = ToolDef("list_files", "List files", {"type": "object", "properties": {}})
TOOLS = [WEATHER, WRITE, LIST]


@dataclass(frozen=True)
class Expected:
    content: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # reasons, in order
    undeclared: list[str] = field(default_factory=list)  # names of undeclared calls


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    expect: dict[tuple[str, bool], Expected] = field(default_factory=dict)
    finish_reason: str = "stop"


def xml_call(name: str, params: dict[str, str], wrap: bool = True) -> str:
    """A call exactly as the Qwen3.5 template renders it."""
    body = f"<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) + "</function>"
    return f"<tool_call>\n{body}\n</tool_call>" if wrap else body


def json_call(name: str, args: dict[str, Any]) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


BOTH = ("*", True)  # every parser, tolerant mode
XML_T = ("qwen_xml", True)
XML_S = ("qwen_xml", False)
JSON_T = ("hermes_json", True)
JSON_S = ("hermes_json", False)

FILE_WITH_CLOSERS = (
    "def f():\n    s = '</parameter>'\n    t = \"</function>\\n</tool_call>\"\n    u = '<tool_call>'\n    return s\n"
)
NESTED_BLOCK = "Example:\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n2\n</parameter>\nend"
FENCED = "```python\nprint('</parameter>')\n```"

CASES: list[Case] = [
    Case("plain_text", "Hello, world! No tools here.", {BOTH: Expected("Hello, world! No tools here."), XML_S: Expected("Hello, world! No tools here."), JSON_S: Expected("Hello, world! No tools here.")}),
    Case("empty", "", {BOTH: Expected("")}),
    Case(
        "clean_xml",
        "Let me check.\n\n" + xml_call("get_weather", {"city": "Paris", "days": "3"}) + "\nDone.",
        {BOTH: Expected("Let me check.\nDone.", [("get_weather", {"city": "Paris", "days": 3})]), XML_S: Expected("Let me check.\nDone.", [("get_weather", {"city": "Paris", "days": 3})])},
    ),
    Case(
        "parallel_xml",
        xml_call("get_weather", {"city": "Paris"}) + "\n" + xml_call("get_weather", {"city": "Oslo"}),
        {BOTH: Expected("", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})])},
    ),
    Case("no_params", xml_call("list_files", {}), {BOTH: Expected("", [("list_files", {})]), XML_S: Expected("", [("list_files", {})])}),
    Case(
        "nested_closers_in_value",
        xml_call("write_file", {"path": "a.py", "content": FILE_WITH_CLOSERS}),
        {BOTH: Expected("", [("write_file", {"path": "a.py", "content": FILE_WITH_CLOSERS})]), XML_S: Expected("", [("write_file", {"path": "a.py", "content": FILE_WITH_CLOSERS})])},
    ),
    Case(
        "balanced_nested_parameters",
        xml_call("write_file", {"content": NESTED_BLOCK, "path": "doc.md"}),
        {BOTH: Expected("", [("write_file", {"content": NESTED_BLOCK, "path": "doc.md"})])},
    ),
    Case(
        "code_fence_in_value",
        xml_call("write_file", {"path": "README.md", "content": FENCED}),
        {BOTH: Expected("", [("write_file", {"path": "README.md", "content": FENCED})])},
    ),
    Case(
        "call_quoted_in_fence",
        "Use this form:\n```xml\n" + xml_call("get_weather", {"city": "Paris"}) + "\n```\nThat's all.",
        {BOTH: Expected("Use this form:\n```xml\n" + xml_call("get_weather", {"city": "Paris"}) + "\n```\nThat's all.")},
    ),
    Case(
        "prose_mentions_tags",
        "Wrap calls in <tool_call> tags and use <function=NAME> inside.",
        {BOTH: Expected("Wrap calls in <tool_call> tags and use <function=NAME> inside.")},
    ),
    Case(
        "missing_wrapper",
        "Sure.\n" + xml_call("get_weather", {"city": "Rome"}, wrap=False),
        {
            XML_T: Expected("Sure.", [("get_weather", {"city": "Rome"})]),
            JSON_T: Expected("Sure.", [("get_weather", {"city": "Rome"})]),
            XML_S: Expected("Sure.\n" + xml_call("get_weather", {"city": "Rome"}, wrap=False)),
        },
    ),
    Case(
        "stray_closers",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n</function_invocation>\n</tool_call>\n</function>\nok",
        {BOTH: Expected("ok", [("get_weather", {"city": "Lima"})])},
    ),
    Case(
        "trailing_text_no_tool_call_close",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nKyiv\n</parameter>\n</function>\nI will wait for the result.",
        {
            BOTH: Expected("I will wait for the result.", [("get_weather", {"city": "Kyiv"})]),
            XML_S: Expected(
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nKyiv\n</parameter>\n</function>\nI will wait for the result.",
                failures=["missing_tool_call_close"],
            ),
        },
    ),
    Case(
        "missing_closers_at_end",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n",
        {BOTH: Expected("", [("get_weather", {"city": "Bern"})]), XML_S: Expected("<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n", failures=["unclosed_call"])},
    ),
    Case(
        "cut_by_length",
        "Writing.\n<tool_call>\n<function=write_file>\n<parameter=content>\nabc",
        {BOTH: Expected("Writing.\n<tool_call>\n<function=write_file>\n<parameter=content>\nabc", failures=["truncated"])},
        finish_reason="length",
    ),
    Case(
        "cut_by_length_after_complete_call",
        xml_call("get_weather", {"city": "Paris"}) + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOs",
        {BOTH: Expected("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", [("get_weather", {"city": "Paris"})], ["truncated"])},
        finish_reason="length",
    ),
    Case(
        "complete_but_unclosed_at_length",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>",
        {BOTH: Expected("<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>", failures=["truncated"])},
        finish_reason="length",
    ),
    Case(
        "bad_tool_call_then_valid",
        "<tool_call>\nnot a call\n</tool_call>\n" + xml_call("get_weather", {"city": "Paris"}),
        {BOTH: Expected("<tool_call>\nnot a call\n</tool_call>", [("get_weather", {"city": "Paris"})], ["no_function_after_tool_call"])},
    ),
    Case(
        "schema_coercion",
        xml_call(
            "get_weather",
            {"city": "", "zip": "02134", "days": "7", "metric": "TRUE", "ratio": "0.5", "opts": '{"a": [1, 2]}', "tags": '["x", "y"]', "maybe": "null", "code": "0042"},
        ),
        {BOTH: Expected("", [("get_weather", {"city": "", "zip": "02134", "days": 7, "metric": True, "ratio": 0.5, "opts": {"a": [1, 2]}, "tags": ["x", "y"], "maybe": None, "code": "0042"})])},
    ),
    Case(
        "coercion_omit_and_passthrough",
        xml_call("get_weather", {"city": "X", "days": "", "ratio": "lots", "metric": "False"}),
        {BOTH: Expected("", [("get_weather", {"city": "X", "ratio": "lots", "metric": False})])},
    ),
    Case(
        "undeclared_tool",
        xml_call("launch_rocket", {"target": "moon", "count": "2"}),
        {BOTH: Expected("", [("launch_rocket", {"target": "moon", "count": "2"})], undeclared=["launch_rocket"])},
    ),
    Case(
        "unicode_and_escapes",
        xml_call("write_file", {"path": "ü/日本.txt", "content": 'quote " back \\ tab \t emoji 😀\n\nline'}),
        {BOTH: Expected("", [("write_file", {"path": "ü/日本.txt", "content": 'quote " back \\ tab \t emoji 😀\n\nline'})])},
    ),
    Case(
        "inline_tool_call_after_text",
        "Calling now:<tool_call>\n<function=list_files>\n</function>\n</tool_call>",
        {BOTH: Expected("Calling now:", [("list_files", {})])},
    ),
    Case(
        "hermes_clean",
        "Checking.\n" + json_call("get_weather", {"city": "Paris", "days": 2}),
        {BOTH: Expected("Checking.", [("get_weather", {"city": "Paris", "days": 2})]), JSON_S: Expected("Checking.", [("get_weather", {"city": "Paris", "days": 2})])},
    ),
    Case(
        "hermes_closer_in_string",
        json_call("write_file", {"path": "x.html", "content": "<b></tool_call></b>\n{\"}"}),
        {BOTH: Expected("", [("write_file", {"path": "x.html", "content": "<b></tool_call></b>\n{\"}"})]), JSON_S: Expected("", [("write_file", {"path": "x.html", "content": "<b></tool_call></b>\n{\"}"})])},
    ),
    Case(
        "hermes_string_arguments_and_coercion",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": \\"4\\"}"}\n</tool_call>',
        {BOTH: Expected("", [("get_weather", {"city": "Oslo", "days": 4})])},
    ),
    Case(
        "hermes_parallel",
        json_call("get_weather", {"city": "A"}) + "\n" + json_call("list_files", {}),
        {BOTH: Expected("", [("get_weather", {"city": "A"}), ("list_files", {})]), JSON_S: Expected("", [("get_weather", {"city": "A"}), ("list_files", {})])},
    ),
    Case(
        "hermes_invalid_then_valid",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}\n</tool_call>\n' + json_call("list_files", {}),
        {BOTH: Expected('<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}\n</tool_call>', [("list_files", {})], ["invalid_json"])},
    ),
    Case(
        "hermes_unterminated_string_then_valid",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A}}\n</tool_call>\n' + json_call("list_files", {}),
        {BOTH: Expected('<tool_call>\n{"name": "get_weather", "arguments": {"city": "A}}\n</tool_call>', [("list_files", {})], ["unclosed_call"])},
    ),
    Case(
        "hermes_arguments_before_name",
        '<tool_call>\n{"arguments": {"city": "Oslo", "days": "2"}, "name": "get_weather"}\n</tool_call>',
        {BOTH: Expected("", [("get_weather", {"city": "Oslo", "days": 2})]), JSON_S: Expected("", [("get_weather", {"city": "Oslo", "days": 2})])},
    ),
    Case(
        "hermes_streamed_arguments_typed_by_schema",  # a string for an integer parameter is typed, streamed or not
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "{[}\\"", "days": "2", "opts": {"a": [1, {"b": null}]}}}\n</tool_call>',
        {BOTH: Expected("", [("get_weather", {"city": '{[}"', "days": 2, "opts": {"a": [1, {"b": None}]}})])},
    ),
    Case(
        "hermes_duplicate_arguments_key",
        '<tool_call>\n{"name": "list_files", "arguments": {"a": 1}, "arguments": {"a": 2}}\n</tool_call>',
        {BOTH: Expected('<tool_call>\n{"name": "list_files", "arguments": {"a": 1}, "arguments": {"a": 2}}\n</tool_call>', failures=["inconsistent_json_call"])},
    ),
    Case(
        "hermes_missing_name",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        {BOTH: Expected('<tool_call>\n{"arguments": {}}\n</tool_call>', failures=["missing_name"])},
    ),
    Case(
        "unbalanced_open_in_value",
        xml_call("write_file", {"content": "<parameter=x>\nno close", "path": "p"}) + "\n" + xml_call("list_files", {}),
    ),
    Case("lone_opener_at_end", "text\n<tool_call>", {BOTH: Expected("text\n<tool_call>", failures=["no_function_after_tool_call"])}),
    Case("partial_tag_at_end", "almost <tool_ca", {BOTH: Expected("almost <tool_ca")}),
    Case(
        "junk_between_parameters",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        {XML_T: Expected("", [("get_weather", {"city": "A", "days": 2})])},
    ),
    Case(
        "missing_parameter_close",
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n<parameter=content>\nhello\n</function>\n</tool_call>\n"
        + xml_call("list_files", {}),
        {
            XML_T: Expected("", [("write_file", {"path": "a.txt", "content": "hello"}), ("list_files", {})]),
            JSON_T: Expected("", [("write_file", {"path": "a.txt", "content": "hello"}), ("list_files", {})]),
        },
    ),
    Case(
        "missing_parameter_close_at_end",
        "<tool_call>\n<function=write_file>\n<parameter=content>\nhello\n</function>\n</tool_call>",
        {XML_T: Expected("", [("write_file", {"content": "hello"})]), XML_S: Expected("<tool_call>\n<function=write_file>\n<parameter=content>\nhello\n</function>\n</tool_call>", failures=["unclosed_call"])},
    ),
    Case(
        "literal_function_close_then_more_value",
        xml_call("write_file", {"content": "a\n</function>\n</tool_call>\nmore text"}),
        {BOTH: Expected("", [("write_file", {"content": "a\n</function>\n</tool_call>\nmore text"})])},
    ),
    Case(
        "call_after_closed_fence",
        "Example:\n```\n<tool_call> is shown here\n```\n" + xml_call("list_files", {}),
        {BOTH: Expected("Example:\n```\n<tool_call> is shown here\n```", [("list_files", {})])},
    ),
    Case(
        "tilde_fence_and_unclosed_fence",
        "~~~~\n" + xml_call("list_files", {}) + "\n~~~~\nok\n```\n" + xml_call("list_files", {}),
        {BOTH: Expected("~~~~\n" + xml_call("list_files", {}) + "\n~~~~\nok\n```\n" + xml_call("list_files", {}))},
    ),
    Case(
        "inline_parameter_mention_in_value_and_spaced_names",
        "<tool_call>\n<function= write_file >\n<parameter= content >\nuse <parameter=x> inline\n</parameter>\n</function>\n</tool_call>",
        {BOTH: Expected("", [("write_file", {"content": "use <parameter=x> inline"})])},
    ),
    Case(
        "text_between_parallel_calls",
        xml_call("get_weather", {"city": "A"}) + "\n\nand also\n\n" + xml_call("get_weather", {"city": "B"}) + "\n\nDone.",
        {BOTH: Expected("and also\n\nDone.", [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})])},
    ),
    Case(
        "xml_body_in_hermes_strict",
        xml_call("get_weather", {"city": "Paris"}),
        {JSON_S: Expected(xml_call("get_weather", {"city": "Paris"}), failures=["no_function_after_tool_call"])},
    ),
]

# Outputs for the think policy (run through OutputParser with start_in_reasoning).
THINK_CASES: list[tuple[str, str, bool, Expected, str]] = [
    # (name, text, start_in_reasoning, expected (content, calls), expected reasoning)
    (
        "call_after_think",
        "I should check the weather.\n</think>\n\n" + xml_call("get_weather", {"city": "Paris"}),
        True,
        Expected("", [("get_weather", {"city": "Paris"})]),
        "I should check the weather.\n",
    ),
    (
        "call_inside_unclosed_think",
        "Let me call it.\n" + xml_call("get_weather", {"city": "Oslo"}),
        True,
        Expected("", [("get_weather", {"city": "Oslo"})]),
        "Let me call it.\n" + xml_call("get_weather", {"city": "Oslo"}),
    ),
    (
        "call_inside_closed_think_is_not_a_call",
        "Maybe " + xml_call("get_weather", {"city": "Rome"}) + " no.\n</think>\n\nNo call needed.",
        True,
        Expected("No call needed."),
        "Maybe " + xml_call("get_weather", {"city": "Rome"}) + " no.\n",
    ),
    (
        "explicit_think_open",
        "<think>\nhmm\n</think>\n\nHello",
        False,
        Expected("Hello"),
        "hmm\n",
    ),
    (
        "no_think",
        "Hello <think> is literal",
        False,
        Expected("Hello <think> is literal"),
        "",
    ),
]


def fold(events: list) -> dict[str, Any]:
    """The folded result of an event stream (what the conformance suite compares)."""
    from deepwell.gateway.chat_types import ContentDelta, ReasoningDelta, ToolCallEnd, ToolParseFailure

    return {
        "content": "".join(e.text for e in events if isinstance(e, ContentDelta)),
        "reasoning": "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "calls": [(e.call.name, e.call.arguments, e.declared) for e in events if isinstance(e, ToolCallEnd)],
        "failures": [(e.reason, e.raw_text) for e in events if isinstance(e, ToolParseFailure)],
    }
