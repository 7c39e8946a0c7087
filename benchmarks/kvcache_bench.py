"""KV-cache daemon benchmark (not a test): RPC latency and host memcpy bandwidth into extents.

    python benchmarks/kvcache_bench.py [--iters 300] [--tokens 8192] [--copy-mib 512]

Starts a real daemon (``python -m deepwell.kvcache_daemon``) on a private unix socket with an arena
under /dev/shm (or uses ``--address`` of a running one), then prints p50/p99 of
Reserve+Commit, Lookup+pin and Release round trips through ``deepwell.kvclient`` and the
GB/s of ``ArenaMap.copy_in`` / ``copy_out`` over a multi-extent allocation.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from deepwell import grpcx
from deepwell.kvcache.v1 import kvcache_pb2 as pb
from deepwell.kvclient import KVClient

MiB = 1024 * 1024
FP = b"bench-model"


def identity(tokens: np.ndarray) -> pb.Identity:
    return pb.Identity(tenant="bench", model_fingerprint=FP, frontier_kind=pb.FRONTIER_KIND_CHECKPOINT,
                       frontier_position=len(tokens), num_tokens=len(tokens), requires_state=True)


def layout(total: int) -> pb.Layout:
    s = total // 8
    return pb.Layout(total_bytes=total, parts=[
        pb.Part(name="kv", role=pb.PART_ROLE_ATTENTION_KV, offset=0, length=total - s),
        pb.Part(name="state", role=pb.PART_ROLE_RECURRENT_STATE, offset=total - s, length=s)])


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples) * 1e3, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="", help="use a running daemon instead of starting one")
    ap.add_argument("--arena-mib", type=int, default=1536)
    ap.add_argument("--granule-mib", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=8192, help="ledger length per entry")
    ap.add_argument("--entry-mib", type=int, default=4)
    ap.add_argument("--copy-mib", type=int, default=512)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="dwkv-bench-")
    shm = tempfile.mkdtemp(prefix="dwkv-bench-", dir="/dev/shm")
    proc = None
    address = args.address
    if not address:
        address = f"unix://{tmp}/kv.sock"
        proc = subprocess.Popen([sys.executable, "-m", "deepwell.kvcache_daemon", "--address", address,
                                 "--arena-path", f"{shm}/arena", "--arena-bytes", str(args.arena_mib * MiB),
                                 "--granule-bytes", str(args.granule_mib * MiB), "--log-level", "warning"],
                                stdout=subprocess.DEVNULL)
        if not asyncio.run(grpcx.wait_healthy(address, "deepwell.kvcache.v1.KVCache", 60)):
            raise SystemExit("daemon did not start")
    try:
        with KVClient(address, "bench") as c:
            rng = np.random.default_rng(0)
            base = rng.integers(0, 100_000, args.tokens, dtype=np.uint32)
            entry_bytes = args.entry_mib * MiB
            payload = rng.integers(0, 256, entry_bytes, dtype=np.uint8)
            rc, lk, rl = [], [], []
            ledgers = []
            for i in range(args.iters):
                t = base.copy()
                t[-1] = 200_000 + i
                ledgers.append(t)
                t0 = time.perf_counter()
                r = c.reserve(identity(t), layout(entry_bytes), t)
                if not r.ok:
                    raise SystemExit(f"reserve failed: {r}")
                t1 = time.perf_counter()
                c.arena.copy_in(r.reply.extents, payload)
                t2 = time.perf_counter()
                cm = c.commit(r.reply.reservation, ["kv", "state"])
                t3 = time.perf_counter()
                assert cm.ok, cm
                rc.append((t1 - t0) + (t3 - t2))
            live = [t for t in ledgers[-max(1, (args.arena_mib // args.entry_mib) // 2):]]
            for i in range(args.iters):
                prompt = np.concatenate([live[i % len(live)], [7]])
                t0 = time.perf_counter()
                r = c.lookup("bench", FP, prompt, pin=True)
                t1 = time.perf_counter()
                rel = c.release(r.reply.lease)
                lk.append(t1 - t0)
                rl.append(time.perf_counter() - t1)
                assert r.ok and r.reply.hit and rel.ok, (r, rel)
            print(f"ledger {args.tokens} tokens, entry {args.entry_mib} MiB, {args.iters} iterations")
            print(f"Reserve+Commit       p50 {pct(rc, 50):7.3f} ms   p99 {pct(rc, 99):7.3f} ms")
            print(f"Lookup+pin           p50 {pct(lk, 50):7.3f} ms   p99 {pct(lk, 99):7.3f} ms")
            print(f"Release              p50 {pct(rl, 50):7.3f} ms   p99 {pct(rl, 99):7.3f} ms")

            copy_bytes = min(args.copy_mib * MiB, (args.arena_mib // 2) * MiB)
            big = np.frombuffer(rng.bytes(copy_bytes), dtype=np.uint8)
            bt = rng.integers(0, 100_000, 64, dtype=np.uint32)
            r = c.reserve(identity(bt), layout(copy_bytes), bt)
            assert r.ok, r
            out = np.empty_like(big)
            best_in = best_out = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                c.arena.copy_in(r.reply.extents, big)
                best_in = min(best_in, time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.arena.copy_out(r.reply.extents, out)
                best_out = min(best_out, time.perf_counter() - t0)
            assert np.array_equal(big, out)
            gb = copy_bytes / 1e9
            print(f"memcpy into {len(r.reply.extents)} extent(s) of {copy_bytes // MiB} MiB: "
                  f"copy_in {gb / best_in:6.2f} GB/s   copy_out {gb / best_out:6.2f} GB/s (best of 5)")
            c.abort(r.reply.reservation)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DEEPWELL_LOG_JSON", "1")
    sys.exit(main())
