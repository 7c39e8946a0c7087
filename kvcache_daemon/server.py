"""Daemon process assembly: arena + journal replay + core + gRPC server + metrics.

Start-up order: open (or reuse) the arena; with persistence, replay the journal into the
core and rewrite it under the new epoch; then bind the socket and report SERVING. The
epoch is the boot time in nanoseconds, so every handle from a previous run answers STALE.
SIGTERM/SIGINT stop the server gracefully (the arena file is removed unless persistence
is on); SIGKILL leaves it for the next start to reuse.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

from deepwell import grpcx, logs
from deepwell.auth import read_token_file
from deepwell.kvcache.v1 import kvcache_pb2 as pb
from deepwell.kvcache.v1 import kvcache_pb2_grpc as pbg

from . import journal as jr
from .arena import open_arena
from .config import DaemonConfig
from .core import Core
from .metrics import Metrics
from .service import KVCacheServicer

log = logs.get_logger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name


def _socket_path(address: str) -> str | None:
    if address.startswith("unix://"):
        return address[len("unix://"):]
    if address.startswith("unix:"):
        return address[len("unix:"):]
    return None


def _socket_alive(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


async def serve(cfg: DaemonConfig, stop: asyncio.Event | None = None) -> int:
    epoch = time.time_ns() & ((1 << 63) - 1)
    token = read_token_file(cfg.internal_token_file) if cfg.internal_token_file else ""  # TokenError: a ValueError
    sock = _socket_path(cfg.address)
    if sock and os.path.exists(sock) and _socket_alive(sock):
        raise OSError(f"{cfg.address} is served by another running process")
    arena = open_arena(cfg.arena_path, cfg.arena_bytes, keep_contents=cfg.persist, prefault=cfg.prefault)
    journal: jr.FileJournal | None = None
    recovered: list[jr.Recovered] = []
    if cfg.persist:
        recovered = jr.replay(cfg.effective_journal_path, cfg.arena_bytes, cfg.granule_bytes) if arena.reused else []
        journal = jr.FileJournal(cfg.effective_journal_path, cfg.arena_bytes, cfg.granule_bytes)
    core = Core(epoch=epoch, arena=arena.view(), arena_bytes=cfg.arena_bytes, granule_bytes=cfg.granule_bytes,
                budget_bytes=cfg.effective_budget, max_extents=cfg.max_extents_per_entry,
                compaction_ms=cfg.compaction_max_ms, pin_quota_bytes=cfg.pin_quota_bytes,
                page_tokens=cfg.index_page_tokens, op_cache=cfg.op_cache_per_client, journal=None)
    kept = sum(core.recover(r) for r in recovered)
    if journal is not None:
        journal.rewrite(sorted(core.entries.values(), key=lambda e: e.id), epoch)
        core.journal = journal
    log.info("daemon_starting", epoch=epoch, address=cfg.address, recovered=kept, discarded=len(recovered) - kept)

    metrics = Metrics()
    servicer = KVCacheServicer(core, cfg, metrics, arena.path, journal)
    if sock and os.path.exists(sock):
        os.unlink(sock)  # left by a SIGKILLed daemon (a live one was refused above)
    handle = grpcx.build_server(cfg.address, register=[lambda s: pbg.add_KVCacheServicer_to_server(servicer, s)],
                                service_names=[SERVICE_NAME], token=token)  # a unix socket is created 0600
    await handle.server.start()
    metrics_server = None
    if cfg.metrics_address:
        from prometheus_client import start_http_server

        host, _, port = cfg.metrics_address.rpartition(":")
        metrics_server, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=metrics.registry)
    await handle.set_serving(SERVICE_NAME)
    await handle.set_serving("")
    log.info("daemon_serving", epoch=epoch, address=cfg.address, port=handle.bound_port)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass

    async def refresh() -> None:
        last_warn = 0.0
        while True:
            snap = core.stats()
            metrics.update(snap)
            now = time.monotonic()
            if snap.oldest_lease_age_s > cfg.lease_warn_s and now - last_warn > cfg.lease_warn_s:
                last_warn = now
                log.warning("old_lease", oldest_lease_age_s=round(snap.oldest_lease_age_s, 1),
                            note="never revoked while its client lives")
            await asyncio.sleep(1.0)

    ticker = asyncio.create_task(refresh())
    try:
        await stop.wait()
    finally:
        log.info("daemon_stopping")
        ticker.cancel()
        servicer.closing.set()
        servicer.cancel_timers()
        await handle.stop(1.0)
        if metrics_server is not None:
            metrics_server.shutdown()
        if journal is not None:
            journal.close()
        del core
        arena.close()
        if not cfg.persist:
            os.unlink(arena.path)  # clean stop: nothing to keep (clients' mappings stay valid)
        if sock and os.path.exists(sock):
            os.unlink(sock)
    return 0

