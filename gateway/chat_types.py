"""API-neutral chat request and output event types shared by every gateway front end.

Contract:
- The OpenAI and Anthropic HTTP handlers and the gRPC ``Chat`` service translate their
  wire formats into :class:`ChatRequest`; everything below (prompt building, templates,
  tool parsing) works only with these types. No pydantic here: plain dataclasses.
- Output of the text pipeline is a flat stream of :data:`Event` values (content,
  reasoning, tool-call start / argument fragments / end, parse failures). Front ends map
  them to SSE / gRPC events.

Invariants:
- ``ToolCallArgsDelta.json_fragment`` values of one call concatenate to exactly the
  JSON object text of that call's final arguments (``json.dumps`` of
  ``ToolCallEnd.call.arguments`` when it is a dict).
- A :class:`ToolParseFailure` never loses text: its ``raw_text`` is also emitted as a
  :class:`ContentDelta` in the same event list.
- Constructors validate their input and raise :class:`InvalidRequest` (a ``ValueError``)
  with a readable reason; the HTTP layer maps it to 400, gRPC to INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Union

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TOOL_CHOICE_MODES = frozenset({"auto", "none", "required"})


class InvalidRequest(ValueError):
    """A chat request that cannot be served as given (maps to HTTP 400 / INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a multi-part message content. Only ``type == "text"`` is renderable
    today; other kinds (``image_url``, ``image``...) are carried so front ends can refuse
    them with a clear reason."""

    type: str
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ToolCallSpec:
    """A tool call: in an assistant message of the history, or a parsed model output.

    ``arguments`` is a dict when it parsed as a JSON object, else the raw string."""

    id: str
    name: str
    arguments: dict[str, Any] | str

    def arguments_json(self) -> str:
        if isinstance(self.arguments, dict):
            return json.dumps(self.arguments, ensure_ascii=False)
        return self.arguments


@dataclass(frozen=True, slots=True)
class ToolDef:
    """A declared function tool; ``parameters`` is its JSON Schema (an object schema)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequest("tool name must be a non-empty string")
        if not isinstance(self.parameters, dict):
            raise InvalidRequest(f"tool {self.name!r}: parameters must be a JSON object schema")

    def to_template(self) -> dict[str, Any]:
        """The OpenAI/HF form chat templates expect in ``tools``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str | list[ContentPart] = ""
    reasoning: str | None = None
    tool_calls: list[ToolCallSpec] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"message role {self.role!r} is not one of {', '.join(sorted(ROLES))}")
        if not isinstance(self.content, (str, list)):
            raise InvalidRequest("message content must be a string or a list of content parts")

    def text(self) -> str:
        """The content as plain text (text parts concatenated as they are, as prompts
        render them); non-text parts contribute nothing."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type == "text")

    def has_non_text_parts(self) -> bool:
        return isinstance(self.content, list) and any(p.type != "text" for p in self.content)


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.temperature is not None and self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise InvalidRequest(f"top_k must be >= -1 (-1 or 0 = off), got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop sequences must be non-empty strings")
        if self.top_logprobs < 0:
            raise InvalidRequest(f"top_logprobs must be >= 0, got {self.top_logprobs}")


ToolChoice = Union[Literal["auto", "none", "required"], dict[str, str]]


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: list[ChatMessage]
    tools: list[ToolDef] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    enable_thinking: bool | None = None
    preserve_thinking: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    session_key: str | None = None
    tenant: str = ""
    model: str = ""
    # a trailing assistant text message is continued (Anthropic prefill); False renders a
    # new assistant turn after it instead
    continue_final_message: bool = True

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidRequest("messages must not be empty")
        tc = self.tool_choice
        if isinstance(tc, str):
            if tc not in TOOL_CHOICE_MODES:
                raise InvalidRequest(f"tool_choice {tc!r} is not one of auto, none, required or {{'name': ...}}")
        elif isinstance(tc, dict):
            name = tc.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest("a named tool_choice needs a non-empty 'name'")
            if name not in {t.name for t in self.tools}:
                raise InvalidRequest(f"tool_choice names tool {name!r}, which is not among the declared tools")
        else:
            raise InvalidRequest("tool_choice must be a string or {'name': ...}")
        if tc == "required" and not self.tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tool names must be unique")

    def forced_tool(self) -> str | None:
        """The tool name of a named ``tool_choice``, else None."""
        return self.tool_choice.get("name") if isinstance(self.tool_choice, dict) else None

    def active_tools(self) -> list[ToolDef]:
        """Tools the model may see: none when ``tool_choice == "none"``."""
        return [] if self.tool_choice == "none" else list(self.tools)


# ---------------------------------------------------------------- output events


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgsDelta:
    index: int
    json_fragment: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    call: ToolCallSpec
    declared: bool = True  # False: the model called a tool that was not in the request


@dataclass(frozen=True, slots=True)
class ToolParseFailure:
    """Markup that looked like a tool call but could not be recovered. ``raw_text`` is
    also emitted as a ContentDelta right after this event."""

    reason: str
    raw_text: str


Event = Union[ContentDelta, ReasoningDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd, ToolParseFailure]

FinishReason = Literal["stop", "length", "tool_calls", "stop_sequence", "cancelled", "error"]
