"""Rebuild a Hugging Face ``tokenizers.Tokenizer`` from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``: llama.cpp stores the vocabulary
(``tokenizer.ggml.tokens``), token kinds (``token_type``), BPE merges, the pre-tokenizer
*name* (``tokenizer.ggml.pre``), special token ids and flags. This module turns that back
into the exact tokenizer the model was trained with and serializes it as ``tokenizer.json``
plus an HF-style ``tokenizer_config.json`` (special tokens, chat template, BOS/EOS flags).

Supported (``tokenizer.ggml.model``):
- ``gpt2``: byte-level BPE (GPT-2, SmolLM/StarCoder, Llama 3, Qwen2/2.5/3, Qwen3.5). The
  pre-tokenizer name selects the split regexes llama.cpp applies, in order
  (``PRE_TOKENIZER_SPLITS``); an unknown name is refused rather than guessed, since a wrong
  split silently changes token ids.
- ``llama``: SentencePiece BPE (Llama 2, Mistral, TinyLlama, ...) with byte fallback, merges
  rebuilt from the piece scores, and llama.cpp's space-prefix rule.
Unigram (``t5``), WordPiece and other vocabularies are refused with a clear error.

Where transformers' own GGUF conversion disagrees with llama.cpp (digits after whitespace
for ``smollm``/``starcoder``; the SentencePiece space prefix after special tokens or before
leading spaces), we follow llama.cpp, the runtime these files are made for; for SmolLM2 that
is also what its original ``tokenizer.json`` does (``Digits`` then ``ByteLevel``).

Invariants: token id ``i`` is ``tokens[i]`` (never renumbered); tokens llama.cpp marks
CONTROL (3) or UNKNOWN (2) become special added tokens and USER_DEFINED (4) plain added
tokens, all matched
whole in the input before BPE runs; BOS/EOS are added by the post-processor exactly when
``add_bos_token``/``add_eos_token`` say so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp token kinds (llama_token_type / gguf.TokenType)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6
_SPECIAL_KINDS = frozenset({TOKEN_CONTROL, TOKEN_UNKNOWN})  # matched whole, dropped by skip_special_tokens

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """llama.cpp's pre-tokenization for one ``tokenizer.ggml.pre`` name."""

    splits: tuple[str, ...]  # regexes applied one after the other, each isolating its matches
    ignore_merges: bool = False  # a word already in the vocabulary is one token (llama.cpp LLAMA3)


PRE_TOKENIZER_SPLITS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec((_GPT2,)),
    "gpt-2": PreTokenizerSpec((_GPT2,)),
    # StarCoder family: every digit alone, then GPT-2's split.
    "smollm": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "starcoder": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "refact": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "command-r": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "codeshell": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "exaone": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "minerva-7b": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "llama-bpe": PreTokenizerSpec((_LLAMA3,), ignore_merges=True),
    "llama3": PreTokenizerSpec((_LLAMA3,), ignore_merges=True),
    "llama-v3": PreTokenizerSpec((_LLAMA3,), ignore_merges=True),
    "smaug-bpe": PreTokenizerSpec((_LLAMA3,), ignore_merges=True),
    "qwen2": PreTokenizerSpec((_QWEN2,)),
    "deepseek-r1-qwen": PreTokenizerSpec((_QWEN2,)),
    "qwen35": PreTokenizerSpec((_QWEN35,)),
}


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


@dataclass(frozen=True)
class GGUFTokenizerData:
    """The tokenizer part of a GGUF's metadata, decoded to Python values."""

    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre ("default" when absent)
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    special_ids: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad/eot/eom -> id
    add_bos: bool = False
    add_eos: bool = False
    scores: Sequence[float] = ()  # SentencePiece piece scores (merge priority), "llama" only
    add_space_prefix: bool = True  # SentencePiece: "▁" before text that starts a segment
    chat_templates: dict[str, str] = field(default_factory=dict)  # "default" + named ones
    model_max_length: int | None = None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], context_length: int | None = None) -> GGUFTokenizerData:
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(model, str) or not isinstance(tokens, list) or not tokens:
            raise GGUFTokenizerError("GGUF has no tokenizer (tokenizer.ggml.model / tokens missing)")
        types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise GGUFTokenizerError(f"token_type has {len(types)} entries for {len(tokens)} tokens")
        special: dict[str, int] = {}
        for name, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"),
            ("eot", "eot_token_id"),
            ("eom", "eom_token_id"),
        ):
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is None:
                continue
            if not 0 <= int(value) < len(tokens):
                raise GGUFTokenizerError(f"tokenizer.ggml.{key}={value} is outside the vocabulary ({len(tokens)})")
            special[name] = int(value)
        return cls(
            model=model,
            pre=str(meta.get("tokenizer.ggml.pre") or "default"),
            tokens=tokens,
            token_types=[int(t) for t in types],
            merges=meta.get("tokenizer.ggml.merges") or [],
            special_ids=special,
            # llama.cpp (and transformers) add BOS for a SentencePiece vocabulary unless told not to
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_templates=chat_templates(meta),
            scores=[float(x) for x in meta.get("tokenizer.ggml.scores") or []],
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            model_max_length=context_length,
        )

    def special_token(self, name: str) -> str | None:
        token_id = self.special_ids.get(name)
        return None if token_id is None else self.tokens[token_id]


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every byte this way)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def check_supported(data: GGUFTokenizerData) -> None:
    """Raise ``GGUFTokenizerError`` now for a tokenizer ``build_tokenizer`` would refuse."""
    if data.model not in ("gpt2", "llama"):
        raise GGUFTokenizerError(
            f"GGUF tokenizer model {data.model!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
        )
    if data.model == "gpt2" and data.pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFTokenizerError(
            f"GGUF pre-tokenizer {data.pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    if data.model == "llama" and len(data.scores) != len(data.tokens):
        raise GGUFTokenizerError(f"tokenizer.ggml.scores has {len(data.scores)} entries for {len(data.tokens)} tokens")


def build_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` the GGUF describes (see module docstring for what is supported)."""
    check_supported(data)
    tok = _byte_level_tokenizer(data) if data.model == "gpt2" else _sentencepiece_tokenizer(data)
    _add_added_tokens(tok, data)
    post = _post_processor(data)
    if post is not None:
        tok.post_processor = post
    return tok


def _byte_level_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    spec = PRE_TOKENIZER_SPLITS[data.pre]
    tok = Tokenizer(_byte_level_bpe(data, spec))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in spec.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    """llama.cpp's SPM tokenizer as a BPE: merges ranked by the merged piece's score.

    llama.cpp repeatedly merges the adjacent pair whose concatenation is the highest-scoring
    piece; a BPE whose merges are every (left, right) split of every piece, best score first,
    makes the same choices, given that every character of a piece is itself a piece (true of
    SentencePiece BPE vocabularies). Unknown characters fall back to ``<0xXX>`` bytes. Each
    text segment (the text before/between/after special tokens) gets a leading "▁" when
    ``add_space_prefix`` is set, and spaces become "▁", as llama.cpp does per fragment.
    """
    vocab: dict[str, int] = {}
    for i, token in enumerate(data.tokens):
        vocab.setdefault(token, i)
    mergeable = {TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_UNUSED}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, (token, kind) in enumerate(zip(data.tokens, data.token_types, strict=True)):
        if kind not in mergeable or len(token) < 2 or vocab[token] != i:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is None or ri is None:
                continue
            if data.token_types[li] in mergeable and data.token_types[ri] in mergeable:
                ranked.append((-data.scores[i], li, ri, left, right))
    ranked.sort()
    unk = data.special_token("unk")
    model = models.BPE(
        vocab=vocab,
        merges=[(left, right) for _, _, _, left, right in ranked],
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = Tokenizer(model)
    steps = [normalizers.Replace(" ", "\u2581")]
    if data.add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    parts = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if data.add_space_prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(parts)
    return tok


def _byte_level_bpe(data: GGUFTokenizerData, spec: PreTokenizerSpec) -> models.BPE:
    alphabet = set(_byte_alphabet().values())
    spell = _byte_alphabet()
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(data.tokens, data.token_types, strict=True)):
        if kind == TOKEN_NORMAL and not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)  # a duplicate spelling keeps its first id; later ones are unreachable
    merges: list[tuple[str, str]] = []
    for merge in data.merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFTokenizerError(f"malformed BPE merge {merge!r} (expected 'left right')")
        merges.append((parts[0], parts[1]))
    return models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges, fuse_unk=False)


def _add_added_tokens(tok: Tokenizer, data: GGUFTokenizerData) -> None:
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(data.tokens, data.token_types, strict=True)
        if kind in _SPECIAL_KINDS
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(data.tokens, data.token_types, strict=True)
        if kind == TOKEN_USER_DEFINED
    ]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    for t in (*special, *user):
        token_id = tok.token_to_id(t.content)
        if token_id is None or data.tokens[token_id] != t.content:
            raise GGUFTokenizerError(f"added token {t.content!r} did not keep its GGUF id")


def _post_processor(data: GGUFTokenizerData) -> processors.PostProcessor | None:
    bos, eos = data.special_token("bos"), data.special_token("eos")
    single: list[str] = []
    pair: list[str] = []
    used: list[tuple[str, int]] = []
    if data.add_bos and bos is not None:
        single.append(f"{bos}:0")
        pair.append(f"{bos}:0")
        used.append((bos, data.special_ids["bos"]))
    single.append("$A:0")
    pair.append("$A:0")
    if data.add_eos and eos is not None:
        single.append(f"{eos}:0")
        pair.append(f"{eos}:0")
        used.append((eos, data.special_ids["eos"]))
    if data.add_bos and bos is not None:
        pair.append(f"{bos}:1")
    pair.append("$B:1")
    if data.add_eos and eos is not None:
        pair.append(f"{eos}:1")
    steps: list[processors.PostProcessor] = []
    if data.model == "gpt2":
        steps.append(processors.ByteLevel(trim_offsets=False))
    if used:
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=used))
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)


def tokenizer_json(data: GGUFTokenizerData) -> bytes:
    """``tokenizer.json`` bytes for the rebuilt tokenizer."""
    return build_tokenizer(data).to_str().encode("utf-8")


def tokenizer_config_json(data: GGUFTokenizerData) -> bytes:
    """An HF ``tokenizer_config.json`` (special tokens, flags, chat template) as bytes."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": data.add_bos,
        "add_eos_token": data.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for name in ("bos", "eos", "unk", "pad"):
        token = data.special_token(name)
        if token is not None:
            config[f"{name}_token"] = token
    if data.model_max_length:
        config["model_max_length"] = data.model_max_length
    template = chat_template_field(data.chat_templates)
    if template is not None:
        config["chat_template"] = template
    config["added_tokens_decoder"] = {
        str(i): {
            "content": t,
            "special": kind in _SPECIAL_KINDS,
            "normalized": False,
            "lstrip": False,
            "rstrip": False,
            "single_word": False,
        }
        for i, (t, kind) in enumerate(zip(data.tokens, data.token_types, strict=True))
        if kind in _SPECIAL_KINDS or kind == TOKEN_USER_DEFINED
    }
    return json.dumps(config, indent=2, ensure_ascii=False).encode("utf-8")


def chat_templates(meta: dict[str, Any]) -> dict[str, str]:
    """The GGUF's chat templates: ``"default"`` (``tokenizer.chat_template``) plus named ones."""
    templates: dict[str, str] = {}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        templates["default"] = meta["tokenizer.chat_template"]
    for name in meta.get("tokenizer.chat_templates") or []:
        text = meta.get(f"tokenizer.chat_template.{name}")
        if isinstance(text, str):
            templates[str(name)] = text
    return templates


def chat_template_field(templates: dict[str, str]) -> str | list[dict[str, str]] | None:
    """HF's ``chat_template`` value: the string, or a list of named templates when there are several."""
    if not templates:
        return None
    if list(templates) == ["default"]:
        return templates["default"]
    return [{"name": name, "template": text} for name, text in templates.items()]
