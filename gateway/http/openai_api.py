"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions``.

Streaming (``stream: true``) follows the sequence the official SDK expects: a role chunk
(``delta.role = "assistant"``), content / ``reasoning_content`` / ``tool_calls`` deltas
(a tool call's first delta carries id, type and name with empty arguments; later ones
carry argument fragments), a chunk with ``finish_reason`` and an empty delta, then — with
``stream_options.include_usage`` — a chunk with ``choices: []`` and ``usage`` (every
earlier chunk then carries ``usage: null``), then ``data: [DONE]``. While the engine
queues/prefills, ``: keep-alive`` comments go out every ``keepalive_s``. An engine error
after the stream started is sent as ``data: {"error": {...}}`` (the SDK raises it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

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
    ToolCallSpec,
    ToolCallStart,
    ToolDef,
)
from deepwell.gateway.errors import GatewayError, invalid
from deepwell.gateway.http import schemas_openai as s
from deepwell.gateway.http.common import (
    KEEPALIVE_COMMENT,
    RequestContext,
    SSEResponse,
    collect_until_disconnect,
    openai_error_body,
    sse,
)
from deepwell.gateway.pipeline import Finished, Generation, KeepAlive, Started

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls",
          "cancelled": "stop", "error": "stop"}


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise invalid("at most 16 stop sequences are supported", param="stop")
    if any(not x for x in stops):
        raise invalid("stop sequences must be non-empty strings", param="stop")
    return stops


def _common_unsupported(body: s.SamplingFields) -> None:
    if body.n is not None and body.n > 1:
        raise invalid("n > 1 is not supported: request one choice at a time", param="n")
    if body.logprobs or body.top_logprobs:
        raise invalid("logprobs are not supported by this gateway yet", param="logprobs")


def sampling_from(body: s.SamplingFields, max_tokens: int | None) -> SamplingOptions:
    try:
        return SamplingOptions(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, max_tokens=max_tokens,
            stop=_stops(body.stop), seed=body.seed % 2**64 if body.seed is not None else None,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
        )
    except InvalidRequest as exc:
        raise invalid(str(exc)) from None


def _content(content: str | list[dict[str, Any]] | None, where: str) -> str | list[ContentPart]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[ContentPart] = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.content[{i}].text must be a string")
            parts.append(ContentPart(type="text", text=text))
        elif kind in ("image_url", "input_image", "image", "input_audio", "file", "video_url"):
            raise invalid(f"{where}.content[{i}]: {kind} content is not supported (this deployment has no "
                          f"vision/audio input)")
        else:
            raise invalid(f"{where}.content[{i}]: unknown content part type {kind!r}")
    return parts


def to_chat_request(body: s.ChatCompletionRequest, ctx: RequestContext) -> tuple[ChatRequest, bool]:
    _common_unsupported(body)
    if body.response_format is not None and body.response_format.type not in ("text",):
        raise invalid(f"response_format {body.response_format.type!r} is not supported until constrained decoding "
                      f"exists; use 'text'", param="response_format")
    messages: list[ChatMessage] = []
    try:
        for i, m in enumerate(body.messages):
            where = f"messages[{i}]"
            role = "tool" if m.role == "function" else m.role
            calls = [ToolCallSpec(id=c.id or f"call_{i}_{j}", name=c.function.name, arguments=c.function.arguments)
                     for j, c in enumerate(m.tool_calls or [])]
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            messages.append(ChatMessage(role=role, content=_content(m.content, where), reasoning=reasoning,
                                        tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name))
        tools = []
        for i, t in enumerate(body.tools or []):
            if t.type != "function" or t.function is None:
                raise invalid(f"tools[{i}]: only function tools are supported (got type {t.type!r})")
            tools.append(ToolDef(name=t.function.name, description=t.function.description or "",
                                 parameters=t.function.parameters or {"type": "object", "properties": {}}))
        choice: Any = body.tool_choice or "auto"
        if isinstance(choice, s.NamedToolChoice):
            choice = {"name": choice.function.name}
        kwargs = dict(body.chat_template_kwargs or {})
        enable_thinking = body.enable_thinking
        if enable_thinking is None and isinstance(kwargs.get("enable_thinking"), bool):
            enable_thinking = kwargs.pop("enable_thinking")
        if enable_thinking is None and body.reasoning_effort is not None:
            enable_thinking = body.reasoning_effort not in ("none", "minimal")
        preserve = bool(kwargs.pop("preserve_thinking", False))
        max_tokens = body.max_completion_tokens or body.max_tokens
        req = ChatRequest(
            messages=messages, tools=tools, tool_choice=choice, sampling=sampling_from(body, max_tokens),
            enable_thinking=enable_thinking, preserve_thinking=preserve, template_kwargs=kwargs,
            session_key=session.session_key(ctx.headers, ctx.tenant, openai_user=body.user,
                                           prompt_cache_key=body.prompt_cache_key), tenant=ctx.tenant,
            model=body.model,
        )
    except InvalidRequest as exc:
        raise invalid(str(exc)) from None
    return req, body.parallel_tool_calls


def usage_json(f: Finished) -> dict[str, Any]:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}


# ---------------------------------------------------------------------------- chat
async def chat_completions(app_state: Any, request: Request, ctx: RequestContext, data: dict[str, Any]) -> Response:
    from deepwell.gateway.http.common import validate

    body: s.ChatCompletionRequest = validate(s.ChatCompletionRequest, data)
    if len(body.messages) > app_state.config.max_messages:
        raise GatewayError("too_large", f"{len(body.messages)} messages exceed the limit of "
                                        f"{app_state.config.max_messages}")
    req, parallel = to_chat_request(body, ctx)
    service = app_state.service
    prepared = service.prepare_chat(req, ctx.request_id, "chat.completions", parallel_tool_calls=parallel)
    gen = service.generation(prepared)
    created = int(time.time())
    cid = f"chatcmpl-{ctx.request_id}"
    if not body.stream:
        events = await collect_until_disconnect(gen, request)
        return JSONResponse(_chat_body(events, cid, created, prepared.model_name),
                            headers={"x-request-id": ctx.request_id})
    await gen.open_stream(app_state.config.keepalive_s)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return SSEResponse(_chat_stream(gen, cid, created, prepared.model_name, include_usage),
                       headers={"x-request-id": ctx.request_id})


def _chat_body(events: list[Any], cid: str, created: int, model: str) -> dict[str, Any]:
    content: list[str] = []
    reasoning: list[str] = []
    finished: Finished | None = None
    for ev in events:
        if isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, Finished):
            finished = ev
    assert finished is not None
    if finished.reason == "error":
        raise finished.failure()
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if content or not finished.tool_calls
                               else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if finished.tool_calls:
        message["tool_calls"] = [{"id": c.call.id, "type": "function",
                                  "function": {"name": c.call.name, "arguments": c.call.arguments_json()}}
                                 for c in finished.tool_calls]
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": FINISH[finished.reason]}],
        "usage": usage_json(finished),
    }


async def _chat_stream(gen: Generation, cid: str, created: int, model: str,
                       include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "system_fingerprint": None,
                                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    status = 200
    try:
        async for ev in gen.stream():
            if isinstance(ev, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(ev, Started):
                yield chunk({"role": "assistant", "content": ""})
            elif isinstance(ev, ContentDelta):
                if ev.text:
                    yield chunk({"content": ev.text})
            elif isinstance(ev, ReasoningDelta):
                if ev.text:
                    yield chunk({"reasoning_content": ev.text})
            elif isinstance(ev, ToolCallStart):
                yield chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                             "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, ToolCallArgsDelta):
                if ev.json_fragment:
                    yield chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.json_fragment}}]})
            elif isinstance(ev, Finished):
                if ev.reason == "error":
                    err = ev.failure()
                    yield sse(openai_error_body(err))
                    status = err.status
                    break
                yield chunk({}, FINISH[ev.reason])
                if include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "system_fingerprint": None, "choices": [], "usage": usage_json(ev)})
        yield sse("[DONE]")
    except GatewayError as err:
        status = err.status
        yield sse(openai_error_body(err))
    finally:
        await gen.aclose(status if gen.finished is not None else 499)


# ---------------------------------------------------------------------------- completions
async def completions(app_state: Any, request: Request, ctx: RequestContext, data: dict[str, Any]) -> Response:
    from deepwell.gateway.http.common import validate

    body: s.CompletionRequest = validate(s.CompletionRequest, data)
    _common_unsupported(body)
    if body.echo:
        raise invalid("echo is not supported", param="echo")
    if body.suffix:
        raise invalid("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of > 1:
        raise invalid("best_of > 1 is not supported", param="best_of")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid("batched prompts are not supported: send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list) and not prompt:
        raise invalid("prompt must not be empty", param="prompt")
    sampling = sampling_from(body, body.max_tokens)
    service = app_state.service
    key = session.session_key(ctx.headers, ctx.tenant, openai_user=body.user, prompt_cache_key=body.prompt_cache_key)
    prepared = service.prepare_text(prompt, sampling, ctx.request_id, "completions", ctx.tenant, key, body.model)
    gen = service.generation(prepared)
    created = int(time.time())
    cid = f"cmpl-{ctx.request_id}"
    if not body.stream:
        events = await collect_until_disconnect(gen, request)
        text = "".join(ev.text for ev in events if isinstance(ev, ContentDelta))
        fin = next(ev for ev in events if isinstance(ev, Finished))
        if fin.reason == "error":
            raise fin.failure()
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": prepared.model_name,
            "system_fingerprint": None,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": FINISH[fin.reason]}],
            "usage": usage_json(fin),
        }, headers={"x-request-id": ctx.request_id})
    await gen.open_stream(app_state.config.keepalive_s)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return SSEResponse(_completion_stream(gen, cid, created, prepared.model_name, include_usage),
                       headers={"x-request-id": ctx.request_id})


async def _completion_stream(gen: Generation, cid: str, created: int, model: str,
                             include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None) -> bytes:
        body: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model,
                                "system_fingerprint": None,
                                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    status = 200
    try:
        async for ev in gen.stream():
            if isinstance(ev, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(ev, ContentDelta) and ev.text:
                yield chunk(ev.text)
            elif isinstance(ev, Finished):
                if ev.reason == "error":
                    err = ev.failure()
                    status = err.status
                    yield sse(openai_error_body(err))
                    break
                yield chunk("", FINISH[ev.reason])
                if include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage_json(ev)})
        yield sse("[DONE]")
    except GatewayError as err:
        status = err.status
        yield sse(openai_error_body(err))
    finally:
        await gen.aclose(status if gen.finished is not None else 499)

