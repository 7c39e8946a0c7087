"""The daemon and its client library as real processes (unix sockets, /dev/shm arenas)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import grpc
import httpx
import numpy as np
import pytest
from kvtest_helpers import REPO, MiB, identity, layout, pattern, toks, wait_until

from deepwell import grpcx
from deepwell.kvcache.v1 import kvcache_pb2 as pb
from deepwell.kvcache.v1 import kvcache_pb2_grpc as pbg
from deepwell.kvclient import Code, KVClient

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_worker.py")
FP = b"model-a"


@pytest.fixture
def client_factory():
    made: list[KVClient] = []

    def make(address: str, name: str = "test", **kw) -> KVClient:
        c = KVClient(address, name, **kw)
        made.append(c)
        assert c.start(20), "client did not attach"
        return c

    yield make
    for c in made:
        c.close()


def put(client: KVClient, tokens, size: int, seed: int, **kw):
    r = client.reserve(identity(tokens, fp=FP, **kw), layout(size), tokens)
    assert r.ok, r
    client.arena.copy_in(r.reply.extents, pattern(seed, size))
    c = client.commit(r.reply.reservation, ["kv", "state"])
    assert c.ok, c
    return c.reply.entry


def stats(client: KVClient) -> pb.StatsReply:
    r = client.stats()
    assert r.ok, r
    return r.reply


def test_daemon_never_imports_torch():
    code = ("import sys, kvcache_daemon.server, kvcache_daemon.cli, kvcache_daemon.__main__, deepwell.kvclient;"
            "bad = [m for m in ('torch', 'triton', 'deepwell.engine_service', 'deepwell.gateway') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_roundtrip_stats_cli_metrics_and_bad_input(daemon_factory, client_factory):
    port = free_port()
    d = daemon_factory(extra=["--metrics-address", f"127.0.0.1:{port}"]).start()
    c = client_factory(d.address)
    assert stat_mode(d.arena_path) == 0o600
    t = toks(1, 500)
    entry = put(c, t, 3 * MiB, seed=4)
    r = c.lookup("t", FP, np.concatenate([t, [9]]))
    assert r.ok and r.reply.hit and r.reply.matched_tokens == 500 and r.reply.entry == entry
    assert c.arena.read(r.reply.extents, 3 * MiB) == pattern(4, 3 * MiB)
    assert c.release(r.reply.lease).ok
    assert c.release(r.reply.lease).ok  # double release: no-op
    out = subprocess.run([sys.executable, "-m", "deepwell.cli", "kvcache", "stats", "--address", d.address, "--json"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert (got["entries"], int(got["committed_bytes"]), int(got["hits"])) == (1, 3 * MiB, 1)
    text = subprocess.run([sys.executable, "-m", "deepwell.kvcache_daemon", "stats", "--address", d.address],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "committed_bytes: 3145728" in text and "client client_id=" in text
    # malformed requests: INVALID_ARGUMENT with a reason; the daemon keeps serving
    with grpc.insecure_channel(d.address, options=grpcx.channel_options()) as ch:
        stub = pbg.KVCacheStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(iter([pb.ReserveChunk(tokens=pb.TokenBlock(tokens_le32=b"\0" * 4))]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in err.value.details()
        hdr = pb.ReserveHeader(client_id=c.client_id, identity=identity(t, fp=FP), layout=layout(MiB))
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(iter([pb.ReserveChunk(header=hdr), pb.ReserveChunk(tokens=pb.TokenBlock(tokens_le32=b"\0" * 8))]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_tokens" in err.value.details()
    bad = layout(MiB)
    bad.parts[0].offset = 5 * MiB
    rejected = c.reserve(identity(t, fp=FP), bad, t)
    assert rejected.code == Code.REJECTED and "outside" in rejected.message
    assert c.release(pb.Handle(epoch=1, id=1, generation=1)).code == Code.STALE
    assert c.compact(10).ok and c.set_budget(32 * MiB).ok and stats(c).budget_bytes == 32 * MiB
    assert c.set_budget(0).code == Code.REJECTED
    assert stats(c).entries == 1

    def metric_seen() -> bool:
        body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        return "deepwell_kvcache_committed_bytes 3.145728e+06" in body and "deepwell_kvcache_hits_total 1.0" in body

    assert wait_until(metric_seen)
    assert 'deepwell_kvcache_rpcs_total{code="ERROR_CODE_STALE",method="Release"} 1.0' in httpx.get(
        f"http://127.0.0.1:{port}/metrics").text


def stat_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o777


def test_million_token_ledger_through_chunked_streams(daemon_factory, client_factory):
    d = daemon_factory().start()
    c = client_factory(d.address)
    t = toks(5, 1_200_000)
    entry = put(c, t, MiB, seed=1, session="long")
    prompt = np.concatenate([t, toks(6, 10)])
    r = c.lookup("t", FP, prompt, session_key="long")
    assert r.ok and r.reply.hit and r.reply.matched_tokens == 1_200_000 and r.reply.entry == entry
    assert r.reply.identity.num_tokens == 1_200_000
    c.release(r.reply.lease)
    prompt[1_000_000] += 1  # a late divergence: the checkpoint at 1.2M is unusable
    assert c.lookup("t", FP, prompt, pin=False).reply.hit is False


def test_sigkilled_client_is_reclaimed_after_grace(daemon_factory, client_factory):
    d = daemon_factory(grace_s=0.5).start()
    c = client_factory(d.address)
    base_entry = put(c, toks(1, 200), MiB, seed=1)
    baseline = stats(c)
    worker = subprocess.Popen([sys.executable, WORKER, "hold", d.address], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        line = worker.stdout.readline()
        while line and not line.startswith("READY "):  # skip log lines
            line = worker.stdout.readline()
        assert line.startswith("READY "), line
        info = json.loads(line[6:])
        assert info == {**info, "lease": True, "take": True, "reserve": True}
        s = stats(c)
        held = {h.client_id: h for h in s.clients}[info["client_id"]]
        assert (held.leases, held.takes, held.reservations, held.attached) == (1, 1, 1, True)
        assert s.reserved_bytes == 2 * MiB and s.taken_bytes == MiB
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        assert wait_until(lambda: all(h.client_id != info["client_id"] for h in stats(c).clients))
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
        worker.stdout.close()
    s = stats(c)
    assert (s.reserved_bytes, s.taken_bytes, s.leases) == (0, 0, 0)
    assert s.committed_bytes == baseline.committed_bytes + 2 * MiB  # its two commits stay (take re-added)
    assert s.entries == baseline.entries + 2
    r = c.lookup("t", b"soak-model", np.concatenate([toks(12, 300), [1]]))  # the taken entry matches again
    assert r.ok and r.reply.hit and c.arena.read(r.reply.extents, MiB) == pattern(2, MiB)
    assert c.lookup("t", FP, np.concatenate([toks(1, 200), [1]]), pin=False).reply.entry == base_entry


def test_abandoned_leases_show_per_client_until_session_closes(daemon_factory, client_factory):
    d = daemon_factory(grace_s=0.3).start()
    owner = client_factory(d.address, "owner")
    sloppy = client_factory(d.address, "sloppy")
    t = toks(1, 100)
    put(owner, t, MiB, seed=1)
    for _ in range(2):
        assert sloppy.lookup("t", FP, np.concatenate([t, [2]])).reply.lease.id
    h = {x.client_name: x for x in stats(owner).clients}["sloppy"]
    assert (h.leases, h.pinned_bytes, h.attached) == (2, 2 * MiB, True) and h.oldest_lease_age_s > 0
    sloppy.close()
    assert wait_until(lambda: "sloppy" not in {x.client_name for x in stats(owner).clients})
    assert stats(owner).leases == 0


def test_daemon_sigkill_mid_copy_then_restart(daemon_factory, client_factory):
    d = daemon_factory(grace_s=0.5).start()
    c = client_factory(d.address, reconnect_min_s=0.05, reconnect_max_s=0.2)
    t = toks(1, 300)
    put(c, t, 8 * MiB, seed=3)
    r = c.lookup("t", FP, np.concatenate([t, [1]]))
    assert r.ok and r.reply.lease.id
    epoch = c.epoch
    buf = bytearray(8 * MiB)
    c.arena.copy_out(r.reply.extents, memoryview(buf)[: 4 * MiB])
    d.kill()  # mid-copy
    c.arena.copy_out(r.reply.extents, memoryview(buf)[4 * MiB:], start=4 * MiB)
    assert bytes(buf) == pattern(3, 8 * MiB)
    assert wait_until(lambda: not c.available)
    miss = c.lookup("t", FP, np.concatenate([t, [1]]))
    assert miss.code == Code.UNAVAILABLE and not miss.ok
    assert c.release(r.reply.lease).code == Code.UNAVAILABLE
    d.start()
    assert c.wait_attached(30) and c.epoch != epoch
    assert c.release(r.reply.lease).code == Code.STALE
    assert c.lookup("t", FP, np.concatenate([t, [1]]), pin=False).reply.hit is False  # not persisted
    assert sorted(os.listdir(d.shm_dir)) == ["arena"]  # reused, not leaked
    assert stats(c).free_bytes == d.arena_bytes


def test_persistence_keeps_committed_and_drops_torn(daemon_factory, client_factory):
    d = daemon_factory(persist=True).start()
    c = client_factory(d.address, reconnect_min_s=0.05, reconnect_max_s=0.2)
    ledgers = [toks(10 + i, 150 + i) for i in range(3)]
    for i, t in enumerate(ledgers):
        put(c, t, (i + 1) * MiB, seed=20 + i)
    torn_t = toks(99, 150)
    r = c.reserve(identity(torn_t, fp=FP), layout(MiB), torn_t)
    c.arena.copy_in(r.reply.extents, pattern(5, MiB))  # copied, never committed
    epoch = c.epoch
    d.kill()
    with open(d.arena_path + ".journal", "ab") as f:  # a torn record at the journal's tail
        f.write(b"DWJ1\x02" + (10_000).to_bytes(8, "little") + b"partial")
    d.start()
    assert c.wait_attached(30) and c.epoch != epoch
    for i, t in enumerate(ledgers):
        m = c.lookup("t", FP, np.concatenate([t, [1]]))
        assert m.ok and m.reply.hit and m.reply.matched_tokens == len(t)
        assert c.arena.read(m.reply.extents, (i + 1) * MiB) == pattern(20 + i, (i + 1) * MiB)
        assert c.release(m.reply.lease).ok
    assert c.lookup("t", FP, np.concatenate([torn_t, [1]]), pin=False).reply.hit is False
    s = stats(c)
    assert (s.entries, s.committed_bytes, s.reserved_bytes) == (3, 6 * MiB, 0)
    assert sorted(os.listdir(d.shm_dir)) == ["arena", "arena.journal"]


def test_garbage_requests_never_crash_the_daemon(daemon_factory):
    d = daemon_factory().start()
    with grpc.insecure_channel(d.address, options=grpcx.channel_options()) as ch:
        stub = pbg.KVCacheStub(ch)
        calls = [
            (stub.Commit, pb.CommitRequest()), (stub.Abort, pb.AbortRequest(client_id="x")),
            (stub.Release, pb.ReleaseRequest()), (stub.Release, pb.ReleaseRequest(outcome=pb.RELEASE_OUTCOME_OK)),
            (stub.Take, pb.TakeRequest()), (stub.ReAdd, pb.ReAddRequest()), (stub.Drop, pb.DropRequest()),
            (stub.Delete, pb.DeleteRequest()), (stub.SetBudget, pb.SetBudgetRequest()),
            (stub.Compact, pb.CompactRequest()), (stub.Stats, pb.StatsRequest()),
            (stub.Lookup, iter([pb.LookupChunk(header=pb.LookupHeader(client_id="x"))])),
            (stub.Lookup, iter([pb.LookupChunk()])), (stub.Reserve, iter([])),
            (stub.Reserve, iter([pb.ReserveChunk(header=pb.ReserveHeader(client_id="x", identity=pb.Identity(
                model_fingerprint=b"f", num_tokens=1, frontier_position=1, frontier_kind=1),
                layout=layout(MiB))), pb.ReserveChunk(tokens=pb.TokenBlock(tokens_le32=b"\1\0\0\0"))])),
        ]
        outcomes = []
        for fn, req in calls:
            try:
                reply = fn(req, timeout=10)
                outcomes.append(reply.error.code if "error" in reply.DESCRIPTOR.fields_by_name else 0)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (fn, exc)
                outcomes.append("INVALID_ARGUMENT")
        assert outcomes == [pb.ERROR_CODE_UNKNOWN_CLIENT, pb.ERROR_CODE_UNKNOWN_CLIENT, "INVALID_ARGUMENT",
                            pb.ERROR_CODE_UNKNOWN_CLIENT, pb.ERROR_CODE_UNKNOWN_CLIENT,
                            pb.ERROR_CODE_UNKNOWN_CLIENT, pb.ERROR_CODE_UNKNOWN_CLIENT,
                            pb.ERROR_CODE_UNKNOWN_CLIENT, "INVALID_ARGUMENT", 0, 0, "INVALID_ARGUMENT",
                            "INVALID_ARGUMENT", "INVALID_ARGUMENT", pb.ERROR_CODE_UNKNOWN_CLIENT]
    assert d.proc.poll() is None and "rpc_internal_error" not in d.log()


def test_cli_reports_bad_config_and_arena_errors(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "deepwell.cli", "kvcache", "--arena-bytes", "5"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid arena_bytes=5" in bad.stderr
    env = {**os.environ, "DEEPWELL_KVCACHE_GRACE_S": "0"}
    bad = subprocess.run([sys.executable, "-m", "deepwell.kvcache_daemon"], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid grace_s=0.0" in bad.stderr
    nodir = subprocess.run([sys.executable, "-m", "deepwell.kvcache_daemon", "--arena-path", str(tmp_path / "no" / "arena"),
                            "--address", f"unix://{tmp_path}/s.sock"], cwd=REPO, capture_output=True, text=True)
    assert nodir.returncode == 1 and "does not exist" in nodir.stderr
    huge = subprocess.run([sys.executable, "-m", "deepwell.kvcache_daemon", "--arena-path", str(tmp_path / "arena"),
                           "--arena-bytes", str(1 << 50), "--address", f"unix://{tmp_path}/s.sock"], cwd=REPO,
                          capture_output=True, text=True)
    assert huge.returncode == 1 and "free" in huge.stderr and not (tmp_path / "arena").exists()


def test_second_daemon_on_a_live_arena_refuses(daemon_factory, tmp_path):
    d = daemon_factory().start()
    clash = subprocess.run([sys.executable, "-m", "deepwell.kvcache_daemon", "--arena-path", d.arena_path, "--arena-bytes",
                            str(d.arena_bytes), "--granule-bytes", str(d.granule_bytes),
                            "--address", f"unix://{tmp_path}/other.sock"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert clash.returncode == 1 and "in use by another running daemon" in clash.stderr
    clash = subprocess.run([sys.executable, "-m", "deepwell.kvcache_daemon", "--arena-path", str(tmp_path / "arena"),
                            "--arena-bytes", str(d.arena_bytes), "--address", d.address],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert clash.returncode == 1 and "served by another running process" in clash.stderr
    assert not (tmp_path / "arena").exists()
    with KVClient(d.address, "still-there") as c:
        assert c.available and c.stats().ok
