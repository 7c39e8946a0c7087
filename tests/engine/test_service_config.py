"""EngineConfig flags/env/validation and the KV-pool sizing rule (no model, no server)."""

from __future__ import annotations

import argparse

import pytest
import torch

from deepwell import configs
from deepwell.engine_service.cli import configure, size_pools
from deepwell.engine_service.config import ENV_PREFIX, EngineConfig
from deepwell.engine_service.runner_api import MemorySpec


def parse(argv: list[str], env: dict[str, str] | None = None) -> EngineConfig:
    p = argparse.ArgumentParser()
    configure(p)
    return configs.from_args(EngineConfig, p.parse_args(argv), ENV_PREFIX, environ=env or {})


def test_defaults_flags_and_env() -> None:
    cfg = parse([])
    assert (cfg.listen, cfg.page_size, cfg.model, cfg.device) == ("127.0.0.1:50051", 64, "", "auto")
    cfg = parse(["--token-budget", "64"], {"DEEPWELL_ENGINE_TOKEN_BUDGET": "128", "DEEPWELL_ENGINE_PAGE_SIZE": "16"})
    assert (cfg.token_budget, cfg.page_size) == (64, 16)  # flag > env > default


@pytest.mark.parametrize("kw,msg", [
    ({"token_budget": 0}, "invalid token_budget=0"), ({"device": "tpu"}, "invalid device='tpu'"),
    ({"kv_dtype": "q4"}, "invalid kv_dtype='q4'"), ({"listen": "nowhere"}, "invalid listen='nowhere'"),
    ({"memory_fraction": 0.0}, "invalid memory_fraction=0.0"), ({"metrics_port": -2}, "invalid metrics_port=-2"),
    ({"max_concurrency": 0}, "invalid max_concurrency=0"), ({"page_size": 0}, "invalid page_size=0"),
])
def test_validation(kw: dict, msg: str) -> None:
    with pytest.raises(configs.ConfigError, match=msg):
        EngineConfig(**kw)


def test_size_pools() -> None:
    cpu = torch.device("cpu")
    hybrid = MemorySpec(page_size=64, bytes_per_page=1 << 20, bytes_per_state_slot=1 << 20,
                        num_attention_layers=1, num_recurrent_layers=3)
    dense = MemorySpec(page_size=64, bytes_per_page=1 << 20, bytes_per_state_slot=0,
                       num_attention_layers=4, num_recurrent_layers=0)
    # an explicit --cpu-kv-gib, capped by max_concurrency full-context sequences: 4 * 8192/64 = 512 pages
    # (the default, auto, is one context: tests/engine/test_pool_sizing.py)
    # hybrid: a slot per running request plus two per request for the prefix cache's state images
    assert size_pools(EngineConfig(max_concurrency=4, cpu_kv_gib=2.0), hybrid, 8192, cpu) == (512, 12)
    assert size_pools(EngineConfig(max_concurrency=4, cpu_kv_gib=2.0, prefix_cache="off"), hybrid, 8192,
                      cpu) == (512, 4)
    # limited by the CPU budget: 0.25 GiB / 1 MiB = 256 pages
    assert size_pools(EngineConfig(cpu_kv_gib=0.25), dense, 8192, cpu) == (256, 0)
    assert size_pools(EngineConfig(num_pages=10, state_slots=3), hybrid, 8192, cpu) == (10, 3)
    assert size_pools(EngineConfig(max_context=1024, max_concurrency=2, cpu_kv_gib=2.0), dense, 8192, cpu) == (32, 0)
    with pytest.raises(configs.ConfigError, match="hold no KV page"):
        size_pools(EngineConfig(cpu_kv_gib=0.0001), dense, 8192, cpu)


def test_model_defaults_from_generation_config() -> None:
    from deepwell.engine_service.sampling import SamplingParams
    from deepwell.engine_service.service import default_sampling, eos_ids_of, params_from_proto, special_token_text
    from deepwell.engine.v1 import engine_pb2

    d = default_sampling({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert (d.temperature, d.top_p, d.top_k) == (0.6, 0.95, 20)
    assert default_sampling({"do_sample": False, "temperature": 0.6}).temperature == 0.0
    assert default_sampling({"top_p": 7.0}) == SamplingParams()  # invalid defaults are ignored
    assert eos_ids_of({"eos_token_id": 2}, {"eos_token_id": [7, 8]}) == [7, 8]
    assert eos_ids_of({"eos_token_id": 2}, {}) == [2]
    assert special_token_text(b'{"eos_token": {"content": "</s>"}, "bos_token": "<s>"}', "eos_token") == "</s>"
    assert special_token_text(b"not json", "eos_token") == ""
    p = params_from_proto(engine_pb2.SamplingParams(top_k=5, max_tokens=3), d)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (0.6, 0.95, 5, 3, None)
    p = params_from_proto(engine_pb2.SamplingParams(temperature=0.0, seed=9), d)
    assert (p.temperature, p.seed) == (0.0, 9)


def test_size_pools_on_cuda_refuses_a_pool_below_one_context() -> None:
    cuda = torch.device("cuda")  # only the type is read: free memory is passed in
    spec = MemorySpec(page_size=64, bytes_per_page=1 << 20, bytes_per_state_slot=1 << 20, num_attention_layers=4,
                      num_recurrent_layers=12, page_bytes_by_kv_dtype=(("bf16", 1 << 20), ("nvfp4", 290 << 10)))
    # 10 GiB free, 0.9 of it less 3 slots: 9213 pages (589,632 tokens) >= 2 contexts of 262,144
    assert size_pools(EngineConfig(max_concurrency=1), spec, 262_144, cuda, free_bytes=10 << 30) == (4096, 3)
    with pytest.raises(configs.ConfigError) as err:
        size_pools(EngineConfig(max_concurrency=1), spec, 262_144, cuda, free_bytes=1 << 30)
    msg = str(err.value)
    # the numbers and the fixes: tokens that fit, the context, the budget, what nvfp4 would hold
    assert "holds 58752 tokens" in msg and "one full context of 262144 tokens" in msg
    assert "--memory-fraction 0.9 of 1.0 GiB free" in msg and "nvfp4 207" in msg
    assert "--max-context 58752" in msg
    # an explicit smaller context fits
    assert size_pools(EngineConfig(max_concurrency=1, max_context=32768), spec, 262_144, cuda,
                      free_bytes=1 << 30) == (512, 3)


def test_size_pools_on_cpu_shrinks_the_context_with_a_warning() -> None:
    spec = MemorySpec(page_size=64, bytes_per_page=1 << 20, bytes_per_state_slot=0, num_attention_layers=4,
                      num_recurrent_layers=0)
    assert size_pools(EngineConfig(cpu_kv_gib=0.125), spec, 32768, torch.device("cpu")) == (128, 0)
