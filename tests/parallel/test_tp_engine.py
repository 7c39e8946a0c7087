"""``EngineCore`` over the 2-rank tensor-parallel runner (gloo, CPU, fp32) generates exactly the
single-process engine's greedy tokens: several requests batched with chunked prefill and a turn
that reuses the resident checkpoint (tiny ``qwen3_5`` and ``llama``); a conversation spilled to a
real KV-cache daemon and restored from it (the host tier: every rank's share in one entry); and
MTP speculative decoding, whose accept / propose run on every rank.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deepwell.engine_service.cache.host import HostTier
from deepwell.engine_service.engine import EngineCore, EngineLimits, TokensEvent
from deepwell.engine_service.runner_api import ModelRunner
from deepwell.engine_service.sampling import SamplingParams
from deepwell.kvclient.client import KVClient
from tests.engine.test_batching import Collector
from tests.engine.test_spec_decode import _add_mtp
from tests.kvcache.kvtest_helpers import Daemon
from tests.parallel.helpers_tp import single_runner, tp_runner

PAGE = 8


def _core(runner: ModelRunner, *, spec: int = 0, pages: int = 64) -> EngineCore:
    return EngineCore(runner, EngineLimits(num_pages=pages, num_state_slots=12, max_concurrency=4, token_budget=24,
                                           queue_size=16, max_context=512, chunk_tokens=10, prefix_cache=True,
                                           speculative_tokens=spec))


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 3 for i in range(n)]


# (request id, prompt, max tokens, step it arrives at, turn boundary)
TURN1 = _prompt(1, 33)
REQUESTS = [("a", TURN1, 6, 0, 33), ("b", _prompt(2, 9), 9, 0, None), ("c", _prompt(3, 41), 5, 1, None),
            ("d", _prompt(4, 17), 7, 3, None), ("e", TURN1 + _prompt(5, 12), 6, 12, None)]


def _generate(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {rid: [] for rid, *_ in REQUESTS}
    arrivals: dict[int, list] = {}
    for rid, ids, max_tokens, at, boundary in REQUESTS:
        def sink(ev: object, rid: str = rid) -> None:
            if isinstance(ev, TokensEvent):
                out[rid].extend(ev.token_ids)

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        arrivals.setdefault(at, []).append(core.make_request(ids, params, request_id=rid, sink=sink,
                                                             turn_boundary=boundary))
    step = 0
    while step <= max(arrivals) or core.has_work():
        for req in arrivals.get(step, []):
            core.submit(req)
        core.step()
        step += 1
        assert step < 500
    return out


@pytest.mark.parametrize("name", ["qwen3_5", "llama"])
def test_greedy_tokens_equal_the_single_process_engine(name: str, tiny_dir: Callable[[str], Path]) -> None:
    path = tiny_dir(name)
    single = _core(single_runner(path, page_size=PAGE))
    want = _generate(single)
    with tp_runner(path, page_size=PAGE) as tp:
        core = _core(tp)
        assert _generate(core) == want
        assert core.cache is not None and single.cache is not None
        assert core.cache.counters.hit_tokens == single.cache.counters.hit_tokens
        assert sum(core.cache.counters.hit_tokens.values()) >= 33  # turn 2 ("e") reused turn 1
        assert core.counters.steps == single.counters.steps
    assert all(len(t) == mt for (_, _, mt, _, _), t in zip(REQUESTS, want.values()))


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(arena_bytes=16 << 20, granule_bytes=1 << 20).start()
    yield d
    d.cleanup()


def _run(core: EngineCore, ids: list[int], max_tokens: int, **kw: object) -> Collector:
    col = Collector()
    core.submit(core.make_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                  sink=col, **kw))  # type: ignore[arg-type]
    deadline = time.monotonic() + 60
    while core.has_work() and time.monotonic() < deadline:
        if core.step() == 0:
            time.sleep(0.001)  # a restore on the host tier's thread
    return col


def test_spilled_conversation_restores_from_the_daemon(daemon: Daemon, tiny_dir: Callable[[str], Path]) -> None:
    """Turn 1 on the TP engine, every cache entry spilled to the daemon and dropped from the
    device; turn 2 restores turn 1 from the host and decodes what a cold single-process run does."""
    path = tiny_dir("qwen3_5")
    p1 = _prompt(6, 30)
    with tp_runner(path, page_size=PAGE) as tp:
        core = _core(tp)
        client = KVClient(daemon.address, "tp-engine", rpc_timeout_s=5.0, retries=1, reconnect_max_s=0.2)
        assert client.start(5.0)
        host = HostTier(client, tp, fingerprint=b"tiny-qwen3_5-tp2", page_size=PAGE, hybrid=True)
        try:
            core.attach_host(host)
            first = _run(core, p1, 4, turn_boundary=22, session_key="t/s")
            with core.lock:
                cache = core.cache
                assert cache is not None
                for e in list(cache.entries.values()):
                    assert cache.spill(e)
                    cache.drop(e, "pressure")
            assert host.counters.spills["ok"] >= 2
            p2 = p1 + first.tokens + [5, 6]
            second = _run(core, p2, 5, session_key="t/s")
            assert second.finished.cached == {"host_entry": 33}  # 30 prompt + 3 computed generated tokens
            assert host.counters.restores == {"ok": 1, "failed": 0}
        finally:
            host.close()
            client.close()
    cold = _core(single_runner(path, page_size=PAGE))
    assert first.tokens == _run(cold, p1, 4).tokens
    assert second.tokens == _run(cold, p2, 5).tokens


def test_mtp_speculation_tokens_equal_plain(tiny_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """With drafts from a random MTP layer (almost all rejected: the recurrent state is rolled back
    on every rank at every step) the TP engine decodes the single-process plain tokens."""
    path = tmp_path / "qwen3_5_mtp"
    shutil.copytree(tiny_dir("qwen3_5"), path)
    _add_mtp(path)
    want = _generate(_core(single_runner(path, page_size=PAGE)))
    with tp_runner(path, page_size=PAGE, mtp=True) as tp:
        assert tp.mtp_layers == 1
        core = _core(tp, spec=3)
        assert _generate(core) == want
        assert core.counters.spec_rounds > 0
