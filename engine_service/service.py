"""The async gRPC servicer of ``deepwell.engine.v1.Engine`` over an ``Engine``.

Contract (see ``protos/deepwell/engine/v1/engine.proto``):
- ``Generate`` validates, submits and streams ``Admitted``, then ``TokenChunk``s, then
  ``Finished`` (usage, timings). Bad input fails the call with INVALID_ARGUMENT and the
  reason; a full waiting queue with RESOURCE_EXHAUSTED. If the stream ends early (client
  cancel, disconnect, deadline) the request is cancelled and its memory freed at once.
- ``Cancel`` cancels by request id. ``GetModelInfo`` describes the model and lists its
  files; ``ReadModelFile`` streams one in chunks of at most ``FILE_CHUNK_BYTES``.
- ``Stats`` reports the engine's counters and pools, the prefix cache's resident entries and
  the prompt tokens served from each reuse level so far (``cached_total``).
- ``Sessions`` lists the sessions the engine knows (``engine_service.sessions``): their cached
  prefix on each tier, bytes held, last turn, age and idle time.
- ``Admitted.cached`` and ``Usage.cached`` carry the request's prompt tokens served from each
  reuse level (its first admission; the request's ``tenant`` and ``prompt_metadata_digest`` scope
  its cache identity, ``session_key`` names its conversation, ``prefix_boundary`` its shared block).
- Events cross from the engine thread to the asyncio loop only through
  ``loop.call_soon_threadsafe``; no handler blocks the loop on the model.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from deepwell import __version__
from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
from deepwell.logs import get_logger
from deepwell.engine_service.engine import (
    AdmittedEvent,
    Engine,
    Event,
    FinishedEvent,
    InvalidRequest,
    QueueFull,
    TokensEvent,
)
from deepwell.engine_service.sampling import SamplingParams
from deepwell.engine_service.scheduler import Finish
from deepwell.engine_service.sessions import SessionRow, collect

log = get_logger(__name__)

FILE_CHUNK_BYTES = 1 << 20
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name

_PLACEMENTS = {"none": engine_pb2.CACHE_PLACEMENT_NONE, "resident": engine_pb2.CACHE_PLACEMENT_RESIDENT,
               "host": engine_pb2.CACHE_PLACEMENT_HOST, "both": engine_pb2.CACHE_PLACEMENT_BOTH}

_REASONS = {
    Finish.STOP: engine_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    Finish.CANCELLED: engine_pb2.FINISH_REASON_CANCELLED,
    Finish.DEADLINE: engine_pb2.FINISH_REASON_DEADLINE,
    Finish.ERROR: engine_pb2.FINISH_REASON_ERROR,
}


@dataclass(frozen=True)
class ModelFileData:
    name: str
    data: bytes
    sha256: str


def load_files(files: Mapping[str, Callable[[], bytes]]) -> dict[str, ModelFileData]:
    """Read every model side file once (tokenizer.json etc.) and digest it."""
    out = {}
    for name, read in files.items():
        data = read()
        out[name] = ModelFileData(name, data, hashlib.sha256(data).hexdigest())
    return out


def default_sampling(generation_config: Mapping[str, Any]) -> SamplingParams:
    """Sampling defaults from ``generation_config.json`` (HF semantics), then the engine's."""
    g = generation_config
    kw: dict[str, Any] = {}
    if g.get("do_sample") is False:
        kw["temperature"] = 0.0
    elif isinstance(g.get("temperature"), (int, float)):
        kw["temperature"] = float(g["temperature"])
    if isinstance(g.get("top_p"), (int, float)):
        kw["top_p"] = float(g["top_p"])
    if isinstance(g.get("top_k"), int):
        kw["top_k"] = int(g["top_k"])
    if isinstance(g.get("min_p"), (int, float)):
        kw["min_p"] = float(g["min_p"])
    if isinstance(g.get("repetition_penalty"), (int, float)):
        kw["repetition_penalty"] = float(g["repetition_penalty"])
    try:
        params = SamplingParams(**kw)
        params.validate(vocab_size=1 << 30)
    except ValueError as exc:
        log.warning("ignoring invalid generation_config sampling defaults", error=str(exc))
        return SamplingParams()
    return params


def eos_ids_of(config: Mapping[str, Any], generation_config: Mapping[str, Any]) -> list[int]:
    for src in (generation_config, config):
        v = src.get("eos_token_id")
        if isinstance(v, int):
            return [v]
        if isinstance(v, list) and all(isinstance(x, int) for x in v):
            return list(v)
    return []


def special_token_text(tokenizer_config: bytes | None, key: str) -> str:
    if not tokenizer_config:
        return ""
    try:
        v = json.loads(tokenizer_config).get(key)
    except (ValueError, AttributeError):
        return ""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


def params_from_proto(sp: engine_pb2.SamplingParams, defaults: SamplingParams) -> SamplingParams:
    """Merge the request's set fields over the defaults (validation happens later)."""
    d = defaults
    return SamplingParams(
        temperature=sp.temperature if sp.HasField("temperature") else d.temperature,
        top_p=sp.top_p if sp.HasField("top_p") else d.top_p,
        top_k=sp.top_k if sp.HasField("top_k") else d.top_k,
        min_p=sp.min_p if sp.HasField("min_p") else d.min_p,
        presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else d.presence_penalty,
        frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else d.frequency_penalty,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else d.repetition_penalty,
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
    )


def params_to_proto(p: SamplingParams) -> engine_pb2.SamplingParams:
    return engine_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                                     presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                     repetition_penalty=p.repetition_penalty)


def cache_hits(cached: Mapping[str, int]) -> engine_pb2.CacheHits:
    """``CacheHits`` from tokens by level name (the field names)."""
    return engine_pb2.CacheHits(**{k: v for k, v in cached.items() if v})


def event_to_proto(ev: Event) -> engine_pb2.GenerateResponse:
    if isinstance(ev, AdmittedEvent):
        return engine_pb2.GenerateResponse(admitted=engine_pb2.Admitted(
            request_id=ev.request_id, prompt_tokens=ev.prompt_tokens, cached=cache_hits(ev.cached),
            max_tokens=ev.max_tokens))
    if isinstance(ev, TokensEvent):
        chunk = engine_pb2.TokenChunk(token_ids=ev.token_ids)
        for s in ev.logprobs or ():
            chunk.logprobs.append(engine_pb2.TokenLogprob(
                token_id=s.token_id, logprob=s.logprob or 0.0,
                top=[engine_pb2.TopLogprob(token_id=t, logprob=v) for t, v in s.top]))
        return engine_pb2.GenerateResponse(tokens=chunk)
    fin = engine_pb2.Finished(
        reason=_REASONS[ev.reason],
        usage=engine_pb2.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                               cached=cache_hits(ev.cached), spec_draft_tokens=ev.spec_drafted,
                               spec_accepted_tokens=ev.spec_accepted),
        timings=engine_pb2.Timings(queue_ms=ev.queue_ms, prefill_ms=ev.prefill_ms, decode_ms=ev.decode_ms,
                                   ttft_ms=ev.ttft_ms, restore_ms=ev.restore_ms),
        error=ev.error)
    if ev.stop_token_id is not None:
        fin.stop_token_id = ev.stop_token_id
    return engine_pb2.GenerateResponse(finished=fin)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine, info: engine_pb2.ModelInfo, files: Mapping[str, ModelFileData],
                 device: str) -> None:
        self.engine = engine
        self.core = engine.core
        self.info = info
        self.files = dict(files)
        self.device = device
        self.defaults = self.core.defaults

    async def Generate(self, request: engine_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.GenerateResponse]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        remaining = context.time_remaining()
        try:
            params = params_from_proto(request.sampling, self.defaults)
            req = self.core.make_request(
                list(request.prompt_token_ids), params, request_id=request.request_id,
                turn_boundary=request.turn_boundary if request.HasField("turn_boundary") else None,
                prefix_boundary=request.prefix_boundary if request.HasField("prefix_boundary") else None,
                priority=request.priority, timeout_s=remaining, sink=sink, tenant=request.tenant,
                session_key=request.session_key, metadata_digest=request.prompt_metadata_digest)
            # off the event loop: the prompt's digests and the host tier's lookup (an RPC) come first
            await loop.run_in_executor(None, self.engine.submit, req)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        done = False
        log.info("request_queued", request_id=req.request_id, prompt_tokens=len(req.prompt_ids),
                 max_tokens=req.max_tokens, session=req.owner.session or None)
        try:
            while not done:
                ev = await events.get()
                done = isinstance(ev, FinishedEvent)
                if isinstance(ev, FinishedEvent):
                    if ev.reason is Finish.ERROR:
                        log.error("request_failed", request_id=req.request_id, error=ev.error)
                    log.info("request_finished", request_id=req.request_id, reason=ev.reason.value,
                             prompt_tokens=ev.prompt_tokens, cached_tokens=sum(ev.cached.values()),
                             cached=ev.cached or None, completion_tokens=ev.completion_tokens,
                             ttft_ms=round(ev.ttft_ms, 1), prefill_ms=round(ev.prefill_ms, 1))
                yield event_to_proto(ev)
        finally:
            if not done:
                self.engine.cancel(req.request_id)
                log.info("request_cancelled_by_client", request_id=req.request_id)

    async def Cancel(self, request: engine_pb2.CancelRequest,
                     context: grpc.aio.ServicerContext) -> engine_pb2.CancelResponse:
        return engine_pb2.CancelResponse(found=self.engine.cancel(request.request_id))

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        return self.info

    async def ReadModelFile(self, request: engine_pb2.ReadModelFileRequest,
                            context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.FileChunk]:
        f = self.files.get(request.name)
        if f is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no model file {request.name!r}; available: {sorted(self.files)}")
            return
        data = f.data
        if not data:
            yield engine_pb2.FileChunk(offset=0, data=b"", last=True)
            return
        for off in range(0, len(data), FILE_CHUNK_BYTES):
            end = off + FILE_CHUNK_BYTES
            yield engine_pb2.FileChunk(offset=off, data=data[off:end], last=end >= len(data))

    async def Stats(self, request: engine_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.EngineStats:
        s = self.engine.snapshot()
        host = await asyncio.get_running_loop().run_in_executor(None, self._host_stats)
        return engine_pb2.EngineStats(host=host,
            requests_running=s.requests_running, requests_waiting=s.requests_waiting,
            kv_pages_used=s.kv_pages_used, kv_pages_total=s.kv_pages_total,
            state_slots_used=s.state_slots_used, state_slots_total=s.state_slots_total,
            tokens_prefilled=s.tokens_prefilled, tokens_decoded=s.tokens_decoded,
            requests_finished=s.requests_finished,
            cached_total=cache_hits(s.cache.hit_tokens) if s.cache is not None else engine_pb2.CacheHits(),
            uptime_s=s.uptime_s, device=self.device, cache_entries=s.cache_entries, cache_pages=s.cache_pages,
            cache_state_slots=s.cache_slots)

    def _host_stats(self) -> engine_pb2.HostTierStats | None:
        """The daemon's arena figures (one Stats RPC, bounded by the client's timeout), None without
        a host tier or when the daemon does not answer."""
        cache = self.core.cache
        host = cache.host if cache is not None else None
        if host is None or not host.available:
            return None
        res = host.client.stats()
        if not res.ok or res.reply is None:
            return None
        r = res.reply
        return engine_pb2.HostTierStats(arena_bytes=r.arena_bytes, budget_bytes=r.budget_bytes,
                                        committed_bytes=r.committed_bytes, entries=r.entries, evictions=r.evictions)

    async def Sessions(self, request: engine_pb2.SessionsRequest,
                       context: grpc.aio.ServicerContext) -> engine_pb2.SessionsReply:
        # off the event loop: it walks the cache's entries under the engine lock
        rows = await asyncio.get_running_loop().run_in_executor(None, collect, self.core, request.tenant)
        shown = rows[:request.limit] if request.limit else rows
        return engine_pb2.SessionsReply(sessions=[session_to_proto(r) for r in shown], engine_id=self.info.engine_id,
                                        ledger_capacity=self.core.sessions.capacity, total=len(rows))


def session_to_proto(r: SessionRow) -> engine_pb2.SessionInfo:
    info = engine_pb2.SessionInfo(
        tenant=r.tenant, session_key=r.session_key, cached_tokens=r.cached_tokens, resident_tokens=r.resident_tokens,
        host_tokens=r.host_tokens, placement=_PLACEMENTS[r.placement], resident_entries=r.resident_entries,
        host_entries=r.host_entries, resident_bytes=r.resident_bytes, host_bytes=r.host_bytes,
        requests_running=r.running, requests=r.requests)
    t = r.last_turn
    if t is not None:
        info.last_turn.CopyFrom(engine_pb2.SessionTurn(
            prompt_tokens=t.prompt_tokens, cached=cache_hits(t.cached), cached_tokens=t.cached_tokens,
            cached_fraction=t.cached_fraction, ttft_ms=t.ttft_ms, completion_tokens=t.completion_tokens,
            reason=_REASONS[Finish(t.reason)] if t.reason else engine_pb2.FINISH_REASON_UNSPECIFIED))
    if r.age_s is not None:
        info.age_s = r.age_s
    if r.idle_s is not None:
        info.idle_s = r.idle_s
    return info


def build_model_info(*, model_id: str, architecture: str, model_type: str, core: Any, kv_dtype: str,
                     config: Mapping[str, Any], generation_config: Mapping[str, Any], chat_template: str,
                     files: Mapping[str, ModelFileData], engine_id: str,
                     kv_calibration_digest: str = "") -> engine_pb2.ModelInfo:
    tok_cfg = files.get("tokenizer_config.json")
    info = engine_pb2.ModelInfo(
        model_id=model_id, architecture=architecture, model_type=model_type,
        max_context_tokens=core.max_context, kv_dtype=kv_dtype, vocab_size=core.runner.vocab_size,
        eos_token_ids=eos_ids_of(config, generation_config), chat_template=chat_template or "",
        bos_token=special_token_text(tok_cfg.data if tok_cfg else None, "bos_token"),
        eos_token=special_token_text(tok_cfg.data if tok_cfg else None, "eos_token"),
        files=[engine_pb2.ModelFile(name=f.name, size=len(f.data), sha256=f.sha256) for f in files.values()],
        default_sampling=params_to_proto(core.defaults), page_size=core.blocks.page_size,
        max_concurrency=core.scheduler.limits.max_concurrency, engine_id=engine_id, version=__version__,
        hybrid=core.spec.hybrid, supports_vision=False, kv_calibration_digest=kv_calibration_digest,
        speculative_tokens=core.spec_tokens)
    for key in ("bos_token_id", "pad_token_id"):
        v = generation_config.get(key, config.get(key))
        if isinstance(v, int) and v >= 0:
            setattr(info, key, v)
    return info
