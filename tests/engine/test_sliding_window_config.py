"""Sliding-window configs of the plain-attention families: refused only when some layer
would really attend within a window, by HF's rule for qwen2/qwen3 ``layer_types``
(``use_sliding_window`` + ``sliding_window``, layers from ``max_window_layers`` on)."""

from __future__ import annotations

import pytest

from deepwell.engine_service.models.llama import qwen2_args, qwen3_args, sliding_window_layers
from deepwell.engine_service.models.spec import FULL

LAYERS = 4


def config(**extra):
    return {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": LAYERS, "intermediate_size": 128, "vocab_size": 256, "hidden_act": "silu",
            "rope_theta": 10000.0, "max_position_embeddings": 512, **extra}


def test_use_sliding_window_with_every_layer_below_max_window_layers_is_full_attention():
    # Qwen2.5 ships configs like this: the flag is on, but max_window_layers == num_hidden_layers
    for build in (qwen2_args, qwen3_args):
        args = build(config(use_sliding_window=True, sliding_window=32, max_window_layers=LAYERS))
        assert args.layer_types == (FULL,) * LAYERS
        args = build(config(use_sliding_window=True, sliding_window=32, max_window_layers=LAYERS + 10))
        assert args.layer_types == (FULL,) * LAYERS


@pytest.mark.parametrize("extra", [
    {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": LAYERS - 1},
    {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0},
    {"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
])
def test_a_layer_that_would_use_a_window_is_refused(extra):
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        qwen2_args(config(**extra))


@pytest.mark.parametrize("extra", [
    {}, {"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 32, "layer_types": ["full_attention"] * LAYERS},
    {"use_sliding_window": True},  # HF defaults: window 4096 from layer 28 on, beyond these 4 layers
])
def test_full_attention_configs_are_accepted(extra):
    assert qwen2_args(config(**extra)).layer_types == (FULL,) * LAYERS


@pytest.mark.parametrize("layers", [2, 4, 30])
@pytest.mark.parametrize("extra", [
    {}, {"use_sliding_window": True}, {"use_sliding_window": True, "sliding_window": 16},
    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 4},
    {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
])
def test_same_layers_as_hf(layers, extra):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2Config(num_hidden_layers=layers, **extra)
    expected = [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"]
    assert sliding_window_layers(config(num_hidden_layers=layers, **extra), layers) == expected
