"""The API-neutral request path shared by the HTTP APIs and the gRPC Chat service.

``ChatService.prepare_chat`` (or ``prepare_text`` for raw completions) picks the engine
(rendezvous on the session key), builds the prompt with that engine's template and
tokenizer and checks it against the context; every client error surfaces here as a
``GatewayError`` before any engine call. ``Generation.events()`` then streams:
``Started`` (after the engine admitted the request: real prompt and cached token
counts), text / reasoning / tool-call events, ``KeepAlive`` whenever nothing happened
for ``keepalive_s`` (the front end writes an SSE comment), and exactly one ``Finished``.
An engine failure before ``Started`` raises ``GatewayError`` (overloaded, rejected,
unavailable — unavailable engines are retried on the next one by rendezvous order);
after ``Started`` it ends the stream with ``Finished(reason="error")``.

``Generation.aclose()`` (client went away, stop string, parallel-call cut) cancels the
engine call and sends ``Cancel``; it is idempotent and always writes the accounting record
and metrics exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deepwell import logs
from deepwell.engine.v1 import engine_pb2
from deepwell.gateway.accounting import CACHE_LEVELS, RequestLog, RequestRecord, session_hash
from deepwell.gateway.chat_types import ChatRequest, Event, InvalidRequest, SamplingOptions, ToolCallEnd
from deepwell.gateway.config import U32, GatewayConfig
from deepwell.gateway.engine_client import EngineClient, EngineOverloaded, EngineRejected, EngineUnavailable, ModelBundle
from deepwell.gateway.errors import ContextLengthError, GatewayError, invalid
from deepwell.gateway.metrics import GatewayMetrics
from deepwell.gateway.output import OutputProcessor
from deepwell.gateway.routing import NoHealthyEngine, Router
from deepwell.gateway.tool_format import tool_format

log = logs.get_logger("deepwell.gateway.pipeline")

ENGINE_FINISH = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ERROR: "error",
}
# The engine ended the request itself (shutting down, a deadline, another caller's Cancel): the
# client did not ask for it, so its answer is cut short. It is an error the client can retry
# (503 before a response began, an error event in a stream), never a normal finish.
ENGINE_STOPPED = {engine_pb2.FINISH_REASON_CANCELLED: "cancelled", engine_pb2.FINISH_REASON_DEADLINE: "deadline"}

@dataclass
class Started:
    request_id: str
    model: str
    prompt_tokens: int
    cached: dict[str, int]
    engine: str

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())


@dataclass
class Finished:
    reason: str  # stop | length | tool_calls | stop_sequence | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    cached: dict[str, int]
    stop_sequence: str | None = None
    error: str = ""
    error_kind: str = "internal"  # with reason "error": the GatewayError kind a response without a stream gets
    retry_after_s: int | None = None

    def failure(self) -> GatewayError:
        """The error a response without a stream answers for a generation that ended in error."""
        if self.error_kind != "internal":
            return GatewayError(self.error_kind, self.error, retry_after_s=self.retry_after_s)
        return GatewayError("internal", f"generation failed in the engine: {self.error or 'unknown error'}")
    tool_calls: list[ToolCallEnd] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())


@dataclass
class KeepAlive:
    pass


OutEvent = Started | Finished | KeepAlive | Event

_BACKGROUND: set[asyncio.Task[Any]] = set()  # fire-and-forget Cancel RPCs (kept referenced)


@dataclass
class Prepared:
    request_id: str
    endpoint: str
    tenant: str
    session_key: str | None
    engine: EngineClient
    bundle: ModelBundle
    prompt_ids: list[int]
    turn_boundary: int | None
    sampling: SamplingOptions
    processor_args: dict[str, Any]
    model_name: str
    chat: ChatRequest | None = None  # kept for failover re-preparation
    text_prompt: str | list[int] | None = None
    tool_format: str | None = None  # how the tools reached the prompt: "template" | "generic_hermes"
    exclude: tuple[str, ...] = ()
    prefix_boundary: int | None = None  # end of the shared system-and-tools block


def _cache_dict(hits: engine_pb2.CacheHits) -> dict[str, int]:
    return {level: int(getattr(hits, level)) for level in CACHE_LEVELS}


def effective_max_tokens(requested: int | None, default_max_tokens: int = 0, max_output_tokens: int = 0) -> int:
    """The output limit sent to the engine (0 = up to the context): the request's own
    limit, else ``--default-max-tokens``, never more than ``--max-output-tokens`` (0 = no
    cap), and always within the engine's uint32."""
    limit = requested or default_max_tokens or max_output_tokens
    if max_output_tokens:
        limit = min(limit, max_output_tokens)
    return min(limit, U32)


def sampling_params(s: SamplingOptions, default_max_tokens: int = 0,
                    max_output_tokens: int = 0) -> engine_pb2.SamplingParams:
    p = engine_pb2.SamplingParams(max_tokens=effective_max_tokens(s.max_tokens, default_max_tokens, max_output_tokens))
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed"):
        value = getattr(s, name)
        if value is not None:
            setattr(p, name, value)
    return p


class ChatService:
    def __init__(self, config: GatewayConfig, router: Router, metrics: GatewayMetrics, request_log: RequestLog) -> None:
        self.config = config
        self.router = router
        self.metrics = metrics
        self.request_log = request_log

    # ------------------------------------------------------------------ lookup
    def _engine(self, key: str, exclude: tuple[str, ...] = ()) -> EngineClient:
        try:
            engine = self.router.pick(key, exclude)
        except NoHealthyEngine as exc:
            raise GatewayError("unavailable", str(exc), retry_after_s=exc.retry_after_s) from None
        assert isinstance(engine, EngineClient)
        return engine

    def any_bundle(self) -> ModelBundle:
        for engine in self.router.healthy():
            if isinstance(engine, EngineClient) and engine.bundle is not None:
                return engine.bundle
        raise GatewayError("unavailable", "no healthy engine is available", retry_after_s=self.config.retry_after_s)

    def served_models(self) -> list[ModelBundle]:
        seen: dict[str, ModelBundle] = {}
        for engine in self.router.engines:
            if isinstance(engine, EngineClient) and engine.bundle is not None and engine.healthy:
                seen.setdefault(engine.bundle.model_id, engine.bundle)
        return list(seen.values())

    # ------------------------------------------------------------------ prompts
    @staticmethod
    def _render(req: ChatRequest, bundle: ModelBundle) -> Any:
        from deepwell.gateway.prompting import build_prompt
        from deepwell.gateway.templates import TemplateError

        if bundle.template is None:
            raise invalid(f"model {bundle.model_id!r} has no chat template; use /v1/completions with a raw prompt")
        try:
            fmt = tool_format(req, bundle)
            return build_prompt(req, bundle.template, bundle.tokenizer, generic_tools=fmt is not None and fmt.generic)
        except TemplateError as exc:
            raise invalid(f"chat template error: {exc}") from None
        except InvalidRequest as exc:
            raise invalid(str(exc)) from None

    def count_tokens(self, req: ChatRequest) -> int:
        return len(self._render(req, self.any_bundle()).token_ids)

    def _check_context(self, n_prompt: int, bundle: ModelBundle) -> None:
        if bundle.max_context and n_prompt >= bundle.max_context:
            raise ContextLengthError(n_prompt, bundle.max_context)
        if n_prompt == 0:
            raise invalid("the prompt is empty")

    def prepare_chat(self, req: ChatRequest, request_id: str, endpoint: str, parallel_tool_calls: bool = True,
                     exclude: tuple[str, ...] = ()) -> Prepared:
        if req.sampling.logprobs or req.sampling.top_logprobs:
            raise invalid("logprobs are not supported by this gateway yet", param="logprobs")
        engine = self._engine(req.session_key or request_id, exclude)
        bundle = engine.bundle
        assert bundle is not None
        prompt = self._render(req, bundle)
        ids = list(prompt.token_ids)
        start_in_reasoning = prompt.opens_reasoning
        tools = req.active_tools()
        fmt = tool_format(req, bundle)
        if fmt is not None and fmt.parser is None:
            log.warning("no_tool_parser", model=bundle.model_id,
                        detail="the model's template has no known tool-call format; calls stay text "
                               "(set --tool-parser to choose one)")
        forced = ""
        if fmt is not None and (req.tool_choice == "required" or req.forced_tool()):
            prefix = fmt.forced_prefix(req.forced_tool() if req.tool_choice != "required" else None)
            if prefix is None:
                raise invalid(f"tool_choice {req.tool_choice!r} is not supported with tool parser {fmt.parser!r}")
            forced = prefix
            close = "</think>\n\n" if start_in_reasoning else ""
            ids += bundle.tokenizer.encode(close + forced, add_special_tokens=False).ids
            start_in_reasoning = False
        self._check_context(len(ids), bundle)
        return Prepared(
            request_id=request_id, endpoint=endpoint, tenant=req.tenant, session_key=req.session_key, engine=engine,
            bundle=bundle, prompt_ids=ids, turn_boundary=prompt.turn_boundary, sampling=req.sampling,
            model_name=req.model or bundle.model_id, chat=req, exclude=exclude, prefix_boundary=prompt.prefix_boundary,
            tool_format=fmt.name if fmt is not None else None,
            processor_args=dict(
                stops=req.sampling.stop, start_in_reasoning=start_in_reasoning, split_reasoning=True,
                tools=tools, parser_name=fmt.parser if fmt is not None else None,
                tolerant=self.config.tolerant_tool_calls, parallel_tool_calls=parallel_tool_calls,
                forced_prefix=forced,
            ),
        )

    def prepare_text(self, prompt: str | list[int], sampling: SamplingOptions, request_id: str, endpoint: str,
                     tenant: str, session_key: str | None, model: str, exclude: tuple[str, ...] = ()) -> Prepared:
        if sampling.logprobs or sampling.top_logprobs:
            raise invalid("logprobs are not supported by this gateway yet", param="logprobs")
        engine = self._engine(session_key or request_id, exclude)
        bundle = engine.bundle
        assert bundle is not None
        if isinstance(prompt, str):
            ids = list(bundle.tokenizer.encode(prompt, add_special_tokens=True).ids)
        else:
            vocab = bundle.info.vocab_size or bundle.tokenizer.get_vocab_size()
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise invalid(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
            ids = list(prompt)
        self._check_context(len(ids), bundle)
        return Prepared(
            request_id=request_id, endpoint=endpoint, tenant=tenant, session_key=session_key, engine=engine,
            bundle=bundle, prompt_ids=ids, turn_boundary=None, sampling=sampling, model_name=model or bundle.model_id,
            text_prompt=prompt, exclude=exclude,
            processor_args=dict(stops=sampling.stop, split_reasoning=False),
        )

    def reprepare(self, p: Prepared) -> Prepared:
        exclude = (*p.exclude, p.engine.address)
        if p.chat is not None:
            parallel = p.processor_args.get("parallel_tool_calls", True)
            return self.prepare_chat(p.chat, p.request_id, p.endpoint, parallel, exclude)
        assert p.text_prompt is not None
        return self.prepare_text(p.text_prompt, p.sampling, p.request_id, p.endpoint, p.tenant, p.session_key,
                                 p.model_name, exclude)

    def generation(self, prepared: Prepared) -> Generation:
        return Generation(self, prepared)


class Generation:
    """One running request; iterate ``events()`` once, always ``aclose()``."""

    def __init__(self, service: ChatService, prepared: Prepared) -> None:
        self.service = service
        self.p = prepared
        self.processor = OutputProcessor(prepared.bundle.tokenizer, **prepared.processor_args)
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.started: Started | None = None
        self.finished: Finished | None = None
        self.status = 200
        self._completion_tokens = 0
        self._engine_timings: dict[str, float] = {}
        self._spec: dict[str, int] = {}  # the engine's speculative-decoding counts of this request
        self._queue: asyncio.Queue[OutEvent | BaseException | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._engine_done = False
        self._active_stream = False
        self._iter: AsyncIterator[OutEvent] | None = None
        self._primed: list[OutEvent] = []
        self.record = RequestRecord(request_id=prepared.request_id, tenant=prepared.tenant, endpoint=prepared.endpoint,
                                    tool_format=prepared.tool_format)

    # ------------------------------------------------------------------ engine side
    def _request(self) -> engine_pb2.GenerateRequest:
        cfg = self.service.config
        sampling = sampling_params(self.p.sampling, cfg.default_max_tokens, cfg.max_output_tokens)
        req = engine_pb2.GenerateRequest(
            request_id=self.p.request_id, prompt_token_ids=self.p.prompt_ids, sampling=sampling,
            session_key=self.p.session_key or "", tenant=self.p.tenant,
        )
        if self.p.turn_boundary is not None:
            req.turn_boundary = self.p.turn_boundary
        if self.p.prefix_boundary is not None:
            req.prefix_boundary = self.p.prefix_boundary
        return req

    async def _produce(self) -> None:
        try:
            await self._produce_inner()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # delivered to the consumer
            await self._queue.put(exc)
        finally:
            await self._queue.put(None)

    async def _produce_inner(self) -> None:
        while True:
            try:
                await self._stream_engine()
                return
            except EngineUnavailable as exc:
                if self.started is not None:
                    raise
                log.warning("engine_unavailable_failover", engine=self.p.engine.address, error=str(exc))
                try:
                    self.p = self.service.reprepare(self.p)
                except GatewayError as err:
                    raise GatewayError("unavailable", f"engine unavailable: {exc}",
                                       retry_after_s=err.retry_after_s or self.service.config.retry_after_s) from None
                self.processor = OutputProcessor(self.p.bundle.tokenizer, **self.p.processor_args)

    async def _stream_engine(self) -> None:
        stream = self.p.engine.generate(self._request())
        try:
            await self._consume(stream)
        finally:
            await stream.aclose()  # cancels the engine call when we stopped early

    async def _consume(self, stream: AsyncIterator[engine_pb2.GenerateResponse]) -> None:
        put = self._queue.put
        async for msg in stream:
            kind = msg.WhichOneof("event")
            if kind == "admitted":
                a = msg.admitted
                self.started = Started(request_id=self.p.request_id, model=self.p.model_name,
                                       prompt_tokens=a.prompt_tokens or len(self.p.prompt_ids),
                                       cached=_cache_dict(a.cached), engine=self.p.engine.address)
                await put(self.started)
            elif kind == "tokens":
                ids = list(msg.tokens.token_ids)
                if ids and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self._completion_tokens += len(ids)
                for ev in self.processor.push(ids):
                    await put(ev)
                if self.processor.stop_sequence is not None or self.processor.wants_stop:
                    reason = "stop_sequence" if self.processor.stop_sequence is not None else "stop"
                    await self._finish(reason, None)
                    return
            elif kind == "finished":
                f = msg.finished
                t = f.timings
                self._engine_timings = {"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "decode_ms": t.decode_ms,
                                        "engine_ttft_ms": t.ttft_ms, "restore_ms": t.restore_ms}
                self._spec = {"draft_tokens": f.usage.spec_draft_tokens,
                              "accepted_tokens": f.usage.spec_accepted_tokens}
                self._engine_done = True
                if f.reason in ENGINE_STOPPED:
                    await self._finish("error", f, kind="unavailable", error=(
                        f"the engine stopped this request before it finished ({ENGINE_STOPPED[f.reason]}"
                        f"{': ' + f.error if f.error else ''}); the answer is incomplete: retry it"))
                    return
                await self._finish(ENGINE_FINISH.get(f.reason, "stop"), f)
                return
        raise EngineUnavailable("the engine closed the stream without a Finished message")

    async def _finish(self, reason: str, f: engine_pb2.Finished | None, kind: str = "internal",
                      error: str = "") -> None:
        if self.started is None:  # a stream must start before it can finish
            raise EngineUnavailable("the engine finished a request it never admitted")
        for ev in self.processor.finish(reason):
            await self._queue.put(ev)
        if reason == "stop" and self.processor.calls:
            reason = "tool_calls"
        if self.processor.stop_sequence is not None and reason in ("stop", "stop_sequence"):
            reason = "stop_sequence"
        usage = f.usage if f is not None else None
        completion = usage.completion_tokens if usage is not None and usage.completion_tokens else self._completion_tokens
        cached = _cache_dict(usage.cached) if usage is not None and usage.HasField("cached") else self.started.cached
        self.finished = Finished(
            reason=reason, prompt_tokens=self.started.prompt_tokens, completion_tokens=completion, cached=cached,
            stop_sequence=self.processor.stop_sequence, error=error or (f.error if f is not None else ""),
            error_kind=kind, retry_after_s=self.service.config.retry_after_s, tool_calls=list(self.processor.calls),
        )
        await self._queue.put(self.finished)

    # ------------------------------------------------------------------ consumer side
    async def events(self, keepalive_s: float | None = None) -> AsyncIterator[OutEvent]:
        """Yield events; raises ``GatewayError`` for failures before ``Started``."""
        if self._task is None:
            self._task = asyncio.create_task(self._produce(), name=f"generate-{self.p.request_id}")
        while True:
            try:
                item = await (asyncio.wait_for(self._queue.get(), keepalive_s) if keepalive_s else self._queue.get())
            except TimeoutError:
                yield KeepAlive()
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                err = self._translate(item)
                if self.started is None:
                    self.status = err.status
                    err.accounted = True  # type: ignore[attr-defined]  # metrics written by aclose
                    raise err
                self.status = 500 if err.kind == "internal" else 200
                self.finished = Finished(reason="error", prompt_tokens=self.started.prompt_tokens,
                                         completion_tokens=self._completion_tokens, cached=self.started.cached,
                                         error=err.message, error_kind=err.kind, retry_after_s=err.retry_after_s)
                yield self.finished
                return
            yield item

    def _translate(self, exc: BaseException) -> GatewayError:
        retry = self.service.config.retry_after_s
        if isinstance(exc, GatewayError):
            return exc
        if isinstance(exc, EngineOverloaded):
            return GatewayError("overloaded", f"the engine is overloaded: {exc}", retry_after_s=retry)
        if isinstance(exc, EngineRejected):
            return GatewayError("invalid_request", f"the engine rejected the request: {exc}")
        if isinstance(exc, EngineUnavailable):
            return GatewayError("unavailable", f"engine unavailable: {exc}", retry_after_s=retry)
        log.error("generation_failed", request_id=self.p.request_id, error=repr(exc))
        return GatewayError("internal", f"internal gateway error: {type(exc).__name__}")

    async def prime(self, keepalive_s: float) -> None:
        """Wait for the first event (at most ``keepalive_s``) so that failures at admission
        raise ``GatewayError`` here, before a front end commits to a streaming status."""
        self._iter = self.events(keepalive_s)
        first = await anext(self._iter, None)
        self._primed = [first] if first is not None else []

    async def stream(self) -> AsyncIterator[OutEvent]:
        """The events after ``prime`` (including the primed one)."""
        for ev in self._primed:
            yield ev
        assert self._iter is not None, "call prime() first"
        async for ev in self._iter:
            yield ev

    async def collect(self) -> list[OutEvent]:
        """Non-streaming: every event (no keep-alives)."""
        return [ev async for ev in self.events()]

    async def open_stream(self, keepalive_s: float) -> None:
        """``prime``, closing the generation if that fails (the error propagates), then
        count the stream as open. What every streaming front end does before its 200."""
        try:
            await self.prime(keepalive_s)
        except BaseException:
            await self.aclose()
            raise
        self.stream_opened()

    def stream_opened(self) -> None:
        self._active_stream = True
        self.service.metrics.active_streams.labels(self.p.endpoint).inc()

    async def aclose(self, status: int | None = None) -> None:
        """Stop the engine request if still running, then account. Nothing here awaits
        before the accounting, because a disconnected client's task may already be
        cancelled (Starlette cancels the response scope); the explicit engine Cancel RPC
        runs as its own task."""
        if self._closed:
            return
        self._closed = True
        if status is not None:
            self.status = status
        log.debug("generation_closed", request_id=self.p.request_id, status=self.status,
                  engine_done=self._engine_done, producer_done=self._task.done() if self._task else None)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # its finally closes the engine stream (cancels the call)
        if self.finished is None and self.started is not None:
            self.finished = Finished(reason="cancelled", prompt_tokens=self.started.prompt_tokens,
                                     completion_tokens=self._completion_tokens, cached=self.started.cached)
        if self._active_stream:
            self.service.metrics.active_streams.labels(self.p.endpoint).dec()
        self._account()
        if self.started is not None and not self._engine_done:
            task = asyncio.get_running_loop().create_task(self.p.engine.cancel(self.p.request_id))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    def _account(self) -> None:
        m = self.service.metrics
        r = self.record
        r.status = self.status
        r.session = self.p.session_key if self.service.config.request_log_session_keys else None
        r.session_hash = session_hash(self.p.session_key)
        r.engine = self.p.engine.address
        m.finished(self.p.endpoint, self.status)
        if self.first_token_at is not None:
            m.ttft.labels(self.p.endpoint).observe(self.first_token_at - self.arrival)
        f = self.finished
        if f is not None:
            r.prompt_tokens, r.completion_tokens = f.prompt_tokens, f.completion_tokens
            r.cached_tokens = {**f.cached, "total": f.cached_tokens}
            r.finish_reason = f.reason
            m.tokens.labels("prompt").inc(f.prompt_tokens)
            m.tokens.labels("completion").inc(f.completion_tokens)
            m.tokens.labels("cached").inc(f.cached_tokens)
        outcome = self.processor.tool_parse_outcome
        r.tool_parse = outcome
        r.tool_parse_reasons = [o for o in self.processor.outcomes if o != "call"]
        if self.processor.has_tool_parser:
            m.tool_parse.labels(outcome).inc()
        for o in self.processor.outcomes:
            if o.startswith("failure"):
                m.tool_parse_failures.labels(o.split(":", 1)[-1][:64]).inc()
        now = time.monotonic()
        r.timings = {"total_ms": round((now - self.arrival) * 1000, 3), **self._engine_timings}
        if self.first_token_at is not None:
            r.timings["ttft_ms"] = round((self.first_token_at - self.arrival) * 1000, 3)
        r.speculative = dict(self._spec)
        self.service.request_log.write(r)
