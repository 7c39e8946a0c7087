"""Tool-call parsers: a small registry of streaming parsers sharing one interface.

- ``get_parser(name)`` returns the parser class; construct one per response with
  ``cls(tools, tolerant)`` and drive it with ``feed(text)`` / ``finish(finish_reason)``.
- ``parser_for_template(template_source, model_type)`` picks a parser name from the
  model's chat template (or model type), or None when the model has no tool-call format.
- ``COUNTERS`` holds process-wide parse outcome counts (export them as metrics).
- ``OutputParser`` (pipeline.py) combines the reasoning split and tool parsing for one
  response, including the think policy.
"""

from __future__ import annotations

from deepwell.gateway.toolparse.base import COUNTERS, ParseCounters, ToolStreamParser, new_call_id
from deepwell.gateway.toolparse.hermes_json import HermesJsonParser
from deepwell.gateway.toolparse.qwen_xml import QwenXmlParser

PARSERS: dict[str, type[ToolStreamParser]] = {
    QwenXmlParser.name: QwenXmlParser,
    HermesJsonParser.name: HermesJsonParser,
}

_XML_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_coder", "qwen3_6")
_JSON_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def get_parser(name: str) -> type[ToolStreamParser]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


def parser_for_template(template_source: str, model_type: str = "") -> str | None:
    """The parser name for a model: from what its template writes, else its model type."""
    src = template_source or ""
    if "<function=" in src and "<parameter=" in src:
        return QwenXmlParser.name
    if "<tool_call>" in src:
        return HermesJsonParser.name
    if model_type in _XML_MODEL_TYPES:
        return QwenXmlParser.name
    if model_type in _JSON_MODEL_TYPES:
        return HermesJsonParser.name
    return None


__all__ = [
    "COUNTERS",
    "PARSERS",
    "HermesJsonParser",
    "ParseCounters",
    "QwenXmlParser",
    "ToolStreamParser",
    "get_parser",
    "new_call_id",
    "parser_for_template",
]
