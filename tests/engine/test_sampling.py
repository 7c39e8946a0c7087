"""Sampler: exact results for each knob, reproducible seeds, validation messages."""

from __future__ import annotations

import math

import pytest
import torch

from deepwell.engine_service.sampling import SampleRow, Sampler, SamplingParams, make_generator

CPU = torch.device("cpu")


def row(params: SamplingParams, prompt=(), output=(), eos=frozenset(), seed: int | None = 0) -> SampleRow:
    gen = None if params.greedy else make_generator(params.seed if params.seed is not None else seed, CPU)
    return SampleRow(params=params, prompt_ids=list(prompt), output_ids=list(output), generator=gen, eos_ids=eos)


def test_greedy_argmax_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler().sample(logits, [row(SamplingParams(temperature=0.0))] * 2)
    assert [o.token_id for o in out] == [1, 0]


def test_filters_that_leave_one_token_equal_greedy() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0, 0.5]])
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        for seed in range(5):
            assert Sampler().sample(logits, [row(p, seed=seed)])[0].token_id == 1


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.3, 0.2, 0.05]]))
    seen_k, seen_p = set(), set()
    for seed in range(200):
        seen_k.add(Sampler().sample(logits, [row(SamplingParams(top_k=2), seed=seed)])[0].token_id)
        seen_p.add(Sampler().sample(logits, [row(SamplingParams(top_p=0.75), seed=seed)])[0].token_id)
    assert seen_k == {1, 2}
    assert seen_p == {1, 2, 3}  # 0.4 + 0.3 < 0.75: token 3 is needed to reach it


def test_min_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {Sampler().sample(logits, [row(SamplingParams(min_p=0.5), seed=s)])[0].token_id for s in range(200)}
    assert seen == {0, 1}


def test_seed_is_reproducible_and_independent_of_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=1234)
    r = row(p)
    alone = [Sampler().sample(logits[1:2], [r])[0].token_id for _ in range(10)]
    # the same request inside batches with others (own generators) draws the same tokens
    r2 = row(p)
    others = [row(SamplingParams(temperature=0.7), seed=9), row(SamplingParams(temperature=0.0))]
    first = Sampler().sample(logits, [others[0], r2, others[1]])[1].token_id
    assert first == alone[0]
    batched = [first] + [Sampler().sample(logits, [others[0], r2, others[1]])[1].token_id for _ in range(9)]
    assert batched == alone
    assert len(set(alone)) > 1  # it really samples


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.9, 0.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler().sample(logits, [row(p, prompt=[0])])[0].token_id == 2  # 2.0 / 2 = 1.0 < 1.9
    logits = torch.tensor([[-1.0, -2.0, -1.5, -1.2]])
    assert Sampler().sample(logits, [row(p, output=[0])])[0].token_id == 3  # -1 * 2 = -2 < -1.2


def test_cached_prompt_mask_equals_uncached() -> None:
    logits = torch.zeros(1, 40)
    logits[0, 9], logits[0, 11], logits[0, 5] = 2.0, 1.5, 1.6
    p = SamplingParams(temperature=0.0, repetition_penalty=1.7)
    prompt, output = [3, 9, 9, 17], [5, 3]
    seen = torch.zeros(40, dtype=torch.bool)
    seen[prompt] = True
    plain = Sampler().sample(logits, [row(p, prompt=prompt, output=output)])[0].token_id
    assert plain == 11  # 9 (prompt) and 5 (output) are penalized below 1.5
    cached_row = SampleRow(params=p, prompt_ids=prompt, output_ids=output, generator=None, prompt_seen=seen)
    assert Sampler().sample(logits, [cached_row])[0].token_id == plain
    assert seen.sum() == 3  # the cached mask is not modified


def test_presence_and_frequency_penalties_count_output_only() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    pres = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert Sampler().sample(logits, [row(pres, prompt=[1], output=[0])])[0].token_id == 1
    assert Sampler().sample(logits, [row(pres, prompt=[0])])[0].token_id == 0  # prompt does not count
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert Sampler().sample(logits, [row(freq, output=[0, 0])])[0].token_id == 0  # 3 - 0.4 = 2.6 > 2.5
    assert Sampler().sample(logits, [row(freq, output=[0, 0, 0])])[0].token_id == 1  # 3 - 0.6 = 2.4


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    assert Sampler().sample(logits, [row(p, output=[3], eos=frozenset({0}))])[0].token_id == 2
    assert Sampler().sample(logits, [row(p, output=[3, 3], eos=frozenset({0}))])[0].token_id == 0


def test_logprobs_are_raw_and_exact() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0]])
    p = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=10.0)
    out = Sampler().sample(logits, [row(p, prompt=[1])])[0]
    lse = math.log(sum(math.exp(v) for v in (1.0, 3.0, 2.0, 3.0)))
    assert out.token_id == 3  # 1 was penalized; 3 wins
    assert out.logprob == pytest.approx(3.0 - lse, abs=1e-6)
    assert [t for t, _ in out.top] == [1, 3, 2]
    assert [v for _, v in out.top] == pytest.approx([3.0 - lse, 3.0 - lse, 2.0 - lse], abs=1e-6)
    assert Sampler().sample(logits, [row(SamplingParams(temperature=0.0))])[0].logprob is None


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"stop_token_ids": (100,)}, "stop_token_ids"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
])
def test_validation_names_the_setting(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=f"invalid sampling.{msg}="):
        SamplingParams(**kw).validate(vocab_size=100)


def test_defaults_are_valid() -> None:
    SamplingParams().validate(vocab_size=2)
