"""Shared helpers of the KV-cache daemon tests: identities, layouts, byte patterns, daemons."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deepwell.kvcache.v1 import kvcache_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


def identity(tokens, *, tenant: str = "t", fp: bytes = b"model-a", md: bytes = b"", session: str = "",
             frontier: int | None = None, requires_state: bool = True,
             kind: int = pb.FRONTIER_KIND_CHECKPOINT) -> pb.Identity:
    n = len(tokens)
    return pb.Identity(tenant=tenant, model_fingerprint=fp, session_key=session, metadata_digest=md,
                       frontier_kind=kind, frontier_position=n if frontier is None else frontier,
                       num_tokens=n, page_size=64, requires_state=requires_state)


def layout(total: int, state: bool = True) -> pb.Layout:
    parts = []
    if state:
        s = max(1, total // 8)
        parts.append(pb.Part(name="kv", role=pb.PART_ROLE_ATTENTION_KV, offset=0, length=total - s))
        parts.append(pb.Part(name="state", role=pb.PART_ROLE_RECURRENT_STATE, offset=total - s, length=s))
    else:
        parts.append(pb.Part(name="kv", role=pb.PART_ROLE_ATTENTION_KV, offset=0, length=total))
    return pb.Layout(parts=parts, total_bytes=total, descriptor=b"test")


def part_names(lay: pb.Layout) -> list[str]:
    return [p.name for p in lay.parts]


def pattern(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def toks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint32)


def write_extents(buf: memoryview, extents, data: bytes) -> None:
    pos = 0
    for off, ln in extents:
        k = min(ln, len(data) - pos)
        if k <= 0:
            break
        buf[off:off + k] = data[pos:pos + k]
        pos += k


def read_extents(buf: memoryview, extents, n: int) -> bytes:
    out = bytearray()
    for off, ln in extents:
        k = min(ln, n - len(out))
        if k <= 0:
            break
        out += buf[off:off + k]
    return bytes(out)


def make_core(arena_mib: int = 16, granule: int = MiB, budget_mib: int | None = None, **kw):
    from deepwell.kvcache_daemon.core import Core

    size = arena_mib * MiB
    return Core(epoch=7, arena=memoryview(bytearray(size)), arena_bytes=size, granule_bytes=granule,
                budget_bytes=(budget_mib or arena_mib) * MiB, **kw)


def put(core, cid: str, tokens, size: int, seed: int, **idkw):
    """Reserve, write ``pattern(seed, size)``, commit; returns (entry handle, extents)."""
    from deepwell.kvcache_daemon.model import Committed, Reserved

    r = core.reserve(cid, "", identity(tokens, **idkw), layout(size, idkw.get("requires_state", True)), tokens)
    assert isinstance(r, Reserved), r
    write_extents(core.arena, r.extents, pattern(seed, size))
    c = core.commit(cid, "", r.reservation, True, ["kv", "state"] if idkw.get("requires_state", True) else ["kv"])
    assert isinstance(c, Committed), c
    return c.entry, r.extents


@dataclass
class Daemon:
    """A real ``python -m deepwell.kvcache_daemon`` process on a private socket and arena directory."""

    arena_bytes: int = 64 * MiB
    granule_bytes: int = 1 * MiB
    grace_s: float = 0.5
    persist: bool = False
    extra: list[str] = field(default_factory=list)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    proc: subprocess.Popen | None = None
    shm_dir: str = ""
    sock_dir: str = ""
    log_path: str = ""

    def __post_init__(self) -> None:
        self.shm_dir = tempfile.mkdtemp(prefix=f"dwkv-{self.tag}-", dir="/dev/shm")
        self.sock_dir = tempfile.mkdtemp(prefix=f"dwkv-{self.tag}-")
        self.log_path = os.path.join(self.sock_dir, "daemon.log")

    @property
    def address(self) -> str:
        return f"unix://{self.sock_dir}/kv.sock"

    @property
    def arena_path(self) -> str:
        return os.path.join(self.shm_dir, "arena")

    def start(self, timeout_s: float = 30.0) -> Daemon:
        args = [sys.executable, "-m", "deepwell.kvcache_daemon", "--address", self.address, "--arena-path", self.arena_path,
                "--arena-bytes", str(self.arena_bytes), "--granule-bytes", str(self.granule_bytes),
                "--grace-s", str(self.grace_s), "--log-level", "info",
                "--persist" if self.persist else "--no-persist", *self.extra]
        env = {**os.environ, "DEEPWELL_LOG_JSON": "1"}
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path, "ab"))
        import asyncio

        from deepwell import grpcx

        ok = asyncio.run(grpcx.wait_healthy(self.address, "deepwell.kvcache.v1.KVCache", timeout_s))
        if not ok:
            self.stop()
            raise RuntimeError(f"daemon did not become healthy; log:\n{Path(self.log_path).read_text()[-3000:]}")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def log(self) -> str:
        return Path(self.log_path).read_text()


def wait_until(cond, timeout_s: float = 20.0, step_s: float = 0.05) -> bool:
    """Poll ``cond`` (bounded; used for liveness waits, never to assert speed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step_s)
    return bool(cond())
