"""HF parity: fp32 logits of a 64-token prompt within 1e-4 x max|logit| of transformers,
for every tiny config (every registered architecture), computed in one prefill, in chunks
of 7, and token by token, through ``runner.forward`` with fragmented pages + a state slot.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepwell.engine_service.loading import open_model
from deepwell.engine_service.models import supported
from deepwell.engine_service.runner import build_runner
from tests.engine.helpers_models import (
    TINY,
    hf_logits,
    one_torch_thread,
    prompt,
    rel_err,
    run_chunks,
    save_tiny,
)

TOL = 1e-4
TABLE = [7, 2, 9, 4, 0]  # non-contiguous pages (page_size 16 -> 80 tokens)
SCHEDULES = {"prefill": [64], "chunks7": [7] * 9 + [1], "per_token": [1] * 64}

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    root = tmp_path_factory.mktemp("tiny")
    ids = prompt()
    out = {}
    for name in TINY:
        model = save_tiny(name, root / name)
        out[name] = (root / name, hf_logits(model, ids))
    return out


def test_every_registered_model_type_has_a_parity_config(
    cases: dict[str, tuple[Path, torch.Tensor]],
) -> None:
    covered = {json.loads((p / "config.json").read_text())["model_type"] for p, _ in cases.values()}
    for model_type in supported():
        # VLM wrappers (qwen3_5, qwen3_5_moe) load their ``*_text`` model: the text config
        # is what parity covers; test_runner_loading covers the wrapper layout.
        assert model_type in covered or f"{model_type}_text" in covered, model_type


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(TINY))
def test_parity(name: str, schedule: str, cases: dict[str, tuple[Path, torch.Tensor]]) -> None:
    path, ref = cases[name]
    runner = build_runner(open_model(path), page_size=16)
    runner.allocate(num_pages=12, num_state_slots=3)
    runner.reset_state(1)
    chunks = SCHEDULES[schedule]
    logits = run_chunks(runner, prompt(), chunks, TABLE, slot=1)
    ends = [sum(chunks[: i + 1]) for i in range(len(chunks))]
    errs = [rel_err(lg, ref[e - 1]) for lg, e in zip(logits, ends, strict=True)]
    assert max(errs) <= TOL, (name, schedule, max(errs))
