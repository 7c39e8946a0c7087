"""A request matches a prefix-cache entry whose spill to the host tier is in flight, and the
spill completes between the lookup and the adoption (found by benchmarks/soak.py: the room it
makes polls the spills, which used to free the matched entry, and adopting it then failed the
whole step with KeyError ('entry', N)). The matched entry stays until the request adopts it."""

from __future__ import annotations

from concurrent.futures import Future

from deepwell.engine_service.block_manager import BlockManager
from deepwell.engine_service.cache.resident import PrefixCache
from deepwell.engine_service.sampling import SamplingParams
from deepwell.engine_service.scheduler import Request, Scheduler, SchedulerLimits, Status


class LateFuture(Future):
    """A finished spill that reports done only from its second ``done()`` on (the host tier's
    worker completed it right after the step's first poll)."""

    def __init__(self) -> None:
        super().__init__()
        self.set_result(True)
        self.calls = 0

    def done(self) -> bool:
        self.calls += 1
        return self.calls > 1


class FakeHost:
    available = True

    def spill_async(self, **kw):
        return LateFuture()

    def lookup(self, *a, **kw):
        return None

    def release(self, lease) -> None:
        pass


def _run(s: Scheduler, req: Request) -> None:
    s.add(req)
    while req.status is not Status.FINISHED:
        plan = s.schedule()
        s.update(plan, {sl.request.request_id: [7] for sl in plan.slices if sl.need_logits})


def test_an_entry_whose_spill_finishes_during_admission_is_still_adopted() -> None:
    bm = BlockManager(32, 4, 0)
    pc = PrefixCache(bm, hybrid=False)
    pc.host = FakeHost()
    s = Scheduler(SchedulerLimits(4, 64, 8, 128, 0), bm, cache=pc)
    greedy = SamplingParams(temperature=0.0)
    _run(s, Request(request_id="a", prompt_ids=list(range(1, 13)), params=greedy, max_tokens=1,
                    eos_ids=frozenset({0})))
    (entry,) = pc.entries.values()
    pc.evict(entry)  # spilling: still matchable until a poll sees the copy done
    b = Request(request_id="b", prompt_ids=list(range(1, 13)) + [99, 98], params=greedy, max_tokens=1,
                eos_ids=frozenset({0}))
    s.add(b)
    plan = s.schedule()  # used to raise KeyError ('entry', 1)
    assert b.status is Status.RUNNING and b.num_computed == 12 and b.cache_hits
    s.update(plan, {sl.request.request_id: [7] for sl in plan.slices if sl.need_logits})
    while b.status is not Status.FINISHED:
        plan = s.schedule()
        s.update(plan, {sl.request.request_id: [7] for sl in plan.slices if sl.need_logits})
    pc.poll()  # the spill is done now: the entry's memory goes back, b's own references went with b
    assert not pc.entries or entry.id not in pc.entries
    assert bm.free_pages + bm.cached_only_pages == 32
