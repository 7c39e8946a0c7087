"""One response's text -> typed events: reasoning split, then tool-call parsing.

Contract of :class:`OutputParser`:
- ``feed(text)`` / ``finish(finish_reason)`` like a tool parser; events are
  ReasoningDelta, ContentDelta and the tool-call events.
- Reasoning text is never parsed for calls while it streams (prose that mentions tool
  syntax is not a call), with one exception, the think policy: when the output ends
  inside a never-closed ``<think>``, complete calls found in the reasoning are emitted
  at finish (after any calls from the content), each once. Malformed markup inside
  reasoning stays reasoning (no failure is reported for it).
- Without a parser name, content passes through unparsed.
"""

from __future__ import annotations

from typing import Callable

from deepwell.gateway.chat_types import ContentDelta, Event, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, ToolDef
from deepwell.gateway.reasoning import ReasoningSplitter
from deepwell.gateway.toolparse import get_parser
from deepwell.gateway.toolparse.base import COUNTERS, ToolStreamParser, new_call_id


class OutputParser:
    def __init__(
        self,
        tools: list[ToolDef],
        parser_name: str | None,
        *,
        tolerant: bool = True,
        reasoning: bool = True,
        start_in_reasoning: bool = False,
        id_factory: Callable[[], str] = new_call_id,
    ) -> None:
        self._split = ReasoningSplitter(start_in_reasoning) if reasoning else None
        self._cls = get_parser(parser_name) if parser_name else None
        self._tools = tools
        self._tolerant = tolerant
        self._id_factory = id_factory
        self.tool_parser: ToolStreamParser | None = (
            self._cls(tools, tolerant, id_factory=id_factory) if self._cls else None
        )

    @property
    def outcomes(self) -> list[str]:
        return list(self.tool_parser.outcomes) if self.tool_parser else []

    def _route(self, deltas: list, out: list[Event]) -> None:
        for d in deltas:
            if isinstance(d, ContentDelta) and self.tool_parser is not None:
                out.extend(self.tool_parser.feed(d.text))
            else:
                out.append(d)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._split is None:
            self._route([ContentDelta(text)] if text else [], out)
        else:
            self._route(self._split.feed(text), out)
        return out

    def finish(self, finish_reason: str = "stop") -> list[Event]:
        out: list[Event] = []
        if self._split is not None:
            self._route(self._split.finish(), out)
        if self.tool_parser is None:
            return out
        out.extend(self.tool_parser.finish(finish_reason))
        if self._split is not None and self._split.in_reasoning and self._cls is not None:
            out.extend(self._recover_from_think())
        return out

    def _recover_from_think(self) -> list[Event]:
        assert self.tool_parser is not None and self._cls is not None and self._split is not None
        rec = self._cls(self._tools, self._tolerant, first_index=self.tool_parser.next_index, id_factory=self._id_factory)
        events = rec.feed(self._split.reasoning_text) + rec.finish("stop")
        ended = {e.index for e in events if isinstance(e, ToolCallEnd)}
        kept = [e for e in events if isinstance(e, (ToolCallStart, ToolCallArgsDelta, ToolCallEnd)) and e.index in ended]
        # renumber densely after the content's calls
        remap = {old: self.tool_parser.next_index + i for i, old in enumerate(sorted(ended))}
        out: list[Event] = []
        for e in kept:
            if isinstance(e, ToolCallStart):
                out.append(ToolCallStart(remap[e.index], e.id, e.name))
            elif isinstance(e, ToolCallArgsDelta):
                out.append(ToolCallArgsDelta(remap[e.index], e.json_fragment))
            else:
                out.append(ToolCallEnd(remap[e.index], e.call, e.declared))
        self.tool_parser.next_index += len(ended)
        for _ in ended:
            self.tool_parser.outcomes.append("recovered:call_in_unclosed_think")
            COUNTERS.inc(self.tool_parser.name, "recovered:call_in_unclosed_think")
        return out


__all__ = ["OutputParser"]
