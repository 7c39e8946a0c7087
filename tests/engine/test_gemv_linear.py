"""``--linear-kernel gemv`` (``layers.gemv_linear``): decode steps' linear layers through the
split-K GEMV (here under the Triton interpreter), prefill chunks through torch's GEMM; the same
tokens and, in fp32, logits within the summation order of the plain model's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepwell.configs import ConfigError
from deepwell.engine_service.config import EngineConfig
from deepwell.engine_service.engine import EngineCore, EngineLimits, TokensEvent
from deepwell.engine_service.layers import gemv_linear
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import build_runner
from deepwell.engine_service.sampling import SamplingParams
from tests.engine.helpers_models import save_tiny

# These tests run the Triton kernels on CPU tensors through the interpreter. tests/conftest.py
# sets TRITON_INTERPRET=1 only where no GPU is visible (triton reads it when a kernel is
# defined), so under CUDA this process compiles kernels for the GPU and cannot run them: there
# test_in_a_triton_interpreter_process runs this file in a child process with the interpreter
# and no GPU, as on a CPU machine.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_the_interpreter = pytest.mark.skipif(not INTERPRETED, reason="no Triton interpreter in this process: run by "
                                        "test_in_a_triton_interpreter_process")


EXPECTED_PASSED = 2  # the tests below


@pytest.mark.skipif(INTERPRETED, reason="this process has the Triton interpreter: the tests run here")
def test_in_a_triton_interpreter_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert re.search(rf"\b{EXPECTED_PASSED} passed", proc.stdout), proc.stdout[-2000:]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3_5_gemv")
    save_tiny("qwen3_5", d)
    return d


def _generate(path: Path, kernel: str) -> tuple[list[int], list[torch.Tensor]]:
    runner = build_runner(open_model(path), page_size=8, linear_kernel=kernel)
    core = EngineCore(runner, EngineLimits(num_pages=32, num_state_slots=4, max_concurrency=2, token_budget=64,
                                           queue_size=4, max_context=256))
    logits: list[torch.Tensor] = []
    forward = runner.forward
    runner.forward = lambda *a, **k: logits.append(forward(*a, **k)) or logits[-1]  # type: ignore[method-assign]
    out: list[int] = []
    prompt = torch.randint(3, 250, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    req = core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                            sink=lambda ev: out.extend(ev.token_ids) if isinstance(ev, TokensEvent) else None)
    core.submit(req)
    while core.has_work():
        core.step()
    return out, logits


@in_the_interpreter
def test_gemv_decode_equals_torch(qwen: Path) -> None:
    plain, plain_logits = _generate(qwen, "torch")
    fast, fast_logits = _generate(qwen, "gemv")
    assert fast == plain and len(plain) == 4
    assert len(fast_logits) == 4  # the prefill chunk (its layers: torch's GEMM; the LM head's one row: the GEMV)
    for a, b in zip(fast_logits, plain_logits, strict=True):  # then decode steps: every linear the GEMV
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@in_the_interpreter
def test_gemv_layers_and_refusals(qwen: Path) -> None:
    runner = build_runner(open_model(qwen), page_size=8, linear_kernel="gemv")
    kinds = {type(m) for m in runner.model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {gemv_linear.GemvLinear}
    assert gemv_linear.resolve("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="linear_kernel must be"):
        gemv_linear.resolve("cublas", torch.device("cpu"))
    with pytest.raises(ConfigError, match="linear_kernel"):
        EngineConfig(linear_kernel="gemv", device="cpu")
    with pytest.raises(ConfigError, match="linear_kernel"):
        EngineConfig(linear_kernel="gemv", device="cuda", tensor_parallel=2)
