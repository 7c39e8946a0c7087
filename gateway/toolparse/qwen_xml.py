"""``qwen_xml``: Qwen3-Coder / Qwen3.5 / Qwen3.6 XML tool calls.

``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``.
Tolerant mode also accepts a Hermes JSON body inside ``<tool_call>`` (models of this
family sometimes fall back to it). The scanning rules are in ``tagged.py``.
"""

from __future__ import annotations

from deepwell.gateway.toolparse.tagged import TaggedToolParser


class QwenXmlParser(TaggedToolParser):
    name = "qwen_xml"
    formats_strict = ("xml",)
    formats_tolerant = ("xml", "json")
