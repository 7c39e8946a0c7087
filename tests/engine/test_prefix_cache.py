"""The resident prefix cache on the FakeRunner: which level serves which prompt, at which
position, with outputs equal to a cold run; the checkpoint chain of a Qwen3.5-style tool
loop; tenant isolation; and a long randomized loop of session turns under memory pressure.

The FakeRunner fails a step whose state slot disagrees with the pages it reads, and its
logits hash the history read back from the pages, so a wrong reuse (wrong pages, wrong
image, a page overwritten under a reader) changes the outputs or fails the step.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from deepwell.engine_service.cache.types import Kind
from deepwell.engine_service.engine import EngineCore, EngineLimits
from deepwell.engine_service.sampling import SamplingParams
from deepwell.engine_service.scheduler import Finish
from tests.engine.test_batching import Collector, drained
from tests.engine.test_scheduler_fakerunner import FakeRunner, greedy_reference


def make(hybrid: bool = True, pages: int = 64, slots: int = 12, conc: int = 4, budget: int = 16,
         page_size: int = 4) -> tuple[FakeRunner, EngineCore]:
    runner = FakeRunner(page_size=page_size, hybrid=hybrid)
    core = EngineCore(runner, EngineLimits(pages, slots, conc, budget, 32, 1024), eos_ids=())
    return runner, core


def run(core: EngineCore, prompt: list[int], max_tokens: int = 3, **kw) -> Collector:
    col = Collector()
    core.submit(core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), sink=col, **kw))
    for _ in range(500):
        core.step()
        if not core.has_work():
            break
    core.blocks.check()
    return col


def test_frontier_reuses_prompt_and_generated_tokens() -> None:
    for hybrid in (True, False):
        runner, core = make(hybrid)
        p1 = list(range(10, 31))  # 21 tokens
        first = run(core, p1, max_tokens=4)
        assert first.finished.cached == {} and first.tokens == greedy_reference(runner, p1, 4)
        p2 = p1 + first.tokens + [5, 6, 7]  # the conversation continues: history resent
        second = run(core, p2, max_tokens=3)
        # 21 prompt tokens + 3 generated were computed (the 4th was sampled, never fed back)
        assert second.finished.cached == {"resident_frontier": 24}
        assert second.tokens == greedy_reference(runner, p2, 3)
        assert runner.forward_calls[-3][0][1:] == (24, 4)  # only the 4 new tokens prefilled
        drained(core)


def test_reuse_is_always_shorter_than_the_prompt() -> None:
    runner, core = make(hybrid=False)
    p = list(range(10, 30))
    run(core, p, max_tokens=1)
    again = run(core, p, max_tokens=2)  # the same prompt: 20 tokens cached, one must be computed
    assert again.finished.cached == {"resident_checkpoint": 19}
    assert again.tokens == greedy_reference(runner, p, 2)
    drained(core)


def test_hybrid_resumes_only_where_a_state_image_exists() -> None:
    runner, core = make(hybrid=True)
    p1 = list(range(10, 40))
    run(core, p1, max_tokens=2, turn_boundary=12)
    assert sorted((e.kind.value, len(e)) for e in core.cache.entries.values()) == [("exec", 31), ("turn", 12)]
    diverged = p1[:20] + [3, 3, 3]  # agrees with the entry up to 20: only the image at 12 is usable
    col = run(core, diverged)
    assert col.finished.cached == {"resident_checkpoint": 12}
    assert col.tokens == greedy_reference(runner, diverged, 3)
    # attention-only: the same prompts reuse the whole common prefix
    runner2, attn = make(hybrid=False)
    run(attn, p1, max_tokens=2, turn_boundary=12)
    col = run(attn, diverged)
    assert col.finished.cached == {"resident_checkpoint": 20}
    assert col.tokens == greedy_reference(runner2, diverged, 3)
    drained(core)
    drained(attn)


def test_shared_prefix_across_sessions() -> None:
    system = list(range(40, 58))  # 18 tokens of shared system prompt + tools
    for hybrid in (True, False):
        runner, core = make(hybrid)
        a = run(core, system + [1, 2, 3], session_key="t/a", prefix_boundary=18)
        assert a.finished.cached == {}
        assert any(e.kind is Kind.PREFIX and len(e) == 18 for e in core.cache.entries.values())
        p = system + [7, 8, 9, 10]
        b = run(core, p, session_key="t/b", prefix_boundary=18)
        # hybrid: the prefix image at 18; attention-only: session a's ledger cut where it diverges (18 too)
        assert b.finished.cached == {"shared_prefix": 18}, hybrid
        assert b.tokens == greedy_reference(runner, p, 3)
        drained(core)


def test_tenants_never_share_an_entry_or_a_page() -> None:
    runner, core = make(hybrid=True)
    p = list(range(10, 40))
    a = run(core, p, tenant="acme", prefix_boundary=12, turn_boundary=20)
    b = run(core, p, tenant="globex", prefix_boundary=12, turn_boundary=20)
    assert a.finished.cached == {} and b.finished.cached == {}
    by_tenant: dict[bytes, set[int]] = {}
    for e in core.cache.entries.values():
        by_tenant.setdefault(e.scope, set()).update(core.blocks.block_table(e.holder))
    assert len(by_tenant) == 2 and not set.intersection(*by_tenant.values())
    again = run(core, p + a.tokens + [1], tenant="acme")
    assert again.finished.cached == {"resident_frontier": 32}
    other_digest = run(core, p + a.tokens + [1], tenant="acme", metadata_digest=b"image-1")  # other meaning
    assert other_digest.finished.cached == {}
    drained(core)


# -- a Qwen3.5-style tool loop ---------------------------------------------------------------
SYS, USER, ASSIST, TOOL, THINK, UNTHINK, END = 90, 91, 92, 93, 94, 95, 96


def render(turns: list[tuple[str, list[int]]], generation: bool) -> list[int]:
    """Assistant turns after the last user message keep an empty think block; earlier ones
    drop it (what Qwen3.5's template does once a new user message arrives)."""
    last_user = max(i for i, (role, _) in enumerate(turns) if role == "user")
    out = [SYS, 40, 41, 42, 43, 44, END]
    for i, (role, body) in enumerate(turns):
        if role == "assistant":
            out += [ASSIST] + ([THINK, UNTHINK] if i > last_user else []) + body + [END]
        else:
            out += [USER if role == "user" else TOOL] + body + [END]
    return out + ([ASSIST, THINK] if generation else [])


def test_tool_loop_keeps_the_checkpoint_after_each_user_message() -> None:
    runner, core = make(hybrid=True, pages=128, slots=16, budget=64)
    turns: list[tuple[str, list[int]]] = [("user", [10, 11, 12])]
    first_boundary = len(render(turns, False))
    reuse: list[tuple[dict[str, int], int]] = []
    for step in range(6):  # five tool calls, each answered
        prompt, boundary = render(turns, True), len(render(turns, False))
        col = run(core, prompt, max_tokens=3, turn_boundary=boundary, session_key="t/s")
        assert col.tokens == greedy_reference(runner, prompt, 3)
        reuse.append((col.finished.cached, boundary))
        turns += [("assistant", [20 + step, 21]), ("tool", [30 + step])]
    # each tool-loop request resumes at the previous request's turn boundary
    for (cached, _), (_, prev_boundary) in zip(reuse[1:], reuse, strict=False):
        assert cached == {"resident_checkpoint": prev_boundary}
    turns.append(("user", [13, 14]))  # a new user message: earlier think blocks disappear
    prompt = render(turns, True)
    col = run(core, prompt, max_tokens=3, turn_boundary=len(render(turns, False)), session_key="t/s")
    assert col.finished.cached == {"resident_checkpoint": first_boundary}
    assert col.tokens == greedy_reference(runner, prompt, 3)
    turns_kept = sorted(len(e) for e in core.cache.entries.values() if e.kind is Kind.TURN)
    assert first_boundary in turns_kept and len(turns_kept) <= 4  # anchors + the latest, not every call
    drained(core)


# -- pressure ----------------------------------------------------------------------------------
def pressure_loop(seed: int, hybrid: bool, page_size: int, extra_slots: int) -> EngineCore:
    """Sessions grow turn by turn in a pool too small for all of them: entries are evicted,
    running sequences never are (the FakeRunner would fail), every output equals a cold run,
    the block manager's invariants hold after every step, and dropping the cache frees all."""
    rng = random.Random(seed)
    runner = FakeRunner(page_size=page_size, hybrid=hybrid)
    core = EngineCore(runner, EngineLimits(num_pages=160 // page_size, num_state_slots=3 + extra_slots * 3,
                                           max_concurrency=3, token_budget=rng.choice([5, 9, 16]), queue_size=64,
                                           max_context=400), eos_ids=())
    sessions = {f"s{i}": [SYS, 40 + i % 2, 41, 42] for i in range(5)}
    pending: list[tuple[str, list[int], Collector]] = []
    finished = 0
    for _ in range(400):
        if len(pending) < 4 and rng.random() < 0.5:
            sid = rng.choice(sorted(sessions))
            if all(s != sid for s, _, _ in pending):
                prompt = sessions[sid] + [rng.randrange(3, 89) for _ in range(rng.randint(1, 6))]
                col = Collector()
                req = core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 4)),
                                        sink=col, session_key=sid, turn_boundary=len(prompt) - rng.randint(0, 1),
                                        prefix_boundary=3)
                core.submit(req)
                pending.append((sid, prompt, col))
                if rng.random() < 0.1:
                    core.cancel(req.request_id)
        core.step()
        core.blocks.check()
        running_slots = core.blocks.used_slots - core.blocks.cached_only_slots
        assert running_slots == (core.scheduler.num_running if hybrid else 0)
        for item in [x for x in pending if _done(x[2])]:
            sid, prompt, col = item
            pending.remove(item)
            assert col.tokens == greedy_reference(runner, prompt, len(col.tokens))
            if col.finished.reason is Finish.LENGTH:
                finished += 1
                sessions[sid] = prompt + col.tokens if len(prompt) < 60 else sessions[sid][:4]  # 5 x 60 > 160
    assert finished > 5
    for _ in range(200):
        if not core.has_work():
            break
        core.step()
    drained(core)
    return core


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.booleans(), st.sampled_from([2, 4]), st.integers(0, 1))
def test_random_sessions_under_pressure(seed: int, hybrid: bool, page_size: int, extra_slots: int) -> None:
    pressure_loop(seed, hybrid, page_size, extra_slots)


def test_pressure_evicts_and_still_reuses() -> None:
    for hybrid in (True, False):
        c = pressure_loop(1, hybrid, 4, 1).cache.counters
        assert c.evictions["pressure"] > 0 and c.hits > 0, (hybrid, c)


def _done(col: Collector) -> bool:
    from deepwell.engine_service.engine import FinishedEvent

    return any(isinstance(e, FinishedEvent) for e in col.events)


def test_eviction_takes_covered_ended_sequences_before_checkpoints() -> None:
    """Slots for state images run short: the ended sequence (covered by its own turn checkpoint)
    goes before the older anchor checkpoint, which a new user turn needs."""
    runner, core = make(hybrid=True, pages=64, slots=3, conc=1)  # 1 running + 2 images
    p = list(range(10, 40))
    run(core, p, max_tokens=3, turn_boundary=30, session_key="t/a")  # turn checkpoint (anchor) + exec
    kinds = {e.kind: e for e in core.cache.entries.values()}
    assert kinds[Kind.EXEC].keep_rank == 0 and kinds[Kind.TURN].keep_rank == 2
    run(core, list(range(50, 70)), max_tokens=1)  # the last free slot; it ends as a third image
    run(core, list(range(71, 85)), max_tokens=1)  # needs a running slot: one image must go
    assert [e.kind for e in core.cache.entries.values() if len(e) >= 30] == [Kind.TURN]
    assert core.cache.counters.evictions["pressure"] == 1
    again = run(core, p + [7, 7], session_key="t/a")
    assert again.finished.cached == {"resident_checkpoint": 30}
    assert again.tokens == greedy_reference(runner, p + [7, 7], 3)
    drained(core)


def test_resident_budget_evicts_beyond_its_share_of_the_pool() -> None:
    """``cache_fraction``: entries alone hold at most that share of the pages; beyond it the
    least valuable go at the next step, even with the pool otherwise free."""
    runner = FakeRunner(page_size=4)
    core = EngineCore(runner, EngineLimits(40, 12, 4, 16, 16, 1024, cache_fraction=0.25), eos_ids=())
    for seed in range(4):
        run(core, [seed + 10] + list(range(20, 40)), max_tokens=2)  # 6 pages each
        core.step()  # the next step trims
        assert core.blocks.cached_only_pages <= 10
    assert core.cache.counters.evictions["pressure"] >= 2
    drained(core)
