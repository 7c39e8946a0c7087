"""A bf16 KV cache in the kernels' paged layout (``--kv-paged``): the same decode / verify /
prefill kernel family as the quantized formats, no gather. On CPU the pool runs the kernels'
reference; the Triton kernels themselves are compared with it in ``tests/kernels``.

The engine with the paged bf16 cache gives the float (gathered) bf16 pool's logits within bf16
rounding and the same greedy tokens, through chunked prefill, decode batches and speculative
verify slices; ``auto`` picks it on CUDA only; impossible settings say what to change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepwell.engine_service.config import EngineConfig
from deepwell.engine_service.engine import EngineCore, EngineLimits
from deepwell.engine_service.kv.quant_pool import KVSettingsError, QuantKVPool
from deepwell.engine_service.kv.settings import KVSettings, resolve
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import build_runner
from tests.engine.helpers_models import greedy_three, one_torch_thread, prompt, run_chunks

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.fixture(scope="module")
def hybrid64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.test_kv_quant import save_hybrid

    d = tmp_path_factory.mktemp("hybrid64")
    save_hybrid(d)
    return d


def _runner(path: Path, paged: str, device: str = "cpu"):  # type: ignore[no-untyped-def]
    return build_runner(open_model(path), device=device, dtype=torch.bfloat16, kv_dtype="bf16", page_size=64,
                        kv_paged=paged)


def test_resolve_picks_paged_bf16_on_cuda_only() -> None:
    kw = {"model_dtype": torch.bfloat16, "num_layers": 2, "num_kv_heads": 2, "head_dim": 128, "page_size": 64}
    assert resolve(KVSettings("bf16"), **kw).quant_layout is None  # CPU: the float pool
    cuda = resolve(KVSettings("auto"), device_type="cuda", **kw)
    assert cuda.paged_float and cuda.name == "bf16" and cuda.quant_layout is not None
    assert not cuda.quant_layout.hadamard
    assert cuda.bytes_per_page == resolve(KVSettings("bf16", paged="off"), device_type="cuda", **kw).bytes_per_page
    assert resolve(KVSettings("fp16"), device_type="cuda", **kw).quant_layout is None  # fp16 stays gathered
    assert resolve(KVSettings("bf16"), device_type="cuda", **{**kw, "head_dim": 32}).quant_layout is None
    with pytest.raises(KVSettingsError, match="head_dim 32 is not one of"):
        resolve(KVSettings("bf16", paged="on"), **{**kw, "head_dim": 32})
    with pytest.raises(KVSettingsError, match="its dtype is float32"):
        resolve(KVSettings("fp32", paged="on"), **kw)
    with pytest.raises(ValueError, match="kv_paged"):
        EngineConfig(kv_dtype="nvfp4", kv_paged="on")


def test_paged_bf16_logits_match_the_gathered_pool(hybrid64: Path) -> None:
    ids = prompt(150)
    out = {}
    for paged in ("off", "on"):
        r = _runner(hybrid64, paged)
        assert isinstance(r.kv, QuantKVPool) == (paged == "on") or r.kv is None
        r.allocate(8, 1)
        assert isinstance(r.kv, QuantKVPool) == (paged == "on")
        r.reset_state(0)
        out[paged] = torch.stack(run_chunks(r, ids, [70, 64, 1, 1, 14], list(range(8))))
    ref = out["off"]
    err = (out["on"] - ref).norm() / ref.norm()
    assert err < 2e-2, err
    assert torch.equal(out["on"].argmax(-1), ref.argmax(-1))


def _greedy(path: Path, paged: str) -> list[list[int]]:
    runner = _runner(path, paged)
    core = EngineCore(runner, EngineLimits(num_pages=24, num_state_slots=6, max_concurrency=3, token_budget=48,
                                           queue_size=4, max_context=512, prefix_cache=False), eos_ids=())
    return greedy_three(core)


def test_engine_greedy_tokens_equal_with_either_pool(hybrid64: Path) -> None:
    assert _greedy(hybrid64, "on") == _greedy(hybrid64, "off")
