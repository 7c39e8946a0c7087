"""OpenAI Responses API (``POST /v1/responses``): text, function tools, streaming.

Scope: ``input`` as a string or a list of items (messages with text content,
``function_call``, ``function_call_output``; ``reasoning`` items are accepted and dropped
like earlier reasoning), ``instructions``, function ``tools`` (other tool types such as
``web_search`` or ``namespace`` are ignored with a warning), ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens``, sampling, ``reasoning.effort``
(``none``/``minimal`` turn thinking off). Not supported (400 saying so):
``previous_response_id`` (nothing is stored), ``text.format`` json_schema, images/files.

Output items: ``reasoning`` (reasoning_text content), ``message`` (one output_text part),
``function_call`` items. Streaming emits ``response.created`` / ``response.in_progress``,
per item ``response.output_item.added`` -> deltas (``response.reasoning_text.delta``,
``response.content_part.added`` + ``response.output_text.delta``,
``response.function_call_arguments.delta``) -> ``*.done`` -> ``response.output_item.done``,
then ``response.completed`` (or ``response.incomplete`` at max_output_tokens); every event
carries ``sequence_number``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from deepwell import logs
from deepwell.gateway import session
from deepwell.gateway.chat_types import (
    ChatMessage,
    ChatRequest,
    ContentDelta,
    InvalidRequest,
    ReasoningDelta,
    SamplingOptions,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallSpec,
    ToolCallStart,
    ToolDef,
)
from deepwell.gateway.errors import GatewayError, invalid
from deepwell.gateway.http.common import (
    KEEPALIVE_COMMENT,
    RequestContext,
    SSEResponse,
    collect_until_disconnect,
    openai_error_body,
    sse,
    validate,
)
from deepwell.gateway.http.schemas_openai import Lenient
from deepwell.gateway.pipeline import Finished, Generation, KeepAlive, Started

log = logs.get_logger("deepwell.gateway.http.responses")


class ResponsesRequest(Lenient):
    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)  # capped by --max-output-tokens
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # a session source (gateway.session)
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content parts")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise invalid(f"{where}[{i}]: {kind} is not supported (this deployment has no vision/file input)")
        else:
            raise invalid(f"{where}[{i}]: unsupported content part {kind!r}")
    return "".join(out)


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    msgs: list[ChatMessage] = []
    if body.instructions:
        msgs.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        msgs.append(ChatMessage(role="user", content=body.input))
        return msgs
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant")
            msgs.append(ChatMessage(role=role, content=_text(item.get("content", ""), f"{where}.content")))
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(args, str):
                raise invalid(f"{where}: function_call needs string call_id, name and arguments")
            call = ToolCallSpec(id=call_id, name=name, arguments=args)
            if msgs and msgs[-1].role == "assistant":
                last = msgs.pop()
                msgs.append(ChatMessage(role="assistant", content=last.content, tool_calls=[*last.tool_calls, call]))
            else:
                msgs.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}: function_call_output needs a string call_id")
            msgs.append(ChatMessage(role="tool", content=_text(item.get("output", ""), f"{where}.output"),
                                    tool_call_id=call_id))
        elif kind == "reasoning":
            continue  # earlier reasoning is dropped from the prompt (token stability)
        else:
            raise invalid(f"{where}: input item type {kind!r} is not supported")
    return msgs


def to_chat_request(body: ResponsesRequest, ctx: RequestContext) -> ChatRequest:
    if body.previous_response_id:
        raise invalid("previous_response_id is not supported: this gateway stores no responses; send the full input",
                      param="previous_response_id")
    fmt = (body.text or {}).get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise invalid(f"text.format {fmt.get('type')!r} is not supported until constrained decoding exists",
                      param="text.format")
    tools: list[ToolDef] = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") != "function":
            log.warning("ignored_tool", index=i, type=t.get("type"))
            continue
        name = t.get("name")
        params = t.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(name, str) or not name or not isinstance(params, dict):
            raise invalid(f"tools[{i}]: a function tool needs a name and an object 'parameters' schema")
        tools.append(ToolDef(name=name, description=str(t.get("description") or ""), parameters=params))
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice must be auto, none, required or {'type': 'function', 'name': ...}")
        choice = {"name": choice["name"]}
    effort = (body.reasoning or {}).get("effort")
    enable_thinking = None if effort is None else effort not in ("none", "minimal")
    try:
        return ChatRequest(
            messages=_messages(body), tools=tools, tool_choice=choice,
            sampling=SamplingOptions(temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_output_tokens),
            enable_thinking=enable_thinking,
            session_key=session.session_key(ctx.headers, ctx.tenant, openai_user=body.user,
                                           prompt_cache_key=body.prompt_cache_key), tenant=ctx.tenant,
            model=body.model,
        )
    except InvalidRequest as exc:
        raise invalid(str(exc)) from None


class _Builder:
    """Accumulates output items; produces the streaming events for each step."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest) -> None:
        self.rid, self.model, self.body = rid, model, body
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0
        self.calls: dict[int, int] = {}  # tool index -> output index

    def ev(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(payload, kind)

    def response(self, status: str, finished: Finished | None = None) -> dict[str, Any]:
        usage = None
        if finished is not None:
            usage = {"input_tokens": finished.prompt_tokens, "output_tokens": finished.completion_tokens,
                     "total_tokens": finished.prompt_tokens + finished.completion_tokens,
                     "input_tokens_details": {"cached_tokens": finished.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.items if status != "in_progress" else [], "usage": usage,
                "error": None, "incomplete_details": incomplete, "instructions": self.body.instructions,
                "tools": [t for t in self.body.tools or [] if t.get("type") == "function"],
                "tool_choice": self.body.tool_choice or "auto", "parallel_tool_calls": self.body.parallel_tool_calls,
                "temperature": self.body.temperature, "top_p": self.body.top_p,
                "max_output_tokens": self.body.max_output_tokens, "previous_response_id": None,
                "reasoning": self.body.reasoning, "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "metadata": self.body.metadata or {}}

    def close_open(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.items.index(item)
        out = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self.ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=part["text"], logprobs=[]))
            out.append(self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                               part=part))
            item["status"] = "completed"
        out.append(self.ev("response.output_item.done", output_index=idx, item=item))
        return out

    def add(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close_open()
        self.items.append(item)
        self.open = item
        shown = {**item, "content": []} if item["type"] in ("message", "reasoning") else item
        if item["type"] == "message":
            shown["status"] = "in_progress"
        out.append(self.ev("response.output_item.added", output_index=len(self.items) - 1, item=shown))
        if item["type"] == "message":
            out.append(self.ev("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                               content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def on(self, ev: Any) -> list[bytes]:
        out: list[bytes] = []
        n = len(self.items)
        if isinstance(ev, ReasoningDelta) and ev.text:
            if self.open is None or self.open["type"] != "reasoning":
                out += self.add({"type": "reasoning", "id": f"rs_{self.rid}_{n}", "summary": [],
                                 "content": [{"type": "reasoning_text", "text": ""}]})
            self.open["content"][0]["text"] += ev.text
            out.append(self.ev("response.reasoning_text.delta", item_id=self.open["id"],
                               output_index=self.items.index(self.open), content_index=0, delta=ev.text))
        elif isinstance(ev, ContentDelta) and ev.text:
            if self.open is None or self.open["type"] != "message":
                out += self.add({"type": "message", "id": f"msg_{self.rid}_{n}", "status": "completed",
                                 "role": "assistant",
                                 "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})
            self.open["content"][0]["text"] += ev.text
            out.append(self.ev("response.output_text.delta", item_id=self.open["id"],
                               output_index=self.items.index(self.open), content_index=0, delta=ev.text, logprobs=[]))
        elif isinstance(ev, ToolCallStart):
            out += self.add({"type": "function_call", "id": f"fc_{ev.id}", "call_id": ev.id, "name": ev.name,
                             "arguments": "", "status": "in_progress"})
            self.calls[ev.index] = len(self.items) - 1
        elif isinstance(ev, ToolCallArgsDelta) and ev.json_fragment and ev.index in self.calls:
            item = self.items[self.calls[ev.index]]
            item["arguments"] += ev.json_fragment
            out.append(self.ev("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=self.calls[ev.index], delta=ev.json_fragment))
        elif isinstance(ev, ToolCallEnd) and ev.index in self.calls:
            item = self.items[self.calls[ev.index]]
            item["arguments"] = ev.call.arguments_json()
            item["status"] = "completed"
            out.append(self.ev("response.function_call_arguments.done", item_id=item["id"],
                               output_index=self.calls[ev.index], name=item["name"], arguments=item["arguments"]))
            if self.open is item:
                out += self.close_open()
        return out


async def responses(app_state: Any, request: Request, ctx: RequestContext, data: dict[str, Any]) -> Response:
    body: ResponsesRequest = validate(ResponsesRequest, data)
    n_items = 1 if isinstance(body.input, str) else len(body.input)
    if n_items > app_state.config.max_messages:
        raise GatewayError("too_large", f"{n_items} input items exceed the limit of {app_state.config.max_messages}")
    req = to_chat_request(body, ctx)
    service = app_state.service
    prepared = service.prepare_chat(req, ctx.request_id, "responses", parallel_tool_calls=body.parallel_tool_calls)
    gen = service.generation(prepared)
    builder = _Builder(f"resp_{ctx.request_id}", prepared.model_name, body)
    if not body.stream:
        events = await collect_until_disconnect(gen, request)
        finished = None
        for ev in events:
            builder.on(ev)
            if isinstance(ev, Finished):
                finished = ev
        builder.close_open()
        assert finished is not None
        if finished.reason == "error":
            raise finished.failure()
        status = "incomplete" if finished.reason == "length" else "completed"
        return JSONResponse(builder.response(status, finished), headers={"x-request-id": ctx.request_id})
    await gen.open_stream(app_state.config.keepalive_s)
    return SSEResponse(_stream(gen, builder), headers={"x-request-id": ctx.request_id})


async def _stream(gen: Generation, b: _Builder) -> AsyncIterator[bytes]:
    status = 200
    try:
        async for ev in gen.stream():
            if isinstance(ev, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(ev, Started):
                yield b.ev("response.created", response=b.response("in_progress"))
                yield b.ev("response.in_progress", response=b.response("in_progress"))
            elif isinstance(ev, Finished):
                for chunk in b.close_open():
                    yield chunk
                if ev.reason == "error":
                    err = ev.failure()
                    status = err.status
                    code = "service_unavailable" if err.kind == "unavailable" else "server_error"
                    yield b.ev("error", code=code, message=err.message, param=None)
                    return
                final = "incomplete" if ev.reason == "length" else "completed"
                yield b.ev(f"response.{final}", response=b.response(final, ev))
            else:
                for chunk in b.on(ev):
                    yield chunk
    except GatewayError as err:
        status = err.status
        yield sse(openai_error_body(err), "error")
    finally:
        await gen.aclose(status if gen.finished is not None else 499)
