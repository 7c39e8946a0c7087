"""A client process for the process tests (run as a script, SIGKILLed by the tests).

    kv_worker.py hold ADDRESS      commit 2 entries, then hold a lease, a take and a
                                   reservation; print "READY <json>"; sleep forever
    kv_worker.py soak ADDRESS SEED random operations until SIGTERM; every restore is checked
                                   against the checksum named in the entry's descriptor;
                                   exit 3 on any mismatch; prints "DONE <json>"
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from kvtest_helpers import MiB, digest, identity, layout, pattern, toks  # noqa: E402

from deepwell.kvclient import Code, KVClient  # noqa: E402

FP = b"soak-model"


def commit(client: KVClient, tokens, size: int, seed: int, session: str = "") -> tuple:
    lay = layout(size)
    data = pattern(seed, size)
    lay.descriptor = json.dumps({"seed": seed, "size": size, "digest": digest(data)}).encode()
    r = client.reserve(identity(tokens, fp=FP, session=session), lay, tokens)
    if not r.ok:
        return r.code, None
    client.arena.copy_in(r.reply.extents, data)
    c = client.commit(r.reply.reservation, ["kv", "state"])
    return c.code, c.reply.entry if c.ok else None


def hold(address: str) -> int:
    client = KVClient(address, "holder")
    assert client.start(20), "attach failed"
    a, b = toks(11, 300), toks(12, 300)
    commit(client, a, MiB, 1)
    commit(client, b, MiB, 2)
    lease = client.lookup("t", FP, np.concatenate([a, [1]]))
    other = client.lookup("t", FP, np.concatenate([b, [1]]))
    take = client.take(other.reply.lease)
    res = client.reserve(identity(toks(13, 100), fp=FP), layout(2 * MiB), toks(13, 100))
    client.arena.copy_in(res.reply.extents, b"x" * 1000)
    print("READY " + json.dumps({"lease": lease.ok and lease.reply.hit, "take": take.ok, "reserve": res.ok,
                                 "client_id": client.client_id}), flush=True)
    while True:
        time.sleep(1)


def soak(address: str, seed: int) -> int:
    rng = random.Random(seed)
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    print("STARTED", flush=True)
    client = KVClient(address, f"soak-{seed}", rpc_timeout_s=2.0)
    client.start(20)
    counts = {"commits": 0, "restores": 0, "misses": 0, "unavailable": 0, "takes": 0}
    ledgers = [toks(1000 + k, 70 + 10 * k) for k in range(6)]
    bad = 0
    held = None
    while not stop["flag"]:
        if not client.available:
            counts["unavailable"] += 1
            client.wait_attached(0.2)
            continue
        k = rng.randrange(len(ledgers))
        op = rng.random()
        if op < 0.35:
            size = rng.choice([MiB // 2, MiB, 2 * MiB])
            code, _ = commit(client, ledgers[k], size, rng.randrange(1 << 30), session=f"s{k}")
            counts["commits"] += code == Code.OK
        elif op < 0.45:
            r = client.reserve(identity(ledgers[k], fp=FP), layout(MiB), ledgers[k])
            if r.ok:
                client.arena.copy_in(r.reply.extents, b"torn" * 100)
                if held is not None:  # keep at most one uncommitted reservation (reclaimed at death)
                    client.abort(held)
                held = r.reply.reservation
        else:
            r = client.lookup("t", FP, np.concatenate([ledgers[k], [7, 8]]), pin=True)
            if not (r.ok and r.reply.hit):
                counts["misses"] += 1
                continue
            meta = json.loads(r.reply.layout.descriptor)
            got = client.arena.read(r.reply.extents, meta["size"])
            if digest(got) != meta["digest"]:
                bad += 1
                print(f"MISMATCH entry={r.reply.entry}", file=sys.stderr, flush=True)
            counts["restores"] += 1
            if rng.random() < 0.2:
                t = client.take(r.reply.lease)
                if t.ok:
                    counts["takes"] += 1
                    (client.readd if rng.random() < 0.7 else client.drop)(t.reply.take)
            else:
                client.release(r.reply.lease, ok=True)
    client.close()
    print("DONE " + json.dumps({**counts, "bad": bad}), flush=True)
    return 3 if bad else 0


if __name__ == "__main__":
    mode, address = sys.argv[1], sys.argv[2]
    sys.exit(hold(address) if mode == "hold" else soak(address, int(sys.argv[3])))
