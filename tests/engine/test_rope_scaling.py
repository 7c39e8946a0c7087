"""``--rope-scaling``: YaRN context extension of a model's config (``engine_service.rope_scaling``),
its validation, what ``auto`` means, and that the extended SmolLM2 answers short prompts exactly as
the unextended one (attention factor 1) while serving 4x the context."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepwell.configs import ConfigError
from deepwell.engine_service.config import EngineConfig
from deepwell.engine_service.layers.rope import RopeSpec
from deepwell.engine_service.rope_scaling import DEFAULT_MODEL_YARN, Yarn, for_model, parse, with_yarn

LLAMA = {"model_type": "llama", "max_position_embeddings": 8192, "head_dim": 64,
         "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}


def test_parse_and_auto() -> None:
    assert parse("model") is None and parse("auto") is None
    assert parse("yarn:4") == Yarn(4.0) and parse("yarn:2.5:1") == Yarn(2.5, 1.0)
    for bad in ("yarn", "yarn:1", "yarn:0.5", "yarn:x", "linear:4", "yarn:4:0", "yarn:4:1:2", ""):
        with pytest.raises(ValueError, match="auto, model or yarn"):
            parse(bad)
    assert for_model("auto", default_model=True) == DEFAULT_MODEL_YARN == Yarn(4.0, 1.0)
    assert for_model("auto", default_model=False) is None
    assert for_model("yarn:8", default_model=True) == Yarn(8.0)
    with pytest.raises(ConfigError, match="rope_scaling"):
        EngineConfig(rope_scaling="yarn:1")


def test_yarn_over_the_trained_context() -> None:
    out = with_yarn(LLAMA, Yarn(4.0, 1.0))
    assert LLAMA["max_position_embeddings"] == 8192 and LLAMA["rope_parameters"]["rope_type"] == "default"
    assert out["max_position_embeddings"] == 32768
    assert out["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 100000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 8192, "attention_factor": 1.0}
    spec = RopeSpec.from_config(out, 64)
    assert (spec.rope_type, spec.factor, spec.original_max_position, spec.attention_factor) == ("yarn", 4.0, 8192, 1.0)


def test_a_yarn_checkpoint_keeps_its_original_and_a_vlm_its_text_config() -> None:
    qwen = {"text_config": {"max_position_embeddings": 131072, "partial_rotary_factor": 0.25,
                            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7,
                                                "original_max_position_embeddings": 32768,
                                                "mrope_section": [11, 11, 10]}},
            "architectures": ["X"]}
    out = with_yarn(qwen, Yarn(8.0))
    tc = out["text_config"]
    assert tc["max_position_embeddings"] == 262144 and out["architectures"] == ["X"]
    assert tc["rope_parameters"] == {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e7,
                                     "original_max_position_embeddings": 32768, "mrope_section": [11, 11, 10]}
    legacy = {"max_position_embeddings": 4096, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    out = with_yarn(legacy, Yarn(2.0))
    assert "rope_scaling" not in out and out["rope_parameters"]["rope_type"] == "yarn"
    assert out["rope_parameters"]["rope_theta"] == 1e4 and out["max_position_embeddings"] == 8192


def test_extended_smollm2_answers_short_prompts_as_before() -> None:
    from tokenizers import Tokenizer

    from deepwell.engine_service.runner import build_runner
    from tests.engine.fixtures_smollm2 import smollm2_source
    from tests.engine.test_smollm2 import PAGES, our_greedy

    src = smollm2_source()
    tok = Tokenizer.from_str(src.files["tokenizer.json"]().decode("utf-8"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = build_runner(src, "cpu", torch.float32)
        extended = build_runner(dataclasses.replace(src, config=with_yarn(src.config, DEFAULT_MODEL_YARN)),
                                "cpu", torch.float32)
        assert extended.max_context == 4 * plain.max_context == 32768
        for r in (plain, extended):
            r.allocate(PAGES, 0)
        for q in ("What is the capital of France?", "Name three primary colors."):
            ids = tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
            a, _ = our_greedy(plain, ids, 16, 2)
            b, _ = our_greedy(extended, ids, 16, 2)
            assert a == b, (tok.decode(a), tok.decode(b))
    finally:
        torch.set_num_threads(before)
