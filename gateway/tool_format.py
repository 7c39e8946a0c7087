"""How a request's tools reach the prompt, and which parser reads the model's calls back.

- ``template``: the model's chat template renders the tools; the parser is the one its
  template implies (``gateway.toolparse.parser_for_template``) or ``--tool-parser``.
- ``generic_hermes``: the template ignores tools (``ModelBundle.renders_tools`` is False), so
  ``gateway.prompting.generic_tool_messages`` writes them into the system turn and asks for
  Hermes ``<tool_call>`` JSON blocks, which ``hermes_json`` parses.

A forced call (``tool_choice`` required / named) appends the opening markup of a call in the
parser's form, so the model must continue inside one.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepwell.gateway.chat_types import ChatRequest
from deepwell.gateway.engine_client import ModelBundle

# Opening markup that forces a tool call: (any call, a named call), per parser.
FORCED_CALL_PREFIX = {
    "qwen_xml": ("<tool_call>\n", "<tool_call>\n<function={name}>\n"),
    "hermes_json": ("<tool_call>\n", '<tool_call>\n{{"name": "{name}", "arguments": '),
}
GENERIC_PARSER = "hermes_json"  # the form gateway.prompting.GENERIC_TOOLS_HEADER asks for


@dataclass(frozen=True)
class ToolFormat:
    name: str  # "template" | "generic_hermes"
    parser: str | None  # None: no known call format, calls stay text

    @property
    def generic(self) -> bool:
        return self.name == "generic_hermes"

    def forced_prefix(self, tool_name: str | None) -> str | None:
        """The markup that opens a call (of ``tool_name`` when given); None: the parser has none."""
        templates = FORCED_CALL_PREFIX.get(self.parser or "")
        if templates is None:
            return None
        return templates[1].format(name=tool_name) if tool_name else templates[0]


def tool_format(req: ChatRequest, bundle: ModelBundle) -> ToolFormat | None:
    """The request's tool format; None when it offers no tools (or ``tool_choice`` is none)."""
    if not req.active_tools():
        return None
    if bundle.renders_tools:
        return ToolFormat("template", bundle.tool_parser)
    return ToolFormat("generic_hermes", GENERIC_PARSER)
