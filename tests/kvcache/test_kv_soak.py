"""Bounded soak: several client processes do random operations while clients are SIGKILLed
and the daemon is SIGKILLed and restarted (persistence on). Every restore must match the
checksum recorded at commit; at the end occupancy returns to baseline (no reservation,
take or lease left; committed + free == arena). DEEPWELL_KV_SOAK_S sets the duration
(default 4 s, 10 s with DEEPWELL_SLOW=1)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

from kvtest_helpers import REPO, MiB, wait_until

from deepwell.kvclient import KVClient

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_worker.py")


def spawn(address: str, seed: int, log_dir: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, "soak", address, str(seed)], cwd=REPO,
                            stdout=open(os.path.join(log_dir, f"w{seed}.out"), "w"),
                            stderr=open(os.path.join(log_dir, f"w{seed}.err"), "w"))


def test_soak_with_client_and_daemon_kills(daemon_factory):
    default = "10" if os.environ.get("DEEPWELL_SLOW") == "1" else "4"
    duration = float(os.environ.get("DEEPWELL_KV_SOAK_S", default))
    d = daemon_factory(arena_bytes=48 * MiB, grace_s=0.5, persist=True).start()
    rng = random.Random(1)
    workers: dict[int, subprocess.Popen] = {}
    seed = 0
    for _ in range(3):
        seed += 1
        workers[seed] = spawn(d.address, seed, d.sock_dir)
    killed = restarts = 0
    end = time.monotonic() + duration
    restart_at = time.monotonic() + duration / 2
    try:
        while time.monotonic() < end:
            time.sleep(min(2.0, duration / 8))
            victim = rng.choice(sorted(workers))
            workers.pop(victim).send_signal(signal.SIGKILL)
            killed += 1
            seed += 1
            workers[seed] = spawn(d.address, seed, d.sock_dir)
            if restarts == 0 and time.monotonic() >= restart_at:
                d.kill()
                time.sleep(0.3)
                d.start()
                restarts += 1
        results = []
        for s, w in workers.items():
            out_path = os.path.join(d.sock_dir, f"w{s}.out")
            assert wait_until(lambda: "STARTED" in open(out_path).read(), 60)  # SIGTERM handler installed
            w.send_signal(signal.SIGTERM)
            assert w.wait(30) == 0, open(os.path.join(d.sock_dir, f"w{s}.err")).read()[-2000:]
            out = open(os.path.join(d.sock_dir, f"w{s}.out")).read()
            results.append(json.loads(out.split("DONE ", 1)[1]))
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.kill()
                w.wait(10)
    for s in range(1, seed + 1):  # killed workers too: none saw a mismatch
        assert "MISMATCH" not in open(os.path.join(d.sock_dir, f"w{s}.err")).read()
    print(f"soak: {duration:.0f}s killed={killed} restarts={restarts} workers={results}")
    assert killed >= 3 and restarts == 1
    assert sum(r["bad"] for r in results) == 0
    assert sum(r["restores"] for r in results) > 0 and sum(r["commits"] for r in results) > 0
    with KVClient(d.address, "auditor") as audit:
        assert wait_until(lambda: [c.client_name for c in audit.stats().reply.clients] == ["auditor"], 30)
        s = audit.stats().reply
        assert (s.reserved_bytes, s.taken_bytes, s.leases) == (0, 0, 0)
        assert s.committed_bytes + s.free_bytes == s.arena_bytes
