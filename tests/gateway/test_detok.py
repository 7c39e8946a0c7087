"""IncrementalDetokenizer with SmolLM2's real byte-level BPE tokenizer."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepwell.gateway.detok import IncrementalDetokenizer
from tests.gateway.test_prompting import tokenizer

SAMPLES = [
    "Hello, world!",
    "日本語のテキストと絵文字 😀👍🏽 — mixed «quotes»",
    "  leading spaces\n\ttabs\r\n and  double  spaces ",
    "<think>\nreasoning\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
    "emoji at end 🧪",
    "\u00e9\u0301 combining, \U0001f468\u200d\U0001f469\u200d\U0001f467 family",
]


def stream(ids: list[int], step: int, skip: bool = True) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(tokenizer(), skip_special_tokens=skip)
    parts = [d.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    parts.append(d.flush())
    return parts, "".join(parts)


def test_samples_token_by_token_and_in_groups() -> None:
    tok = tokenizer()
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False).ids
        for step in (1, 2, 3, 7):
            parts, joined = stream(ids, step)
            assert joined == tok.decode(ids, skip_special_tokens=True) == text
            assert all("\ufffd" not in p for p in parts)


def test_multibyte_character_split_across_tokens_is_held_back() -> None:
    tok = tokenizer()
    ids = tok.encode("🧪", add_special_tokens=False).ids
    assert len(ids) > 1  # byte-level BPE spells this emoji with several tokens
    d = IncrementalDetokenizer(tok)
    assert [d.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "🧪"
    assert d.flush() == ""


def test_special_tokens_skipped_or_kept() -> None:
    tok = tokenizer()
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>", add_special_tokens=False).ids
    assert stream(ids, 1, skip=True)[1] == "assistant\nHi"
    assert stream(ids, 1, skip=False)[1] == "<|im_start|>assistant\nHi<|im_end|>"


def test_invalid_bytes_are_not_held_forever() -> None:
    tok = tokenizer()
    lone = tok.encode("😀", add_special_tokens=False).ids[:1]  # a lone UTF-8 lead byte
    d = IncrementalDetokenizer(tok)
    assert d.push(lone) == ""  # may still become a character
    assert d.push(tok.encode("a", add_special_tokens=False).ids) == "\ufffda"  # it did not
    d = IncrementalDetokenizer(tok)
    out = "".join(d.push(lone) for _ in range(40))
    assert "\ufffd" in out  # a long invalid run is not held forever
    assert out + d.flush() == tok.decode(lone * 40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=60), cuts=st.lists(st.integers(1, 5), max_size=30))
def test_any_text_any_grouping(text: str, cuts: list[int]) -> None:
    tok = tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok)
    parts, i = [], 0
    for c in cuts + [len(ids)]:
        parts.append(d.push(ids[i : i + c]))
        i += c
    parts.append(d.push(ids[i:]))
    parts.append(d.flush())
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=True)


def sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer: Metaspace pre-tokenizer, BPE with byte fallback, and a
    decoder that strips the leading space of the first token (the classic pitfall of
    decoding a window that starts mid-sequence)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "tokens and spaces"] * 20
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    vocab = tok.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    raw_merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in raw_merges]
    sp = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    sp.add_special_tokens(["<s>", "</s>"])
    return sp


def test_sentencepiece_style_decoder_with_byte_fallback() -> None:
    sp = sentencepiece_style_tokenizer()
    for text in ["the quick brown fox", "hello  world ünï 😀 end", " leading space kept inside", "日本 the dog"]:
        ids = sp.encode(text).ids
        assert any(sp.id_to_token(i).startswith("<0x") for i in ids) or text.isascii()
        for step in (1, 2, 5):
            d = IncrementalDetokenizer(sp)
            parts = [d.push(ids[i : i + step]) for i in range(0, len(ids), step)] + [d.flush()]
            assert "".join(parts) == sp.decode(ids)
            assert all("\ufffd" not in p for p in parts)
