"""Decode graphs (``engine_service.graphs``) over 2 tensor-parallel ranks, on CPU: every rank plans
and prepares its shard's static-buffer steps (``capture=False``: the same code a CUDA capture
records, run eagerly), decode steps go through them on every rank, and the logits stay the
single-process runner's within the bound (nvfp4 KV, the paged layout graphs need, with the
rotation and rounding fixed as in ``test_tp_quant``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice
from tests.engine.helpers_models import prompt
from tests.engine.test_kv_quant import save_hybrid
from tests.parallel.helpers_tp import close_to, rel, single_runner, tp_runner


@pytest.fixture(scope="module")
def hybrid64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3_5_d64_graphs")
    save_hybrid(d)
    return d


def test_tp_decode_steps_through_the_graphs(hybrid64: Path) -> None:
    kw = {"page_size": 64, "kv_dtype": "nvfp4", "kv_hadamard": "on", "kv_k_rounding": "nearest", "kv_center_k": "off"}
    single = single_runner(hybrid64, **kw)
    single.allocate(8, 4)
    with tp_runner(hybrid64, **kw) as tp:
        assert tp.graphs is None and tp.graphs_unsupported() is None
        tp.plan_graphs(4)
        tp.allocate(8, 4)
        graphs = tp.capture_graphs(capture=False)
        diff, scale = graphs.check()
        assert diff <= 1e-5 * scale and graphs.describe()["buckets"] == [1, 2, 4]
        lens, tables = (70, 9, 40), [[0, 1], [2], [3]]
        ids = [prompt(n, seed=i + 1) for i, n in enumerate(lens)]
        for r in (tp, single):
            for slot in range(3):
                r.reset_state(slot)
            r.forward(ForwardBatch(torch.tensor([t for x in ids for t in x]),
                                   [SeqSlice(i, tables[i], 0, n) for i, n in enumerate(lens)]))
        pos, nxt = list(lens), [x[-1] for x in ids]
        for _ in range(4):
            batch = ForwardBatch(torch.tensor(nxt), [SeqSlice(i, tables[i], pos[i], 1) for i in range(3)])
            got, ref = tp.forward(batch), single.forward(batch)
            assert close_to(got, ref), rel(got, ref)
            nxt, pos = ref.argmax(-1).tolist(), [p + 1 for p in pos]
        assert tp.graphs is not None and tp.graphs.replays == 4
        tp.graphs = None  # a failed start-up check turns them off on every rank
        assert tp.graphs is None
        batch = ForwardBatch(torch.tensor(nxt), [SeqSlice(i, tables[i], pos[i], 1) for i in range(3)])
        got, ref = tp.forward(batch), single.forward(batch)
        assert close_to(got, ref), rel(got, ref)
