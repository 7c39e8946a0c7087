"""One runner call as a typed message, run the same way on every rank; and the rank > 0 process.

A message is a JSON object ``{"op": NAME, ...}`` (``group.TPGroup.broadcast_message``). Every
rank runs ``execute`` on its own ``TorchModelRunner`` (rank 0 too, in ``runner.TPModelRunner``),
then all report success (``TPGroup.status``). Two calls move bytes besides:

- ``export_kv``: each rank exports its share of the entry's pages and state slot to a host
  buffer; ranks > 0 send theirs to rank 0, which lays them out (``runner`` module);
- ``import_kv``: rank 0 sends each rank its share, which it imports.

The worker process (``python -m deepwell.engine_service.parallel.worker RANK``) reads its start
spec, a JSON object, from stdin (model path, config, ``RunnerOptions``, world size, store port,
device), joins the group, builds its runner, reports the build's status, then serves messages
until ``stop``. It exits when rank 0 goes away (a collective fails, or its parent process is gone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import torch

from deepwell.engine_service.kv.pool import Region
from deepwell.engine_service.parallel.group import TPGroup, client_store, join, leave, rank_device
from deepwell.engine_service.parallel.shard import RunnerOptions, build_rank_runner
from deepwell.engine_service.runner import TorchModelRunner
from deepwell.engine_service.runner_api import DraftInput, ForwardBatch, SeqSlice

STOP = "stop"
EXPORT = "export_kv"
IMPORT = "import_kv"


# -- codec ----------------------------------------------------------------------------------------
def encode_batch(batch: ForwardBatch) -> dict[str, Any]:
    return {"op": "forward", "ids": batch.input_ids.tolist(),
            "seqs": [[s.state_slot, list(s.block_table), s.start, s.num_tokens, s.need_logits, s.all_logits,
                      s.verify] for s in batch.seqs]}


def decode_batch(msg: dict[str, Any], device: torch.device) -> ForwardBatch:
    seqs = [SeqSlice(int(slot), tuple(table), int(start), int(n), bool(need), bool(every), bool(verify))
            for slot, table, start, n, need, every, verify in msg["seqs"]]
    return ForwardBatch(torch.tensor(msg["ids"], dtype=torch.long, device=device), seqs)


def encode_drafts(inputs: list[DraftInput]) -> dict[str, Any]:
    return {"op": "propose", "inputs": [[list(d.block_table), d.start, d.hidden_row, list(d.tokens), d.num_drafts]
                                        for d in inputs]}


def decode_drafts(msg: dict[str, Any]) -> list[DraftInput]:
    return [DraftInput(tuple(table), int(start), int(row), tuple(tokens), int(k))
            for table, start, row, tokens, k in msg["inputs"]]


def execute(runner: TorchModelRunner, msg: dict[str, Any]) -> Any:
    """Run the call ``msg`` names on this rank's runner (not the byte-moving ones) and return its result."""
    op = msg["op"]
    if op == "forward":
        return runner.forward(decode_batch(msg, runner.device))
    if op == "allocate":
        return runner.allocate(int(msg["pages"]), int(msg["slots"]))
    if op == "reset_state":
        return runner.reset_state(int(msg["slot"]))
    if op == "copy_state":
        return runner.copy_state(int(msg["src"]), int(msg["dst"]))
    if op == "copy_pages":
        return runner.copy_pages([int(p) for p in msg["src"]], [int(p) for p in msg["dst"]])
    if op == "accept":
        return runner.accept(int(msg["slot"]), int(msg["n"]))
    if op == "accept_many":
        return runner.accept_many({int(s): int(n) for s, n in zip(msg["slots"], msg["n"], strict=True)})
    if op == "propose":
        return runner.propose(decode_drafts(msg))
    if op == "calibrate_kv":
        return runner.calibrate_kv(msg["ids"], source=msg["source"], max_position=msg["max_position"],
                                   sink=bool(msg["sink"]))
    if op == "check_kv_kernels":
        return runner.check_kv_kernels()
    if op == "plan_graphs":
        return runner.plan_graphs(int(msg["max_batch"]), int(msg.get("verify_tokens", 0)))
    if op == "capture_graphs":
        return runner.capture_graphs(msg["capture"])
    if op == "check_graphs":
        assert runner.graphs is not None, "check_graphs before capture_graphs"
        return runner.graphs.check()
    if op == "graphs_off":
        runner.graphs = None
        return None
    raise ValueError(f"unknown tensor-parallel call {op!r}")


def share_nbytes(runner: TorchModelRunner, num_pages: int, slot: int) -> int:
    """Bytes of this rank's share of an entry of ``num_pages`` pages (and the state slot when ``slot >= 0``)."""
    return runner.entry_nbytes(num_pages, slot >= 0 and runner.state is not None)


def sync(device: torch.device) -> None:
    """Wait for the device's copies to / from host buffers (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- rank > 0 --------------------------------------------------------------------------------------
def serve_one(runner: TorchModelRunner, group: TPGroup, msg: dict[str, Any], log: Any) -> None:
    """A worker's part of one call: run it (and move its bytes), then report the status."""
    op, failed = msg["op"], False
    try:
        if op == EXPORT:
            pages, slot = [int(p) for p in msg["pages"]], int(msg["slot"])
            buf = torch.zeros(share_nbytes(runner, len(pages), slot), dtype=torch.uint8)
            try:
                runner.export_kv(pages, slot, Region([buf]))
                sync(runner.device)
            except Exception:
                failed = True
                log.exception("tp_call_failed", op=op, rank=group.rank)
            group.send_bytes(buf, 0)  # always: rank 0 waits for it
        elif op == IMPORT:
            pages, slot = [int(p) for p in msg["pages"]], int(msg["slot"])
            buf = torch.empty(share_nbytes(runner, len(pages), slot), dtype=torch.uint8)
            group.recv_bytes(buf, 0)
            runner.import_kv(pages, slot, int(msg["position"]), Region([buf]), len(pages))
            sync(runner.device)
        else:
            execute(runner, msg)
    except Exception:
        failed = True
        log.exception("tp_call_failed", op=op, rank=group.rank)
    group.status(failed)


def _watch_parent(parent: int) -> None:
    """Exit when the engine process (rank 0) is gone, even while blocked outside a collective."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepwell.engine_service.parallel.worker",
                                     description="a tensor-parallel rank > 0 of an engine (started by rank 0)")
    parser.add_argument("rank", type=int)
    rank = parser.parse_args(argv).rank
    spec = json.loads(sys.stdin.read())
    from deepwell.logs import get_logger, setup_logging

    setup_logging(f"engine-tp{rank}", spec.get("log_level", "info"))
    log = get_logger("engine_service.parallel")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="tp-parent").start()
    if spec.get("cpu_threads"):
        torch.set_num_threads(int(spec["cpu_threads"]))
    world = int(spec["world"])
    store = client_store(int(spec["port"]), world)
    store.set(f"tp_up_{rank}", "1")  # rank 0 waits for every worker's key before it joins
    group = join(store, rank, world, rank_device(torch.device(spec["device"]), rank))
    try:
        runner = None
        try:
            from deepwell.engine_service.loading import open_model

            opts = RunnerOptions(**spec["options"])
            source = open_model(spec["model"], weights=not opts.random)
            source.config = spec["config"]
            runner = build_rank_runner(source, group, opts)
        except Exception:
            log.exception("tp_rank_build_failed", rank=rank)
        if group.status(runner is None) or runner is None:
            return 1
        while True:
            msg = group.broadcast_message()
            if msg["op"] == STOP:
                return 0
            serve_one(runner, group, msg, log)
    except Exception:  # rank 0 is gone (a collective failed): nothing left to serve
        log.exception("tp_worker_exiting", rank=rank)
        return 2
    finally:
        leave()


if __name__ == "__main__":
    sys.exit(main())
