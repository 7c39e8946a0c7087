"""EngineCore on the FakeRunner: batching invariance, preemption, events, errors.

Ended sequences stay in the prefix cache (on by default): ``drained`` checks that what is
still held belongs to cache entries only, then drops them and expects an empty pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepwell.engine_service.engine import AdmittedEvent, EngineCore, EngineLimits, FinishedEvent, InvalidRequest, TokensEvent
from deepwell.engine_service.sampling import SamplingParams
from deepwell.engine_service.scheduler import Finish, QueueFull
from tests.engine.test_scheduler_fakerunner import FakeRunner, greedy_reference

GREEDY = SamplingParams(temperature=0.0)


def core(runner: FakeRunner, num_pages: int = 64, slots: int = 8, conc: int = 8, budget: int = 16,
         queue: int = 16, ctx: int = 256, chunk: int = 0) -> EngineCore:
    return EngineCore(runner, EngineLimits(num_pages, slots, conc, budget, queue, ctx, chunk), eos_ids=())


def drained(c: EngineCore) -> None:
    """Nothing but cache entries holds memory; dropping them empties the pools."""
    b = c.blocks
    assert (b.used_pages, b.used_slots) == (b.cached_only_pages, b.cached_only_slots)
    b.check()
    if c.cache is not None:
        c.cache.clear()
    assert (b.used_pages, b.used_slots) == (0, 0)
    b.check()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 97 for i in range(n)]


class Collector:
    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, ev) -> None:
        self.events.append(ev)

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokensEvent) for t in e.token_ids]

    @property
    def finished(self) -> FinishedEvent:
        fin = [e for e in self.events if isinstance(e, FinishedEvent)]
        assert len(fin) == 1
        return fin[0]


def drive(c: EngineCore, arrivals: dict[int, list], max_steps: int = 1000) -> None:
    """Step ``c``; before step i submit the requests in ``arrivals[i]``."""
    for i in range(max_steps):
        for req in arrivals.get(i, []):
            c.submit(req)
        c.step()
        if not c.has_work() and i >= max(arrivals, default=0):
            return
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("budget,page_size,num_pages,chunk", [(16, 4, 64, 0), (5, 4, 64, 0), (3, 2, 24, 0),
                                                              (64, 8, 40, 0), (32, 4, 64, 7)])
def test_concurrent_requests_equal_alone(budget: int, page_size: int, num_pages: int, chunk: int) -> None:
    specs = [(1, 23, 9, 0), (2, 5, 12, 0), (3, 40, 6, 2), (4, 11, 10, 5)]  # seed, prompt len, max tokens, arrival
    runner = FakeRunner(page_size=page_size)
    c = core(runner, num_pages=num_pages, budget=budget, chunk=chunk)
    sinks, arrivals = {}, {}
    for seed, n, mt, at in specs:
        sinks[seed] = Collector()
        req = c.make_request(prompt(seed, n), SamplingParams(temperature=0.0, max_tokens=mt), request_id=f"r{seed}",
                             sink=sinks[seed])
        arrivals.setdefault(at, []).append(req)
    drive(c, arrivals)
    for seed, n, mt, _ in specs:
        assert sinks[seed].tokens == greedy_reference(runner, prompt(seed, n), mt)
        assert sinks[seed].finished.reason is Finish.LENGTH
        assert sinks[seed].finished.completion_tokens == mt
    drained(c)


def test_preemption_under_pressure_keeps_outputs() -> None:
    runner = FakeRunner(page_size=2)
    c = core(runner, num_pages=14, budget=8)
    sinks = {}
    reqs = []
    for seed in range(4):
        sinks[seed] = Collector()
        reqs.append(c.make_request(prompt(seed, 6), SamplingParams(temperature=0.0, max_tokens=14),
                                   request_id=f"p{seed}", sink=sinks[seed]))
    drive(c, {0: reqs})
    assert sum(r.num_preemptions for r in reqs) > 0
    for seed in range(4):
        assert sinks[seed].tokens == greedy_reference(runner, prompt(seed, 6), 14)
        assert sum(isinstance(e, AdmittedEvent) for e in sinks[seed].events) == 1


def test_seeded_sampling_is_batch_invariant() -> None:
    def run(together: bool) -> list[list[int]]:
        runner = FakeRunner()
        c = core(runner, budget=7)
        outs = []
        reqs = []
        for seed in range(3):
            col = Collector()
            outs.append(col)
            reqs.append(c.make_request(prompt(seed, 9 + seed), SamplingParams(temperature=0.9, top_p=0.9, seed=seed,
                                                                               max_tokens=8), sink=col))
        if together:
            drive(c, {0: reqs})
        else:
            for r in reqs:
                drive(c, {0: [r]})
        return [o.tokens for o in outs]

    assert run(True) == run(False)


def test_turn_boundary_checkpoint_serves_a_rewritten_history() -> None:
    """The chunk is cut at the turn boundary, the state there is copied into an image slot and
    kept; a later prompt that agrees up to the boundary only resumes there."""
    runner = FakeRunner(page_size=4)
    c = core(runner, budget=6)
    p = prompt(7, 14)
    col = Collector()
    req = c.make_request(p, SamplingParams(temperature=0.0, max_tokens=6), request_id="t", turn_boundary=9, sink=col)
    drive(c, {0: [req]})
    assert [call[0][1:] for call in runner.forward_calls[:3]] == [(0, 6), (6, 3), (9, 5)]  # cut at 9
    assert runner.state_copies[0][2] == 9  # the image at the boundary
    assert col.tokens == greedy_reference(runner, p, 6)
    rewritten = p[:9] + [50, 51, 52]
    again = Collector()
    drive(c, {0: [c.make_request(rewritten, SamplingParams(temperature=0.0, max_tokens=4), sink=again)]})
    assert again.finished.cached == {"resident_checkpoint": 9}
    assert runner.forward_calls[-4][0][1:] == (9, 3)  # only the rewritten tokens were computed
    assert again.tokens == greedy_reference(runner, rewritten, 4)
    drained(c)


def test_event_sequence_and_usage() -> None:
    runner = FakeRunner()
    c = core(runner)
    col = Collector()
    c.submit(c.make_request(prompt(1, 5), SamplingParams(temperature=0.0, max_tokens=3, logprobs=2), sink=col))
    drive(c, {})
    kinds = [type(e).__name__ for e in col.events]
    assert kinds == ["AdmittedEvent", "TokensEvent", "TokensEvent", "TokensEvent", "FinishedEvent"]
    adm = col.events[0]
    assert (adm.prompt_tokens, adm.max_tokens) == (5, 3)
    assert all(len(e.logprobs[0].top) == 2 for e in col.events[1:4])
    fin = col.finished
    assert (fin.prompt_tokens, fin.completion_tokens, fin.reason) == (5, 3, Finish.LENGTH)
    assert c.counters.tokens_decoded == 3 and c.counters.tokens_prefilled == 5


def test_stop_token_is_reported_not_streamed() -> None:
    runner = FakeRunner()
    ref = greedy_reference(runner, prompt(2, 6), 4)
    c = EngineCore(runner, EngineLimits(32, 4, 4, 16, 4, 256), eos_ids=[ref[2]])
    col = Collector()
    c.submit(c.make_request(prompt(2, 6), SamplingParams(temperature=0.0, max_tokens=10), sink=col))
    drive(c, {})
    assert col.tokens == ref[:2]
    assert (col.finished.reason, col.finished.stop_token_id, col.finished.completion_tokens) == (
        Finish.STOP, ref[2], 3)


def test_internal_error_fails_only_that_step_and_engine_keeps_serving() -> None:
    runner = FakeRunner()
    c = core(runner, budget=64)
    bad, good = Collector(), Collector()
    runner.fail_on_token = 96
    c.submit(c.make_request([1, 96, 2], GREEDY, sink=bad))
    c.step()
    assert bad.finished.reason is Finish.ERROR and "injected failure" in bad.finished.error
    assert c.blocks.used_pages == 0
    c.submit(c.make_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2), sink=good))
    drive(c, {})
    assert good.finished.reason is Finish.LENGTH and good.tokens == greedy_reference(runner, [1, 2, 3], 2)


def test_non_finite_logits_fail_only_that_request() -> None:
    runner = FakeRunner()
    c = core(runner, budget=64)
    bad, good = Collector(), Collector()
    runner.nan_on_token = 95
    c.submit(c.make_request([1, 95, 2], GREEDY, sink=bad))
    c.submit(c.make_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), sink=good))
    drive(c, {})
    assert bad.finished.reason is Finish.ERROR and bad.finished.error == "internal error: model produced non-finite logits"
    assert good.finished.reason is Finish.LENGTH and good.tokens == greedy_reference(runner, [1, 2, 3], 3)
    assert c.cache is not None and len(c.cache.entries) == 1  # the failed one is never kept
    drained(c)


def test_bad_input_messages() -> None:
    c = core(FakeRunner(vocab=97), ctx=64)
    with pytest.raises(InvalidRequest, match="empty prompt"):
        c.make_request([], GREEDY)
    with pytest.raises(InvalidRequest, match=r"token id 97 outside the vocabulary \[0, 97\)"):
        c.make_request([1, 97], GREEDY)
    with pytest.raises(InvalidRequest, match="prompt of 64 tokens is longer than the context: 64 tokens"):
        c.make_request([1] * 64, GREEDY)
    with pytest.raises(InvalidRequest, match="top_p"):
        c.make_request([1], SamplingParams(top_p=2.0))
    r = c.make_request([1] * 60, GREEDY)
    assert r.max_tokens == 4  # clamped to the context
    c.submit(r)
    with pytest.raises(InvalidRequest, match="already in use"):
        c.submit(c.make_request([1], GREEDY, request_id=r.request_id))


def test_queue_full() -> None:
    c = core(FakeRunner(), queue=1)
    c.submit(c.make_request([1], GREEDY))
    with pytest.raises(QueueFull):
        c.submit(c.make_request([2], GREEDY))


def test_cancel_emits_finished_once_and_keeps_the_computed_part() -> None:
    runner = FakeRunner()
    c = core(runner, budget=4)
    col = Collector()
    r = c.make_request(prompt(3, 20), GREEDY, sink=col)
    c.submit(r)
    c.step()
    assert c.blocks.used_pages > 0
    assert c.cancel(r.request_id)
    assert not c.cancel(r.request_id)
    assert col.finished.reason is Finish.CANCELLED
    assert c.cache is not None and [len(e) for e in c.cache.entries.values()] == [4]  # the 4 computed tokens
    resumed = Collector()
    drive(c, {0: [c.make_request(prompt(3, 20), SamplingParams(temperature=0.0, max_tokens=2), sink=resumed)]})
    assert resumed.finished.cached == {"resident_frontier": 4}
    assert resumed.tokens == greedy_reference(runner, prompt(3, 20), 2)
    drained(c)


def test_cancel_during_a_step_keeps_nothing_of_it() -> None:
    """A request cancelled while its step runs is being written: freed, never kept."""
    runner = FakeRunner()
    c = core(runner, budget=4)
    col = Collector()
    r = c.make_request(prompt(3, 20), GREEDY, sink=col)
    c.submit(r)
    real = runner.forward

    def cancel_inside(batch):
        c.cancel(r.request_id)
        return real(batch)

    runner.forward = cancel_inside  # type: ignore[method-assign]
    c.step()
    assert col.finished.reason is Finish.CANCELLED
    assert c.cache is not None and not c.cache.entries
    drained(c)


def test_attention_only_model_uses_no_slots() -> None:
    runner = FakeRunner(hybrid=False)
    c = core(runner, budget=5)
    col = Collector()
    c.submit(c.make_request(prompt(5, 12), SamplingParams(temperature=0.0, max_tokens=4), turn_boundary=7, sink=col))
    drive(c, {})
    assert c.blocks.num_state_slots == 0
    assert col.tokens == greedy_reference(runner, prompt(5, 12), 4)
    assert runner.state_copies == []  # KV-only models need no state image
    assert c.cache is not None and {e.kind.value for e in c.cache.entries.values()} == {"turn", "exec"}

_req = st.tuples(st.integers(1, 30), st.integers(1, 8), st.integers(0, 12), st.booleans())  # len, max, arrival, cancel


@settings(max_examples=40, deadline=None)
@given(st.lists(_req, min_size=1, max_size=6), st.integers(1, 20), st.sampled_from([2, 4, 8]), st.integers(0, 2),
       st.integers(0, 6))
def test_random_workloads_match_reference(reqs, budget: int, page_size: int, slack: int, chunk: int) -> None:
    runner = FakeRunner(page_size=page_size)
    longest = max(n + mt for n, mt, _, _ in reqs)
    num_pages = -(-longest // page_size) + slack  # the largest request always fits, little more
    c = core(runner, num_pages=num_pages, slots=3, conc=3, budget=budget, chunk=chunk)
    sinks, reqs_by_step, cancels = [], {}, {}
    for i, (n, mt, at, cancel) in enumerate(reqs):
        col = Collector()
        sinks.append(col)
        r = c.make_request(prompt(i, n), SamplingParams(temperature=0.0, max_tokens=mt), request_id=f"r{i}", sink=col)
        reqs_by_step.setdefault(at, []).append(r)
        if cancel:
            cancels.setdefault(at + 3, []).append(r.request_id)
    for step in range(3000):
        for r in reqs_by_step.get(step, []):
            c.submit(r)
        for rid in cancels.get(step, []):
            c.cancel(rid)
        c.step()
        c.blocks.check()
        assert c.blocks.used_slots - c.blocks.cached_only_slots == c.scheduler.num_running
        if not c.has_work() and step > 15:
            break
    drained(c)
    for i, (n, mt, _, _) in enumerate(reqs):
        fin = sinks[i].finished
        ref = greedy_reference(runner, prompt(i, n), mt)
        if fin.reason is Finish.CANCELLED:
            assert sinks[i].tokens == ref[: len(sinks[i].tokens)]
        else:
            assert fin.reason is Finish.LENGTH and sinks[i].tokens == ref


def _wait_finished(col: Collector) -> FinishedEvent:
    import time

    for _ in range(2000):
        fin = [e for e in col.events if isinstance(e, FinishedEvent)]
        if fin:
            return fin[0]
        time.sleep(0.005)
    raise AssertionError("request never finished")


def test_engine_thread_serves_survives_a_scheduler_bug_and_stops() -> None:
    from deepwell.engine_service.engine import Engine

    runner = FakeRunner()
    c = core(runner)
    eng = Engine(c)
    eng.start()
    try:
        ok = Collector()
        eng.submit(c.make_request([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=3), sink=ok))
        assert _wait_finished(ok).reason is Finish.LENGTH and ok.tokens == greedy_reference(runner, [4, 5, 6], 3)

        real_schedule = c.scheduler.schedule
        calls = []

        def broken():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("scheduler bug")
            return real_schedule()

        c.scheduler.schedule = broken  # type: ignore[method-assign]
        hit = Collector()
        eng.submit(c.make_request([7, 8], GREEDY, sink=hit))
        fin = _wait_finished(hit)
        assert fin.reason is Finish.ERROR and fin.error == "internal error: scheduler bug"
        after = Collector()
        eng.submit(c.make_request([7, 8], SamplingParams(temperature=0.0, max_tokens=2), sink=after))
        assert _wait_finished(after).reason is Finish.LENGTH
        pending = Collector()
        eng.submit(c.make_request([9], SamplingParams(temperature=0.0, max_tokens=0), sink=pending))
    finally:
        eng.stop()
    assert pending.finished.reason in (Finish.CANCELLED, Finish.LENGTH)
    drained(c)


def test_a_loop_bug_keeps_what_finished_steps_left_consistent() -> None:
    """The engine loop's fail-all after a bug outside the model step (``Engine._loop``): what
    finished steps left consistent stays in the cache; a request of the failing step does not."""

    def fail_all(c: EngineCore) -> None:  # what Engine._loop does on an exception
        with c.lock:
            busy, c._in_step = c._in_step, set()
            for req in c.scheduler.finish_all(Finish.ERROR, "internal error", keep=lambda r: r.request_id not in busy):
                c._emit_finished(req)

    for where in ("schedule", "apply"):
        c = core(FakeRunner(), budget=8)
        sink = Collector()
        c.submit(c.make_request(prompt(1, 20), GREEDY, request_id="a", sink=sink))
        c.step()
        c.step()  # "a" has 16 computed tokens
        target = c.scheduler if where == "schedule" else c
        name = "schedule" if where == "schedule" else "_apply"
        real = getattr(target, name)

        def broken(*a, **kw):
            raise RuntimeError("bug")

        setattr(target, name, broken)
        with pytest.raises(RuntimeError):
            c.step()
        fail_all(c)
        setattr(target, name, real)
        assert sink.finished.reason is Finish.ERROR
        kept = [len(e) for e in c.cache.entries.values()]  # type: ignore[union-attr]
        assert kept == ([16] if where == "schedule" else []), where
        drained(c)
