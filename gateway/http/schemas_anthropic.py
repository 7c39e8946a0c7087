"""Pydantic request models of the Anthropic Messages API (``/v1/messages``, count_tokens)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field



class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class Message(Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class Tool(Lenient):
    name: str = Field(min_length=1, max_length=256)
    type: str | None = None  # None/"custom" = a client tool; server tools carry a versioned type
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Lenient):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=0)


class Metadata(Lenient):
    user_id: str | None = None


class OutputConfig(Lenient):
    effort: str | None = None


class CountTokensRequest(Lenient):
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # capped by --max-output-tokens
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
