"""Scheduler: the one catch-up rule, with exact slices, pages and slots."""

from __future__ import annotations

import pytest

from deepwell.engine_service.block_manager import BlockManager
from deepwell.engine_service.cache.resident import PrefixCache
from deepwell.engine_service.cache.types import Kind
from deepwell.engine_service.sampling import SamplingParams
from deepwell.engine_service.scheduler import Finish, QueueFull, Request, Scheduler, SchedulerLimits, Status

GREEDY = SamplingParams(temperature=0.0)


def make(num_pages: int = 32, page_size: int = 4, slots: int = 4, conc: int = 4, budget: int = 8,
         queue: int = 8, ctx: int = 128, clock=None, chunk: int = 0, cache: bool = False) -> Scheduler:
    bm = BlockManager(num_pages, page_size, slots)
    kw = {"clock": clock} if clock else {}
    pc = PrefixCache(bm, hybrid=slots > 0) if cache else None
    return Scheduler(SchedulerLimits(conc, budget, queue, ctx, chunk), bm, cache=pc, **kw)


def req(rid: str, n: int, max_tokens: int = 4, **kw) -> Request:
    return Request(request_id=rid, prompt_ids=list(range(1, n + 1)), params=kw.pop("params", GREEDY),
                   max_tokens=max_tokens, eos_ids=frozenset({0}), **kw)


def shape(plan) -> list[tuple[str, int, int, bool]]:
    return [(s.request.request_id, s.start, s.num_tokens, s.need_logits) for s in plan.slices]


def run_step(s: Scheduler, token: int = 7) -> list[tuple[str, int, int, bool]]:
    plan = s.schedule()
    s.update(plan, {sl.request.request_id: [token] for sl in plan.slices if sl.need_logits})
    return shape(plan)


def test_chunked_prefill_and_decode_share_steps() -> None:
    s = make(budget=6)
    s.add(req("a", 10))
    assert run_step(s) == [("a", 0, 6, False)]
    s.add(req("b", 5))
    assert run_step(s) == [("a", 6, 4, True), ("b", 0, 2, False)]
    assert run_step(s) == [("a", 10, 1, True), ("b", 2, 3, True)]
    assert run_step(s) == [("a", 11, 1, True), ("b", 5, 1, True)]
    a, b = s.get("a"), s.get("b")
    assert a is not None and b is not None
    assert a.num_computed == 12 and a.tokens[10:] == [7, 7, 7] and b.tokens[5:] == [7, 7]


def test_catch_up_exact_sequence() -> None:
    s = make(budget=6)
    s.add(req("a", 9, max_tokens=2))
    s.add(req("b", 3, max_tokens=2))
    assert run_step(s) == [("a", 0, 6, False)]
    assert run_step(s) == [("a", 6, 3, True), ("b", 0, 3, True)]
    assert run_step(s) == [("a", 9, 1, True), ("b", 3, 1, True)]
    assert not s.has_work()  # both hit max_tokens=2
    assert s.blocks.used_pages == 0 and s.blocks.used_slots == 0


def test_max_concurrency_and_fifo_within_priority() -> None:
    s = make(conc=2, budget=100)
    for rid in "abc":
        s.add(req(rid, 2))
    s.add(req("hi", 2, priority=5))
    plan = s.schedule()
    assert [sl.request.request_id for sl in plan.slices] == ["hi", "a"]
    assert [r.request_id for r in s.waiting()] == ["b", "c"]
    assert s.num_running == 2


def test_admission_by_pages_waits_head_of_line() -> None:
    s = make(num_pages=4, page_size=4, budget=100)
    s.add(req("a", 12, max_tokens=2))  # 3 pages at admission
    s.add(req("b", 8, max_tokens=1))  # 2 pages: must wait
    s.add(req("c", 1, max_tokens=1))  # would fit, but waits behind b
    assert run_step(s) == [("a", 0, 12, True)]
    assert s.blocks.used_pages == 3 and [r.request_id for r in s.waiting()] == ["b", "c"]
    assert run_step(s) == [("a", 12, 1, True)]  # a finishes (max_tokens 2) and frees 4 pages
    assert s.blocks.used_pages == 0
    assert run_step(s) == [("b", 0, 8, True), ("c", 0, 1, True)]


def test_admission_by_state_slots() -> None:
    s = make(slots=1, budget=100)
    s.add(req("a", 2, max_tokens=1))
    s.add(req("b", 2, max_tokens=1))
    assert run_step(s) == [("a", 0, 2, True)]
    assert run_step(s) == [("b", 0, 2, True)]


def test_queue_full_and_never_fits() -> None:
    s = make(num_pages=4, page_size=4, queue=1, ctx=128)
    s.add(req("a", 3))
    with pytest.raises(QueueFull, match="full"):
        s.add(req("b", 3))
    with pytest.raises(ValueError, match=r"needs 5 KV pages \(17 \+ 1 tokens\) but the pool has 4 pages"):
        s.add(req("c", 17, max_tokens=1))
    with pytest.raises(ValueError, match="exceeds the context of 128"):
        s.add(req("d", 120, max_tokens=9))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("a", 3))


def test_cancel_frees_everything_at_once() -> None:
    s = make(budget=4)
    s.add(req("a", 10))
    s.add(req("w", 3))
    run_step(s)
    assert s.blocks.used_pages == 3 and s.blocks.used_slots == 1
    r = s.cancel("a")
    assert r is not None and r.status is Status.FINISHED and r.finish is Finish.CANCELLED
    assert s.blocks.used_pages == 0 and s.blocks.used_slots == 0
    assert s.cancel("w") is not None and not s.has_work()
    assert s.cancel("nope") is None
    s.blocks.check()


def test_deadlines() -> None:
    now = [100.0]
    s = make(clock=lambda: now[0])
    s.add(req("a", 3, deadline=105.0))
    s.add(req("b", 3, deadline=200.0))
    run_step(s)
    now[0] = 105.0
    late = s.expire()
    assert [r.request_id for r in late] == ["a"] and late[0].finish is Finish.DEADLINE
    assert s.blocks.used_slots == 1


@pytest.mark.parametrize("cache", [False, True])
def test_turn_boundary_cuts_the_chunk(cache: bool) -> None:
    s = make(budget=8, cache=cache)
    s.add(req("a", 12, turn_boundary=5))
    plan = s.schedule()
    assert shape(plan) == [("a", 0, 5, False)]
    cp = plan.slices[0].checkpoint
    if cache:  # a state image at 5: a slot reserved for it (slot 0 runs the request)
        assert cp is not None and (cp.kind, cp.position, cp.image_slot) == (Kind.TURN, 5, 1)
    else:
        assert cp is None
    s.update(plan, {})
    plan = s.schedule()
    assert shape(plan) == [("a", 5, 7, True)] and plan.slices[0].checkpoint is None
    if cache:
        assert s.cache is not None and [(e.kind, len(e)) for e in s.cache.entries.values()] == [(Kind.TURN, 5)]
        assert s.blocks.state_slot(("entry", 1)) == 1 and s.blocks.block_table(("entry", 1)) == [0, 1]
    s.blocks.check()


def test_boundaries_at_prompt_end_and_on_budget_edge() -> None:
    s = make(budget=4, cache=True)
    s.add(req("a", 8, turn_boundary=8))
    assert [sl.checkpoint is None for sl in s.schedule().slices] == [True]
    s2 = make(budget=4, cache=True)
    s2.add(req("a", 8, turn_boundary=4))
    plan = s2.schedule()
    assert shape(plan) == [("a", 0, 4, False)] and plan.slices[0].checkpoint is not None
    with pytest.raises(ValueError, match="turn_boundary 9 outside"):
        s2.add(req("b", 8, turn_boundary=9))
    s3 = make(budget=8, cache=True)  # the shared-prefix boundary cuts too
    s3.add(req("c", 12, turn_boundary=9, prefix_boundary=3))
    plan = s3.schedule()
    assert shape(plan) == [("c", 0, 3, False)] and plan.slices[0].checkpoint.kind is Kind.PREFIX  # type: ignore[union-attr]
    s3.update(plan, {})
    plan = s3.schedule()
    assert shape(plan) == [("c", 3, 6, False)] and plan.slices[0].checkpoint.kind is Kind.TURN  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="prefix_boundary 13 outside"):
        s3.add(req("d", 12, prefix_boundary=13))


def test_stop_rules() -> None:
    s = make(budget=100)
    s.add(req("eos", 2, max_tokens=5))
    s.add(req("ign", 2, max_tokens=2, params=SamplingParams(temperature=0.0, ignore_eos=True)))
    s.add(req("stop", 2, max_tokens=5, params=SamplingParams(temperature=0.0, stop_token_ids=(9,))))
    s.add(req("min", 2, max_tokens=5, params=SamplingParams(temperature=0.0, min_tokens=1)))
    plan = s.schedule()
    fin = s.update(plan, {"eos": [0], "ign": [0], "stop": [9], "min": [0]})
    assert {r.request_id: (r.finish, r.stop_token_id) for r in fin} == {
        "eos": (Finish.STOP, 0), "stop": (Finish.STOP, 9)}
    plan = s.schedule()
    fin = s.update(plan, {"ign": [0], "min": [0]})
    assert {r.request_id: (r.finish, r.stop_token_id) for r in fin} == {
        "ign": (Finish.LENGTH, None), "min": (Finish.STOP, 0)}


def test_preemption_frees_and_recomputes() -> None:
    # 4 pages of 2 tokens; two requests grow by decoding until one must yield.
    s = make(num_pages=4, page_size=2, slots=2, budget=100, ctx=8)
    s.add(req("a", 3, max_tokens=4))
    s.add(req("b", 2, max_tokens=4))
    assert run_step(s) == [("a", 0, 3, True), ("b", 0, 2, True)]  # a: 2 pages, b: 1 page
    assert run_step(s) == [("a", 3, 1, True), ("b", 2, 1, True)]  # b grows to 2 pages (4 used)
    plan = s.schedule()  # a needs a 3rd page: b (newest) is preempted
    assert shape(plan) == [("a", 4, 1, True)] and [r.request_id for r in plan.preempted] == ["b"]
    b = s.get("b")
    assert b is not None and b.status is Status.WAITING and b.num_computed == 0 and b.tokens == [1, 2, 7, 7]
    s.update(plan, {"a": [7]})
    assert s.blocks.used_pages == 3
    assert run_step(s) == [("a", 5, 1, True)]  # a finishes (4 tokens); b (2 pages) did not fit meanwhile
    assert run_step(s) == [("b", 0, 4, True)]  # b recomputes prompt + its outputs, then continues
    s.blocks.check()


def test_decodes_go_before_prefill_chunks() -> None:
    s = make(budget=8)
    s.add(req("long", 30, turn_boundary=5))  # its first chunk is cut at 5, leaving budget for short
    s.add(req("short", 2))
    assert run_step(s) == [("long", 0, 5, False), ("short", 0, 2, True)]
    # short is one token behind: it decodes first, long's chunk takes what is left
    assert run_step(s) == [("short", 2, 1, True), ("long", 5, 7, False)]
    assert run_step(s) == [("short", 3, 1, True), ("long", 12, 7, False)]


def test_chunk_cap_lets_long_prompts_share_steps() -> None:
    s = make(budget=8, chunk=5)
    s.add(req("long", 30))
    s.add(req("next", 6))
    assert run_step(s) == [("long", 0, 5, False), ("next", 0, 3, False)]
    assert run_step(s) == [("long", 5, 5, False), ("next", 3, 3, True)]
    assert run_step(s) == [("next", 6, 1, True), ("long", 10, 5, False)]
