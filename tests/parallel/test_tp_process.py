"""``deepwell engine --tensor-parallel 2`` as a real process on CPU: it serves over gRPC the greedy
tokens of the single-process engine, and on SIGTERM its worker rank exits with it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from deepwell import grpcx
from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
from deepwell.engine_service.engine import EngineCore, EngineLimits
from deepwell.engine_service.sampling import SamplingParams
from tests.engine.helpers_process import engine_process
from tests.engine.test_batching import Collector
from tests.parallel.helpers_tp import single_runner


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 3 for i in range(n)]


def _worker_pids(log: Path) -> list[int]:
    for line in log.read_text().splitlines():
        if '"tp_started"' in line:
            return list(json.loads(line)["workers"])
    raise AssertionError(f"no tp_started line in {log}")


async def test_engine_process_serves_with_two_ranks(tiny_dir: Callable[[str], Path], tmp_path: Path) -> None:
    path = tiny_dir("qwen3_5")
    prompts = [(_prompt(1, 27), 6), (_prompt(2, 9), 4)]
    core = EngineCore(single_runner(path, page_size=8), EngineLimits(40, 12, 4, 24, 8, 512))
    want = []
    for ids, n in prompts:
        col = Collector()
        core.submit(core.make_request(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), sink=col))
        while core.has_work():
            core.step()
        want.append(col.tokens)
    # --device cpu: two CPU ranks with gloo (device auto would take CUDA where a GPU is visible)
    with engine_process(tmp_path, ["--model", str(path), "--tensor-parallel", "2", "--num-pages", "40",
                                   "--page-size", "8", "--token-budget", "24", "--cpu-threads", "1",
                                   "--device", "cpu"]) as (addr, _):
        pids = _worker_pids(tmp_path / "stderr.log")
        assert len(pids) == 1
        os.kill(pids[0], 0)  # alive while the engine serves
        async with grpcx.aio_channel(addr) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            got = []
            for ids, n in prompts:
                sampling = engine_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                msgs = [m async for m in stub.Generate(engine_pb2.GenerateRequest(prompt_token_ids=ids,
                                                                                  sampling=sampling))]
                got.append([t for m in msgs if m.HasField("tokens") for t in m.tokens.token_ids])
        assert got == want
    try:  # the engine has exited (SIGTERM): its worker went with it
        os.kill(pids[0], 0)
        raise AssertionError(f"worker {pids[0]} outlived the engine")
    except ProcessLookupError:
        pass
