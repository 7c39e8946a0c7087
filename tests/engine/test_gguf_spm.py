"""SentencePiece (``tokenizer.ggml.model = "llama"``) tokenizers rebuilt from GGUF metadata.

No SentencePiece GGUF ships with our dependencies, so the test writes one: a ~20k-piece
vocabulary made from SmolLM2's (byte-level pieces decoded, spaces spelled "▁", score = -rank,
plus every character they use as its own piece, as SentencePiece BPE vocabularies have) with
``<unk>``/``<s>``/``</s>``, the 256 ``<0xXX>`` byte pieces and a user-defined token.

The oracle is ``llama_cpp_spm`` below, a direct transcription of llama.cpp's algorithm:
special tokens are cut out first; every remaining fragment gets a leading space when it
starts the text or follows a special token, spaces become "▁", then the adjacent pair whose
concatenation is the best-scoring piece is merged until none is left; characters outside
the vocabulary become byte pieces. transformers' GGUF conversion differs from llama.cpp in
two places (it prepends "▁" only at the very start, and only when the text does not already
start with " " or "▁"), so it is compared directly only on texts where the two rules
coincide; its decoding is compared everywhere.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.version import Version
from tokenizers import Tokenizer

from deepwell.engine_service.loading.gguf import GGUFError, open_gguf
from deepwell.engine_service.loading.gguf_file import GGUFFile
from deepwell.engine_service.loading.gguf_tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    GGUFTokenizerData,
    build_tokenizer,
)
from tests.engine.fixtures_smollm2 import smollm2_source

SPECIALS = ("<unk>", "<s>", "</s>", "<|user|>")
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
_MERGEABLE = {TOKEN_NORMAL, TOKEN_USER_DEFINED}


class Vocab:
    def __init__(self, tokens: list[str], types: list[int], scores: list[float]) -> None:
        self.tokens, self.types, self.scores = tokens, types, scores
        self.ids: dict[str, int] = {}
        for i, t in enumerate(tokens):
            self.ids.setdefault(t, i)


def llama_cpp_spm(v: Vocab, text: str) -> list[int]:
    out = [v.ids["<s>"]]  # add_bos
    prev_special = True
    for chunk in _SPECIAL_RE.split(text):
        if not chunk:
            continue
        if chunk in SPECIALS:
            out.append(v.ids[chunk])
            prev_special = True
            continue
        symbols = list(((" " if prev_special else "") + chunk).replace(" ", "\u2581"))
        while True:
            best: tuple[float, int] | None = None
            for i in range(len(symbols) - 1):
                j = v.ids.get(symbols[i] + symbols[i + 1])
                if j is not None and v.types[j] in _MERGEABLE and (best is None or v.scores[j] > best[0]):
                    best = (v.scores[j], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for sym in symbols:
            if sym in v.ids:
                out.append(v.ids[sym])
            else:
                out.extend(v.ids[f"<0x{b:02X}>"] for b in sym.encode("utf-8"))
        prev_special = False
    return out


def _pieces_from_byte_level(tokens: list[str], limit: int) -> list[str]:
    from deepwell.engine_service.loading.gguf_tokenizer import _byte_alphabet

    to_byte = {c: b for b, c in _byte_alphabet().items()}
    seen: set[str] = set()
    pieces: list[str] = []
    for t in tokens:
        try:
            text = bytes(to_byte[c] for c in t).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        text = text.replace(" ", "\u2581")
        if text and text not in seen and text not in SPECIALS:
            seen.add(text)
            pieces.append(text)
            if len(pieces) == limit:
                break
    # SentencePiece BPE keeps every character of every piece as a piece of its own.
    chars = sorted({c for p in pieces for c in p} - seen)
    return pieces + chars


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> tuple[Vocab, Path]:
    smol = Tokenizer.from_str(smollm2_source().files["tokenizer.json"]().decode("utf-8"))
    byte_level = [t for t, _ in sorted(smol.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])]
    pieces = _pieces_from_byte_level(byte_level[17:], 20000)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|user|>", *pieces]
    types = [2, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256 + [TOKEN_USER_DEFINED] + [TOKEN_NORMAL] * len(pieces)
    scores = [0.0] * 260 + [-float(i) for i in range(len(pieces))]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Vocab(tokens, types, scores), path


@pytest.fixture(scope="module")
def ours(spm) -> Tokenizer:
    _, path = spm
    return build_tokenizer(GGUFTokenizerData.from_metadata(GGUFFile(path).metadata))


@pytest.fixture(scope="module")
def theirs(spm):
    from transformers import AutoTokenizer

    _, path = spm
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# transformers < 5.23 ignores llama.cpp's add-BOS default for a SentencePiece GGUF (it reads no
# tokenizer.ggml.add_bos_token and sets none), so its encode() has no leading <s>. The BOS itself
# is checked against llama_cpp_spm; there the pieces are compared without special tokens.
_HF_VERSION = Version(importlib.metadata.version("transformers"))
HF_ADDS_SPM_BOS = _HF_VERSION >= Version("5.23")


def _rules_coincide(text: str) -> bool:
    return not _SPECIAL_RE.search(text) and not text.startswith((" ", "\u2581"))


def _check(v: Vocab, ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text).ids
    assert ids == llama_cpp_spm(v, text), text
    if _rules_coincide(text):
        if HF_ADDS_SPM_BOS:
            assert ids == theirs.encode(text), text
        else:
            pieces = ours.encode(text, add_special_tokens=False).ids
            assert pieces == theirs.encode(text, add_special_tokens=False), text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


CORPUS = [
    "Hello world",
    "  leading spaces and   runs\t\ttabs\n\nnewlines  ",
    "12345 3.14159",
    "héllo wörld 日本語 🤖 ⅻ",
    "def f(x):\n    return x",
    "<s>hi</s> there<|user|>you",
    "a<|user|> b<unk>c",
    "",
    " ",
    "x" * 200,
]


@pytest.mark.parametrize("text", CORPUS)
def test_corpus(spm, ours, theirs, text):
    _check(spm[0], ours, theirs, text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(
        st.one_of(st.text(max_size=40), st.sampled_from([*SPECIALS, " ", "  ", "\n", "▁"])), max_size=5
    ).map("".join)
)
def test_random_text(spm, ours, theirs, text):
    _check(spm[0], ours, theirs, text)


def test_bos_and_flags(spm, ours):
    v, _ = spm
    assert ours.encode("Hello").ids[0] == v.ids["<s>"]  # add_bos defaults on for SentencePiece
    assert ours.encode("Hello", add_special_tokens=False).ids == llama_cpp_spm(v, "Hello")[1:]


def test_tokenizer_only_file_is_not_a_model(spm):
    with pytest.raises(GGUFError, match="lacks .* required tensors"):
        open_gguf(spm[1])


def test_unsupported_tokenizers_are_refused():
    from deepwell.engine_service.loading.gguf_tokenizer import GGUFTokenizerError

    def data(model: str, scores: list[float]) -> GGUFTokenizerData:
        return GGUFTokenizerData(
            model=model, pre="default", tokens=["a", "b"], token_types=[1, 1], merges=[], scores=scores
        )

    with pytest.raises(GGUFTokenizerError, match="tokenizer model 't5' is not supported"):
        build_tokenizer(data("t5", [0.0, 0.0]))
    with pytest.raises(GGUFTokenizerError, match="scores has 1 entries for 2 tokens"):
        build_tokenizer(data("llama", [0.0]))
