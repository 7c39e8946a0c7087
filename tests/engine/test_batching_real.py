"""Batching invariance on the real runner (fp32 greedy, CPU), prefix cache off (its own
tests: ``test_prefix_reuse_real.py``).

Tiny random HF models (hybrid qwen3_5 and attention-only llama) and the real SmolLM2 GGUF:
4 requests with different lengths, token budgets (so different chunkings) and arrival
steps give exactly the tokens each gives alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deepwell.engine_service.engine import EngineCore, EngineLimits, TokensEvent
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import build_runner
from deepwell.engine_service.sampling import SamplingParams

SPECS = [(1, 37, 8, 0), (2, 9, 10, 0), (3, 70, 6, 1), (4, 21, 9, 4)]  # seed, prompt len, max tokens, arrival step


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 5000), (n,), generator=g).tolist()


def _core(path: Path, budget: int, page_size: int, num_pages: int, device: str = "cpu",
          dtype: torch.dtype = torch.float32, chunk: int = 0) -> EngineCore:
    runner = build_runner(open_model(path), device=device, dtype=dtype, page_size=page_size)
    return EngineCore(runner, EngineLimits(num_pages=num_pages, num_state_slots=4, max_concurrency=4,
                                           token_budget=budget, queue_size=8, max_context=512, chunk_tokens=chunk,
                                           prefix_cache=False),
                      eos_ids=())


def _run(core: EngineCore, specs: list[tuple[int, int, int, int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {s[0]: [] for s in specs}
    arrivals: dict[int, list] = {}
    for seed, n, mt, at in specs:
        def sink(ev, seed=seed) -> None:
            if isinstance(ev, TokensEvent):
                out[seed].extend(ev.token_ids)
        req = core.make_request(_prompt(seed, n, core.runner.vocab_size),
                                SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True), sink=sink)
        arrivals.setdefault(at, []).append(req)
    step = 0
    while step <= max(arrivals) or core.has_work():
        for req in arrivals.get(step, []):
            core.submit(req)
        core.step()
        step += 1
        assert step < 2000
    assert core.blocks.used_pages == 0 and core.blocks.used_slots == 0
    return out


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread() -> Iterator[None]:
    """Tiny matmuls on a shared 2-core machine run far faster on one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.engine.helpers_models import save_tiny

    dirs = {}
    for name in ("qwen3_5", "llama"):
        d = tmp_path_factory.mktemp(name)
        save_tiny(name, d)
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("name", ["qwen3_5", "llama"])
def test_tiny_batching_invariance(tiny_dirs: dict[str, Path], name: str) -> None:
    alone_core = _core(tiny_dirs[name], budget=512, page_size=16, num_pages=64)
    alone = {}
    for spec in SPECS:
        alone.update(_run(alone_core, [(spec[0], spec[1], spec[2], 0)]))
    assert [len(alone[s[0]]) for s in SPECS] == [8, 10, 6, 9]
    for budget, page_size, pages, chunk in ((7, 8, 64, 0), (32, 16, 64, 5), (13, 4, 40, 0)):
        together = _run(_core(tiny_dirs[name], budget, page_size, pages, chunk=chunk), SPECS)
        assert together == alone, (name, budget, page_size)


@pytest.mark.gpu
def test_cuda_same_engine_path(tiny_dirs: dict[str, Path]) -> None:
    """On CUDA: fp32 greedy batching invariance for the hybrid model, and bf16 runs clean."""
    path = tiny_dirs["qwen3_5"]
    alone_core = _core(path, budget=512, page_size=16, num_pages=64, device="cuda")
    alone = {}
    for spec in SPECS:
        alone.update(_run(alone_core, [(spec[0], spec[1], spec[2], 0)]))
    assert _run(_core(path, 7, 8, 64, device="cuda"), SPECS) == alone
    bf16 = _run(_core(path, 13, 8, 64, device="cuda", dtype=torch.bfloat16), SPECS)
    assert [len(bf16[s[0]]) for s in SPECS] == [8, 10, 6, 9]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from tests.engine.fixtures_smollm2 import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.mark.slow  # about a minute on 2 busy cores
def test_smollm2_batching_invariance(smollm2: Path) -> None:
    specs = [(1, 30, 6, 0), (2, 7, 8, 0), (3, 45, 5, 1), (4, 16, 7, 3)]
    source = open_model(smollm2)
    runner = build_runner(source, device="cpu", dtype=torch.float32, page_size=16)
    core = EngineCore(runner, EngineLimits(num_pages=48, num_state_slots=0, max_concurrency=4, token_budget=20,
                                           queue_size=8, max_context=768), eos_ids=())
    alone = {}
    for spec in specs:
        alone.update(_run(core, [(spec[0], spec[1], spec[2], 0)]))
    together = _run(core, specs)
    assert together == alone
    assert [len(alone[s[0]]) for s in specs] == [6, 8, 5, 7]
