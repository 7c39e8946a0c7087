"""Real model: SmolLM2-135M-Instruct (GGUF Q4_1) through our loader + runner vs transformers.

fp32 on CPU: logits within 1e-4 x max|logit| at every step, 32 greedy tokens identical, and
asked "What is the capital of France?" through its own chat template it answers "Paris"; the
loader's config and every tensor equal transformers' loading of the same GGUF.
"""

from __future__ import annotations

import jinja2
import pytest
import torch
from tokenizers import Tokenizer

from deepwell.engine_service.runner import build_runner
from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice
from tests.engine.fixtures_smollm2 import hf_smollm2_model, release_hf_smollm2_model, smollm2_source

PAGE = 64
PAGES = 4  # 256 positions: enough for every prompt + 32 tokens here
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One intra-op thread: on a small shared CPU, spinning OpenMP workers make tiny matmuls
    ~20x slower than a single thread (measured here with 2 cores and load ~8)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ours():
    source = smollm2_source()
    runner = build_runner(source, "cpu", torch.float32)
    runner.allocate(PAGES, 0)
    tok = Tokenizer.from_str(source.files["tokenizer.json"]().decode("utf-8"))
    return source, runner, tok


@pytest.fixture(scope="module")
def hf_model():
    yield hf_smollm2_model()
    release_hf_smollm2_model()


def our_greedy(runner, prompt: list[int], steps: int, stop: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill, then one token per step; returns generated ids and each step's logits."""
    table = list(range(PAGES))
    logits = runner.forward(ForwardBatch(torch.tensor(prompt), [SeqSlice(-1, table, 0, len(prompt))]))[0]
    out, all_logits = [], [logits]
    pos = len(prompt)
    for _ in range(steps):
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt == stop or len(out) == steps:
            break
        logits = runner.forward(ForwardBatch(torch.tensor([nxt]), [SeqSlice(-1, table, pos, 1)]))[0]
        all_logits.append(logits)
        pos += 1
    return out, all_logits


def hf_greedy(model, prompt: list[int], steps: int, stop: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        logits, past = res.logits[0, -1], res.past_key_values
        out, all_logits = [], [logits]
        for _ in range(steps):
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt == stop or len(out) == steps:
                break
            res = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            logits, past = res.logits[0, -1], res.past_key_values
            all_logits.append(logits)
    return out, all_logits


def _assert_logits_close(ours_logits, hf_logits) -> None:
    assert len(ours_logits) == len(hf_logits)
    for step, (a, b) in enumerate(zip(ours_logits, hf_logits, strict=True)):
        bound = TOL * float(b.abs().max())
        diff = float((a - b).abs().max())
        assert diff <= bound, f"step {step}: max|diff| {diff:.3g} > {bound:.3g}"


def test_32_greedy_tokens_and_logits_match_transformers(ours, hf_model):
    _, runner, tok = ours
    prompt = tok.encode("Once upon a time, in a small village by the sea, there lived").ids
    our_ids, our_logits = our_greedy(runner, prompt, 32)
    hf_ids, hf_logits = hf_greedy(hf_model, prompt, 32)
    assert len(our_ids) == 32
    assert our_ids == hf_ids
    _assert_logits_close(our_logits, hf_logits)


def test_answers_paris_through_its_own_chat_template(ours, hf_model):
    source, runner, tok = ours
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True
    )
    text = env.from_string(source.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    prompt = tok.encode(text).ids
    eos = source.generation_config["eos_token_id"]
    our_ids, our_logits = our_greedy(runner, prompt, 32, stop=eos)
    hf_ids, hf_logits = hf_greedy(hf_model, prompt, 32, stop=eos)
    assert our_ids == hf_ids
    _assert_logits_close(our_logits, hf_logits)
    answer = tok.decode(our_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer


# --- the loader's config and tensors vs transformers' loading of the same file -------------


def test_smollm2_config(ours, hf_model):
    cfg, hf_cfg = ours[0].config, hf_model.config
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id",
    ):  # fmt: skip
        assert cfg[key] == getattr(hf_cfg, key), key
    assert cfg["rope_parameters"] == hf_cfg.rope_parameters
    assert cfg["rms_norm_eps"] == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-7)  # f32 1e-5 vs 1e-05
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]


def test_smollm2_tensors_equal_transformers(ours, hf_model):
    theirs = hf_model.state_dict()
    seen = set()
    for name, tensor in ours[0].iter_tensors():
        assert name in theirs, name
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), name
        seen.add(name)
    # the only HF parameter without a GGUF tensor is the tied lm_head
    assert set(theirs) - seen == {"lm_head.weight"}
    assert torch.equal(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])
