"""Tiny random HF models written to real safetensors directories, for parity tests.

``TINY`` names every config the suite covers: each registered architecture, GQA ratios
other than the real ones, a qwen3_5 with YaRN (factor 4, original context scaled down to
32 tokens) and one with linear scaling, a qwen3_5_moe and a qwen3_next that mixes dense
and MoE layers. ``make_hf(name)`` builds the transformers model (fp32, eager attention)
with weights perturbed away from their init (norm weights, biases, gates) so every path
matters; ``save_tiny(name, dir)`` writes it with ``save_pretrained``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 256

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.08,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

_HYBRID: dict[str, Any] = {
    **_COMMON,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}

# name -> (module, config class, model class, kwargs)
TINY: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {
        **_COMMON, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {
        **_COMMON, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {
        **_COMMON, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "qwen3_5": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(_HYBRID)),
    "qwen3_5_yarn": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        **_HYBRID, "max_position_embeddings": 128, "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 32, "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5},
    }),
    "qwen3_5_linear": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        **_HYBRID, "linear_num_key_heads": 1, "linear_num_value_heads": 4,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    }),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        **_HYBRID, "num_attention_heads": 8, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    }),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **_HYBRID, "num_key_value_heads": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 1, "mlp_only_layers": [2], "norm_topk_prob": False,
    }),
}


def make_hf(name: str, seed: int = 0) -> torch.nn.Module:
    import importlib

    module, cfg_cls, model_cls, kwargs = TINY[name]
    mod = importlib.import_module(f"transformers.models.{module}")
    config = getattr(mod, cfg_cls)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(mod, model_cls)(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1 and not pname.endswith("A_log"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def save_tiny_head_dim(name: str, directory: Path, head_dim: int = 64) -> None:
    """A tiny config of ``TINY`` with another head_dim (the quantized and paged KV formats take
    64 / 128 / 256), its default initialization, saved as a checkpoint."""
    import importlib

    module, cfg_cls, model_cls, kwargs = TINY[name]
    mod = importlib.import_module(f"transformers.models.{module}")
    torch.manual_seed(0)
    getattr(mod, model_cls)(getattr(mod, cfg_cls)(**{**kwargs, "head_dim": head_dim})).float().save_pretrained(directory)


def save_tiny(name: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    model = make_hf(name, seed)
    model.save_pretrained(directory)
    return model


# transformers binds these to fla-core's / causal-conv1d's kernels when those import (the GPU
# machine carries fla-core); the plain-torch function is the wrapper's ``__wrapped__``
HF_KERNEL_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update")


@contextmanager
def hf_torch_path(model: torch.nn.Module) -> Iterator[None]:
    """Run an HF model on CPU through its plain-torch Gated DeltaNet functions even where
    fla-core is importable (its Triton kernels take no CPU tensors)."""
    saved = []
    if next(model.parameters()).device.type == "cpu":
        for mod in {sys.modules[type(m).__module__] for m in model.modules()}:
            for name in HF_KERNEL_FUNCS:
                fn = getattr(mod, name, None)
                if fn is not None and hasattr(fn, "__wrapped__"):
                    saved.append((mod, name, fn))
                    setattr(mod, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 logits for every position of one prompt, ``[len(ids), vocab]``."""
    with torch.no_grad(), hf_torch_path(model):
        device = next(model.parameters()).device
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    return out.logits[0].float()


def prompt(n: int = 64, seed: int = 5) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (the parity metric: must be <= 1e-4)."""
    return float((ours.float().cpu() - ref).abs().max() / ref.abs().max())


def run_chunks(runner: Any, ids: list[int], chunks: list[int], table: list[int], slot: int = 0,
               start: int = 0) -> list[torch.Tensor]:
    """Feed ``ids`` through one sequence in the given chunk sizes; logits after each chunk."""
    from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice

    out = []
    pos = start
    for c in chunks:
        batch = ForwardBatch(
            torch.tensor(ids[pos - start : pos - start + c], device=runner.device),
            [SeqSlice(slot, table, pos, c)],
        )
        out.append(runner.forward(batch)[0])
        pos += c
    return out


def chunk_logits(runner: Any) -> torch.Tensor:
    """A fresh runner's logits after chunks of 30, 1 and 9 tokens of ``prompt(40)`` (8 pages, 1
    state slot): the FP8 weight tests' comparison."""
    runner.allocate(8, 1)
    runner.reset_state(0)
    return torch.stack(run_chunks(runner, prompt(40), [30, 1, 9], list(range(8))))


def write_fp8_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> None:
    """``tensors`` (codes, ``*_scale_inv`` and 16-bit ones) saved as ``dst``, an FP8 block-scaled
    checkpoint (Qwen's ``quantization_config`` with ``block``) with ``src``'s config and side files."""
    import json
    import shutil

    from safetensors.torch import save_file

    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    for side in src.iterdir():
        if side.name not in ("model.safetensors", "config.json"):
            shutil.copy(side, dst / side.name)


def greedy_three(core: Any, max_tokens: int = 8) -> list[list[int]]:
    """Three greedy requests (prompts of 40, 90 and 7 tokens) through an ``EngineCore`` until done:
    each one's generated tokens; every page is free again after."""
    from deepwell.engine_service.engine import TokensEvent
    from deepwell.engine_service.sampling import SamplingParams

    outs: list[list[int]] = [[] for _ in range(3)]
    for i, n in enumerate((40, 90, 7)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.submit(core.make_request(prompt(n, seed=i + 1), params, sink=lambda ev, i=i: outs[i].extend(
            ev.token_ids) if isinstance(ev, TokensEvent) else None))
    for _ in range(500):
        if not core.has_work():
            break
        core.step()
    assert not core.has_work() and core.blocks.used_pages == 0
    return outs


@pytest.fixture(scope="module", autouse=False)
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy shared CPU torch's
    spinning worker threads make each op ~20x slower: run these modules single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
