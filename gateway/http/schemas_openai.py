"""Pydantic request models of the OpenAI-compatible endpoints (chat, completions).

Models are lenient about unknown fields (clients send many) and strict about the types of
the fields the gateway uses; the translation to ``gateway.chat_types`` lives in
``openai_api``. Unsupported features are refused there with a 400 that says so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

U64 = 2**64 - 1


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(Lenient):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Lenient):
    type: str = "function"
    function: FunctionDef | None = None


class NamedToolChoiceFunction(Lenient):
    name: str = Field(min_length=1)


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class StreamOptions(Lenient):
    include_usage: bool = False


class ResponseFormat(Lenient):
    type: str


class SamplingFields(Lenient):
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=U64)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=100)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # a session source (gateway.session)
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatCompletionRequest(SamplingFields):
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # capped by --max-output-tokens
    max_completion_tokens: int | None = Field(default=None, ge=1)  # capped by --max-output-tokens
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    enable_thinking: bool | None = None


class CompletionRequest(SamplingFields):
    model: str = ""
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # capped by --max-output-tokens
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=128)
