"""``--linear-kernel gemv`` (``layers.gemv_linear``): decode steps' linear layers through the
split-K GEMV (here under the Triton interpreter), prefill chunks through torch's GEMM; the same
tokens and, in fp32, logits within the summation order of the plain model's."""

from __future__ import annotations

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
from tests.engine.helpers_interpreter import in_the_interpreter, interpreter_rerun
from tests.engine.helpers_models import save_tiny

# Triton on CPU tensors: under CUDA this module reruns itself in an interpreter process
test_in_a_triton_interpreter_process = interpreter_rerun(__file__, expected_passed=2)  # the tests below


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
