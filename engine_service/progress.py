"""Progress of long prefills: a ``StepObserver`` that wraps another (the engine's
``EngineMetrics``) and watches the running requests after every step.

``PrefillProgress(inner)`` forwards every ``StepObserver`` hook to ``inner`` (hooks added to
``StepObserver`` later are forwarded too: the forwarding methods are made from its members).
Once ``attach(core)`` gave it the ``EngineCore``, each ``on_step`` — called by the engine under its
lock, on the step thread after a step's tokens are applied — reads the scheduler's running
requests; a request whose prompt is not yet computed is *prefilling*:

- a request prefilling for ``every_s`` seconds (default ``PREFILL_PROGRESS_EVERY_S``) or more
  gets a ``prefill_progress`` info line (``request_id``, ``computed``: prompt positions done,
  cache hits included, ``prompt_tokens``, ``percent``, ``elapsed_s``, ``tokens_per_s`` computed
  by this engine since the request was first seen prefilling), then one every ``every_s``
  seconds; once such a request's prefill ends (or it leaves the running set: finished,
  cancelled, preempted) a ``prefill_done`` line closes it (``completed`` false for the latter).
  Short prefills log nothing.
- with a Prometheus registry (``inner.registry``, as ``EngineMetrics`` has), the gauges
  ``deepwell_engine_prefill_requests`` (running requests still prefilling) and
  ``deepwell_engine_prefill_tokens_remaining`` (their prompt tokens not yet computed).

It only reads the requests (``request_id``, ``prompt_ids``, ``num_computed``), never changes
them; without ``attach`` it only forwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepwell.logs import get_logger
from deepwell.engine_service.engine import Snapshot, StepObserver

log = get_logger(__name__)

PREFILL_PROGRESS_EVERY_S = 5.0


@dataclass
class _Prefill:
    first_seen: float
    computed_at_start: int  # positions already done when first seen (cache hits, an earlier step)
    last_logged: float
    logged: bool = False


class PrefillProgress(StepObserver):
    def __init__(self, inner: StepObserver | None = None, every_s: float = PREFILL_PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner if inner is not None else StepObserver()
        self.every_s = every_s
        self.clock = clock
        self.core: Any = None
        self._tracked: dict[str, _Prefill] = {}
        self._gauges: tuple[Any, Any] | None = None
        registry = getattr(self.inner, "registry", None)
        if registry is not None:
            from prometheus_client import Gauge

            model = getattr(self.inner, "model", "")
            requests = Gauge("deepwell_engine_prefill_requests", "Running requests whose prompt is not yet computed",
                             ["model"], registry=registry)
            remaining = Gauge("deepwell_engine_prefill_tokens_remaining",
                              "Prompt tokens of the running requests not yet computed", ["model"], registry=registry)
            self._gauges = (requests.labels(model), remaining.labels(model))

    def attach(self, core: Any) -> None:
        """Watch ``core``'s running requests from now on."""
        self.core = core

    def on_step(self, snap: Snapshot, prefilled: int, decoded: int) -> None:
        self.inner.on_step(snap, prefilled, decoded)
        if self.core is not None:
            self.observe(self.core.scheduler.running)

    def observe(self, running: list[Any]) -> None:
        """Log and count the prefills among ``running`` (requests with ``request_id``,
        ``prompt_ids`` and ``num_computed``)."""
        now = self.clock()
        seen: set[str] = set()
        waiting_tokens = 0
        for req in running:
            prompt = len(req.prompt_ids)
            done = min(req.num_computed, prompt)
            rid = req.request_id
            state = self._tracked.get(rid)
            if done >= prompt:
                if state is not None:
                    self._close(rid, state, prompt, prompt, now, completed=True)
                continue
            seen.add(rid)
            waiting_tokens += prompt - done
            if state is None:
                self._tracked[rid] = state = _Prefill(now, done, now)
            if now - state.last_logged >= self.every_s:
                state.last_logged, state.logged = now, True
                elapsed = now - state.first_seen
                log.info("prefill_progress", request_id=rid, computed=done, prompt_tokens=prompt,
                         percent=int(100 * done / prompt), elapsed_s=round(elapsed, 1),
                         tokens_per_s=round((done - state.computed_at_start) / max(elapsed, 1e-9), 1))
        for rid in [r for r in self._tracked if r not in seen]:  # finished, cancelled or preempted mid-prefill
            self._close(rid, self._tracked[rid], None, None, now, completed=False)
        if self._gauges is not None:
            self._gauges[0].set(len(seen))
            self._gauges[1].set(waiting_tokens)

    def _close(self, rid: str, state: _Prefill, done: int | None, prompt: int | None, now: float,
               completed: bool) -> None:
        del self._tracked[rid]
        if not state.logged:
            return
        elapsed = now - state.first_seen
        fields: dict[str, Any] = {"request_id": rid, "completed": completed, "elapsed_s": round(elapsed, 1)}
        if completed and done is not None:
            fields.update(prompt_tokens=prompt,
                          tokens_per_s=round((done - state.computed_at_start) / max(elapsed, 1e-9), 1))
        log.info("prefill_done", **fields)


def _forward(name: str) -> Callable[..., Any]:
    def hook(self: PrefillProgress, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"Forwarded to the wrapped observer's ``{name}``."
    return hook


for _name, _member in vars(StepObserver).items():
    if callable(_member) and not _name.startswith("_") and _name not in vars(PrefillProgress):
        setattr(PrefillProgress, _name, _forward(_name))
