"""The tokenizer rebuilt from SmolLM2's GGUF metadata vs transformers loading the same GGUF.

Encode (ids) and decode (with and without special tokens) must agree over a varied corpus and
random text, the tokenizer_config/tokenizer.json pair must load in transformers and render
the chat template exactly as the GGUF-loaded tokenizer does.

One known, deliberate difference: the GGUF says ``tokenizer.ggml.pre = "smollm"``, for which
llama.cpp (like SmolLM2's original ``tokenizer.json``, ``Digits(individual_digits=True)``)
first isolates every ``\\p{N}`` character, then applies GPT-2's split. transformers rebuilds
it with GPT-2's split alone, so the two differ exactly where a digit follows whitespace
(``"  0"``: llama.cpp ``["ĠĠ", "0"]``, transformers ``["Ġ", "Ġ0"]``-style pieces) or a
non-ASCII digit is involved. We follow llama.cpp. So every text is checked against
``llama_cpp_reference`` (transformers' own BPE applied to llama.cpp's pre-token pieces), and
against transformers directly whenever the text has no such digit.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import re
import unicodedata

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from packaging.version import Version
from tokenizers import Tokenizer

from tests.engine.fixtures_smollm2 import smollm2_gguf_path, smollm2_source

# transformers < 5.18 is no reference for two things: it builds the GGUF BPE with unk_token
# "<|endoftext|>", so a byte missing from SmolLM2's vocabulary (e.g. 0xF1, the lead byte of U+40000)
# encodes as id 0 where llama.cpp (llm_tokenizer_bpe_session::tokenize skips a byte that has no
# token), transformers >= 5.18 and we drop it; and it sets eos_token from the GGUF's bos_token_id
# (integrations/ggml.py: eos_token = proto.tokens[proto.bos_token_id]), giving "<|im_start|>".
_HF_VERSION = Version(importlib.metadata.version("transformers"))
HF_GGUF_BPE_LIKE_LLAMA_CPP = _HF_VERSION >= Version("5.18")


def _bytes_in_vocab(ours: Tokenizer, text: str) -> bool:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return all(ours.token_to_id(table[b]) is not None for b in text.encode("utf-8"))


CORPUS = [
    "Hello world",
    "x =  1;\n    42\t7 ١٢٣ ² ½ Ⅻ",  # digits after whitespace, non-ASCII digits
    "What is the capital of France?",
    "  leading spaces and   runs\t\ttabs\n\n\nnewlines \r\n crlf   ",
    "12345 3.14159 1,000,000 0x1F 2024-11-30 v1.2.3",
    "def f(x):\n    return x**2  # comment\n\nclass A:\n\tpass\n",
    'fn main() { println!("{}", 42); } // rust\n<div class="a">&amp;</div>',
    "héllo wörld — naïve café ÆØÅ ß ñ",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 🤖🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "Ω≈ç√∫˜µ≤≥÷ ＡＢＣ ｆｕｌｌ",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_end|> trailing <repo_name>x<file_sep>y<jupyter_code>",
    "<|im_start|",  # broken special token: plain text
    "I'm don't we'll they've she'd I'M DON'T",
    "",
    " ",
    "\n",
    "     ",
    "a" * 300,
    "The quick brown fox jumps over the lazy dog. " * 5,
]


@pytest.fixture(scope="module")
def source():
    return smollm2_source()


@pytest.fixture(scope="module")
def ours(source) -> Tokenizer:
    return Tokenizer.from_str(source.files["tokenizer.json"]().decode("utf-8"))


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


_SPECIALS = re.compile(r"(<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>|<repo_name>|<reponame>|<file_sep>|<filename>"
                       r"|<gh_stars>|<issue_start>|<issue_comment>|<issue_closed>|<jupyter_start>|<jupyter_text>"
                       r"|<jupyter_code>|<jupyter_output>|<jupyter_script>|<empty_output>)")


def _is_digit(ch: str) -> bool:
    return unicodedata.category(ch).startswith("N")  # \p{N}


def llama_cpp_reference(theirs, text: str) -> list[int]:
    """llama.cpp's ``smollm`` tokenization, with transformers' BPE doing the merges.

    Special tokens are matched first; the rest is cut into single ``\\p{N}`` characters and
    the runs between them, and each piece is tokenized on its own (GPT-2 split + BPE).
    """
    ids: list[int] = []
    for chunk in _SPECIALS.split(text):
        if not chunk:
            continue
        if _SPECIALS.fullmatch(chunk):
            ids.append(theirs.convert_tokens_to_ids(chunk))
            continue
        for is_digit, run in itertools.groupby(chunk, key=_is_digit):
            pieces = list(run) if is_digit else ["".join(run)]
            for piece in pieces:
                ids.extend(theirs.encode(piece))
    return ids


def _split_rules_agree(text: str) -> bool:
    """True when GPT-2's split alone gives the same pieces as llama.cpp's digits-first split."""
    return not any(_is_digit(c) and (not c.isascii() or (i > 0 and text[i - 1].isspace())) for i, c in enumerate(text))


def _check(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text).ids
    assert ids == llama_cpp_reference(theirs, text), text
    if _split_rules_agree(text):
        assert ids == theirs.encode(text), text
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", CORPUS)
def test_corpus_matches_transformers(ours, theirs, text):
    _check(ours, theirs, text)


_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)) | st.sampled_from("0123456789 \n\t١٢³½"),
    max_size=60,
)
_PIECES = st.lists(
    st.one_of(_TEXT, st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "  ", "\n\n", "'s", "123"])),
    max_size=6,
).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_PIECES)
def test_random_text_matches_transformers(ours, theirs, text):
    if not HF_GGUF_BPE_LIKE_LLAMA_CPP:
        # transformers < 5.18 encodes a byte missing from the vocabulary as <|endoftext|> (see above)
        assume(_bytes_in_vocab(ours, _SPECIALS.sub("", text)))
    _check(ours, theirs, text)


def test_digits_are_isolated_like_llama_cpp(ours, theirs):
    # llama.cpp's "smollm" pre-tokenizer splits \p{N} first, so " ١٢" is " " + "١" + "٢".
    text = " ١٢"
    assert ours.encode(text).ids == ours.encode(" ").ids + ours.encode("١").ids + ours.encode("٢").ids
    assert ours.encode("x 123").ids == ours.encode("x").ids + ours.encode(" ").ids + [
        ours.token_to_id(d) for d in "123"
    ]
    assert theirs.encode(text) != ours.encode(text).ids  # the documented transformers difference


def test_vocab_and_special_tokens(ours, theirs, source):
    assert ours.get_vocab_size(with_added_tokens=True) == len(theirs) == source.config["vocab_size"] == 49152
    assert ours.get_vocab(with_added_tokens=True) == theirs.get_vocab()
    cfg = json.loads(source.files["tokenizer_config.json"]())
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    added = {int(i): (v["content"], v["special"]) for i, v in cfg["added_tokens_decoder"].items()}
    assert added == {i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()}
    assert len(added) == 17 and all(special for _, special in added.values())
    if not HF_GGUF_BPE_LIKE_LLAMA_CPP:
        pytest.skip(f"needs transformers >= 5.18 (has {_HF_VERSION}) for the special tokens: older versions "
                    "set eos_token from the GGUF's bos_token_id")
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == (
        theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.unk_token,
    )  # fmt: skip


def test_files_load_in_transformers_and_render_chat_template(source, theirs, tmp_path):
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(source.files[name]())
    rebuilt = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    ours_text = rebuilt.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    theirs_text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours_text == theirs_text
    assert ours_text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert ours_text.endswith("<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")
    assert rebuilt.encode(ours_text) == theirs.encode(theirs_text)
    assert rebuilt.eos_token == "<|im_end|>"


def test_chat_template_renders_with_plain_jinja(source):
    """The gateway renders with jinja2 directly (HF semantics); the template needs nothing else."""
    import jinja2

    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True
    )
    text = env.from_string(source.chat_template).render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not re.search(r"\{\{|\{%", text)
