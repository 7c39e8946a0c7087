"""``deepwell.gateway.v1.Chat``: the text-level chat API for gRPC clients in any language.

Same translation as the HTTP APIs (``ChatService``): the proto ``ChatRequest`` becomes a
``gateway.chat_types.ChatRequest``; the stream is ``started`` -> content / reasoning /
tool-call events -> ``finished``. Auth reads ``authorization: Bearer <key>`` or
``x-api-key`` metadata; the session comes from ``session_id`` or the same headers the HTTP
API reads (``gateway.session``), namespaced by tenant.

Status codes: bad request INVALID_ARGUMENT (the reason in the message), auth
UNAUTHENTICATED, engine overloaded RESOURCE_EXHAUSTED, no healthy engine UNAVAILABLE.
A client that goes away cancels the engine request. Health + reflection come from
``deepwell.grpcx.build_server``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from deepwell import grpcx, logs
from deepwell.gateway.v1 import chat_pb2, chat_pb2_grpc
from deepwell.gateway import session
from deepwell.gateway.auth import AuthError
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
from deepwell.gateway.pipeline import Finished, KeepAlive, Started
from deepwell.gateway.surrogates import find_lone_surrogate

log = logs.get_logger("deepwell.gateway.grpc_chat")

SERVICE_NAME = chat_pb2.DESCRIPTOR.services_by_name["Chat"].full_name
STATUS = {
    "invalid_request": grpc.StatusCode.INVALID_ARGUMENT, "too_large": grpc.StatusCode.INVALID_ARGUMENT,
    "context_length": grpc.StatusCode.INVALID_ARGUMENT, "authentication": grpc.StatusCode.UNAUTHENTICATED,
    "not_found": grpc.StatusCode.NOT_FOUND, "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE, "internal": grpc.StatusCode.INTERNAL,
}


def _json_object(text: str, what: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise invalid(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid(f"{what} must be a JSON object")
    found = find_lone_surrogate(value) if "\\u" in text else None
    if found is not None:
        raise invalid(found.message(what))
    return value


def to_chat_request(req: chat_pb2.ChatRequest, tenant: str, headers: dict[str, str], max_messages: int) -> ChatRequest:
    if len(req.messages) > max_messages:
        raise invalid(f"{len(req.messages)} messages exceed the limit of {max_messages}")
    try:
        messages = []
        for i, m in enumerate(req.messages):
            calls = [ToolCallSpec(id=c.id or f"call_{i}_{j}", name=c.name,
                                  arguments=_json_object(c.arguments_json, f"messages[{i}].tool_calls[{j}]"))
                     for j, c in enumerate(m.tool_calls)]
            messages.append(ChatMessage(role=m.role, content=m.content, reasoning=m.reasoning or None, tool_calls=calls,
                                        tool_call_id=m.tool_call_id or None, name=m.name or None))
        tools = [ToolDef(name=t.name, description=t.description,
                         parameters=_json_object(t.parameters_json, f"tools[{i}].parameters_json")
                         or {"type": "object", "properties": {}})
                 for i, t in enumerate(req.tools)]
        choice: Any = req.tool_choice or "auto"
        if choice not in ("auto", "none", "required"):
            choice = {"name": choice}
        opt = (lambda name: getattr(req, name) if req.HasField(name) else None)
        sampling = SamplingOptions(
            temperature=opt("temperature"), top_p=opt("top_p"), top_k=opt("top_k"), min_p=opt("min_p"),
            max_tokens=opt("max_tokens"), stop=list(req.stop), seed=opt("seed"),
            presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
            repetition_penalty=opt("repetition_penalty"),
        )
        sid = req.session_id or session.raw_session_id(headers)
        return ChatRequest(
            messages=messages, tools=tools, tool_choice=choice, sampling=sampling,
            enable_thinking=opt("enable_thinking"), preserve_thinking=req.preserve_thinking,
            template_kwargs=_json_object(req.chat_template_kwargs_json, "chat_template_kwargs_json"),
            session_key=session.namespaced(tenant, sid[: session.MAX_SESSION_CHARS] if sid else None), tenant=tenant,
            model=req.model,
        )
    except InvalidRequest as exc:
        raise invalid(str(exc)) from None


def _usage(f: Finished) -> chat_pb2.ChatUsage:
    return chat_pb2.ChatUsage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
                              cached_tokens=f.cached_tokens)


class ChatServicer(chat_pb2_grpc.ChatServicer):
    def __init__(self, state: Any) -> None:
        self.state = state

    def _tenant(self, context: grpc.aio.ServicerContext) -> tuple[str, dict[str, str]]:
        headers = {k.lower(): (v.decode() if isinstance(v, bytes) else v)
                   for k, v in (context.invocation_metadata() or ())}
        try:
            return self.state.keys.tenant_for(headers), headers
        except AuthError as exc:
            raise GatewayError("authentication", str(exc)) from None

    async def _abort(self, context: grpc.aio.ServicerContext, err: GatewayError, endpoint: str) -> None:
        if not getattr(err, "accounted", False):
            self.state.metrics.requests.labels(endpoint, str(err.status)).inc()
        await context.abort(STATUS[err.kind], err.message)

    async def Complete(self, request: chat_pb2.ChatRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[chat_pb2.ChatEvent]:
        try:
            tenant, headers = self._tenant(context)
            req = to_chat_request(request, tenant, headers, self.state.config.max_messages)
            rid = grpcx.current_request_id() or uuid.uuid4().hex
            parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
            prepared = self.state.service.prepare_chat(req, rid, "grpc.Complete", parallel_tool_calls=parallel)
            gen = self.state.service.generation(prepared)
        except GatewayError as err:
            await self._abort(context, err, "grpc.Complete")
            return
        try:
            try:
                await gen.prime(self.state.config.keepalive_s)
            except GatewayError as err:
                await self._abort(context, err, "grpc.Complete")
                return
            gen.stream_opened()
            async for ev in gen.stream():
                out = self._event(ev, prepared.model_name)
                if out is not None:
                    yield out
        finally:
            await gen.aclose(200 if gen.finished is not None else 499)

    @staticmethod
    def _event(ev: Any, model: str) -> chat_pb2.ChatEvent | None:
        if isinstance(ev, KeepAlive):
            return None
        if isinstance(ev, Started):
            return chat_pb2.ChatEvent(started=chat_pb2.Started(request_id=ev.request_id, model=model,
                                                               prompt_tokens=ev.prompt_tokens,
                                                               cached_tokens=ev.cached_tokens))
        if isinstance(ev, ContentDelta):
            return chat_pb2.ChatEvent(content_delta=ev.text) if ev.text else None
        if isinstance(ev, ReasoningDelta):
            return chat_pb2.ChatEvent(reasoning_delta=ev.text) if ev.text else None
        if isinstance(ev, ToolCallStart):
            return chat_pb2.ChatEvent(tool_call_start=chat_pb2.ToolCallStart(index=ev.index, id=ev.id, name=ev.name))
        if isinstance(ev, ToolCallArgsDelta):
            return chat_pb2.ChatEvent(tool_call_delta=chat_pb2.ToolCallArgumentsDelta(
                index=ev.index, json_fragment=ev.json_fragment)) if ev.json_fragment else None
        if isinstance(ev, ToolCallEnd):
            call = chat_pb2.ToolCall(id=ev.call.id, name=ev.call.name, arguments_json=ev.call.arguments_json())
            return chat_pb2.ChatEvent(tool_call_end=chat_pb2.ToolCallEnd(index=ev.index, call=call))
        if isinstance(ev, Finished):
            return chat_pb2.ChatEvent(finished=chat_pb2.Finished(
                finish_reason=ev.reason, stop_sequence=ev.stop_sequence or "", usage=_usage(ev), error=ev.error))
        return None  # ToolParseFailure: its raw text arrives as a content delta

    async def CountTokens(self, request: chat_pb2.ChatRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> chat_pb2.CountTokensReply:
        try:
            tenant, headers = self._tenant(context)
            req = to_chat_request(request, tenant, headers, self.state.config.max_messages)
            n = self.state.service.count_tokens(req)
        except GatewayError as err:
            await self._abort(context, err, "grpc.CountTokens")
            raise AssertionError("unreachable")  # context.abort raises
        self.state.metrics.requests.labels("grpc.CountTokens", "200").inc()
        return chat_pb2.CountTokensReply(input_tokens=n)

    async def ListModels(self, request: chat_pb2.ListModelsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> chat_pb2.ListModelsReply:
        try:
            self._tenant(context)
        except GatewayError as err:
            await self._abort(context, err, "grpc.ListModels")
        cards = [chat_pb2.ModelCard(id=b.model_id, max_model_len=b.max_context, owned_by="deepwell")
                 for b in self.state.service.served_models()]
        return chat_pb2.ListModelsReply(models=cards)


async def start_chat_server(address: str, state: Any) -> grpcx.ServerHandle:
    servicer = ChatServicer(state)
    handle = grpcx.build_server(address, register=[lambda s: chat_pb2_grpc.add_ChatServicer_to_server(servicer, s)],
                                service_names=[SERVICE_NAME])
    await handle.server.start()
    await handle.set_serving(SERVICE_NAME)
    await handle.set_serving("")
    return handle
