"""Scheduler: one rule decides every step (vLLM v1 style). Pure Python, no torch.

The rule: every running request catches its ``num_computed`` up to its token count
(prompt + generated) within a per-step token budget. A prompt is therefore prefilled in
chunks, a decode is a 1-token catch-up, and both share steps (continuous batching).

Each ``schedule()``:
1. Requests whose deadline passed finish with ``deadline``.
2. Running requests take ``min(missing tokens, budget left, chunk_tokens)``: first those one token
   behind (decodes, so a long prefill never delays them), then the rest, each group in
   admission order.
   When a request needs a new KV page and none is free, the lowest-priority, most recently
   admitted other running request is preempted (its pages and slot freed, its tokens kept;
   it waits at its original place and is recomputed later); if there is no other, the
   request itself is preempted.
3. If nothing was preempted, waiting requests (highest priority first, then arrival) are
   admitted while ``len(running) < max_concurrency``, budget remains and memory allows:
   a state slot (hybrid models) and pages for *all* of its current tokens, allocated at
   admission so its prefill chunks never run short. The queue is head-of-line: a request
   that does not fit yet blocks those behind it (no starvation of long prompts).
4. A slice never crosses the request's ``turn_boundary``: it is cut to end exactly there
   and marked ``snapshot`` so the engine snapshots the recurrent state at that position.
   A slice needs logits only when it ends at the request's last token.

``update(plan, tokens)`` advances ``num_computed``, appends each sampled token and applies
the stop rules (stop ids, EOS unless ``ignore_eos``, ``max_tokens``). Stop tokens count as
generated but are reported as ``stop_token_id`` rather than streamed. ``cancel`` frees a
request's memory at once, waiting or running.

Invariants: a request is in exactly one of ``waiting`` / ``running`` / finished; a running
request holds a state slot (when slots are used) and pages for every token it holds; the
waiting queue never exceeds ``queue_size``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from engine_service.block_manager import BlockManager, OutOfPages, pages_for

if TYPE_CHECKING:
    from engine_service.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Finish(Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


class QueueFull(RuntimeError):
    """The waiting queue is at ``queue_size``: the caller answers RESOURCE_EXHAUSTED."""


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # effective: >= 1, already clamped to the context
    eos_ids: frozenset[int] = frozenset()
    turn_boundary: int | None = None
    priority: int = 0
    deadline: float | None = None  # time.monotonic() value
    arrival: float = field(default_factory=time.monotonic)
    # engine-side attachments (generator, event sink); the scheduler never reads them
    extra: dict[str, Any] = field(default_factory=dict)

    tokens: list[int] = field(init=False)
    num_computed: int = field(init=False, default=0)
    status: Status = field(init=False, default=Status.WAITING)
    finish: Finish | None = field(init=False, default=None)
    stop_token_id: int | None = field(init=False, default=None)
    error: str = field(init=False, default="")
    seq_no: int = field(init=False, default=0)
    ever_admitted: bool = field(init=False, default=False)
    num_preemptions: int = field(init=False, default=0)
    checkpoint_position: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


@dataclass(frozen=True)
class Slice:
    """One request's part of a step."""

    request: Request
    start: int
    num_tokens: int
    need_logits: bool
    new_seq: bool  # first slice after (re)admission: the engine resets the state slot
    snapshot: bool  # ends at the turn boundary: snapshot the state after the step


@dataclass
class StepPlan:
    slices: list[Slice]
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices)


@dataclass(frozen=True)
class SchedulerLimits:
    max_concurrency: int
    token_budget: int
    queue_size: int
    max_context: int
    chunk_tokens: int = 0  # cap on one request's tokens per step (0 = token_budget)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (limits.max_concurrency < 1 or limits.token_budget < 1 or limits.queue_size < 0
                or limits.chunk_tokens < 0):
            raise ValueError(f"bad scheduler limits {limits}")
        self.limits = limits
        self.blocks = blocks
        self.clock = clock
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (-priority, seq_no, req)
        self._by_id: dict[str, Request] = {}
        self._seq = itertools.count()

    # -- queries -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def waiting(self) -> list[Request]:
        return [r for _, _, r in sorted(self._waiting, key=lambda e: (e[0], e[1]))]

    # -- requests in and out -------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue ``req``; raises QueueFull, or ValueError for a duplicate id or bad sizes."""
        if req.request_id in self._by_id:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if not req.prompt_ids:
            raise ValueError("empty prompt")
        if req.num_tokens + req.max_tokens > self.limits.max_context:
            raise ValueError(f"prompt of {req.num_tokens} tokens + max_tokens {req.max_tokens} "
                             f"exceeds the context of {self.limits.max_context} tokens")
        need = pages_for(req.num_tokens + req.max_tokens, self.blocks.page_size)
        if need > self.blocks.num_pages:
            raise ValueError(f"request needs {need} KV pages ({req.num_tokens} + {req.max_tokens} tokens) "
                             f"but the pool has {self.blocks.num_pages} pages in total")
        if req.turn_boundary is not None and not (0 < req.turn_boundary <= len(req.prompt_ids)):
            raise ValueError(f"turn_boundary {req.turn_boundary} outside the prompt (1..{len(req.prompt_ids)})")
        if len(self._waiting) >= self.limits.queue_size:
            raise QueueFull(f"waiting queue is full ({self.limits.queue_size} requests); retry later")
        req.seq_no = next(self._seq)
        req.status = Status.WAITING
        heapq.heappush(self._waiting, (-req.priority, req.seq_no, req))
        self._by_id[req.request_id] = req

    def cancel(self, request_id: str, reason: Finish = Finish.CANCELLED, error: str = "") -> Request | None:
        """Finish a waiting or running request now, freeing its memory; None if unknown."""
        req = self._by_id.get(request_id)
        if req is None:
            return None
        self._finish(req, reason, error=error)
        return req

    def expire(self) -> list[Request]:
        """Finish every request whose deadline has passed."""
        now = self.clock()
        late = [r for r in self._by_id.values() if r.deadline is not None and r.deadline <= now]
        for r in late:
            self._finish(r, Finish.DEADLINE)
        return late

    # -- the step ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        slices: list[Slice] = []
        preempted: list[Request] = []
        # decodes (1-token catch-ups) first so a long prefill never delays them, then the rest
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed > 1)
        for req in order:
            budget = self.limits.token_budget - sum(s.num_tokens for s in slices)
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._slice_len(req, budget)
            if n == 0:
                continue
            if not self._grow(req, req.num_computed + n, slices, preempted):
                continue  # req itself was preempted
            slices.append(self._slice(req, n, new_seq=False))
            budget -= n
        budget = self.limits.token_budget - sum(s.num_tokens for s in slices)
        if not preempted:
            while (self._waiting and budget > 0 and len(self.running) < self.limits.max_concurrency):
                req = self._waiting[0][2]
                if not self.blocks.can_admit(req.num_tokens):
                    break
                heapq.heappop(self._waiting)
                self.blocks.add(req.request_id)
                self.blocks.ensure(req.request_id, req.num_tokens)
                req.status = Status.RUNNING
                req.num_computed = 0
                req.ever_admitted = True
                self.running.append(req)
                n = self._slice_len(req, budget)
                slices.append(self._slice(req, n, new_seq=True))
                budget -= n
        return StepPlan(slices=slices, preempted=preempted)

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Apply a finished step: ``sampled`` maps request id -> token for slices with logits.

        Returns the requests that finished in this step.
        """
        finished: list[Request] = []
        for s in plan.slices:
            req = s.request
            if req.status is not Status.RUNNING:
                continue  # cancelled while the step ran
            req.num_computed += s.num_tokens
            if s.snapshot:
                req.checkpoint_position = s.start + s.num_tokens
            if not s.need_logits:
                continue
            tok = sampled[req.request_id]
            req.tokens.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
                finished.append(req)
        return finished

    def fail(self, request_id: str, error: str) -> Request | None:
        return self.cancel(request_id, Finish.ERROR, error=error)

    def finish_all(self, reason: Finish, error: str = "") -> list[Request]:
        reqs = list(self._by_id.values())
        for r in reqs:
            self._finish(r, reason, error=error)
        return reqs

    # -- helpers -------------------------------------------------------------------------
    def _slice_len(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed, budget)
        if self.limits.chunk_tokens:
            n = min(n, self.limits.chunk_tokens)
        tb = req.turn_boundary
        if tb is not None and req.num_computed < tb < req.num_computed + n:
            n = tb - req.num_computed
        return n

    def _slice(self, req: Request, n: int, new_seq: bool) -> Slice:
        end = req.num_computed + n
        tb = req.turn_boundary
        return Slice(request=req, start=req.num_computed, num_tokens=n, need_logits=end == req.num_tokens,
                     new_seq=new_seq, snapshot=tb is not None and end == tb and req.checkpoint_position is None)

    def _grow(self, req: Request, num_tokens: int, slices: list[Slice], preempted: list[Request]) -> bool:
        """Make ``req`` hold pages for ``num_tokens``, preempting others if needed."""
        while True:
            try:
                self.blocks.ensure(req.request_id, num_tokens)
                return True
            except OutOfPages:
                victim = self._pick_victim(exclude=req)
                if victim is None:
                    self._preempt(req)
                    preempted.append(req)
                    return False
                for i, s in enumerate(slices):
                    if s.request is victim:
                        del slices[i]
                        break
                self._preempt(victim)
                preempted.append(victim)

    def _pick_victim(self, exclude: Request) -> Request | None:
        others = [r for r in self.running if r is not exclude]
        if not others:
            return None
        return min(others, key=lambda r: (r.priority, -r.seq_no))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed = 0
        req.checkpoint_position = None
        req.num_preemptions += 1
        heapq.heappush(self._waiting, (-req.priority, req.seq_no, req))

    def _stop_reason(self, req: Request, tok: int) -> Finish | None:
        p = req.params
        if req.num_output > p.min_tokens:
            if tok in p.stop_token_ids or (tok in req.eos_ids and not p.ignore_eos):
                req.stop_token_id = tok
                return Finish.STOP
        if req.num_output >= req.max_tokens:
            return Finish.LENGTH
        return None

    def _finish(self, req: Request, reason: Finish, error: str = "") -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.blocks.free(req.request_id)
        elif req.status is Status.WAITING:
            self._waiting = [e for e in self._waiting if e[2] is not req]
            heapq.heapify(self._waiting)
        req.status = Status.FINISHED
        req.finish = reason
        req.error = error
        self._by_id.pop(req.request_id, None)

