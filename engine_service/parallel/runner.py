"""``TPModelRunner``: the engine's ``runner_api.ModelRunner`` over N tensor-parallel ranks.

``build_tp_runner(N, source, ...)`` checks that N splits the model and that the devices exist
(``shard.TPConfigError`` naming the numbers, before anything starts), starts ranks 1..N-1 as worker processes
(``python -m deepwell.engine_service.parallel.worker``, their spec as JSON on stdin), joins the
group as rank 0, builds rank 0's shard runner, and returns once every rank has built its own (a
failure anywhere stops them all and raises).

Every call the engine makes (allocate, forward, state resets / copies, page copies, MTP accept
and propose, KV calibration and the kernel check) is broadcast to the workers and run by each
rank on its own shard, under one lock, so all ranks run the same calls in the same order even
when the host tier's thread spills while the step thread runs a forward (which then wait for
each other: the single-process runner overlaps them). Rank 0's results are the call's: the
logits are all-gathered, so rank 0 holds all of them.

Sizes: ``memory_spec`` is one rank's (each device holds ``1/N`` of every page and state slot, so
``size_pools`` sizes the pool per device); ``entry_nbytes`` is the whole entry, every rank's
share. A prefix-cache entry's bytes (``export_kv`` / ``import_kv``) are those of one pool whose
page row is the ranks' page rows side by side: page ``i`` is ``[rank 0's row i | rank 1's row i |
...]``, then the state slot likewise, so the entry keeps ``kv.pool``'s row-major order (its first
pages are a prefix) and the host tier's ``kv`` / ``state`` parts. Rank 0 gathers the workers'
shares over the control group and writes the entry, or reads it and sends each rank its share;
a failure on any rank fails the whole call (the host tier then commits nothing / recomputes).

``close()`` stops the workers and leaves the group (also at interpreter exit).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from deepwell.logs import get_logger
from deepwell.engine_service.kv.calibration import KVCalibration
from deepwell.engine_service.kv.pool import Region
from deepwell.engine_service.kv.selfcheck import KVKernelCheck
from deepwell.engine_service.kv.settings import KVSpec
from deepwell.engine_service.loading.source import ModelSource
from deepwell.engine_service.models.registry import resolve
from deepwell.engine_service.models.spec import ModelArgs
from deepwell.engine_service.parallel.group import TPGroup, join, leave, master_store, rank_device
from deepwell.engine_service.parallel.shard import (
    RunnerOptions,
    TPConfigError,
    build_rank_runner,
    check_tensor_parallel,
)
from deepwell.engine_service.parallel.worker import (
    EXPORT,
    IMPORT,
    STOP,
    encode_batch,
    encode_drafts,
    execute,
    share_nbytes,
    sync,
)
from deepwell.engine_service.runner import TorchModelRunner
from deepwell.engine_service.runner_api import DraftInput, ForwardBatch, MemorySpec
from deepwell.kernels.calibration import ScaleCounts

log = get_logger(__name__)

START_TIMEOUT_S = 300.0  # for the workers to reach the rendezvous (python + torch imports)
STOP_TIMEOUT_S = 30.0


class _Ranks:
    """The workers and the group: what ``close`` (or the finalizer at exit) ends, exactly once."""

    def __init__(self, group: TPGroup, procs: list[subprocess.Popen]) -> None:
        self.group = group
        self.procs = procs
        self.lock = threading.Lock()  # one call at a time over the group
        self.closed = False

    def stop(self) -> None:
        # a call still running (a step the engine's stop timed out on) holds the lock: the workers
        # are then killed instead of told, and the group is left to the process's exit
        locked = self.lock.acquire(timeout=STOP_TIMEOUT_S)
        try:
            if self.closed:
                return
            self.closed = True
            if not locked:
                log.warning("tp_stop_busy", detail="a call is still running: killing the workers")
                for p in self.procs:
                    p.kill()
                _reap(self.procs)
                return
            try:
                self.group.broadcast_message({"op": STOP})
            except Exception:  # a worker already gone: stop the others below
                log.warning("tp_stop_broadcast_failed", exc_info=True)
            _reap(self.procs)
            leave()
        finally:
            if locked:
                self.lock.release()


def _reap(procs: list[subprocess.Popen], timeout_s: float = STOP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _TPGraphs:
    """Rank 0's view of the ranks' decode graphs: ``check`` runs on every rank together (its steps
    all-reduce), rank 0's figures return; ``describe`` and the counters are rank 0's."""

    def __init__(self, runner: TPModelRunner) -> None:
        self._runner = runner

    def check(self) -> tuple[float, float]:
        return self._runner._call({"op": "check_graphs"})

    def describe(self) -> dict[str, Any]:
        graphs = self._runner.local.graphs
        assert graphs is not None
        return graphs.describe()

    @property
    def replays(self) -> int:
        graphs = self._runner.local.graphs
        return graphs.replays if graphs is not None else 0


class TPModelRunner:
    """Rank 0's runner: a ``TorchModelRunner`` over its shard plus the calls' broadcast."""

    def __init__(self, local: TorchModelRunner, group: TPGroup, procs: list[subprocess.Popen]) -> None:
        self.local = local
        self.group = group
        self._ranks = _Ranks(group, procs)
        self._finalizer = weakref.finalize(self, self._ranks.stop)

    # -- what the engine reads (rank 0's shard answers for every rank) -----------------------------
    @property
    def tensor_parallel(self) -> int:
        return self.group.world

    @property
    def args(self) -> ModelArgs:
        """One rank's ``ModelArgs``: head counts and intermediate sizes divided by N, the whole vocabulary."""
        return self.local.args

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def max_context(self) -> int:
        return self.local.max_context

    @property
    def architecture(self) -> str:
        return self.local.architecture

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def page_size(self) -> int:
        return self.local.page_size

    @property
    def mtp_layers(self) -> int:
        return self.local.mtp_layers

    @property
    def kv_spec(self) -> KVSpec:
        return self.local.kv_spec

    @property
    def kv_dtype_name(self) -> str:
        return self.local.kv_dtype_name

    @property
    def kv_calibration(self) -> KVCalibration | None:
        """Rank 0's calibration (its KV heads; every rank calibrates its own)."""
        return self.local.kv_calibration

    @property
    def kv_kernel_check(self) -> KVKernelCheck | None:
        return self.local.kv_kernel_check

    def memory_spec(self) -> MemorySpec:
        """One rank's page and slot bytes (what each device holds: the pool is sized per device)."""
        return self.local.memory_spec()

    def slot_position(self, slot: int) -> int:
        return self.local.slot_position(slot)

    def kv_scale_counts(self) -> tuple[ScaleCounts, ScaleCounts] | None:
        """Rank 0's block-scale counts (its KV heads)."""
        return self.local.kv_scale_counts()

    def entry_nbytes(self, num_pages: int, with_state: bool) -> int:
        """Bytes of a host cache entry: every rank's share."""
        return self.group.world * self.local.entry_nbytes(num_pages, with_state)

    # -- calls run on every rank -------------------------------------------------------------------
    def _call(self, msg: dict[str, Any], run: Callable[[], Any] | None = None) -> Any:
        """Broadcast ``msg``, run it here (``run``, else ``worker.execute``), then agree on success:
        rank 0's own error is raised as is, a worker's as RuntimeError."""
        ranks = self._ranks
        with ranks.lock:
            if ranks.closed:
                raise RuntimeError("the tensor-parallel runner is closed")
            gone = [(rank, p.returncode) for rank, p in enumerate(ranks.procs, 1) if p.poll() is not None]
            if gone:  # its collectives would wait for it until the timeout
                raise RuntimeError("tensor-parallel worker " + ", ".join(f"rank {r} exited (code {c})"
                                                                          for r, c in gone))
            self.group.broadcast_message(msg)
            result, error = None, None
            try:
                result = run() if run is not None else execute(self.local, msg)
            except Exception as exc:
                error = exc
            failed = self.group.status(error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"tensor-parallel call {msg['op']} failed on {failed} worker rank(s) (see their log)")
        return result

    def allocate(self, num_pages: int, num_state_slots: int) -> None:
        self._call({"op": "allocate", "pages": int(num_pages), "slots": int(num_state_slots)})

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self._call(encode_batch(batch), lambda: self.local.forward(batch))

    def reset_state(self, slot: int) -> None:
        self._call({"op": "reset_state", "slot": int(slot)})

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        self._call({"op": "copy_state", "src": int(src_slot), "dst": int(dst_slot)})

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._call({"op": "copy_pages", "src": [int(p) for p in src], "dst": [int(p) for p in dst]})

    def accept(self, slot: int, num_tokens: int) -> None:
        self._call({"op": "accept", "slot": int(slot), "n": int(num_tokens)})

    def accept_many(self, accepted: Mapping[int, int]) -> None:
        self._call({"op": "accept_many", "slots": [int(s) for s in accepted],
                    "n": [int(n) for n in accepted.values()]})

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        inputs = list(inputs)
        return self._call(encode_drafts(inputs), lambda: self.local.propose(inputs))

    def calibrate_kv(self, token_ids: Sequence[int], source: str = "token_ids", max_position: int | None = None,
                     sink: bool = True) -> KVCalibration | None:
        """Every rank calibrates its own KV heads on the same scratch forward; rank 0's report returns."""
        return self._call({"op": "calibrate_kv", "ids": [int(t) for t in token_ids], "source": source,
                           "max_position": max_position, "sink": sink})

    def check_kv_kernels(self) -> KVKernelCheck | None:
        return self._call({"op": "check_kv_kernels"})

    # -- CUDA graphs (engine_service.graphs: every rank captures its own shard's steps) --------------
    def graphs_unsupported(self) -> str | None:
        return self.local.graphs_unsupported()

    def plan_graphs(self, max_batch: int, verify_tokens: int = 0) -> None:
        self._call({"op": "plan_graphs", "max_batch": int(max_batch), "verify_tokens": int(verify_tokens)})

    def capture_graphs(self, capture: bool | None = None) -> _TPGraphs:
        """Every rank captures (or, ``capture=False``, prepares) its decode graphs at once: their
        all-reduces are collectives, so the ranks record them in the same order."""
        self._call({"op": "capture_graphs", "capture": capture})
        return _TPGraphs(self)

    @property
    def graphs(self) -> _TPGraphs | None:
        return _TPGraphs(self) if self.local.graphs is not None else None

    @graphs.setter
    def graphs(self, value: None) -> None:
        """``None``: decode eagerly on every rank (a failed start-up check, ``cli.capture_graphs``)."""
        if value is not None:
            raise ValueError("the TP runner's graphs are set by capture_graphs(); assign None to drop them")
        if self.local.graphs is not None or self.local._graph_batch:
            self._call({"op": "graphs_off"})

    # -- prefix-cache entry bytes ------------------------------------------------------------------
    def export_kv(self, pages: Sequence[int], slot: int, out: Region) -> None:
        """Write the entry of ``pages`` (and state ``slot`` when ``>= 0``) into ``out``: every rank's
        share gathered here, page rows side by side (module docstring)."""
        pages, slot = [int(p) for p in pages], int(slot)
        world, loc = self.group.world, self.local
        share = share_nbytes(loc, len(pages), slot)
        if out.nbytes < world * share:
            raise ValueError(f"the entry needs {world * share} bytes, the region holds {out.nbytes}")

        def run() -> list[torch.Tensor]:
            mine, error = torch.zeros(share, dtype=torch.uint8), None
            try:
                loc.export_kv(pages, slot, Region([mine]))
                sync(loc.device)
            except Exception as exc:  # the workers' bytes still come: take them, then fail
                error = exc
            shares = [mine]
            for r in range(1, world):
                buf = torch.empty(share, dtype=torch.uint8)
                self.group.recv_bytes(buf, r)
                shares.append(buf)
            if error is not None:
                raise error
            return shares

        shares = self._call({"op": EXPORT, "pages": pages, "slot": slot}, run)
        kv = len(pages) * loc.entry_nbytes(1, False)
        if kv:
            out.write(0, torch.stack([s[:kv].view(len(pages), -1) for s in shares], dim=1).reshape(-1))
        if share > kv:
            out.write(world * kv, torch.cat([s[kv:] for s in shares]))

    def import_kv(self, pages: Sequence[int], slot: int, position: int, src: Region, entry_pages: int) -> None:
        """Fill ``pages`` (a prefix of an entry of ``entry_pages`` pages) and the state ``slot`` from
        ``src`` on every rank, each from its share; the slot's state is then at ``position``."""
        pages, slot = [int(p) for p in pages], int(slot)
        world, loc, n = self.group.world, self.local, len(pages)
        page, state = loc.entry_nbytes(1, False), share_nbytes(loc, 0, slot)
        cpu = torch.device("cpu")
        kv = src.read(0, n * page * world, cpu).view(n, world, page) if n * page else None
        st = src.read(entry_pages * page * world, state * world, cpu).view(world, state) if state else None
        empty = torch.empty(0, dtype=torch.uint8)
        shares = [torch.cat([kv[:, r].reshape(-1) if kv is not None else empty, st[r] if st is not None else empty])
                  for r in range(world)]

        def run() -> None:
            for r in range(1, world):
                self.group.send_bytes(shares[r], r)
            loc.import_kv(pages, slot, position, Region([shares[0]]), n)
            sync(loc.device)

        self._call({"op": IMPORT, "pages": pages, "slot": slot, "position": int(position)}, run)

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        self._finalizer()


def build_tp_runner(world: int, source: ModelSource, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, *, kv_dtype: str = "auto", page_size: int = 64,
                    backend: str = "auto", kv_hadamard: str = "auto", kv_center_k: str = "auto",
                    kv_k_rounding: str = "auto", kv_paged: str = "auto", random: bool = False, mtp: bool = False,
                    weight_dtype: str = "auto", log_level: str = "info") -> TPModelRunner:
    """Start ``world`` ranks (this process is rank 0) over ``source``: ``runner.build_runner``'s
    arguments, every rank on its own device (``cuda:i + rank``; all on the CPU with gloo)."""
    dev = torch.device(device)
    family, text_cfg = resolve(source.config)
    check_tensor_parallel(family.build_args(text_cfg), world)
    if dev.type == "cuda" and torch.cuda.device_count() < (dev.index or 0) + world:
        raise TPConfigError(f"tensor_parallel={world} from {dev} needs {(dev.index or 0) + world} CUDA devices, "
                         f"this machine has {torch.cuda.device_count()}")
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    opts = RunnerOptions(dtype=names[dtype], kv_dtype=kv_dtype, page_size=page_size, backend=backend,
                         kv_hadamard=kv_hadamard, kv_center_k=kv_center_k, kv_k_rounding=kv_k_rounding,
                         kv_paged=kv_paged, random=random, mtp=mtp, weight_dtype=weight_dtype)
    store = master_store(world)
    spec = {"world": world, "port": store.port, "device": str(dev), "model": str(source.path),
            "config": source.config, "options": asdict(opts), "log_level": log_level,
            "cpu_threads": torch.get_num_threads()}
    procs = [_spawn(rank, spec) for rank in range(1, world)]
    try:
        _wait_started(store, procs)
        group = join(store, 0, world, rank_device(dev, 0))
    except BaseException:
        for p in procs:
            p.kill()
        _reap(procs)
        raise
    local, error = None, None
    try:
        local = build_rank_runner(source, group, opts)
    except Exception as exc:
        error = exc
    failed = group.status(error is not None)
    if error is not None or failed:
        _reap(procs)  # the workers exit after a failed build status
        leave()
        if error is not None:
            raise error
        raise RuntimeError(f"tensor-parallel start: {failed} worker rank(s) failed to build their shard "
                           "(see their log)")
    assert local is not None
    log.info("tp_started", world=world, device=str(dev), architecture=local.architecture,
             workers=[p.pid for p in procs])
    return TPModelRunner(local, group, procs)


def _spawn(rank: int, spec: dict[str, Any]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "deepwell.engine_service.parallel.worker", str(rank)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # a terminal's Ctrl-C reaches rank 0 only: it stops them
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({**spec, "rank": rank}))
    proc.stdin.close()
    return proc


def _wait_started(store: Any, procs: list[subprocess.Popen]) -> None:
    """Wait until every worker is at the rendezvous (its ``tp_up_<rank>`` key), failing fast when one exits."""
    keys = [f"tp_up_{rank}" for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        dead = [(i + 1, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel worker rank(s) exited before the rendezvous: {dead} (see their log)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
