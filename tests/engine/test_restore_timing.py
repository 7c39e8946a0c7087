"""The engine's per-request ``restore_ms``: the time a request admitted from the host tier spends
RESTORING (out of every step), carried in ``FinishedEvent`` and the ``Timings`` proto; 0 without
a restore; not part of ``queue_ms`` (queue + restore + prefill = TTFT for a first admission).

An in-process ``EngineCore`` over the FakeRunner and a real KV-cache daemon (``test_host_cache``'s
``Node``), whose host tier is slowed by a fixed delay so the restore has a known lower bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from deepwell.engine_service.sampling import SamplingParams
from deepwell.engine_service.service import event_to_proto
from tests.engine.test_batching import Collector
from tests.engine.test_host_cache import Node, _prompt
from tests.kvcache.kvtest_helpers import Daemon

DELAY_S = 0.4  # well above any queueing a loaded CI machine adds (queue_ms < restore_ms below)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(arena_bytes=16 << 20, granule_bytes=1 << 20).start()
    yield d
    d.cleanup()


def _slow_restores(node: Node, delay_s: float) -> None:
    restore = node.host.restore

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return restore(*args, **kwargs)

    node.host.restore = slow  # type: ignore[method-assign]  # restore_async calls it on the worker


def test_restore_ms_is_the_time_spent_restoring(daemon: Daemon) -> None:
    node = Node(daemon)
    try:
        _slow_restores(node, DELAY_S)
        p1 = _prompt(1, 30)
        first = node.run(p1, max_tokens=4, turn_boundary=22, session_key="t/s")
        assert first.finished.restore_ms == 0.0 and first.finished.cached == {}
        node.evict_all()
        second = node.run(p1 + first.tokens + [5, 6], session_key="t/s")
        f = second.finished
        assert f.cached == {"host_entry": 33}
        assert DELAY_S * 1000 <= f.restore_ms < 30_000
        # a first admission's restore is neither queue nor prefill time: the three add up to TTFT
        assert f.queue_ms < f.restore_ms
        assert f.queue_ms + f.restore_ms + f.prefill_ms == pytest.approx(f.ttft_ms, abs=1e-3)
        assert event_to_proto(f).finished.timings.restore_ms == pytest.approx(f.restore_ms)
        # the next turn comes from the device again: no restore
        third = node.run(p1 + first.tokens + [5, 6] + second.tokens + [7], session_key="t/s")
        assert third.finished.cached.get("resident_frontier") and third.finished.restore_ms == 0.0
    finally:
        node.close()


def test_a_request_cancelled_while_restoring_reports_the_time_so_far(daemon: Daemon) -> None:
    node = Node(daemon)
    try:
        p1 = _prompt(2, 30)
        first = node.run(p1, max_tokens=3, session_key="t/c")
        node.evict_all()
        _slow_restores(node, 0.5)
        col = Collector()
        req = node.core.make_request(p1 + first.tokens + [4], SamplingParams(temperature=0.0, max_tokens=3),
                                     sink=col, session_key="t/c")
        node.core.submit(req)
        node.core.step()  # admitted from the host: RESTORING
        assert node.core.scheduler.restoring
        time.sleep(0.02)
        assert node.core.cancel(req.request_id)
        f = col.finished
        assert 20.0 <= f.restore_ms < 30_000 and f.prefill_ms == 0.0 and f.ttft_ms == 0.0
        node.core.scheduler.settle()
        node.core.step()
        assert not node.core.scheduler.restoring and not node.core.has_work()
        node.core.blocks.check()
    finally:
        node.close()
