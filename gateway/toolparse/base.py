"""The tool-call parser interface and its process-wide outcome counters.

A parser object handles ONE response: ``feed(text)`` with each text increment (any
size, any split), then ``finish(finish_reason)`` once. Both return typed events from
``gateway.chat_types`` (ContentDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd,
ToolParseFailure). Non-streaming use is ``feed(all)`` then ``finish``.

Invariants every registered parser keeps (checked by the shared conformance suite):
- The folded result (content text, ended calls with names and argument dicts, failures)
  does not depend on how the text was split into ``feed`` calls.
- No input makes ``feed``/``finish`` raise.
- For each ended call, ``json.loads`` of its concatenated ``ToolCallArgsDelta``
  fragments equals ``ToolCallEnd.call.arguments``.
- A started call that never ends was abandoned: a ``ToolParseFailure`` follows and its
  raw text (the whole call) is emitted as content, so no text is lost.
"""

from __future__ import annotations

import threading
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from typing import Callable

from deepwell.gateway.chat_types import Event, ToolDef


class ParseCounters:
    """Thread-safe counters of parse outcomes, keyed ``(parser, outcome)``.

    Outcomes: ``call`` (a call ended), ``undeclared`` (a call of a tool that was not
    declared), ``failure:<reason>``, ``recovered:<kind>`` (tolerant recoveries)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._listeners: list[Callable[[str, str], None]] = []

    def inc(self, parser: str, outcome: str) -> None:
        with self._lock:
            self._counts[(parser, outcome)] += 1
            listeners = list(self._listeners)
        for fn in listeners:
            fn(parser, outcome)

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def add_listener(self, fn: Callable[[str, str], None]) -> None:
        """Call ``fn(parser, outcome)`` on every increment (e.g. a Prometheus counter)."""
        with self._lock:
            self._listeners.append(fn)


COUNTERS = ParseCounters()


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolStreamParser(ABC):
    """Base of every registered parser (see the module docstring for the contract)."""

    name: str = ""

    def __init__(
        self,
        tools: list[ToolDef],
        tolerant: bool = True,
        *,
        first_index: int = 0,
        id_factory: Callable[[], str] = new_call_id,
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.tolerant = tolerant
        self.next_index = first_index
        self._new_id = id_factory
        # per-response outcome list for request logs: ("call"|"failure:<r>"|"recovered:<k>")
        self.outcomes: list[str] = []

    def _count(self, outcome: str) -> None:
        self.outcomes.append(outcome)
        COUNTERS.inc(self.name, outcome)

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self, finish_reason: str = "stop") -> list[Event]: ...
