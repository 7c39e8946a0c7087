"""Anthropic-compatible ``/v1/messages`` and ``/v1/messages/count_tokens``.

Translation: ``system`` (string or text blocks; the billing-header block is stripped by
prompt building) -> a system message, as is a ``system``-role entry of ``messages`` (Claude
Code sends them mid-conversation; rendered where it stands, or merged into the first); user ``tool_result`` blocks -> ``tool`` messages (in
order), user text blocks -> a user message; assistant ``thinking`` -> reasoning,
``tool_use`` -> tool calls. ``thinking.type`` enabled/adaptive -> ``enable_thinking``,
disabled -> off; ``output_config.effort`` is accepted. ``tool_choice`` any -> required,
tool -> named, ``disable_parallel_tool_use`` -> one call at most. Server tools (a ``type``
other than custom, e.g. ``web_search_20250305``) are ignored with a warning.

Streaming sequence: ``message_start`` (usage.input_tokens = prompt tokens not served from
cache, ``cache_read_input_tokens`` = cached prompt tokens; the sum is the prompt) ->
per block ``content_block_start`` / deltas / ``content_block_stop`` (thinking blocks end
with a ``signature_delta``; tool_use blocks stream ``input_json_delta``) ->
``message_delta`` (stop_reason, stop_sequence, usage.output_tokens) -> ``message_stop``.
Keep-alives are ``ping`` events (what the SDKs skip). Thinking signatures are a SHA-256 digest of the thinking text
(an opaque integrity tag, not an attestation).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepwell import logs
from deepwell.gateway import session
from deepwell.gateway.chat_types import (
    ChatMessage,
    ChatRequest,
    ContentDelta,
    ContentPart,
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
from deepwell.gateway.http import schemas_anthropic as s
from deepwell.gateway.http.common import (
    RequestContext,
    SSEResponse,
    anthropic_error_body,
    collect_until_disconnect,
    sse,
    validate,
)
from deepwell.gateway.pipeline import Finished, Generation, KeepAlive, Started

PING = sse({"type": "ping"}, "ping")

log = logs.get_logger("deepwell.gateway.http.anthropic")

STOP_REASON = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
               "tool_calls": "tool_use", "cancelled": "end_turn"}


def signature(thinking: str) -> str:
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text blocks")
    out = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid(f"{where}[{i}]: only text blocks are supported here (got {kind!r})")
        out.append(block["text"])
    return "".join(out)  # text blocks are concatenated as they are (no separator), as the API does


def _user_messages(content: str | list[dict[str, Any]], where: str) -> list[ChatMessage]:
    if isinstance(content, str):
        return [ChatMessage(role="user", content=content)]
    out: list[ChatMessage] = []
    parts: list[ContentPart] = []
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{where}[{i}].text must be a string")
            parts.append(ContentPart(type="text", text=block["text"]))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise invalid(f"{where}[{i}].tool_use_id must be a non-empty string")
            text = _text_of(block.get("content"), f"{where}[{i}].content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append(ChatMessage(role="tool", content=text, tool_call_id=tool_use_id))
        elif kind in ("image", "document", "search_result"):
            raise invalid(f"{where}[{i}]: {kind} blocks are not supported (this deployment has no vision/document "
                          f"input)")
        else:
            raise invalid(f"{where}[{i}]: unsupported content block type {kind!r} in a user message")
    if parts:
        out.append(ChatMessage(role="user", content=parts))
    return out


def _assistant_message(content: str | list[dict[str, Any]], where: str) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallSpec] = []
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{where}[{i}].text must be a string")
            texts.append(block["text"])
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise invalid(f"{where}[{i}].thinking must be a string")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            name, inp, cid = block.get("name"), block.get("input", {}), block.get("id")
            if not isinstance(name, str) or not name or not isinstance(cid, str) or not isinstance(inp, dict):
                raise invalid(f"{where}[{i}]: tool_use needs string id and name and an object input")
            calls.append(ToolCallSpec(id=cid, name=name, arguments=inp))
        else:
            raise invalid(f"{where}[{i}]: unsupported content block type {kind!r} in an assistant message")
    return ChatMessage(role="assistant", content="".join(texts), reasoning="".join(reasoning) or None,
                       tool_calls=calls)


def to_chat_request(body: s.CountTokensRequest, ctx: RequestContext) -> tuple[ChatRequest, bool]:
    if body.model_extra:  # e.g. context_management, container, mcp_servers: accepted, not applied
        log.debug("ignored_fields", fields=sorted(body.model_extra), beta=ctx.headers.get("anthropic-beta", ""))
    messages: list[ChatMessage] = []
    if body.system:
        if isinstance(body.system, str):
            messages.append(ChatMessage(role="system", content=body.system))
        else:
            _text_of(body.system, "system")  # validates the blocks
            messages.append(ChatMessage(role="system", content=[ContentPart(type="text", text=b["text"])
                                                                 for b in body.system]))
    try:
        for i, m in enumerate(body.messages):
            where = f"messages[{i}].content"
            if m.role == "user":
                messages.extend(_user_messages(m.content, where))
            elif m.role == "system":  # Claude Code sends these mid-conversation
                text = _text_of(m.content, where)
                if text:  # `--bare` sends empty ones (carrying only a per-message output_config)
                    messages.append(ChatMessage(role="system", content=text))
            else:
                messages.append(_assistant_message(m.content, where))
        tools: list[ToolDef] = []
        for i, t in enumerate(body.tools or []):
            if t.type not in (None, "custom"):
                log.warning("ignored_server_tool", name=t.name, type=t.type)
                continue
            tools.append(ToolDef(name=t.name, description=t.description or "",
                                 parameters=t.input_schema or {"type": "object", "properties": {}}))
        choice: Any = "auto"
        parallel = True
        if body.tool_choice is not None:
            tc = body.tool_choice
            parallel = not tc.disable_parallel_tool_use
            if tc.type == "any":
                choice = "required"
            elif tc.type == "none":
                choice = "none"
            elif tc.type == "tool":
                if not tc.name:
                    raise invalid("tool_choice of type 'tool' needs a name")
                choice = {"name": tc.name}
        enable_thinking = None
        if body.thinking is not None:
            enable_thinking = body.thinking.type != "disabled"
        sampling = SamplingOptions()
        if isinstance(body, s.MessagesRequest):
            stops = body.stop_sequences or []
            if any(not x for x in stops):
                raise invalid("stop_sequences must be non-empty strings")
            sampling = SamplingOptions(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                       max_tokens=body.max_tokens, stop=stops)
        user_id = body.metadata.user_id if body.metadata else None
        req = ChatRequest(
            messages=messages, tools=tools, tool_choice=choice, sampling=sampling, enable_thinking=enable_thinking,
            session_key=session.session_key(ctx.headers, ctx.tenant, anthropic_user_id=user_id), tenant=ctx.tenant,
            model=body.model,
        )
    except InvalidRequest as exc:
        raise invalid(str(exc)) from None
    return req, parallel


def _check_limits(app_state: Any, n: int) -> None:
    if n > app_state.config.max_messages:
        raise GatewayError("too_large", f"{n} messages exceed the limit of {app_state.config.max_messages}")


async def count_tokens(app_state: Any, request: Request, ctx: RequestContext, data: dict[str, Any]) -> Response:
    body: s.CountTokensRequest = validate(s.CountTokensRequest, data)
    _check_limits(app_state, len(body.messages))
    req, _ = to_chat_request(body, ctx)
    n = app_state.service.count_tokens(req)
    return JSONResponse({"input_tokens": n}, headers={"x-request-id": ctx.request_id})


def _usage(f: Finished | Started, output_tokens: int) -> dict[str, Any]:
    cached = f.cached_tokens
    return {"input_tokens": max(f.prompt_tokens - cached, 0), "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def messages(app_state: Any, request: Request, ctx: RequestContext, data: dict[str, Any]) -> Response:
    body: s.MessagesRequest = validate(s.MessagesRequest, data)
    _check_limits(app_state, len(body.messages))
    req, parallel = to_chat_request(body, ctx)
    service = app_state.service
    prepared = service.prepare_chat(req, ctx.request_id, "messages", parallel_tool_calls=parallel)
    gen = service.generation(prepared)
    mid = f"msg_{ctx.request_id}"
    if not body.stream:
        events = await collect_until_disconnect(gen, request)
        return JSONResponse(_message_body(events, mid, prepared.model_name), headers={"x-request-id": ctx.request_id})
    await gen.open_stream(app_state.config.keepalive_s)
    return SSEResponse(_message_stream(gen, mid, prepared.model_name), headers={"x-request-id": ctx.request_id})


def _message_body(events: list[Any], mid: str, model: str) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    finished: Finished | None = None
    for ev in events:
        if isinstance(ev, ReasoningDelta) and ev.text:
            if not blocks or blocks[-1]["type"] != "thinking":
                blocks.append({"type": "thinking", "thinking": "", "signature": ""})
            blocks[-1]["thinking"] += ev.text
        elif isinstance(ev, ContentDelta) and ev.text:
            if not blocks or blocks[-1]["type"] != "text":
                blocks.append({"type": "text", "text": ""})
            blocks[-1]["text"] += ev.text
        elif isinstance(ev, ToolCallEnd):
            if isinstance(ev.call.arguments, dict):
                blocks.append({"type": "tool_use", "id": ev.call.id, "name": ev.call.name, "input": ev.call.arguments})
            else:  # arguments that are not a JSON object cannot be a tool_use input: keep them as text
                blocks.append({"type": "text", "text": ev.call.arguments})
        elif isinstance(ev, Finished):
            finished = ev
    assert finished is not None
    if finished.reason == "error":
        raise finished.failure()
    for b in blocks:
        if b["type"] == "thinking":
            b["signature"] = signature(b["thinking"])
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": STOP_REASON[finished.reason], "stop_sequence": finished.stop_sequence,
            "usage": _usage(finished, finished.completion_tokens)}


async def _message_stream(gen: Generation, mid: str, model: str) -> AsyncIterator[bytes]:
    index = -1
    open_kind: str | None = None
    thinking: list[str] = []
    tool_blocks: dict[int, int] = {}  # tool-call index -> block index
    status = 200

    def start(kind: str, block: dict[str, Any]) -> bytes:
        nonlocal index, open_kind
        index += 1
        open_kind = kind
        return sse({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start")

    def stop() -> list[bytes]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(sse({"type": "content_block_delta", "index": index,
                            "delta": {"type": "signature_delta", "signature": signature("".join(thinking))}},
                           "content_block_delta"))
            thinking.clear()
        if open_kind is not None:
            out.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
        open_kind = None
        return out

    def delta(d: dict[str, Any], at: int | None = None) -> bytes:
        return sse({"type": "content_block_delta", "index": index if at is None else at, "delta": d},
                   "content_block_delta")

    try:
        async for ev in gen.stream():
            if isinstance(ev, KeepAlive):
                yield PING
            elif isinstance(ev, Started):
                msg = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                       "stop_reason": None, "stop_sequence": None, "usage": _usage(ev, 0)}
                yield sse({"type": "message_start", "message": msg}, "message_start")
            elif isinstance(ev, ReasoningDelta) and ev.text:
                if open_kind != "thinking":
                    for b in stop():
                        yield b
                    yield start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                thinking.append(ev.text)
                yield delta({"type": "thinking_delta", "thinking": ev.text})
            elif isinstance(ev, ContentDelta) and ev.text:
                if open_kind != "text":
                    for b in stop():
                        yield b
                    yield start("text", {"type": "text", "text": ""})
                yield delta({"type": "text_delta", "text": ev.text})
            elif isinstance(ev, ToolCallStart):
                for b in stop():
                    yield b
                yield start("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
                tool_blocks[ev.index] = index
            elif isinstance(ev, ToolCallArgsDelta) and ev.json_fragment:
                yield delta({"type": "input_json_delta", "partial_json": ev.json_fragment}, tool_blocks.get(ev.index))
            elif isinstance(ev, ToolCallEnd):
                if open_kind == "tool_use" and tool_blocks.get(ev.index) == index:
                    for b in stop():
                        yield b
            elif isinstance(ev, Finished):
                for b in stop():
                    yield b
                if ev.reason == "error":
                    err = ev.failure()
                    status = err.status
                    yield sse(anthropic_error_body(err), "error")
                    return
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": STOP_REASON[ev.reason], "stop_sequence": ev.stop_sequence},
                           "usage": {"output_tokens": ev.completion_tokens}}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except GatewayError as err:
        status = err.status
        yield sse(anthropic_error_body(err), "error")
    finally:
        await gen.aclose(status if gen.finished is not None else 499)

