"""``hermes_json``: Hermes / Qwen2.5 / Qwen3 JSON tool calls.

``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``; ``"parameters"`` is
accepted for ``"arguments"``, and arguments given as a JSON string are decoded. The object
is scanned string-aware (``</tool_call>`` inside a string value is value text) and the
arguments stream as they arrive when the name comes first (``json_body.py``). Tolerant
mode also accepts the XML body form. The scanning rules are in ``tagged.py``.
"""

from __future__ import annotations

from deepwell.gateway.toolparse.tagged import TaggedToolParser


class HermesJsonParser(TaggedToolParser):
    name = "hermes_json"
    formats_strict = ("json",)
    formats_tolerant = ("json", "xml")
