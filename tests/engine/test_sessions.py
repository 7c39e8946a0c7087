"""The live sessions view (``engine_service.sessions``): the bounded ledger, the view it joins with
the prefix cache (resident entries and the host tier's shadow index), and the ``Sessions`` RPC of
a real engine process whose prefix cache spills to a real KV-cache daemon."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from deepwell.engine_service.cache.index import Ledger, Owner
from deepwell.engine_service.cache.types import Entry, Kind
from deepwell.engine_service.engine import EngineCore, EngineLimits
from deepwell.engine_service.sampling import SamplingParams
from deepwell.engine_service.sessions import SessionLedger, Turn, collect, live_host_entries
from tests.engine.test_batching import Collector
from tests.engine.test_scheduler_fakerunner import FakeRunner
from tests.kvcache.kvtest_helpers import Daemon


# -- the ledger ------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ledger_records_turns_running_requests_and_times() -> None:
    clock = Clock()
    ledger = SessionLedger(capacity=10, clock=clock)
    ledger.started("t", "t/a")
    clock.now = 101.0
    ledger.started("t", "t/a")
    assert [(r.session_key, r.running, r.requests, r.last_turn) for r in ledger.records()] == [("t/a", 2, 2, None)]
    clock.now = 103.0
    turn = Turn(prompt_tokens=40, cached={"resident_frontier": 30}, ttft_ms=12.5, completion_tokens=3, reason="stop")
    ledger.finished("t", "t/a", turn)
    (rec,) = ledger.records()
    assert (rec.first_seen, rec.last_seen, rec.running, rec.last_turn) == (100.0, 103.0, 1, turn)
    assert (turn.cached_tokens, turn.cached_fraction) == (30, 0.75)
    ledger.started("", "")  # requests without a session key are not listed
    ledger.finished("t", "", turn)
    assert len(ledger) == 1
    ledger.started("u", "t/a")  # the tenant is part of the key
    assert [(r.tenant, r.session_key) for r in ledger.records()] == [("u", "t/a"), ("t", "t/a")]


def test_ledger_is_bounded_and_forgets_the_least_recently_seen() -> None:
    ledger = SessionLedger(capacity=3)
    for name in "abcd":
        ledger.started("t", f"t/{name}")
    assert [r.session_key for r in ledger.records()] == ["t/d", "t/c", "t/b"]  # a forgotten
    ledger.finished("t", "t/b", Turn(5, {}, 1.0))  # touched: now the most recent
    ledger.started("t", "t/e")
    assert [r.session_key for r in ledger.records()] == ["t/e", "t/b", "t/d"]
    ledger.finished("t", "t/a", Turn(5, {}, 1.0))  # finishing a forgotten session: back, nothing running
    assert [(r.session_key, r.running) for r in ledger.records()][0] == ("t/a", 0)
    assert len(ledger) == 3
    with pytest.raises(ValueError):
        SessionLedger(capacity=0)
    big = SessionLedger()  # the default bound: the 1000 most recently seen sessions
    for i in range(5000):
        big.started("t", f"t/{i}")
    assert len(big) == 1000 and big.records()[0].session_key == "t/4999" and big.records()[-1].session_key == "t/4000"


def test_ledger_is_thread_safe() -> None:
    ledger = SessionLedger(capacity=50)

    def work(k: int) -> None:
        for i in range(300):
            key = f"t/{(k + i) % 20}"
            ledger.started("t", key)
            ledger.records()
            ledger.finished("t", key, Turn(10, {}, 1.0))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = ledger.records()
    assert len(recs) == 20 and all(r.running == 0 for r in recs)
    assert sum(r.requests for r in recs) == 6 * 300


# -- the view over an in-process engine --------------------------------------------------------
def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 13 + i * 7) % 80 + 3 for i in range(n)]


def _run(core: EngineCore, prompt: list[int], max_tokens: int = 3, **kw) -> Collector:
    col = Collector()
    core.submit(core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), sink=col, **kw))
    deadline = time.monotonic() + 60
    while core.has_work() and time.monotonic() < deadline:
        if core.step() == 0:
            time.sleep(0.001)
    return col


def test_view_of_resident_sessions_with_their_last_turn() -> None:
    runner = FakeRunner(page_size=4, hybrid=True)
    core = EngineCore(runner, EngineLimits(64, 12, 4, 32, 16, 1024), eos_ids=())
    p1 = _prompt(1, 30)
    first = _run(core, p1, tenant="t", session_key="t/a")
    _run(core, _prompt(2, 10), tenant="u", session_key="u/b")
    _run(core, _prompt(3, 9))  # no session key: not listed
    second = _run(core, p1 + first.tokens + [5], tenant="t", session_key="t/a")
    rows = collect(core)
    assert [(r.tenant, r.session_key) for r in rows] == [("t", "t/a"), ("u", "u/b")]  # most recent first
    a = rows[0]
    assert a.placement == "resident" and a.host_entries == 0
    assert a.cached_tokens == a.resident_tokens == len(p1) + 3 + 1 + 2  # its EXEC entry: prompt + generated - 1
    spec = runner.memory_spec()
    pages = -(-a.resident_tokens // 4)
    assert a.resident_bytes == pages * spec.bytes_per_page + spec.bytes_per_state_slot  # one image
    t = a.last_turn
    assert t is not None and t.prompt_tokens == len(p1) + 4 and t.cached == second.finished.cached
    assert t.cached_tokens == len(p1) + 2 and t.cached_fraction == pytest.approx((len(p1) + 2) / (len(p1) + 4))
    assert t.ttft_ms == pytest.approx(second.finished.ttft_ms) and t.reason == "length"
    assert (a.requests, a.running) == (2, 0)
    assert a.age_s is not None and a.idle_s is not None and a.age_s >= a.idle_s >= 0
    assert [r.session_key for r in collect(core, tenant="u")] == ["u/b"]
    assert len(collect(core, limit=1)) == 1
    # a session the ledger forgot is still listed while entries name it (no times then)
    core.sessions = SessionLedger(capacity=1)
    core.sessions.started("x", "x/y")
    rows = collect(core)
    assert [r.session_key for r in rows][0] == "x/y" and rows[0].placement == "none"
    forgotten = {r.session_key: r for r in rows[1:]}
    assert set(forgotten) == {"t/a", "u/b"} and forgotten["t/a"].age_s is None and forgotten["t/a"].last_turn is None


def _entry(eid: int, tokens: list[int], kind: Kind = Kind.EXEC) -> Entry:
    owner = Owner("t", b"", "t/s")
    return Entry(eid, owner, Ledger.of(owner.scope, tokens, 4), kind)


def test_host_entries_follow_the_daemons_supersede_rule() -> None:
    base = _prompt(4, 20)
    short, longer = _entry(1, base[:12]), _entry(2, base)
    checkpoint = _entry(3, base[:8], Kind.TURN)
    other = _entry(4, _prompt(5, 10))
    assert live_host_entries([short, longer], hybrid=True) == [longer]
    assert live_host_entries([longer, short], hybrid=True) == [longer, short]  # a shorter one later stays
    assert live_host_entries([checkpoint, longer], hybrid=True) == [checkpoint, longer]  # its image is only there
    assert live_host_entries([checkpoint, longer], hybrid=False) == [longer]
    assert live_host_entries([other, longer], hybrid=True) == [other, longer]
    assert live_host_entries([short, _entry(5, base[:12])], hybrid=True)[0].id == 5  # the same tokens again


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(arena_bytes=16 << 20, granule_bytes=1 << 20).start()
    yield d
    d.cleanup()


def test_view_of_spilled_sessions(daemon: Daemon) -> None:
    from tests.engine.test_host_cache import Node

    node = Node(daemon, pages=40)
    try:
        p1 = _prompt(6, 30)
        node.run(p1, max_tokens=4, turn_boundary=22, tenant="t", session_key="t/h")
        node.evict_all()  # every entry spilled, then dropped from the device
        node.run(_prompt(7, 12), tenant="t", session_key="t/r")
        rows = {r.session_key: r for r in collect(node.core)}
        h, r = rows["t/h"], rows["t/r"]
        assert (h.placement, h.resident_entries, h.resident_bytes) == ("host", 0, 0)
        assert h.host_tokens == h.cached_tokens == len(p1) + 3
        # the EXEC entry and the turn checkpoint (a hybrid image the daemon keeps)
        assert h.host_entries == 2
        host = node.host
        assert h.host_bytes == sum(-(-n // 4) * host.page_nbytes + host.state_nbytes for n in (22, len(p1) + 3))
        assert (r.placement, r.host_entries) == ("resident", 0) and r.resident_bytes > 0
        # the same prompt again resumes from the spilled turn checkpoint: the session is on both tiers
        # now, and its last turn says where its cached tokens came from
        again = node.run(p1, max_tokens=4, tenant="t", session_key="t/h")
        assert again.finished.cached == {"host_entry": 22}
        rows = {x.session_key: x for x in collect(node.core)}
        assert rows["t/h"].placement == "both" and rows["t/h"].requests == 2
        turn = rows["t/h"].last_turn
        assert turn is not None and turn.cached == {"host_entry": 22} and turn.cached_fraction == 22 / 30
    finally:
        node.close()


# -- the Sessions RPC of a real engine process ---------------------------------------------------
def test_sessions_rpc_one_resident_one_spilled(daemon: Daemon, tmp_path) -> None:
    """A real engine with a host tier and a resident budget of one session: session a's entry is
    spilled to the daemon when b's would go over the budget; Sessions reports a on the host and b
    on the GPU, each with its last turn; a tenant filter and the internal token apply."""
    from deepwell import grpcx
    from deepwell.auth import generate_token_file
    from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
    from tests.engine.helpers_models import save_tiny
    from tests.engine.helpers_process import engine_process

    model = tmp_path / "model"
    save_tiny("qwen3_5", model)
    token_file = tmp_path / "token"
    token = generate_token_file(token_file)
    # 40 pages of 16 tokens, entries alone may hold 6: one session's 63-token entry (4 pages) fits,
    # two do not
    args = ["--model", str(model), "--num-pages", "40", "--page-size", "16", "--max-concurrency", "2",
            "--cache-fraction", "0.15", "--cpu-threads", "1", "--log-level", "warning",
            "--internal-token-file", str(token_file), "--kv-daemon", daemon.address]
    a, b = _prompt(8, 60), _prompt(9, 60)

    async def go(address: str) -> tuple[engine_pb2.SessionsReply, engine_pb2.SessionsReply]:
        async with grpcx.aio_channel(address, token=token) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)

            async def generate(ids: list[int], session: str = "", tenant: str = "t") -> engine_pb2.Finished:
                msgs = [m async for m in stub.Generate(engine_pb2.GenerateRequest(
                    prompt_token_ids=ids, session_key=session, tenant=tenant,
                    sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))]
                return msgs[-1].finished

            await generate(a, "t/a")
            await generate(b, "t/b")
            reply = None
            for _ in range(50):  # a sessionless request steps the engine: the budget spills a; done spills land
                await generate([7, 8, 9])
                reply = await stub.Sessions(engine_pb2.SessionsRequest())
                if {s.session_key: s.placement for s in reply.sessions}.get("t/a") == engine_pb2.CACHE_PLACEMENT_HOST:
                    break
                await asyncio.sleep(0.05)
            assert reply is not None
            only_u = await stub.Sessions(engine_pb2.SessionsRequest(tenant="u"))
            return reply, only_u

    async def unauthenticated(address: str) -> None:
        async with grpcx.aio_channel(address) as ch:
            await engine_pb2_grpc.EngineStub(ch).Sessions(engine_pb2.SessionsRequest())

    with engine_process(tmp_path, args) as (address, _):
        reply, only_u = asyncio.run(go(address))
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the internal token covers it like every RPC
            asyncio.run(unauthenticated(address))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    rows = {s.session_key: s for s in reply.sessions}
    assert set(rows) == {"t/a", "t/b"} and reply.total == 2 and reply.ledger_capacity == 1000 and reply.engine_id
    sa, sb = rows["t/a"], rows["t/b"]
    assert sa.placement == engine_pb2.CACHE_PLACEMENT_HOST, reply
    assert (sa.host_tokens, sa.cached_tokens, sa.resident_tokens, sa.resident_bytes) == (63, 63, 0, 0)
    assert sa.host_entries == 1 and sa.host_bytes > 0
    assert sb.placement == engine_pb2.CACHE_PLACEMENT_RESIDENT, reply
    assert (sb.resident_tokens, sb.cached_tokens, sb.host_entries, sb.host_bytes) == (63, 63, 0, 0)
    assert sb.resident_bytes > 0
    for s in (sa, sb):
        assert s.tenant == "t" and s.requests == 1 and s.requests_running == 0
        t = s.last_turn
        assert (t.prompt_tokens, t.cached_tokens, t.completion_tokens) == (60, 0, 4)
        assert t.cached_fraction == 0.0 and t.ttft_ms > 0 and t.reason == engine_pb2.FINISH_REASON_LENGTH
        assert s.HasField("age_s") and s.age_s >= s.idle_s > 0
    assert sa.age_s > sb.age_s
    assert [s.session_key for s in reply.sessions] == ["t/b", "t/a"]  # most recently active first
    assert list(only_u.sessions) == [] and only_u.total == 0
