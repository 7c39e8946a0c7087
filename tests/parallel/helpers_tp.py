"""Tiny models and runners for the tensor-parallel tests (CPU, gloo, 2 ranks, fp32).

``tiny_dir(name)`` writes a tiny HF model of ``tests.engine.helpers_models.TINY`` once per test
session; ``tp_runner(path)`` starts a 2-rank ``TPModelRunner`` over it (rank 0 in the test
process, rank 1 a worker process on loopback) and always closes it; ``single_runner(path)`` is
the single-process runner the TP one is compared with. ``close_to(a, b)`` is the acceptance
bound: ``max |a - b| <= 1e-5 * max |b|``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from deepwell.engine_service.loading import open_model
from deepwell.engine_service.parallel.runner import TPModelRunner, build_tp_runner
from deepwell.engine_service.runner import TorchModelRunner, build_runner

TP = 2
TOLERANCE = 1e-5  # of max |logit|


@contextmanager
def tp_runner(path: Path, **kw: object) -> Iterator[TPModelRunner]:
    runner = build_tp_runner(TP, open_model(path), log_level="warning", **kw)  # type: ignore[arg-type]
    try:
        yield runner
    finally:
        runner.close()


def single_runner(path: Path, **kw: object) -> TorchModelRunner:
    return build_runner(open_model(path), **kw)  # type: ignore[arg-type]


def close_to(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return float((got - ref).abs().max()) <= TOLERANCE * float(ref.abs().max())


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())
