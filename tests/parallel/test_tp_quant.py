"""A quantized KV cache (nvfp4, K centered per page, calibrated at start) over 2 tensor-parallel
ranks: each rank calibrates its own KV heads on the same scratch forward, and with the rotation
and the rounding fixed (``--kv-hadamard on``, ``--kv-k-rounding nearest``: no choice made per
layer over a rank's heads only) the logits are the single-process runner's within the bound."""

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
    d = tmp_path_factory.mktemp("qwen3_5_d64")
    save_hybrid(d)
    return d


def test_nvfp4_ranks_calibrate_their_heads_as_one_process_does(hybrid64: Path) -> None:
    kw = {"page_size": 64, "kv_dtype": "nvfp4", "kv_hadamard": "on", "kv_k_rounding": "nearest",
          "kv_center_k": "page"}
    single = single_runner(hybrid64, **kw)
    with tp_runner(hybrid64, **kw) as tp:
        out = []
        for r in (single, tp):
            r.allocate(4, 2)
            cal = r.calibrate_kv(prompt(100, seed=9))
            assert cal is not None and cal.page_means is not None
            r.reset_state(1)
            ids = prompt(70, seed=1)
            a = r.forward(ForwardBatch(torch.tensor(ids[:65]), [SeqSlice(1, [3, 1], 0, 65)]))
            b = r.forward(ForwardBatch(torch.tensor(ids[65:]), [SeqSlice(1, [3, 1], 65, 5)]))
            out.append((a, b))
        assert tp.kv_dtype_name == "nvfp4"
        for got, ref in zip(out[1], out[0]):
            assert close_to(got, ref), rel(got, ref)
