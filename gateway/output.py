"""Generated token ids -> API-neutral text events, for one response.

Stages, in order: ``IncrementalDetokenizer`` (no partial UTF-8) -> ``StopMatcher``
(gateway-side stop strings, minimal hold-back) -> ``toolparse.pipeline.OutputParser``
(``<think>`` split, tool-call parsing of the content, think policy). ``push(ids)`` returns
the events those ids complete; after a stop string matched ``stop_sequence`` is set and the
caller cancels the engine request. ``finish`` drains every stage. With
``parallel_tool_calls`` off, events after the first ``ToolCallEnd`` are dropped and
``wants_stop`` turns true (the caller stops the engine).

``forced_prefix``: when ``tool_choice`` forces a call, the prompt already ends with the
call's opening markup; the parser is fed that text first and its (empty) content is not
shown to the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepwell.gateway.chat_types import ContentDelta, Event, ToolCallEnd, ToolDef, ToolParseFailure
from deepwell.gateway.detok import IncrementalDetokenizer
from deepwell.gateway.stops import StopMatcher
from deepwell.gateway.toolparse.pipeline import OutputParser


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        stops: Sequence[str] = (),
        start_in_reasoning: bool = False,
        split_reasoning: bool = True,
        tools: Sequence[ToolDef] = (),
        parser_name: str | None = None,
        tolerant: bool = False,
        parallel_tool_calls: bool = True,
        forced_prefix: str = "",
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.stops = StopMatcher(list(stops))
        self.parser = OutputParser(list(tools), parser_name if tools else None, tolerant=tolerant,
                                   reasoning=split_reasoning, start_in_reasoning=start_in_reasoning)
        self.parallel = parallel_tool_calls
        self.stop_sequence: str | None = None
        self.calls: list[ToolCallEnd] = []
        self.failures: list[ToolParseFailure] = []
        self.wants_stop = False
        self._cut = False
        if forced_prefix:
            self._accept(self.parser.feed(forced_prefix), forced=True)

    def _accept(self, events: list[Event], forced: bool = False) -> list[Event]:
        out: list[Event] = []
        for ev in events:
            if self._cut or (forced and isinstance(ev, ContentDelta)):
                continue
            if isinstance(ev, ToolCallEnd):
                self.calls.append(ev)
                if not self.parallel:
                    self._cut = True
                    self.wants_stop = True
            elif isinstance(ev, ToolParseFailure):
                self.failures.append(ev)
            out.append(ev)
        return out

    def push(self, token_ids: Sequence[int]) -> list[Event]:
        if self.stop_sequence is not None or self.wants_stop:
            return []
        emit, matched = self.stops.push(self.detok.push(token_ids))
        events = self._accept(self.parser.feed(emit)) if emit else []
        if matched is not None:
            self.stop_sequence = matched
        return events

    def finish(self, finish_reason: str) -> list[Event]:
        """Drain every stage; ``finish_reason`` is the neutral reason so far."""
        out: list[Event] = []
        if self.stop_sequence is None and not self.wants_stop:
            emit, matched = self.stops.push(self.detok.flush())
            if matched is not None:
                self.stop_sequence = matched
            else:
                emit += self.stops.flush()
            if emit:
                out.extend(self._accept(self.parser.feed(emit)))
        out.extend(self._accept(self.parser.finish(finish_reason)))
        return out

    @property
    def has_tool_parser(self) -> bool:
        return self.parser.tool_parser is not None

    @property
    def outcomes(self) -> list[str]:
        return self.parser.outcomes

    @property
    def tool_parse_outcome(self) -> str:
        if self.failures or any(o.startswith("failure") for o in self.outcomes):
            return "failure"
        return "ok" if self.calls else "none"
