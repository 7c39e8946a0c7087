"""Async client of one engine (``deepwell.engine.v1.Engine``) plus its model bundle.

Lifecycle: ``start()`` opens a channel and a background health loop. Each round checks
``grpc.health.v1`` (the ``deepwell.engine.v1.Engine`` service, falling back to the
server-wide status when that name is not registered); the first time an engine is
serving — and again whenever its ``engine_id`` changes (a restarted engine) — the client
fetches ``GetModelInfo`` and the gateway files (``tokenizer.json``,
``tokenizer_config.json``) through ``ReadModelFile`` and builds the ``ModelBundle``
(tokenizer, chat template, tool-parser name). The engine counts as healthy only while it
is serving AND its bundle is loaded. gRPC channels reconnect by themselves, so an engine
that comes back is picked up by the next health round.

Errors from ``generate`` are typed: ``EngineOverloaded`` (RESOURCE_EXHAUSTED),
``EngineRejected`` (INVALID_ARGUMENT / OUT_OF_RANGE, the engine's reason),
``EngineUnavailable`` (transport failures; the engine is marked unhealthy at once).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepwell import grpcx, logs
from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc

log = logs.get_logger("deepwell.gateway.engine_client")

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
GATEWAY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MAX_FILE_BYTES = 512 * 1024 * 1024
RPC_TIMEOUT_S = 10.0


class EngineError(Exception):
    """Base of the typed engine failures."""


class EngineUnavailable(EngineError):
    pass


class EngineOverloaded(EngineError):
    pass


class EngineRejected(EngineError):
    pass


def map_rpc_error(exc: grpc.aio.AioRpcError) -> EngineError:
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return EngineOverloaded(details)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
        return EngineRejected(details)
    return EngineUnavailable(f"{code.name}: {details}")


@dataclass
class ModelBundle:
    """Everything the gateway needs to talk text with one engine's model."""

    info: engine_pb2.ModelInfo
    tokenizer: Any  # tokenizers.Tokenizer
    template: Any | None  # gateway.templates.ChatTemplate, None when the model has none
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    tool_parser: str | None = "hermes_json"
    renders_tools: bool = True  # False: the template ignores tools -> the generic tool prompt

    @property
    def model_id(self) -> str:
        return self.info.model_id

    @property
    def max_context(self) -> int:
        return int(self.info.max_context_tokens)


def _special_token(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def build_bundle(info: engine_pb2.ModelInfo, files: dict[str, bytes], tool_parser_override: str = "") -> ModelBundle:
    """Tokenizer + template + parser choice from a ModelInfo and its fetched files."""
    from tokenizers import Tokenizer

    from deepwell.gateway.templates import ChatTemplate
    from deepwell.gateway.toolparse import parser_for_template

    if "tokenizer.json" not in files:
        raise EngineError(f"engine for model {info.model_id!r} does not offer tokenizer.json")
    tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    tok_cfg: dict[str, Any] = {}
    if "tokenizer_config.json" in files:
        try:
            loaded = json.loads(files["tokenizer_config.json"])
            tok_cfg = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            log.warning("tokenizer_config_unreadable", model=info.model_id)
    source = info.chat_template or (tok_cfg.get("chat_template") if isinstance(tok_cfg.get("chat_template"), str) else "")
    bos = info.bos_token or _special_token(tok_cfg.get("bos_token"))
    eos = info.eos_token or _special_token(tok_cfg.get("eos_token"))
    template = ChatTemplate(source, bos_token=bos, eos_token=eos) if source else None
    parser = tool_parser_override or parser_for_template(source or "", info.model_type)
    renders = template is not None and _renders_tools(template)
    if template is not None and not renders:
        log.info("generic_tool_prompt", model=info.model_id,
                 detail="the chat template ignores tools; they go into the system turn in the Hermes form")
    return ModelBundle(info=info, tokenizer=tokenizer, template=template, tokenizer_config=tok_cfg,
                       tool_parser=parser, renders_tools=renders)


_PROBE_TOOL = {"type": "function", "function": {"name": "deepwell_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


def _renders_tools(template: Any) -> bool:
    """Whether the chat template writes the tools it is given into the prompt."""
    from deepwell.gateway.templates import TemplateError

    try:
        text = template.render([{"role": "user", "content": "hi"}], [_PROBE_TOOL], add_generation_prompt=True)
    except TemplateError:
        return False
    return "deepwell_probe_tool" in text


class EngineClient:
    def __init__(self, address: str, health_interval_s: float = 2.0, tool_parser_override: str = "",
                 token: str = "") -> None:
        self.address = address
        self.token = token  # the internal token (deepwell.auth) sent on every call when set
        self.health_interval_s = health_interval_s
        self.tool_parser_override = tool_parser_override
        self.bundle: ModelBundle | None = None
        self._serving = False
        self._channel: grpc.aio.Channel | None = None
        self._stub: engine_pb2_grpc.EngineStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.last_error: str = ""

    @property
    def healthy(self) -> bool:
        return self._serving and self.bundle is not None

    async def start(self) -> None:
        self._channel = grpcx.aio_channel(self.address, token=self.token)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._task = asyncio.create_task(self._health_loop(), name=f"engine-health-{self.address}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    async def wait_healthy(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.healthy:
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return self.healthy
        return True

    def mark_unhealthy(self, reason: str) -> None:
        if self._serving:
            log.warning("engine_unhealthy", engine=self.address, reason=reason)
        self._serving = False
        self.last_error = reason

    async def _check_serving(self) -> bool:
        assert self._health is not None
        for service in (ENGINE_SERVICE, ""):
            try:
                reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and service:
                    continue
                self.last_error = f"{exc.code().name}: {exc.details()}"
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        return False

    async def _health_loop(self) -> None:
        while True:
            try:
                serving = await self._check_serving()
                if serving:
                    info = await self.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
                    if self.bundle is None or self.bundle.info.engine_id != info.engine_id or \
                            self.bundle.info.model_id != info.model_id:
                        await self._load(info)
                was = self.healthy
                self._serving = serving
                if was != self.healthy:
                    log.info("engine_health", engine=self.address, healthy=self.healthy,
                             model=self.bundle.model_id if self.bundle else None)
            except grpc.aio.AioRpcError as exc:
                self.mark_unhealthy(f"{exc.code().name}: {exc.details()}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broken model bundle must not kill the loop
                self.mark_unhealthy(f"model bundle: {exc}")
                log.error("engine_bundle_failed", engine=self.address, error=str(exc))
            self._changed.set()
            await asyncio.sleep(self.health_interval_s)

    async def _load(self, info: engine_pb2.ModelInfo) -> None:
        offered = {f.name for f in info.files}
        files = {name: await self.read_file(name) for name in GATEWAY_FILES if name in offered}
        self.bundle = build_bundle(info, files, self.tool_parser_override)
        log.info("engine_model_loaded", engine=self.address, model=info.model_id, engine_id=info.engine_id,
                 max_context=info.max_context_tokens, tool_parser=self.bundle.tool_parser)

    @property
    def stub(self) -> engine_pb2_grpc.EngineStub:
        if self._stub is None:
            raise EngineUnavailable(f"engine client {self.address} not started")
        return self._stub

    async def read_file(self, name: str) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in self.stub.ReadModelFile(engine_pb2.ReadModelFileRequest(name=name), timeout=120.0):
            if chunk.offset != size:
                raise EngineError(f"ReadModelFile({name}) chunk at offset {chunk.offset}, expected {size}")
            parts.append(chunk.data)
            size += len(chunk.data)
            if size > MAX_FILE_BYTES:
                raise EngineError(f"ReadModelFile({name}) exceeds {MAX_FILE_BYTES} bytes")
            if chunk.last:
                break
        return b"".join(parts)

    async def generate(self, request: engine_pb2.GenerateRequest) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """Stream one request's events; cancelling the consumer cancels the engine call."""
        # The engine logs under the same id (x-request-id metadata) that the client sees.
        call = self.stub.Generate(request, metadata=[(grpcx.REQUEST_ID_KEY, request.request_id)])
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as exc:
            err = map_rpc_error(exc)
            if isinstance(err, EngineUnavailable) and exc.code() != grpc.StatusCode.CANCELLED:
                self.mark_unhealthy(str(err))
            raise err from None
        finally:
            if not call.done():
                cancelled = call.cancel()
                log.debug("engine_call_cancelled", engine=self.address, request_id=request.request_id,
                          cancelled=cancelled)

    async def sessions(self, tenant: str = "") -> engine_pb2.SessionsReply:
        """The engine's ``Sessions`` list; ``EngineError`` when it cannot answer."""
        try:
            return await self.stub.Sessions(engine_pb2.SessionsRequest(tenant=tenant), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc) from None

    async def cancel(self, request_id: str) -> bool:
        try:
            reply = await self.stub.Cancel(engine_pb2.CancelRequest(request_id=request_id), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.found)
