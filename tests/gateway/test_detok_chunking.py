"""Streamed == non-streamed detokenization for any chunking of the engine's token pushes,
including one push of more than 32 ids that ends inside a multi-byte character."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepwell.gateway.detok import IncrementalDetokenizer
from tests.gateway.fake_engine import load_tokenizer
from tests.gateway.test_prompting import tokenizer as smollm2_tokenizer

MULTIBYTE = "😀👍🏽 日本語 — ünï «q» 🧪"
texts = st.text(alphabet=st.sampled_from(list("ab \n") + list(MULTIBYTE)), max_size=120)


def streamed(tok, ids: list[int], cuts: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok)
    parts, i = [], 0
    for c in cuts:
        parts.append(d.push(ids[i : i + c]))
        i += c
    parts.append(d.push(ids[i:]))
    parts.append(d.flush())
    return parts


def test_long_push_ending_inside_a_character():
    for tok in (load_tokenizer(), smollm2_tokenizer()):
        text = "x " * 40 + "😀 done"
        ids = tok.encode(text, add_special_tokens=False).ids
        emoji_end = len(tok.encode("x " * 40 + "😀", add_special_tokens=False).ids)
        assert emoji_end > 33
        for cut in range(emoji_end - 3, emoji_end):  # the first push ends inside the emoji's bytes
            if tok.decode(ids[:cut]).endswith("\ufffd"):
                parts = streamed(tok, ids, [cut])
                assert "".join(parts) == tok.decode(ids) == text, (cut, parts)
                assert all("\ufffd" not in p for p in parts), (cut, parts)


@settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(lead=st.integers(0, 40), text=texts, cuts=st.lists(st.integers(1, 80), max_size=12),
       which=st.sampled_from(["fake", "smollm2"]))
def test_any_chunking_equals_one_decode(lead, text, cuts, which):
    tok = load_tokenizer() if which == "fake" else smollm2_tokenizer()
    text = "x " * lead + text  # ASCII first, so large pushes end inside the multi-byte characters after it
    ids = tok.encode(text, add_special_tokens=False).ids
    parts = streamed(tok, ids, cuts)
    assert "".join(parts) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in parts)
