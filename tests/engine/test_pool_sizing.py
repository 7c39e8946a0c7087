"""The KV pool's size rule (``engine_service.cli.size_pools``): on CPU sized to what is served.

Default (``cpu_kv_gib = 0``, auto): one full served context (at most ``max_concurrency``), up to
``CPU_KV_AUTO_GIB``; an explicit ``cpu_kv_gib`` is the budget, capped at ``max_concurrency`` full
contexts; ``num_pages`` is the pool whatever the memory."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from deepwell import configs
from deepwell.engine_service.cli import size_pools
from deepwell.engine_service.config import CPU_KV_AUTO_CONTEXTS, CPU_KV_AUTO_GIB, EngineConfig
from deepwell.engine_service.runner_api import MemorySpec

CPU = torch.device("cpu")
# SmolLM2-135M: 30 layers x 3 KV heads x d=64, K and V: 46,080 bytes per token in fp32, 6,480 in nvfp4
SMOL_FP32 = MemorySpec(page_size=64, bytes_per_page=30 * 2 * 3 * 64 * 4 * 64, bytes_per_state_slot=0,
                       num_attention_layers=30, num_recurrent_layers=0)
SMOL_NVFP4 = MemorySpec(page_size=64, bytes_per_page=414_720, bytes_per_state_slot=0, num_attention_layers=30,
                        num_recurrent_layers=0)


def test_auto_is_one_served_context_on_cpu() -> None:
    assert (CPU_KV_AUTO_CONTEXTS, CPU_KV_AUTO_GIB) == (1, 2.0)
    assert EngineConfig().cpu_kv_gib == 0  # the default is auto
    # the embedded default model at its served 32k: 512 pages = 1.41 GiB (was the whole 2 GiB: 728 pages)
    with capture_logs() as logs:
        assert size_pools(EngineConfig(), SMOL_FP32, 32768, CPU) == (512, 0)
    sized = next(e for e in logs if e["event"] == "kv_pool_sized")
    assert (sized["contexts"], sized["sized_by"], sized["pool_gib"]) == (1, "contexts", 1.406)
    assert "auto" in sized["budget"]
    # the same in nvfp4: 0.2 GiB
    assert size_pools(EngineConfig(kv_dtype="nvfp4"), SMOL_NVFP4, 32768, CPU) == (512, 0)
    # a smaller served context, a smaller pool
    assert size_pools(EngineConfig(max_context=8192), SMOL_FP32, 32768, CPU) == (128, 0)
    # never more contexts than requests run at once (1 already) and never more than 2 GiB
    assert size_pools(EngineConfig(max_concurrency=1), SMOL_FP32, 32768, CPU) == (512, 0)
    big = MemorySpec(page_size=64, bytes_per_page=16 << 20, bytes_per_state_slot=0, num_attention_layers=4,
                     num_recurrent_layers=0)
    with capture_logs() as logs:
        assert size_pools(EngineConfig(), big, 32768, CPU) == (128, 0)  # 2 GiB / 16 MiB, below one context
    assert any(e["event"] == "kv_pool_below_context" for e in logs)


def test_explicit_budget_is_an_upper_bound() -> None:
    # 8 GiB asked, 16 contexts allowed: 8 GiB of pages (5.7 contexts)
    assert size_pools(EngineConfig(cpu_kv_gib=8.0), SMOL_FP32, 32768, CPU) == ((8 << 30) // SMOL_FP32.bytes_per_page,
                                                                              0)
    # ... but never more than max_concurrency full contexts
    assert size_pools(EngineConfig(cpu_kv_gib=8.0, max_concurrency=2), SMOL_FP32, 32768, CPU) == (1024, 0)
    # 2 GiB explicit: the old default's pool
    assert size_pools(EngineConfig(cpu_kv_gib=2.0), SMOL_FP32, 32768, CPU) == (728, 0)
    # an explicit pool size wins over both
    assert size_pools(EngineConfig(num_pages=7, cpu_kv_gib=8.0), SMOL_FP32, 32768, CPU) == (7, 0)
    with pytest.raises(configs.ConfigError, match="cpu_kv_gib"):
        EngineConfig(cpu_kv_gib=-1.0)


def test_cuda_sizing_is_unchanged_by_the_cpu_rule() -> None:
    cuda = torch.device("cuda")  # only the type is read: free memory is passed in
    # 16 contexts of 32k fit in 40 GiB free: the concurrency cap, not one context
    assert size_pools(EngineConfig(), SMOL_FP32, 32768, cuda, free_bytes=40 << 30) == (16 * 512, 0)


def test_a_measured_step_comes_off_the_cuda_budget() -> None:
    cuda = torch.device("cuda")
    page = SMOL_FP32.bytes_per_page
    # 1 GiB free x 0.9 = 327 pages of 2.8 MiB; less 300 MiB for a step, 218 (an 8k context is 128)
    free = 1 << 30
    assert size_pools(EngineConfig(max_context=8192), SMOL_FP32, 32768, cuda, free_bytes=free) == (
        int(free * 0.9) // page, 0)
    with capture_logs() as logs:
        got = size_pools(EngineConfig(max_context=8192), SMOL_FP32, 32768, cuda, free_bytes=free,
                         step_bytes=300 << 20)
    assert got == ((int(free * 0.9) - (300 << 20)) // page, 0)
    assert "less 300 MiB for one step of --token-budget 512 tokens" in logs[-1]["budget"]
    # a step that leaves less than one context refuses to start, naming it
    with pytest.raises(configs.ConfigError, match="less 800 MiB for one step"):
        size_pools(EngineConfig(max_context=8192), SMOL_FP32, 32768, cuda, free_bytes=free, step_bytes=800 << 20)


def _tiny_runner(tmp_path, device: str, dtype: torch.dtype):
    from tests.engine.helpers_models import save_tiny

    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import build_runner

    save_tiny("qwen3_5", tmp_path / "m")
    return build_runner(open_model(tmp_path / "m"), device=device, dtype=dtype, page_size=16)


def test_no_step_is_measured_off_cuda(tmp_path) -> None:
    assert _tiny_runner(tmp_path, "cpu", torch.float32).step_activation_bytes(512) == 0  # host memory: not this way


@pytest.mark.gpu
def test_a_step_is_measured_on_cuda(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runner = _tiny_runner(tmp_path, "cuda", torch.bfloat16)
    small, big = runner.step_activation_bytes(64), runner.step_activation_bytes(2048)
    assert 0 < small < big  # activations grow with the step's tokens
    runner.allocate(num_pages=8, num_state_slots=1)  # nothing left behind blocks serving
    runner.reset_state(0)


def test_a_step_that_does_not_fit_refuses_to_start() -> None:
    from deepwell.engine_service.cli import measure_step

    class Runner:
        def __init__(self, result) -> None:  # type: ignore[no-untyped-def]
            self.result = result

        def step_activation_bytes(self, tokens: int) -> int:
            if isinstance(self.result, Exception):
                raise self.result
            return self.result * tokens

    cfg = EngineConfig(token_budget=4096)
    assert measure_step(cfg, Runner(3)) == 3 * 4096
    assert measure_step(cfg, object()) == 0  # a runner that measures nothing (TP, test doubles)
    with pytest.raises(configs.ConfigError, match=r"token_budget=4096.*Lower --token-budget"):
        measure_step(cfg, Runner(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")))
    with pytest.raises(ValueError, match="not memory"):  # any other failure is not reworded
        measure_step(cfg, Runner(ValueError("not memory")))
