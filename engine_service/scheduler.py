"""Scheduler: one rule decides every step (vLLM v1 style). Pure Python, no torch.

The rule: every running request catches its ``num_computed`` up to its token count
(prompt + generated) within a per-step token budget. A prompt is therefore prefilled in
chunks, a decode is a 1-token catch-up, both share steps (continuous batching), and a
request admitted with a prefix-cache hit simply starts at ``num_computed = r``.

Each ``schedule()``:
1. Requests whose deadline passed finish with ``deadline``.
2. Running requests take ``min(missing tokens, budget left, chunk_tokens)``: first those one token
   behind (decodes, so a long prefill never delays them), then the rest, each group in
   admission order.
   When a request needs a new KV page and none is free, cache entries are evicted (LRU);
   if that is not enough, the lowest-priority, most recently admitted other running request
   is preempted (it ends like a finished one: kept as a cache entry, its tokens kept; it waits
   at its original place and resumes from the cache or is recomputed); if there is no other,
   the request itself is preempted.
3. If nothing was preempted, waiting requests (highest priority first, then arrival) are
   admitted while ``len(running) < max_concurrency``, budget remains and memory allows. With
   a prefix cache (``cache.resident.PrefixCache``) the request's prompt is looked up first; a
   hit gives it the entry's pages by reference and a ``Restore`` (state image, copy-on-write
   page) the engine performs before the step. It then needs a state slot (hybrid models) and
   pages for *all* of its current tokens beyond the shared ones, allocated at admission so
   its prefill chunks never run short (evicting cache entries to make room). The queue is
   head-of-line: a request that does not fit yet blocks those behind it.
4. A slice never crosses the request's ``turn_boundary`` or ``prefix_boundary``: it is cut to
   end exactly there and carries a ``Checkpoint`` (with a state slot reserved for the image on
   hybrid models) so the engine copies the state there and the cache keeps the prefix as an
   entry. A slice needs logits only when it ends at the request's last token.

``update(plan, tokens)`` (after the engine ran the step and made its copies) hands the
checkpoints to the cache, drops the copy pins, advances ``num_computed``, appends each
sampled token and applies the stop rules (stop ids, EOS unless ``ignore_eos``,
``max_tokens``). Stop tokens count as generated but are reported as ``stop_token_id``
rather than streamed. ``cancel`` ends a request at once, waiting or running; a running one's
memory goes to the cache (``retain``) or is freed.

Invariants: a request is in exactly one of ``waiting`` / ``running`` / finished; a running
request holds a state slot (when slots are used) and pages for every token it holds; the
waiting queue never exceeds ``queue_size``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from deepwell.engine_service.block_manager import BlockManager, OutOfPages, pages_for
from deepwell.engine_service.cache.index import Ledger, Owner
from deepwell.engine_service.cache.resident import PrefixCache
from deepwell.engine_service.cache.types import Hit, Kind, Level, Restore

if TYPE_CHECKING:
    from deepwell.engine_service.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RESTORING = "restoring"  # admitted; its pages and slot are being filled from the host tier
    RUNNING = "running"
    FINISHED = "finished"


class Finish(Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


SLOT_RESERVE = 2  # with a host tier, state slots kept free (spilling ahead) for checkpoint images
_WAIT = object()  # a checkpoint's image slot is on its way: the slice waits a step


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
    prefix_boundary: int | None = None  # end of the shared system-and-tools block
    owner: Owner = field(default_factory=Owner)  # tenant, metadata digest, session: the cache identity
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
    checkpoints: set[int] = field(init=False, default_factory=set)  # positions already kept as entries
    ledger: Ledger | None = field(init=False, default=None)  # the prompt prepared for lookups
    cache_hits: dict[str, int] = field(init=False, default_factory=dict)  # at first admission, by Level value
    anchor: bool = field(init=False, default=True)  # its checkpoints do not extend its conversation's latest
    host_lease: Any = field(init=False, default=None)  # cache.host.HostLease pinned for its admission
    host_checked: bool = field(init=False, default=False)  # the host tier was asked (once per admission)
    host_asked: int = field(init=False, default=0)  # the longest spilled match it asked the daemon about
    first_slice: Restore | None = field(init=False, default=None)  # after a host restore: its first slice's
    # its memory holds exactly its num_computed positions (False from admission until a step of it
    # is applied: pending copies): only then may it be kept in the cache
    consistent: bool = field(init=False, default=True)
    draft: list[int] = field(init=False, default_factory=list)  # speculative tokens to verify next step

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
class Checkpoint:
    """Keep the request's first ``position`` tokens as a cache entry after the step."""

    kind: Kind
    position: int
    image_slot: int  # the slot the engine copies the state into (-1: attention-only)


@dataclass(frozen=True)
class Slice:
    """One request's part of a step."""

    request: Request
    start: int
    num_tokens: int
    need_logits: bool
    new_seq: bool  # first slice after (re)admission: the engine resets (or restores) the state slot
    restore: Restore | None = None  # new_seq from a cache hit: the copies to make first
    checkpoint: Checkpoint | None = None  # ends at a boundary: the state image to take after the step
    draft: tuple[int, ...] = ()  # a verify slice: the last token, then these drafted ones (num_tokens - 1)

    @property
    def verify(self) -> bool:
        return bool(self.draft)


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
                 clock: Callable[[], float] = time.monotonic, cache: PrefixCache | None = None) -> None:
        if (limits.max_concurrency < 1 or limits.token_budget < 1 or limits.queue_size < 0
                or limits.chunk_tokens < 0):
            raise ValueError(f"bad scheduler limits {limits}")
        self.limits = limits
        self.blocks = blocks
        self.clock = clock
        self.cache = cache
        self.running: list[Request] = []
        self.restoring: list[tuple[Request, Future[bool]]] = []  # admitted, filled from the host tier
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
        return bool(self.running or self._waiting or self.restoring)

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
        n = len(req.prompt_ids)
        for name, b in (("turn_boundary", req.turn_boundary), ("prefix_boundary", req.prefix_boundary)):
            if b is not None and not (0 < b <= n):
                raise ValueError(f"{name} {b} outside the prompt (1..{n})")
        if len(self._waiting) >= self.limits.queue_size:
            raise QueueFull(f"waiting queue is full ({self.limits.queue_size} requests); retry later")
        req.seq_no = next(self._seq)
        req.status = Status.WAITING
        heapq.heappush(self._waiting, (-req.priority, req.seq_no, req))
        self._by_id[req.request_id] = req

    def cancel(self, request_id: str, reason: Finish = Finish.CANCELLED, error: str = "",
               retain: bool = True) -> Request | None:
        """Finish a waiting or running request now; a running one's memory goes to the cache
        (``retain``: its state is consistent, not in the middle of a step) or is freed."""
        req = self._by_id.get(request_id)
        if req is None:
            return None
        self._finish(req, reason, error=error, retain=retain)
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
        self._finish_restores()
        if self.cache is not None:  # the resident budget; room ahead for checkpoints and decodes (host tier)
            self.cache.trim()
            self.cache.keep_free(pages=len(self.running) + 1, slots=SLOT_RESERVE if self.blocks.uses_slots else 0)
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
                continue  # req itself was preempted, or waits for a spill to free a page
            first, req.first_slice = req.first_slice, None
            sl = self._slice(req, n, new_seq=first is not None, restore=first)
            if sl is not None:
                slices.append(sl)
        budget = self.limits.token_budget - sum(s.num_tokens for s in slices)
        if not preempted:
            while (self._waiting and budget > 0
                   and len(self.running) + len(self.restoring) < self.limits.max_concurrency):
                req = self._waiting[0][2]
                admitted = self._admit(req)
                if admitted is None:
                    break
                heapq.heappop(self._waiting)
                if req.status is Status.RESTORING:
                    continue  # joins the steps once its pages are filled
                n = self._slice_len(req, budget)
                sl = self._slice(req, n, new_seq=True, restore=admitted)
                if sl is not None:
                    slices.append(sl)
                    budget -= n
        return StepPlan(slices=slices, preempted=preempted)

    def _admit(self, req: Request) -> Restore | None:
        """Place ``req`` (reusing a cached prefix when there is one); None when it does not fit yet."""
        hit = self._lookup(req)
        lease = self._host_lookup(req)
        if self.cache is not None and self.cache.host is not None:
            assert req.ledger is not None
            ledger = req.ledger if req.num_tokens == len(req.prompt_ids) else self._extended(req, req.num_tokens)
            known = max(hit.tokens if hit is not None else 0, lease.tokens if lease is not None else 0)
            hint = self.cache.host_hint(ledger, req.owner)
            if hint > known and hint > req.host_asked:  # spilled since it was asked: ask again (once per hint)
                if lease is not None:
                    self.cache.host.release(lease)
                    req.host_lease = None
                req.host_asked, req.host_checked = hint, False
                lease = self._host_lookup(req)
        if lease is not None:
            if lease.tokens > (hit.tokens if hit is not None else 0):
                return self._admit_from_host(req)
            assert self.cache is not None and self.cache.host is not None
            self.cache.host.release(lease)  # the device holds as much: keep the host's recency
            req.host_lease = None
        shared = hit.tokens // self.blocks.page_size if hit is not None else 0
        pages = pages_for(req.num_tokens, self.blocks.page_size) - shared
        slots = 1 if self.blocks.uses_slots else 0
        if not self._room(pages, slots, hit):
            return None
        self.blocks.add(req.request_id)
        restore = Restore()
        start = 0
        if hit is not None:
            assert self.cache is not None
            restore = self.cache.adopt(hit, req.request_id)
            start = hit.tokens
        self.blocks.ensure(req.request_id, req.num_tokens)
        if restore.copy_page is not None:  # the request's own page for the positions after the cut
            dst = self.blocks.block_table(req.request_id)[start // self.blocks.page_size]
            restore = replace(restore, copy_page=(restore.copy_page[0], dst))
        req.status = Status.RUNNING
        req.num_computed = start
        req.consistent = start == 0
        if not req.ever_admitted:
            req.cache_hits = {hit.level.value: hit.tokens} if hit is not None else {}
            req.anchor = hit is None or hit.level is Level.SHARED_PREFIX or hit.branch
        req.ever_admitted = True
        self.running.append(req)
        return restore

    def prepare(self, req: Request) -> None:
        """Work a request needs before admission that can run outside the engine's lock, on the
        caller's thread: its prompt's ledger (digests), and the host tier's lookup (an RPC)."""
        if self.cache is None:
            return
        if req.ledger is None:
            req.ledger = Ledger.of(req.owner.scope, req.prompt_ids, self.blocks.page_size)
        self._host_lookup(req)

    def _host_lookup(self, req: Request) -> Any:
        """The host tier's pinned match for ``req`` (asked once per admission; None: a miss)."""
        host = self.cache.host if self.cache is not None else None
        if host is None or req.host_checked:
            return req.host_lease
        req.host_checked = True
        ledger = req.ledger
        assert ledger is not None  # _lookup / prepare made it
        tokens = ledger.tokens if req.num_tokens == len(req.prompt_ids) else self._extended(req, req.num_tokens).tokens
        o = req.owner
        req.host_lease = host.lookup(tokens, tenant=o.tenant, metadata_digest=o.metadata_digest, session=o.session)
        return req.host_lease

    def _admit_from_host(self, req: Request) -> Restore | None:
        """Admit ``req`` into fresh pages and a slot that the host tier fills from its lease
        (levels 3 / 4) on its own worker and copy stream; the request joins the steps when that is
        done (``_finish_restores``), from scratch when the restore is not confirmed."""
        assert self.cache is not None and self.cache.host is not None
        if not self._room(pages_for(req.num_tokens, self.blocks.page_size), 1 if self.blocks.uses_slots else 0):
            return None  # waits with its lease
        self.blocks.add(req.request_id)
        self.blocks.ensure(req.request_id, req.num_tokens)
        future = self.cache.host.restore_async(req.host_lease, self.blocks.block_table(req.request_id),
                                               self.blocks.state_slot(req.request_id))
        req.status = Status.RESTORING
        req.ever_admitted = True
        self.restoring.append((req, future))
        return Restore()

    def _finish_restores(self) -> None:
        """Requests whose host restore is done join the running ones (at the lease's position when
        the daemon confirmed it, else at 0); a request cancelled meanwhile gives its memory back."""
        for item in [x for x in self.restoring if x[1].done()]:
            self.restoring.remove(item)
            req, future = item
            lease, req.host_lease = req.host_lease, None
            if req.status is Status.FINISHED:
                self.blocks.free(req.request_id)
                continue
            ok = future.exception() is None and bool(future.result())
            start = lease.tokens if ok else 0
            if ok:
                assert self.cache is not None
                self.cache.count_host_hit(lease.level, start)
            if not req.cache_hits and req.num_preemptions == 0:
                req.cache_hits = {lease.level.value: start} if ok else {}
            req.status = Status.RUNNING
            req.num_computed = start
            req.consistent = True  # the copy is done (or nothing was restored)
            req.first_slice = Restore(state_ready=ok)
            self.running.append(req)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait for the host restores and spills in flight and apply them (shutdown, tests)."""
        for _, future in list(self.restoring):
            future.exception(timeout=timeout_s)
        self._finish_restores()
        if self.cache is not None:
            self.cache.settle(timeout_s)

    def _lookup(self, req: Request) -> Hit | None:
        if self.cache is None:
            return None
        if req.ledger is None:  # once per request: a prompt waiting head-of-line is looked up every step
            req.ledger = Ledger.of(req.owner.scope, req.prompt_ids, self.blocks.page_size)
        ledger = req.ledger
        if req.num_tokens > len(req.prompt_ids):  # preempted after generating: its generated tokens too
            ledger = self._extended(req, req.num_tokens)
        return self.cache.lookup(ledger, req.owner)

    def _extended(self, req: Request, n: int) -> Ledger:
        """The ledger of ``req``'s first ``n`` tokens (``n`` beyond its prompt): the prompt's array
        and digests reused, only the generated tokens converted and hashed."""
        assert req.ledger is not None
        gen = np.asarray(req.tokens[len(req.prompt_ids):n], dtype=np.uint32)
        return Ledger.of(req.owner.scope, np.concatenate([req.ledger.tokens, gen]), self.blocks.page_size,
                         req.ledger.digests)

    def _room(self, pages: int, slots: int, hit: Hit | None = None) -> bool:
        if self.cache is not None:
            return self.cache.room(pages, slots, hit.entry if hit is not None else None)
        return self.blocks.free_pages >= pages and self.blocks.free_slots >= slots

    def update(self, plan: StepPlan, sampled: dict[str, Sequence[int]]) -> list[Request]:
        """Apply a step the engine ran (forward, then the restores' and checkpoints' copies):
        ``sampled`` maps request id -> its new tokens for slices with logits: one, or for a verify
        slice the L accepted ones (the drafts that matched, then the model's own token; the engine
        has cut them at the first stop), which make its first L positions computed.

        Returns the requests that finished in this step.
        """
        finished: list[Request] = []
        for s in plan.slices:
            req = s.request
            req.draft.clear()
            if req.status is not Status.RUNNING:
                continue  # cancelled while the step ran (its pins went with its memory)
            if s.checkpoint is not None:
                self._keep_checkpoint(req, s.checkpoint)
            if s.restore is not None or s.checkpoint is not None:
                self.blocks.unpin(req.request_id)
            toks = sampled.get(req.request_id, ()) if s.need_logits else ()
            if s.verify and not 1 <= len(toks) <= s.num_tokens:
                raise ValueError(f"verify slice of {s.num_tokens} tokens accepted {len(toks)}")
            req.num_computed += len(toks) if s.verify else s.num_tokens
            req.consistent = True
            if not s.need_logits:
                continue
            for tok in toks:
                req.tokens.append(tok)
                reason = self._stop_reason(req, tok, req.num_output)
                if reason is not None:
                    if reason is Finish.STOP:
                        req.stop_token_id = tok
                    self._finish(req, reason)
                    finished.append(req)
                    break
        return finished

    def keep_until_stop(self, req: Request, tokens: Sequence[int]) -> tuple[int, bool]:
        """``(n, ends)``: how many of ``tokens``, appended in order to ``req``, it keeps (up to and
        including the first that would finish it, by the stop rules ``update`` applies), and
        whether the last kept one finishes it."""
        for i, tok in enumerate(tokens):
            if self._stop_reason(req, tok, req.num_output + i + 1) is not None:
                return i + 1, True
        return len(tokens), False

    def draft_room(self, req: Request, want: int, pending: int = 0) -> int:
        """How many tokens ``req`` may draft (at most ``want``) once the step's ``pending`` new
        tokens are applied: within its max_tokens, and within the pages it holds plus free ones
        (taken now; never evicting or preempting), so that the drafting's KV writes and the next
        verify slice have pages."""
        if req.status is not Status.RUNNING or want <= 0:
            return 0
        tokens = req.num_tokens + pending
        want = min(want, req.max_tokens - (req.num_output + pending) - 1)
        while want > 0:
            try:
                self.blocks.ensure(req.request_id, tokens + want)
                return want
            except OutOfPages:
                want -= 1
        return 0

    def _keep_checkpoint(self, req: Request, cp: Checkpoint) -> None:
        req.checkpoints.add(cp.position)
        if self.cache is None:
            return
        assert req.ledger is not None  # looked up at admission
        ps = self.blocks.page_size
        ledger = Ledger(req.ledger.tokens[:cp.position], req.ledger.digests[:cp.position // ps])
        self.cache.checkpoint(req.request_id, ledger, cp.kind, req.owner, cp.image_slot, anchor=req.anchor)

    def fail(self, request_id: str, error: str) -> Request | None:
        """End a request its step failed on: never cached (the step may have half written it)."""
        return self.cancel(request_id, Finish.ERROR, error=error, retain=False)

    def finish_all(self, reason: Finish, error: str = "", keep: Callable[[Request], bool] = lambda r: False
                   ) -> list[Request]:
        """Finish every request; ``keep(req)``: may its memory go to the cache (its state consistent)."""
        reqs = list(self._by_id.values())
        for r in reqs:
            self._finish(r, reason, error=error, retain=keep(r))
        return reqs

    # -- helpers -------------------------------------------------------------------------
    def _boundaries(self, req: Request) -> tuple[int, ...]:
        return tuple(b for b in (req.turn_boundary, req.prefix_boundary) if b is not None)

    def _slice_len(self, req: Request, budget: int) -> int:
        if req.draft and req.num_tokens - req.num_computed == 1:  # a verify slice: the drafts that fit
            room = min(budget, self.limits.chunk_tokens or budget, req.max_tokens - req.num_output)
            del req.draft[max(0, room - 1):]
            return 1 + len(req.draft)
        req.draft.clear()
        n = min(req.num_tokens - req.num_computed, budget)
        if self.limits.chunk_tokens:
            n = min(n, self.limits.chunk_tokens)
        for b in self._boundaries(req):
            if req.num_computed < b < req.num_computed + n:
                n = b - req.num_computed
        return n

    def _slice(self, req: Request, n: int, new_seq: bool, restore: Restore | None = None) -> Slice | None:
        """The slice, or None when it ends at a boundary whose image slot a spill in flight is about
        to free: the request then waits a step (its first slice's ``restore`` kept for it)."""
        end = req.num_computed + n
        checkpoint = self._checkpoint_at(req, end)
        if checkpoint is _WAIT:
            if new_seq:
                req.first_slice = restore if restore is not None else Restore()
            return None
        draft = tuple(req.draft) if n > 1 and req.draft else ()
        return Slice(request=req, start=req.num_computed, num_tokens=n,
                     need_logits=end == req.num_tokens or bool(draft), new_seq=new_seq,
                     restore=restore if restore is not None and restore != Restore() else None,
                     checkpoint=checkpoint, draft=draft)  # type: ignore[arg-type]

    def _checkpoint_at(self, req: Request, end: int) -> Checkpoint | object | None:
        """A checkpoint when the slice ends at a boundary not kept yet, with a state slot reserved
        for the image on hybrid models; ``_WAIT`` when a spill in flight frees one soon; None
        (counted as skipped) when no slot can be had."""
        if self.cache is None or end in req.checkpoints or end not in self._boundaries(req):
            return None
        kind = Kind.TURN if end == req.turn_boundary else Kind.PREFIX
        slot = -1
        if self.blocks.uses_slots:
            if self.blocks.free_slots == 0:
                self.cache.room(0, 1)
            got = self.blocks.take_slot(req.request_id)
            if got is None:
                if self.cache.pending_slots > 0:
                    return _WAIT
                self.cache.counters.checkpoints_skipped += 1
                return None
            slot = got
        return Checkpoint(kind, end, slot)

    def _grow(self, req: Request, num_tokens: int, slices: list[Slice], preempted: list[Request]) -> bool:
        """Make ``req`` hold pages for ``num_tokens``, evicting cache entries, then preempting others;
        False when it was preempted or waits (no slice this step) for spills in flight to free pages."""
        while True:
            try:
                self.blocks.ensure(req.request_id, num_tokens)
                return True
            except OutOfPages:
                need = self.blocks.extra_pages_needed(req.request_id, num_tokens)
                if self._room(need, 0):
                    continue
                if self.cache is not None and self.blocks.free_pages + self.cache.pending_pages >= need:
                    return False  # a spill will free the pages: wait rather than preempt
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
        """Back to the queue at its place; what it computed stays in the cache while room allows."""
        self.running.remove(req)
        self._release(req, retain=True)
        req.draft.clear()
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        req.host_checked, req.host_asked = False, 0
        heapq.heappush(self._waiting, (-req.priority, req.seq_no, req))

    def _release(self, req: Request, retain: bool) -> None:
        if self.cache is None or not retain or not req.consistent or req.ledger is None:
            self.blocks.free(req.request_id)
            return
        ledger = req.ledger
        if req.num_computed > len(ledger):
            ledger = self._extended(req, req.num_computed)
        else:
            ps = self.blocks.page_size
            ledger = Ledger(ledger.tokens[:req.num_computed], ledger.digests[:req.num_computed // ps])
        self.cache.retire(req.request_id, ledger, req.owner)

    @staticmethod
    def _stop_reason(req: Request, tok: int, num_output: int) -> Finish | None:
        """Does ``tok``, generated as ``req``'s ``num_output``-th token, finish it?"""
        p = req.params
        if num_output > p.min_tokens:
            if tok in p.stop_token_ids or (tok in req.eos_ids and not p.ignore_eos):
                return Finish.STOP
        if num_output >= req.max_tokens:
            return Finish.LENGTH
        return None

    def _finish(self, req: Request, reason: Finish, error: str = "", retain: bool = True) -> None:
        # RESTORING: its pages are being written; _finish_restores frees them once that is done
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req, retain=retain)
        elif req.status is Status.WAITING:
            self._waiting = [e for e in self._waiting if e[2] is not req]
            heapq.heapify(self._waiting)
            if req.host_lease is not None and self.cache is not None and self.cache.host is not None:
                self.cache.host.release(req.host_lease)
                req.host_lease = None
        req.draft.clear()
        req.status = Status.FINISHED
        req.finish = reason
        req.error = error
        self._by_id.pop(req.request_id, None)
