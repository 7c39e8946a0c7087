"""The prefix cache's host tier against a real KV-cache daemon process (levels 3 and 4):
spill-before-evict, restores that equal a cold run, engine restarts, and every daemon fault
turning into a miss (daemon killed during a spill and during a restore, restarted, down).

The engine side is an in-process ``EngineCore`` over the FakeRunner (its logits hash the
history it reads back from the pages and it fails a step whose state disagrees with them,
so a wrong restore shows), sharing one daemon with a fresh engine where a restart is tested.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from deepwell.kvclient.client import KVClient
from deepwell.engine_service.cache.host import HostTier
from deepwell.engine_service.engine import EngineCore, EngineLimits
from deepwell.engine_service.sampling import SamplingParams
from deepwell.engine_service.scheduler import Finish
from tests.engine.test_batching import Collector
from tests.engine.test_scheduler_fakerunner import FakeRunner, greedy_reference
from tests.kvcache.kvtest_helpers import Daemon, wait_until

FP = b"fake-model"


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(arena_bytes=16 << 20, granule_bytes=1 << 20).start()
    yield d
    d.cleanup()


class Node:
    """An engine with a host tier: its FakeRunner, core and daemon client."""

    def __init__(self, daemon: Daemon, *, hybrid: bool = True, pages: int = 24, fp: bytes = FP) -> None:
        self.runner = FakeRunner(page_size=4, hybrid=hybrid)
        self.core = EngineCore(self.runner, EngineLimits(pages, 12, 4, 32, 16, 1024), eos_ids=())
        self.client = KVClient(daemon.address, "test-engine", rpc_timeout_s=2.0, retries=1, reconnect_max_s=0.2)
        assert self.client.start(5.0)
        self.host = HostTier(self.client, self.runner, fingerprint=fp, page_size=4, hybrid=hybrid)
        self.core.attach_host(self.host)

    def run(self, prompt: list[int], max_tokens: int = 3, **kw) -> Collector:
        col = Collector()
        self.core.submit(self.core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                                sink=col, **kw))
        deadline = time.monotonic() + 60
        while self.core.has_work() and time.monotonic() < deadline:
            if self.core.step() == 0:
                time.sleep(0.001)  # a restore on the host tier's worker
        self.core.blocks.check()
        return col

    def evict_all(self) -> None:
        """Memory pressure on everything: each entry is offered to the daemon, then dropped."""
        with self.core.lock:
            cache = self.core.cache
            for e in list(cache.entries.values()):
                cache.spill(e)
                cache.drop(e, "pressure")

    def close(self) -> None:
        self.host.close()
        self.client.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 13 + i * 7) % 80 + 3 for i in range(n)]


@pytest.mark.parametrize("hybrid", [True, False])
def test_spilled_entry_is_restored_and_continues_exactly(daemon: Daemon, hybrid: bool) -> None:
    node = Node(daemon, hybrid=hybrid)
    try:
        p1 = _prompt(1, 30)
        first = node.run(p1, max_tokens=4, turn_boundary=22, session_key="t/s")
        node.evict_all()
        assert not node.core.cache.entries and node.host.counters.spills["ok"] >= 2
        p2 = p1 + first.tokens + [5, 6]
        second = node.run(p2, session_key="t/s")
        assert second.finished.cached == {"host_entry": 33}  # 30 prompt + 3 computed generated tokens
        assert second.tokens == greedy_reference(node.runner, p2, 3)
        assert node.host.counters.restores == {"ok": 1, "failed": 0}
        # the restored conversation goes on from the device again
        p3 = p2 + second.tokens + [7]
        assert node.run(p3, session_key="t/s").finished.cached == {"resident_frontier": len(p2) + 2}
    finally:
        node.close()


def test_pressure_spills_before_it_evicts(daemon: Daemon) -> None:
    """A pool too small for two conversations: the first one's entries go to the daemon when
    the second needs the pages, and come back from there."""
    node = Node(daemon, pages=12)  # 48 tokens
    try:
        a = _prompt(2, 30)
        ga = node.run(a, max_tokens=2).tokens
        node.run(_prompt(3, 40), max_tokens=2)  # needs a's pages: spill, then evict
        assert node.core.cache.counters.evictions["pressure"] >= 1 and node.host.counters.spills["ok"] >= 1
        again = node.run(a + ga + [9], max_tokens=2)
        assert again.finished.cached == {"host_entry": 31}
        assert again.tokens == greedy_reference(node.runner, a + ga + [9], 2)
    finally:
        node.close()


def test_a_restarted_engine_resumes_from_the_host(daemon: Daemon) -> None:
    """SIGTERM-like shutdown spills what the device held; a new engine process (here: a new
    core and client with the same fingerprint) restores the session's next turn."""
    from deepwell.engine_service.engine import Engine

    old = Node(daemon)
    p1 = _prompt(4, 26)
    first = old.run(p1, max_tokens=3, session_key="t/r")
    Engine(old.core).stop(spill_s=5.0)
    old.close()
    new = Node(daemon)
    try:
        p2 = p1 + first.tokens + [4, 4]
        col = new.run(p2, session_key="t/r")
        assert col.finished.cached == {"host_entry": 28}
        assert col.tokens == greedy_reference(new.runner, p2, 3)
        other = Node(daemon, fp=b"another-model")  # another fingerprint never matches
        try:
            assert other.run(p2).finished.cached == {}
        finally:
            other.close()
    finally:
        new.close()


def test_session_lookup_when_digests_find_nothing(daemon: Daemon) -> None:
    """Attention-only: an entry the prompt leaves inside its first digest page is found by the
    session key alone (level 4), and only for that session."""
    node = Node(daemon, hybrid=False, pages=40)
    try:
        p1 = _prompt(5, 100)  # 100 tokens: its first digest page (64 tokens) is full
        node.run(p1, max_tokens=1, session_key="t/k")
        node.evict_all()
        p2 = p1[:40] + [1, 2, 3]
        assert node.run(p2, session_key="t/other").finished.cached == {}
        with node.core.lock:
            node.core.cache.clear()  # (forget that run without spilling it)
        col = node.run(p2, session_key="t/k")
        assert col.finished.cached == {"session_lookup": 40}
        assert col.tokens == greedy_reference(node.runner, p2, 3)
    finally:
        node.close()


@pytest.mark.parametrize("when", ["spill", "restore"])
def test_daemon_killed_mid_copy_is_a_miss(daemon: Daemon, when: str) -> None:
    node = Node(daemon)
    try:
        p1 = _prompt(6, 30)
        first = node.run(p1, max_tokens=3)
        if when == "restore":
            node.evict_all()
            assert node.host.counters.spills["ok"] >= 1
        node.host.after_copy = lambda kind: daemon.kill() if kind == when else None
        if when == "spill":
            node.evict_all()
            assert node.host.counters.spills["ok"] == 0  # the commit never happened
        p2 = p1 + first.tokens + [3]
        col = node.run(p2)
        assert col.finished.reason is Finish.LENGTH and col.finished.cached == {}  # computed from scratch
        assert col.tokens == greedy_reference(node.runner, p2, 3)
        node.host.after_copy = None
        daemon.start()  # restarted: nothing of the torn copy matches, reuse resumes
        assert wait_until(lambda: node.client.available, 20)
        node.evict_all()
        again = node.run(p2 + col.tokens + [8])
        assert again.finished.cached == {"host_entry": len(p2) + 2}
        assert again.tokens == greedy_reference(node.runner, p2 + col.tokens + [8], 3)
    finally:
        node.close()


def test_daemon_down_means_misses_and_the_engine_serves_on(daemon: Daemon) -> None:
    node = Node(daemon)
    try:
        daemon.kill()
        assert wait_until(lambda: not node.client.available, 10)
        p = _prompt(7, 20)
        for _ in range(2):
            col = node.run(p)
            assert col.finished.reason is Finish.LENGTH and col.tokens == greedy_reference(node.runner, p, 3)
        node.evict_all()  # spills are skipped, entries dropped
        assert node.run(p + [1]).finished.cached == {}
    finally:
        node.close()


def test_fingerprint_names_everything_the_bytes_depend_on(tmp_path) -> None:
    from deepwell.engine_service.cache.identity import EntryShape, model_fingerprint, revision

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    base = dict(model_id="m", revision=revision(tmp_path), config={"hidden_size": 64}, dtype="torch.bfloat16",
                kv_format="nvfp4", calibration_digest="abc", page_size=64, page_nbytes=100, slot_nbytes=10)
    fp = model_fingerprint(**base)
    for key, value in [("kv_format", "fp8"), ("calibration_digest", "abd"), ("dtype", "torch.float32"),
                       ("page_size", 32), ("config", {"hidden_size": 65}), ("model_id", "n")]:
        assert model_fingerprint(**{**base, key: value}) != fp, key
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)  # weights rewritten
    assert model_fingerprint(**{**base, "revision": revision(tmp_path)}) != fp
    shape = EntryShape(3, 100, 10)
    assert EntryShape.parse(shape.layout(), 100, 10) == shape
    assert EntryShape.parse(shape.layout(), 100, 0) is None  # another engine's state layout
    assert EntryShape.parse(EntryShape(3, 99, 10).layout(), 100, 10) is None


def test_engine_process_restart_resumes_from_the_daemon(daemon: Daemon, tmp_path) -> None:
    """Two real engine processes in turn on one daemon: the first spills its entries when it
    gets SIGTERM; the second (same model, same fingerprint) serves the session's next turn from
    the host (level 3), and its tokens equal a cold run's."""
    import asyncio

    from deepwell import grpcx
    from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
    from tests.engine.helpers_models import save_tiny
    from tests.engine.helpers_process import engine_process

    model = tmp_path / "model"
    save_tiny("qwen3_5", model)
    args = ["--model", str(model), "--num-pages", "16", "--page-size", "16", "--max-concurrency", "2",
            "--cpu-threads", "1", "--log-level", "warning"]

    def generate(address: str, ids: list[int]) -> tuple[list[int], engine_pb2.CacheHits]:
        async def go() -> list:
            async with grpcx.aio_channel(address) as ch:
                stub = engine_pb2_grpc.EngineStub(ch)
                return [m async for m in stub.Generate(engine_pb2.GenerateRequest(
                    prompt_token_ids=ids, session_key="t/p", turn_boundary=len(ids) - 1,
                    sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))]
        msgs = asyncio.run(go())
        return [t for m in msgs if m.HasField("tokens") for t in m.tokens.token_ids], msgs[-1].finished.usage.cached

    p1 = _prompt(8, 40)
    (tmp_path / "a").mkdir()
    with engine_process(tmp_path / "a", [*args, "--kv-daemon", daemon.address]) as (address, _):
        first, _ = generate(address, p1)
    p2 = p1 + first + [5, 6]
    (tmp_path / "b").mkdir()
    with engine_process(tmp_path / "b", [*args, "--kv-daemon", daemon.address]) as (address, _):
        tokens, cached = generate(address, p2)
    assert cached.host_entry == len(p1) + 2, cached
    (tmp_path / "c").mkdir()
    with engine_process(tmp_path / "c", [*args, "--prefix-cache", "off"]) as (address, _):
        cold, cold_cached = generate(address, p2)
    assert tokens == cold and cold_cached.host_entry == 0


def test_close_cuts_the_wait_for_a_daemon_that_never_attached() -> None:
    """The background page-locking (CUDA) waits for the daemon; an engine stopped meanwhile
    must not wait out ``LOCK_WAIT_S`` at shutdown."""
    client = KVClient("unix:///nonexistent/kvcache.sock", "test-engine", rpc_timeout_s=0.5, reconnect_max_s=0.2)
    client.start(0.0)
    tier = HostTier(client, FakeRunner(page_size=4, hybrid=True), fingerprint=FP, page_size=4, hybrid=True)
    try:
        tier._worker.submit(tier._lock_arena)  # what the constructor submits on CUDA
        time.sleep(0.3)
        t0 = time.monotonic()
        tier.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        client.close()
