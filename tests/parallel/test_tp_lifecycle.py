"""Tensor parallelism's checks and lifetime: sizes that do not divide the model are refused with
the numbers (before any process starts), the tensor cuts put back together are the checkpoint's
tensors, one rank behaves as the single-process runner, ``close`` stops the workers, and a
worker that dies is an error rather than a hang."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from deepwell import configs
from deepwell.engine_service import cli
from deepwell.engine_service.config import EngineConfig
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.models.registry import resolve
from deepwell.engine_service.models.spec import ModelArgs
from deepwell.engine_service.parallel import runner as tp_runner_module
from deepwell.engine_service.parallel.runner import build_tp_runner
from deepwell.engine_service.parallel.shard import TPConfigError, shard_args, shard_tensor, vocab_rows
from deepwell.engine_service.runner import build_runner
from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice
from tests.engine.helpers_models import TINY, prompt
from tests.parallel.helpers_tp import tp_runner


def _args(name: str, **over: Any) -> ModelArgs:
    module, _, _, kwargs = TINY[name]
    family, tc = resolve({"model_type": module, **kwargs, **over})
    return family.build_args(tc)


def test_sizes_that_do_not_divide_are_named() -> None:
    with pytest.raises(TPConfigError) as exc:
        shard_args(_args("llama"), 3)
    msg = str(exc.value)
    assert "tensor_parallel=3" in msg and "num_attention_heads (4)" in msg and "num_key_value_heads (2)" in msg
    assert "intermediate_size (128)" in msg
    with pytest.raises(TPConfigError) as exc:
        shard_args(_args("qwen3_5"), 4)
    msg = str(exc.value)
    assert "num_key_value_heads (2)" in msg and "linear_num_key_heads (2)" in msg
    assert "num_attention_heads" not in msg and "linear_num_value_heads" not in msg
    with pytest.raises(TPConfigError, match=r"moe_intermediate_size \(33\)"):
        shard_args(_args("qwen3_5_moe", moe_intermediate_size=33), 2)
    with pytest.raises(TPConfigError, match=">= 1"):
        shard_args(_args("llama"), 0)


def test_shard_args_divide_heads_and_sizes() -> None:
    full = _args("qwen3_5")
    half = shard_args(full, 2)
    assert (half.attention.num_heads, half.attention.num_kv_heads) == (2, 1)
    assert half.gdn is not None and (half.gdn.num_k_heads, half.gdn.num_v_heads) == (1, 2)
    assert half.intermediate == 64 and half.vocab_size == full.vocab_size and half.hidden == full.hidden


def test_cuts_put_together_are_the_tensors() -> None:
    args = _args("qwen3_5", vocab_size=255)  # an odd vocabulary: the last rank's rows are padded
    g = torch.Generator().manual_seed(0)

    def cuts(name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        t = torch.randn(shape, generator=g)
        return t, [shard_tensor(name, t, args, r, 2) for r in range(2)]

    t, (a, b) = cuts("model.layers.1.self_attn.q_proj.weight", (256, 64))
    assert torch.equal(torch.cat([a, b]), t)
    t, (a, b) = cuts("model.layers.1.self_attn.o_proj.weight", (64, 128))
    assert torch.equal(torch.cat([a, b], dim=1), t)
    t, (a, b) = cuts("model.layers.1.self_attn.o_proj.bias", (64,))
    assert torch.equal(a, t) and not b.any()  # the bias is added once, by rank 0
    gdn = args.gdn
    assert gdn is not None
    for name, shape in (("model.layers.0.linear_attn.in_proj_qkv.weight", (gdn.conv_dim, 64)),
                        ("model.layers.0.linear_attn.conv1d.weight", (gdn.conv_dim, 1, 4))):
        t, (a, b) = cuts(name, shape)
        q, k, v = torch.split(t, [gdn.key_dim, gdn.key_dim, gdn.value_dim])
        half = [gdn.key_dim // 2, gdn.key_dim // 2, gdn.value_dim // 2]
        for r, s in enumerate((a, b)):
            for part, mine in zip((q, k, v), torch.split(s, half)):
                assert torch.equal(mine, part.chunk(2)[r])
    t, (a, b) = cuts("model.layers.0.linear_attn.A_log", (4,))
    assert torch.equal(torch.cat([a, b]), t)
    t, (a, b) = cuts("model.layers.0.mlp.experts.gate_up_proj", (3, 2 * 32, 64))
    assert torch.equal(torch.cat([a[:, :16], b[:, :16], a[:, 16:], b[:, 16:]], dim=1), t)
    t, (a, b) = cuts("model.embed_tokens.weight", (255, 64))
    assert vocab_rows(255, 2) == 128 and a.shape == b.shape == (128, 64)
    assert torch.equal(torch.cat([a, b])[:255], t) and not b[127].any()
    t, (a, b) = cuts("model.layers.0.input_layernorm.weight", (64,))
    assert torch.equal(a, t) and torch.equal(b, t)


def test_bad_sizes_are_refused_before_any_process_starts(tiny_dir: Callable[[str], Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_spawn(*_: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(tp_runner_module, "_spawn", no_spawn)
    path = tiny_dir("llama")
    with pytest.raises(TPConfigError, match="num_key_value_heads"):
        build_tp_runner(4, open_model(path))
    cfg = EngineConfig(tensor_parallel=3, page_size=8)
    with pytest.raises(configs.ConfigError, match=r"invalid tensor_parallel=3: .*num_attention_heads \(4\)"):
        cli._build_runner(build_runner, cfg, open_model(path), torch.device("cpu"), torch.float32)
    with pytest.raises(configs.ConfigError, match="tensor_parallel"):
        EngineConfig(tensor_parallel=0)


def test_one_rank_is_the_single_process_runner(tiny_dir: Callable[[str], Path]) -> None:
    path = tiny_dir("qwen3_5")
    tp = build_tp_runner(1, open_model(path), page_size=8)
    try:
        single = build_runner(open_model(path), page_size=8)
        ids = prompt(11)
        out = []
        for r in (tp, single):
            r.allocate(4, 2)
            r.reset_state(1)
            out.append(r.forward(ForwardBatch(torch.tensor(ids), [SeqSlice(1, [2, 0], 0, 11)])))
        assert torch.equal(out[0], out[1])
    finally:
        tp.close()


def test_close_stops_the_workers(tiny_dir: Callable[[str], Path]) -> None:
    with tp_runner(tiny_dir("llama"), page_size=8) as tp:
        tp.allocate(4, 0)
        proc = tp._ranks.procs[0]
    assert proc.wait(timeout=10) == 0
    tp.close()  # again: nothing left to do
    with pytest.raises(RuntimeError, match="closed"):
        tp.reset_state(0)


def test_a_dead_worker_is_an_error_not_a_hang(tiny_dir: Callable[[str], Path]) -> None:
    with tp_runner(tiny_dir("llama"), page_size=8) as tp:
        tp.allocate(4, 0)
        proc = tp._ranks.procs[0]
        proc.kill()
        proc.wait()
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            tp.forward(ForwardBatch(torch.tensor(prompt(4)), [SeqSlice(-1, [0], 0, 4)]))
