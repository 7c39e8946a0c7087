"""``engine_service.progress.PrefillProgress``: long prefills logged (``prefill_progress`` /
``prefill_done``) and counted in gauges, every other observer hook forwarded."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

from structlog.testing import capture_logs

from deepwell.engine_service.engine import EngineCore, EngineLimits, StepObserver
from deepwell.engine_service.metrics import EngineMetrics
from deepwell.engine_service.progress import PrefillProgress
from deepwell.engine_service.sampling import SamplingParams
from tests.engine.test_scheduler_fakerunner import FakeRunner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req(rid: str, prompt: int, done: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_ids=[0] * prompt, num_computed=done)


def _gauge(metrics: EngineMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": "m"})


def test_long_prefills_are_logged_every_few_seconds_and_counted() -> None:
    clock, metrics = Clock(), EngineMetrics("m")
    obs = PrefillProgress(metrics, every_s=5.0, clock=clock)
    with capture_logs() as logs:
        obs.observe([_req("long", 10_000, 1000), _req("short", 100, 0), _req("decoding", 50, 60)])
        assert (_gauge(metrics, "deepwell_engine_prefill_requests"),
                _gauge(metrics, "deepwell_engine_prefill_tokens_remaining")) == (2, 9000 + 100)
        clock.now = 2.0
        obs.observe([_req("long", 10_000, 3000)])  # "short" ended within 2 s: never logged
        clock.now = 5.0
        obs.observe([_req("long", 10_000, 6000)])
        clock.now = 7.0
        obs.observe([_req("long", 10_000, 8000)])  # not yet 5 s since the last line
        clock.now = 10.0
        obs.observe([_req("long", 10_000, 10_000)])  # done: closed
    assert [e["event"] for e in logs] == ["prefill_progress", "prefill_done"]
    line, done = logs
    assert (line["request_id"], line["computed"], line["prompt_tokens"], line["percent"], line["elapsed_s"],
            line["tokens_per_s"]) == ("long", 6000, 10_000, 60, 5.0, 1000.0)  # 5000 computed here in 5 s
    assert (done["request_id"], done["completed"], done["elapsed_s"], done["tokens_per_s"]) == ("long", True, 10.0,
                                                                                               900.0)
    assert _gauge(metrics, "deepwell_engine_prefill_requests") == 0


def test_a_request_leaving_mid_prefill_is_closed() -> None:
    clock = Clock()
    obs = PrefillProgress(None, every_s=1.0, clock=clock)
    with capture_logs() as logs:
        obs.observe([_req("a", 100, 0)])
        clock.now = 1.5
        obs.observe([_req("a", 100, 10)])
        clock.now = 2.0
        obs.observe([])  # cancelled or preempted
    assert [(e["event"], e.get("completed")) for e in logs] == [("prefill_progress", None), ("prefill_done", False)]


def test_every_hook_is_forwarded() -> None:
    inner = mock.Mock(spec=StepObserver)
    obs = PrefillProgress(inner)
    hooks = [n for n, m in vars(StepObserver).items() if callable(m) and not n.startswith("_")]
    assert {"on_step", "on_first_token", "on_finished", "on_host_copy"} <= set(hooks)
    for name in hooks:
        getattr(obs, name)("x", 1, 2)
        getattr(inner, name).assert_called_once_with("x", 1, 2)


def test_in_the_engine_step_loop() -> None:
    """Attached to a real EngineCore: its steps drive the lines (every_s=0: one per step)."""
    clock = Clock()
    metrics = EngineMetrics("m")
    obs = PrefillProgress(metrics, every_s=0.0, clock=clock)
    core = EngineCore(FakeRunner(hybrid=False), EngineLimits(num_pages=64, num_state_slots=0, max_concurrency=2,
                                                             token_budget=8, queue_size=4, max_context=256),
                      observer=obs)
    obs.attach(core)
    with capture_logs() as logs:
        core.submit(core.make_request(list(range(1, 31)), SamplingParams(temperature=0.0, max_tokens=2)))
        for _ in range(20):
            clock.now += 1
            if not core.step() and not core.has_work():
                break
    progress = [e for e in logs if e["event"] == "prefill_progress"]
    assert [e["computed"] for e in progress] == [8, 16, 24]  # 30 prompt tokens, 8 a step; the 4th step ends it
    assert [e["event"] for e in logs if e["event"].startswith("prefill_done")] == ["prefill_done"]
    assert _gauge(metrics, "deepwell_engine_prefill_requests") == 0
    assert _gauge(metrics, "deepwell_engine_tokens_prefilled_total") == 30  # the metrics still see every step
