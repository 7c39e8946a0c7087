"""Engine: the step loop. Requests in, token events out.

``EngineCore`` is synchronous and single-threaded: ``step()`` expires deadlines, asks the
scheduler for a plan, builds the ``ForwardBatch``, runs the model, takes turn-boundary
snapshots, samples, applies the results and emits events. Tests drive it directly.

With a prefix cache (``EngineLimits.prefix_cache``, on by default) the scheduler admits a
request that reuses a cached prefix at ``num_computed = r``; before the step's forward the
engine makes the copies its ``Restore`` names (the state image into the request's slot, the
page cut inside into the request's own page), and after it copies each ``Checkpoint``'s state
into its image slot; ``update`` then hands the checkpoints to the cache. A request cancelled
while its step runs is not kept in the cache (its pages and state are being written).

``Engine`` runs an ``EngineCore`` on its own thread. ``submit`` / ``cancel`` / ``snapshot``
may be called from any thread (the asyncio server's): they touch the scheduler under a
lock that the step loop holds only for bookkeeping, never across the model forward, so the
asyncio loop is never blocked by a step. Events go to each request's ``sink`` callable,
called on the engine thread (or the cancelling thread) - sinks must only hand off (e.g.
``loop.call_soon_threadsafe``).

Per request the event sequence is: ``Admitted`` once (first admission), ``Tokens`` zero or
more times, ``Finished`` exactly once. Errors: a request whose logits row is not finite
fails alone; a failing model step fails only the requests in that step (the step may have
written their KV/state, so they cannot be retried); a bug elsewhere in the loop fails what
is in flight. Each gets ``Finished(ERROR)`` and is logged with its id; the engine keeps
serving.
Cancelling during a step is safe: freed pages and slots are reused only by a later
``schedule()``, which runs after the step's forward returns.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
import torch

from deepwell.logs import get_logger
from deepwell.engine_service.block_manager import BlockManager
from deepwell.engine_service.cache.index import Owner
from deepwell.engine_service.cache.host import HostCounters, HostTier
from deepwell.engine_service.cache.resident import PrefixCache
from deepwell.engine_service.cache.types import CacheCounters
from deepwell.engine_service.runner_api import DraftInput, ForwardBatch, ModelRunner, SeqSlice
from deepwell.engine_service.sampling import SampleRow, Sampled, Sampler, SamplingParams, make_generator
from deepwell.engine_service.scheduler import Finish, QueueFull, Request, Scheduler, SchedulerLimits, Slice, Status, StepPlan
from deepwell.engine_service.sessions import SessionLedger, Turn
from deepwell.kernels.calibration import ScaleCounts

log = get_logger(__name__)

KV_SCALES_EVERY_S = 1.0  # served block-scale counts are read from the device at most this often


class InvalidRequest(ValueError):
    """Bad input: the message is the reason, for INVALID_ARGUMENT."""


# -- events ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdmittedEvent:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    cached: dict[str, int] = field(default_factory=dict)  # prompt tokens reused, by CacheHits level


@dataclass(frozen=True)
class TokensEvent:
    token_ids: list[int]
    logprobs: list[Sampled] | None = None  # one per token when asked for


@dataclass(frozen=True)
class FinishedEvent:
    reason: Finish
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    stop_token_id: int | None = None
    error: str = ""
    cached: dict[str, int] = field(default_factory=dict)
    restore_ms: float = 0.0  # RESTORING from the host tier, out of every step (a first one: not in queue_ms)
    spec_drafted: int = 0  # speculative decoding: draft tokens verified for this request
    spec_accepted: int = 0  # and accepted


Event = AdmittedEvent | TokensEvent | FinishedEvent
Sink = Callable[[Event], None]


@dataclass
class _Times:
    arrival: float
    admitted: float | None = None  # its first slice
    first_token: float | None = None
    last_token: float | None = None
    restore_first: float | None = None  # its first admission, when that was from the host tier (ends queue_ms)
    restore_started: float | None = None  # RESTORING since (None: not now)
    restore_ms: float = 0.0  # RESTORING in total (ended restores)


@dataclass
class Counters:
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    requests_finished: int = 0
    steps: int = 0
    spec_rounds: int = 0  # verify slices run
    spec_drafted: int = 0  # draft tokens verified
    spec_accepted: int = 0  # of them accepted


@dataclass(frozen=True)
class Snapshot:
    """Point-in-time engine counters (for Stats and metrics)."""

    requests_running: int
    requests_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    state_slots_used: int
    state_slots_total: int
    tokens_prefilled: int
    tokens_decoded: int
    requests_finished: int
    uptime_s: float
    cache_entries: int = 0
    cache_pages: int = 0  # pages held by cache entries alone
    cache_slots: int = 0  # state slots held by cache entries alone (images)
    cache_bytes: int = 0  # what those pages and slots hold
    cache: CacheCounters | None = None  # None: no prefix cache
    host: HostCounters | None = None  # None: no host tier


class StepObserver:
    """Hooks for metrics; the default does nothing."""

    def on_step(self, snap: Snapshot, prefilled: int, decoded: int) -> None: ...
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_token_gap(self, gap_s: float) -> None: ...
    def on_finished(self, reason: str) -> None: ...
    def on_kv_scales(self, k: ScaleCounts, v: ScaleCounts) -> None:
        """Running totals of the quantized KV cache's block-scale health (fp8 / nvfp4)."""

    def on_host_copy(self, kind: str, seconds: float, nbytes: int, ok: bool) -> None:
        """A spill to (``kind`` = spill) or restore from (restore) the host tier ended."""

    def on_spec_round(self, drafted: int, accepted: int) -> None:
        """One verify slice: ``drafted`` draft tokens checked, ``accepted`` of them kept."""


@dataclass(frozen=True)
class EngineLimits:
    num_pages: int
    num_state_slots: int
    max_concurrency: int
    token_budget: int
    queue_size: int
    max_context: int
    chunk_tokens: int = 0  # per-request cap per step (0 = token_budget)
    prefix_cache: bool = True  # keep ended sequences and checkpoints for reuse (cache.resident)
    cache_fraction: float = 1.0  # the most of the KV pool's pages that entries alone may hold
    speculative_tokens: int = 0  # MTP drafts per decode step (0: off; the runner must have enable_mtp()'d)


class EngineCore:
    """Scheduler + runner + sampler; one ``step()`` at a time, on one thread."""

    def __init__(self, runner: ModelRunner, limits: EngineLimits, eos_ids: Sequence[int] = (),
                 defaults: SamplingParams | None = None, observer: StepObserver | None = None) -> None:
        spec = runner.memory_spec()
        slots = limits.num_state_slots if spec.hybrid else 0
        self.runner = runner
        self.spec = spec
        self.max_context = min(limits.max_context, runner.max_context, limits.num_pages * spec.page_size)
        runner.allocate(limits.num_pages, slots)
        self.blocks = BlockManager(limits.num_pages, spec.page_size, slots)
        max_conc = min(limits.max_concurrency, slots) if spec.hybrid else limits.max_concurrency
        self.cache = (PrefixCache(self.blocks, hybrid=spec.hybrid, max_pages=int(limits.cache_fraction * limits.num_pages))
                      if limits.prefix_cache else None)
        self.scheduler = Scheduler(
            SchedulerLimits(max_concurrency=max_conc, token_budget=limits.token_budget,
                            queue_size=limits.queue_size, max_context=self.max_context,
                            chunk_tokens=limits.chunk_tokens),
            self.blocks, cache=self.cache)
        self.sampler = Sampler()
        self.spec_tokens = limits.speculative_tokens
        if self.spec_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.spec_tokens}")
        if self.spec_tokens and not getattr(runner, "mtp_layers", 0):
            raise ValueError("speculative decoding needs a runner with the MTP module enabled (enable_mtp())")
        self.eos_ids = frozenset(eos_ids)
        self.defaults = defaults or SamplingParams()
        self.observer = observer or StepObserver()
        self.counters = Counters()
        self.sessions = SessionLedger()  # the last turn of each recent session (the Sessions RPC)
        self.started = time.monotonic()
        self.lock = threading.RLock()
        self._kv_scales_at = float("-inf")
        self._in_step: set[str] = set()  # ids of the requests in the step running now
        self._restoring: dict[str, Request] = {}  # RESTORING at the last schedule(), timed in _time_restores
        self.observer.on_step(self.snapshot(), 0, 0)

    def attach_host(self, host: HostTier) -> None:
        """Give the prefix cache its host tier (after the KV calibration: the fingerprint names it)."""
        if self.cache is None:
            raise ValueError("the host tier needs the prefix cache (prefix_cache=True)")
        with self.lock:
            self.cache.host = host

    # -- requests ------------------------------------------------------------------------
    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str = "",
                     turn_boundary: int | None = None, priority: int = 0, timeout_s: float | None = None,
                     sink: Sink | None = None, prefix_boundary: int | None = None, tenant: str = "",
                     session_key: str = "", metadata_digest: bytes = b"") -> Request:
        """Validate and build a request (raises InvalidRequest with the reason)."""
        vocab = self.runner.vocab_size
        if not prompt_ids:
            raise InvalidRequest("empty prompt: prompt_token_ids must hold at least one token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # C-speed check first: prompts reach 1M tokens
            bad = next(t for t in prompt_ids if not (0 <= t < vocab))
            raise InvalidRequest(f"prompt token id {bad} outside the vocabulary [0, {vocab})")
        n = len(prompt_ids)
        if n >= self.max_context:
            raise InvalidRequest(f"prompt of {n} tokens is longer than the context: {self.max_context} tokens "
                                 f"hold at most {self.max_context - 1} prompt tokens plus one generated")
        for name, b in (("turn_boundary", turn_boundary), ("prefix_boundary", prefix_boundary)):
            if b is not None and not (0 < b <= n):
                raise InvalidRequest(f"{name} {b} outside the prompt (1..{n})")
        try:
            params.validate(vocab)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        room = self.max_context - n
        max_tokens = min(params.max_tokens, room) if params.max_tokens else room
        req = Request(request_id=request_id or uuid.uuid4().hex, prompt_ids=list(prompt_ids), params=params,
                      max_tokens=max_tokens, eos_ids=self.eos_ids, turn_boundary=turn_boundary,
                      priority=priority, deadline=None if timeout_s is None else time.monotonic() + timeout_s,
                      prefix_boundary=prefix_boundary, owner=Owner(tenant, metadata_digest, session_key))
        req.extra["sink"] = sink
        req.extra["times"] = _Times(arrival=req.arrival)
        if not params.greedy:
            req.extra["generator"] = make_generator(params.seed, self.runner.device)
        return req

    def submit(self, req: Request) -> None:
        """Queue ``req``; raises QueueFull or InvalidRequest. Its cache preparation (prompt digests,
        the host tier's lookup) runs first, on the calling thread, outside the lock."""
        self.scheduler.prepare(req)
        with self.lock:
            try:
                self.scheduler.add(req)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
            self.sessions.started(req.owner.tenant, req.owner.session)
            self.observer.on_step(self.snapshot(), 0, 0)

    def cancel(self, request_id: str, reason: Finish = Finish.CANCELLED) -> bool:
        with self.lock:  # a request in the running step is mid-write: not kept in the cache
            req = self.scheduler.cancel(request_id, reason, retain=request_id not in self._in_step)
            if req is not None:
                self._emit_finished(req)
                self.observer.on_step(self.snapshot(), 0, 0)
            return req is not None

    def has_work(self) -> bool:
        with self.lock:
            return self.scheduler.has_work()

    def snapshot(self) -> Snapshot:
        with self.lock:
            b, c = self.blocks, self.counters
            cache = self.cache
            return Snapshot(self.scheduler.num_running + len(self.scheduler.restoring), self.scheduler.num_waiting,
                            b.used_pages, b.num_pages,
                            b.used_slots, b.num_state_slots, c.tokens_prefilled, c.tokens_decoded,
                            c.requests_finished, time.monotonic() - self.started,
                            cache_entries=len(cache.entries) if cache else 0, cache_pages=b.cached_only_pages,
                            cache_slots=b.cached_only_slots,
                            cache_bytes=(b.cached_only_pages * self.spec.bytes_per_page
                                         + b.cached_only_slots * self.spec.bytes_per_state_slot)
                            * getattr(self.runner, "tensor_parallel", 1),  # memory_spec is one rank's
                            cache=copy.deepcopy(cache.counters) if cache else None,
                            host=copy.deepcopy(cache.host.counters) if cache and cache.host else None)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> int:
        """Run one step; returns the number of tokens computed (0 when idle)."""
        with self.lock:
            for req in self.scheduler.expire():
                self._emit_finished(req)
            plan = self.scheduler.schedule()
            now = time.monotonic()
            if self._restoring or self.scheduler.restoring:
                self._time_restores(now)
            if not plan.slices:
                return 0
            for s in plan.slices:
                times: _Times = s.request.extra["times"]
                if times.admitted is None:
                    times.admitted = now
                    self._emit(s.request, AdmittedEvent(s.request.request_id, len(s.request.prompt_ids),
                                                        s.request.max_tokens, dict(s.request.cache_hits)))
            batch = self._build_batch(plan)
            self._in_step = {s.request.request_id for s in plan.slices}
        try:
            sampled, drafts = self._run(plan, batch)
        except Exception as exc:  # an internal error fails this step's requests only
            ids = [s.request.request_id for s in plan.slices]
            log.exception("engine step failed", request_ids=ids, error=str(exc))
            with self.lock:
                self._in_step = set()
                for s in plan.slices:
                    req = self.scheduler.fail(s.request.request_id, f"internal error: {exc}")
                    if req is not None:
                        self._emit_finished(req)
            return 0
        self._report_kv_scales()
        with self.lock:
            done = self._apply(plan, sampled, drafts)
            self._in_step = set()  # (after: a failure while applying leaves these half-updated)
            return done

    def _report_kv_scales(self) -> None:
        """Hand the runner's served block-scale counts (if it keeps any) to the observer, at
        most every ``KV_SCALES_EVERY_S`` (a small device-to-host copy after a step)."""
        read = getattr(self.runner, "kv_scale_counts", None)  # optional ModelRunner method
        now = time.monotonic()
        if read is None or now - self._kv_scales_at < KV_SCALES_EVERY_S:
            return
        self._kv_scales_at = now
        counts = read()
        if counts is not None:
            self.observer.on_kv_scales(*counts)

    def _time_restores(self, now: float) -> None:
        """A request's stay in RESTORING (admitted from the host tier, its pages and slot being
        filled, out of every step) runs from the ``schedule()`` that admitted it to the one that
        let it join the running requests (so it includes the wait for that step)."""
        current = {req.request_id: req for req, _ in self.scheduler.restoring}
        for rid, req in current.items():
            t: _Times = req.extra["times"]
            if rid not in self._restoring and t.restore_started is None:
                t.restore_started = now
                if t.admitted is None and t.restore_first is None:
                    t.restore_first = now
        for rid, req in self._restoring.items():
            t = req.extra["times"]
            if rid not in current and t.restore_started is not None:
                t.restore_ms += (now - t.restore_started) * 1000.0
                t.restore_started = None
        self._restoring = current

    def _build_batch(self, plan: StepPlan) -> ForwardBatch:
        ids: list[int] = []
        seqs: list[SeqSlice] = []
        ps = self.blocks.page_size
        for s in plan.slices:
            req = s.request
            end = s.start + s.num_tokens
            ids.extend(req.tokens[s.start:end] if not s.verify else [req.tokens[s.start], *s.draft])
            table = self.blocks.table_array(req.request_id)[: -(-end // ps)]  # a copy (one memcpy)
            seqs.append(SeqSlice(state_slot=self.blocks.state_slot(req.request_id), block_table=table,
                                 start=s.start, num_tokens=s.num_tokens, need_logits=s.need_logits,
                                 verify=s.verify))
        # host ids: the runner checks them without a device sync and moves them itself
        return ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.long), seqs=seqs)

    def _run(self, plan: StepPlan, batch: ForwardBatch) -> tuple[dict[str, list[Sampled]], dict[str, list[int]]]:
        """Restores, model forward, checkpoint images, sampling (a verify slice: acceptance and
        the commit of its recurrent state), MTP drafting; outside the lock: the pages and slots
        copied from are pinned by their requests until ``update``. Returns each request's new
        tokens and its drafts for the next step."""
        for s, seq in zip(plan.slices, batch.seqs):
            r = s.restore
            if r is not None and r.copy_page is not None:
                self.runner.copy_pages([r.copy_page[0]], [r.copy_page[1]])
            if s.new_seq and seq.state_slot >= 0:
                if r is not None and r.image_slot >= 0:
                    self.runner.copy_state(r.image_slot, seq.state_slot)
                elif r is None or not r.state_ready:
                    self.runner.reset_state(seq.state_slot)
        logits = self.runner.forward(batch)
        for s, seq in zip(plan.slices, batch.seqs):
            if s.checkpoint is not None and s.checkpoint.image_slot >= 0:
                self.runner.copy_state(seq.state_slot, s.checkpoint.image_slot)
        wanted = [(s, seq) for s, seq in zip(plan.slices, batch.seqs) if s.need_logits]
        counts = [s.num_tokens if s.verify else 1 for s, _ in wanted]
        if logits.shape[0] != sum(counts):
            raise RuntimeError(f"runner returned {logits.shape[0]} logits rows for {sum(counts)} wanted")
        out: dict[str, list[Sampled]] = {}
        accepted: dict[int, int] = {}  # state slot -> verified tokens kept (committed in one call)
        if wanted:
            finite = torch.isfinite(logits).all(dim=-1).tolist()
            plain: list[Slice] = []
            plain_rows: list[int] = []
            lo = 0
            for (s, seq), n in zip(wanted, counts):
                rows = range(lo, lo + n)
                lo += n
                if not all(finite[i] for i in rows):  # fails in _apply, alone
                    s.request.extra["step_error"] = "model produced non-finite logits"
                elif s.verify:
                    acc = out[s.request.request_id] = self._accept(s, logits[rows.start:rows.stop])
                    accepted[seq.state_slot] = len(acc)
                else:
                    plain.append(s)
                    plain_rows.append(rows.start)
            if accepted:
                self.runner.accept_many(accepted)  # type: ignore[attr-defined]
            if plain:
                x = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
                for s, smp in zip(plain, self.sampler.sample(x, [self._sample_row(s.request) for s in plain])):
                    out[s.request.request_id] = [smp]
        drafts = self._propose(plan, batch, out) if self.spec_tokens else {}
        return out, drafts

    def _sample_row(self, req: Request) -> SampleRow:
        return SampleRow(params=req.params, prompt_ids=req.prompt_ids, output_ids=req.output_ids,
                         generator=req.extra.get("generator"), eos_ids=self.eos_ids, prompt_seen=self._prompt_seen(req))

    def _accept(self, s: Slice, logits: torch.Tensor) -> list[Sampled]:
        """A verify slice's tokens (the accepted drafts, then the model's own, cut at a stop); its
        recurrent state is committed to exactly the positions they follow (``accept_many``)."""
        acc = self.sampler.verify(logits, self._sample_row(s.request), s.draft)
        keep, _ = self.scheduler.keep_until_stop(s.request, [a.token_id for a in acc])
        return acc[:keep]

    def _propose(self, plan: StepPlan, batch: ForwardBatch, out: dict[str, list[Sampled]]) -> dict[str, list[int]]:
        """MTP after the step: the MTP layers run over every slice's computed rows (their KV
        filled for later drafts), and requests still decoding draft up to ``spec_tokens`` tokens."""
        inputs: list[DraftInput] = []
        owners: list[str] = []
        row = 0
        with self.lock:  # page reservations for the drafts are scheduler state
            for s, seq in zip(plan.slices, batch.seqs):
                req, first = s.request, row
                row += s.num_tokens
                new = [x.token_id for x in out.get(req.request_id, ())]
                if req.status is not Status.RUNNING or (s.need_logits and not new):
                    continue  # cancelled meanwhile, or its logits failed
                m = len(new) if s.verify else s.num_tokens
                # the tokens after positions start .. start + m - 1 (never a copy of the whole context)
                following = list(new[:m]) if s.verify else (req.tokens[s.start + 1:] + new)[:m]
                ends = s.need_logits and self.scheduler.keep_until_stop(req, new)[1]
                k = 0 if not s.need_logits or ends else self.scheduler.draft_room(req, self.spec_tokens, len(new))
                inputs.append(DraftInput(self.blocks.table_array(req.request_id)[:], s.start, first,
                                         following, k))
                owners.append(req.request_id)
        drafts = self.runner.propose(inputs)  # type: ignore[attr-defined]
        return {rid: d for rid, d in zip(owners, drafts) if d}

    def _prompt_seen(self, req: Request) -> torch.Tensor | None:
        """The prompt's token set as a [vocab] bool mask, built once per request (repetition penalty)."""
        if req.params.repetition_penalty == 1.0:
            return None
        mask = req.extra.get("prompt_seen")
        if mask is None:
            mask = torch.zeros(self.runner.vocab_size, dtype=torch.bool, device=self.runner.device)
            mask[torch.tensor(req.prompt_ids, dtype=torch.long, device=self.runner.device)] = True
            req.extra["prompt_seen"] = mask
        return mask

    def _apply(self, plan: StepPlan, sampled: dict[str, list[Sampled]], drafts: dict[str, list[int]]) -> int:
        now = time.monotonic()
        for sl in plan.slices:
            err = sl.request.extra.pop("step_error", None)
            if err is not None:
                log.error("request failed in step", request_id=sl.request.request_id, error=err)
                if self.scheduler.fail(sl.request.request_id, f"internal error: {err}") is not None:
                    self._emit_finished(sl.request)
        finished = self.scheduler.update(plan, {k: [x.token_id for x in v] for k, v in sampled.items()})
        done = {id(r) for r in finished}
        decoded = 0
        for s in plan.slices:
            req = s.request
            smp = sampled.get(req.request_id)
            if smp is None or (id(req) not in done and req.status is not Status.RUNNING):
                continue  # no logits in this slice, or cancelled while the step ran
            decoded += len(smp)
            if s.verify:
                self._count_round(req, s.draft, smp)
            times: _Times = req.extra["times"]
            if times.first_token is None:
                times.first_token = now
                self.observer.on_first_token(now - times.arrival)
            elif times.last_token is not None:
                for _ in smp:  # tokens of a verify slice arrive together: their mean gap each
                    self.observer.on_token_gap((now - times.last_token) / len(smp))
            times.last_token = now
            is_stop = id(req) in done and req.stop_token_id is not None
            shown = smp[:-1] if is_stop else smp
            if shown:
                lp = list(shown) if req.params.logprobs else None
                self._emit(req, TokensEvent([x.token_id for x in shown], lp))
            if id(req) in done:
                self._emit_finished(req)
            elif req.status is Status.RUNNING and req.request_id in drafts:
                req.draft = list(drafts[req.request_id])
        total = plan.num_tokens
        prefilled = sum(s.num_tokens for s in plan.slices if not _is_decode(s))
        self.counters.tokens_prefilled += prefilled
        self.counters.tokens_decoded += decoded
        self.counters.steps += 1
        self.observer.on_step(self.snapshot(), prefilled, decoded)
        return total

    def _count_round(self, req: Request, draft: tuple[int, ...], got: list[Sampled]) -> None:
        accepted = 0
        for d, x in zip(draft, got):
            if d != x.token_id:
                break
            accepted += 1
        c = self.counters
        c.spec_rounds += 1
        c.spec_drafted += len(draft)
        c.spec_accepted += accepted
        mine = req.extra.setdefault("spec", [0, 0])
        mine[0] += len(draft)
        mine[1] += accepted
        self.observer.on_spec_round(len(draft), accepted)

    # -- events --------------------------------------------------------------------------
    def _emit(self, req: Request, event: Event) -> None:
        sink: Sink | None = req.extra.get("sink")
        if sink is not None:
            try:
                sink(event)
            except Exception:
                log.exception("event sink failed", request_id=req.request_id)

    def _emit_finished(self, req: Request) -> None:
        if req.extra.get("finished_sent"):
            return
        req.extra["finished_sent"] = True
        self.counters.requests_finished += 1
        self.observer.on_finished((req.finish or Finish.ERROR).value)
        t: _Times = req.extra["times"]
        now = time.monotonic()
        admitted = t.admitted if t.admitted is not None else now
        first = t.first_token
        ms = 1000.0
        restore_ms = t.restore_ms + ((now - t.restore_started) * ms if t.restore_started is not None else 0.0)
        ev = FinishedEvent(
            reason=req.finish or Finish.ERROR, prompt_tokens=len(req.prompt_ids), completion_tokens=req.num_output,
            queue_ms=((t.restore_first if t.restore_first is not None else admitted) - t.arrival) * ms,
            prefill_ms=((first if first is not None else now) - admitted) * ms if t.admitted is not None else 0.0,
            decode_ms=(now - first) * ms if first is not None else 0.0,
            ttft_ms=(first - t.arrival) * ms if first is not None else 0.0,
            stop_token_id=req.stop_token_id, error=req.error, cached=dict(req.cache_hits), restore_ms=restore_ms,
            spec_drafted=req.extra.get("spec", (0, 0))[0], spec_accepted=req.extra.get("spec", (0, 0))[1])
        if req.owner.session:
            self.sessions.finished(req.owner.tenant, req.owner.session, Turn(
                ev.prompt_tokens, ev.cached, ev.ttft_ms, ev.completion_tokens, ev.reason.value))
        self._emit(req, ev)


def _is_decode(s: Slice) -> bool:
    """A decode slice feeds back the one token generated last step (with the drafts after it, a
    verify slice); anything else is prefill."""
    return s.verify or (s.num_tokens == 1 and not s.new_seq and s.start >= len(s.request.prompt_ids))


class Engine:
    """An ``EngineCore`` stepping on its own daemon thread."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._wake = threading.Condition(threading.Lock())
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> None:
        self.core.submit(req)
        with self._wake:
            self._wake.notify()

    def cancel(self, request_id: str, reason: Finish = Finish.CANCELLED) -> bool:
        return self.core.cancel(request_id, reason)

    def snapshot(self) -> Snapshot:
        return self.core.snapshot()

    def stop(self, timeout_s: float = 10.0, spill_s: float = 0.0) -> None:
        """Stop stepping; every unfinished request gets ``Finished(CANCELLED)`` (what it computed
        goes to the prefix cache); then for at most ``spill_s`` seconds the cache's entries are
        spilled to the host tier (when there is one), so a restarted engine resumes them."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self.core.lock:
            sched, busy = self.core.scheduler, self.core._in_step  # a step still running if the join timed out
            for rid in [r.request_id for r in (*sched.running, *sched.waiting())]:
                req = sched.cancel(rid, Finish.CANCELLED, "engine shutting down", retain=rid not in busy)
                if req is not None:
                    self.core._emit_finished(req)
            cache = self.core.cache
            if not busy:
                sched.settle()
            if spill_s > 0 and cache is not None and cache.host is not None and not busy:
                t0 = time.monotonic()
                n = cache.spill_all(spill_s)
                log.info("shutdown_spill", entries=n, of=len(cache.entries), seconds=round(time.monotonic() - t0, 3))

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.core.has_work():
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    return
            try:
                if self.core.step() == 0 and self.core.has_work():
                    time.sleep(0.001)  # waiting requests that do not fit yet: do not spin hot
            except Exception as exc:  # a bug outside the model step: fail what is in flight, keep serving
                log.exception("engine loop error; failing every request in flight")
                try:
                    with self.core.lock:  # what a finished step left consistent is still kept in the cache
                        busy, self.core._in_step = self.core._in_step, set()
                        for req in self.core.scheduler.finish_all(Finish.ERROR, f"internal error: {exc}",
                                                                  keep=lambda r: r.request_id not in busy):
                            self.core._emit_finished(req)
                except Exception:
                    log.exception("could not fail the requests in flight")
                time.sleep(0.01)


__all__ = ["AdmittedEvent", "Engine", "EngineCore", "EngineLimits", "Event", "FinishedEvent", "InvalidRequest",
           "QueueFull", "Snapshot", "StepObserver", "TokensEvent"]
