"""Open a GGUF file (llama.cpp's format) as a ``ModelSource``.

``open_gguf(path)`` parses the header once (``gguf_file.GGUFFile``: one mmap, ~0.2 s for a
50k-token vocabulary) and returns:

- ``config``: an HF ``config.json``-style dict for the architecture (``llama`` — which covers
  SmolLM2, Llama 2/3-style files without ``rope_freqs`` — ``qwen2`` and ``qwen3``);
- ``iter_tensors()``: ``(hf_name, fp32 tensor)`` one tensor at a time, dequantized from any
  type ``gguf.quants`` knows (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, K-quants, ...), with
  llama.cpp's Q/K row permutation undone for ``llama``;
- ``files``: ``tokenizer.json`` (rebuilt, see ``gguf_tokenizer``), ``tokenizer_config.json``,
  ``generation_config.json`` and ``config.json``, built lazily on first request;
- ``chat_template`` (the default one) and ``generation_config`` (special token ids plus any
  ``general.sampling.*`` defaults).

Invariants: every tensor in the file is either mapped to an HF name or the open fails
naming it (a file we do not fully understand is refused, never half-loaded); shapes are HF
order (``[out, in]``); each yielded tensor owns its memory (no view into the mmap).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepwell.logs import get_logger
from deepwell.engine_service.loading.gguf_file import GGUFFile, GGUFFormatError, GGUFTensorInfo, f32_decimal
from deepwell.engine_service.loading.gguf_tokenizer import (
    GGUFTokenizerData,
    GGUFTokenizerError,
    chat_templates,
    check_supported,
    tokenizer_config_json,
    tokenizer_json,
)
from deepwell.engine_service.loading.source import ModelSource, TensorStream

log = get_logger(__name__)


class GGUFError(ValueError):
    """The GGUF file cannot be loaded (unsupported architecture, unknown tensor, bad metadata)."""


# GGUF architecture -> (HF model_type, HF architectures entry)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# Architectures whose q/k rows llama.cpp's converter permuted (convert_hf_to_gguf's LlamaModel).
_PERMUTED_QK = frozenset({"llama"})

# GGUF block tensor suffix -> HF module path inside ``model.layers.N``
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

_SAMPLING_KEYS: dict[str, str] = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def hf_tensor_name(gguf_name: str, num_layers: int) -> str:
    """The Hugging Face name of a GGUF tensor; ``GGUFError`` for names we do not know."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
        if part in _BLOCK_NAMES and layer < num_layers:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _TOP_RE.match(gguf_name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart we know")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave: rows of each head go from (half, pair) to (pair, half).

    llama.cpp reorders each head's rows from HF's rotate-half layout ``[x0..x(d/2-1), y0..]``
    to interleaved pairs ``[x0, y0, x1, y1, ...]`` for its GPT-J style RoPE; ``w`` is
    ``[n_head * head_dim, ...]`` (a weight or a bias).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot unpermute {tuple(w.shape)} for {n_head} heads")
    head_dim = rows // n_head
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def dequantize(file: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor as an owned fp32 torch tensor in HF (row-major, ``[out, in]``) shape."""
    from gguf.quants import dequantize as gguf_dequantize

    data = file.tensor_data(info)
    try:
        values = gguf_dequantize(data, info.tensor_type)
    except NotImplementedError as exc:
        raise GGUFError(f"tensor {info.name!r}: quant type {info.tensor_type.name} is not supported") from exc
    # Quantized types come back as fresh arrays; F32 comes back as a view of the read-only
    # mmap, which must be copied so the tensor owns writeable memory.
    if np.may_share_memory(values, data) or not values.flags.writeable:
        values = np.array(values, dtype=np.float32, copy=True)
    array = np.ascontiguousarray(values, dtype=np.float32)
    return torch.from_numpy(array.reshape(info.hf_shape))


def _scalar(value: Any, types: list[Any]) -> Any:
    """Float32 scalars become their shortest round-tripping decimal (9.99e-06 -> 1e-05)."""
    import gguf

    if types == [gguf.GGUFValueType.FLOAT32]:
        return f32_decimal(value)
    return value


def read_metadata(reader: Any) -> dict[str, Any]:
    """All metadata of a ``gguf.GGUFReader`` as Python values, as ``GGUFFile.metadata`` has them."""
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = _scalar(fld.contents(), list(fld.types))
    return meta


def build_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """An HF ``config.json``-style dict for the file's architecture."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError("GGUF rope_freqs (Llama 3.1-style rope scaling) is not supported")
    model_type, hf_arch = ARCHITECTURES[arch]

    def number(key: str, default: int | None = None) -> int:
        full = f"{arch}.{key}"
        value = meta.get(full, default)
        if value is None:
            raise GGUFError(f"GGUF metadata {full!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GGUFError(f"GGUF metadata {full!r} must be a positive integer, got {value!r}")
        return value

    hidden = number("embedding_length")
    heads = number("attention.head_count")
    if hidden % heads and f"{arch}.attention.key_length" not in meta:
        raise GGUFError(f"embedding_length {hidden} is not a multiple of head_count {heads}")
    kv_heads = number("attention.head_count_kv", heads)
    head_dim = number("attention.key_length", hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if vocab <= 0:
        raise GGUFError("GGUF states no vocabulary size (neither vocab_size nor tokenizer tokens)")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": number("feed_forward_length"),
        "num_hidden_layers": number("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": number("context_length", 2048),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    rope_dims = number("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        config["partial_rotary_factor"] = rope_dims / head_dim
        config["rope_parameters"]["partial_rotary_factor"] = rope_dims / head_dim
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_parameters"].update(_rope_scaling(arch, str(scaling), meta))
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[f"{name}_token_id"] = int(value)
    return config


def _rope_scaling(arch: str, kind: str, meta: dict[str, Any]) -> dict[str, Any]:
    factor = meta.get(f"{arch}.rope.scaling.factor")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor is not None and original is not None:
        params: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
        }
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{key}" in meta:
                params[hf] = float(meta[f"{arch}.rope.scaling.{key}"])
        return params
    raise GGUFError(f"GGUF rope scaling {kind!r} (factor={factor}, original={original}) is not supported")


def generation_defaults(meta: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json`` content: special token ids + ``general.sampling.*`` defaults."""
    gen: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    if eos_ids:
        gen["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    for key, hf in _SAMPLING_KEYS.items():
        if key in meta:
            gen[hf] = meta[key]
    if any(k in gen for k in ("temperature", "top_k", "top_p", "min_p")):
        gen["do_sample"] = float(gen.get("temperature", 1.0)) > 0
    return gen


def open_gguf(path: str | Path) -> ModelSource:
    """Open ``path`` (a ``.gguf`` file) as a ``ModelSource``; ``GGUFError`` if it cannot be loaded."""
    path = Path(path)
    try:
        file = GGUFFile(path)
    except GGUFFormatError as exc:
        raise GGUFError(f"cannot read GGUF file {path}: {exc}") from exc
    meta = file.metadata
    tensors = list(file.tensors)
    names = {t.name for t in tensors}
    config = build_config(meta, names)
    arch = meta["general.architecture"]
    n_layers = config["num_hidden_layers"]
    mapping = {t.name: hf_tensor_name(t.name, n_layers) for t in tensors}
    _check_complete(config, set(mapping.values()))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permute = arch in _PERMUTED_QK

    def iter_tensors() -> TensorStream:
        for t in tensors:
            name = mapping[t.name]
            value = dequantize(file, t)
            if permute and ".self_attn.q_proj." in name:
                value = unpermute_qk(value, heads)
            elif permute and ".self_attn.k_proj." in name:
                value = unpermute_qk(value, kv_heads)
            yield name, value

    tok_data: GGUFTokenizerData | None = None
    if "tokenizer.ggml.model" in meta:
        try:  # refuse an unsupported tokenizer at open, not when the gateway first asks
            tok_data = GGUFTokenizerData.from_metadata(meta, config["max_position_embeddings"])
            check_supported(tok_data)
        except GGUFTokenizerError as exc:
            raise GGUFError(f"{path.name}: {exc}") from exc
    templates = chat_templates(meta)
    gen = generation_defaults(meta)
    files: dict[str, Callable[[], bytes]] = {
        "generation_config.json": lambda: json.dumps(gen, indent=2).encode("utf-8"),
        "config.json": lambda: json.dumps(config, indent=2).encode("utf-8"),
    }
    if tok_data is not None:
        data = tok_data
        files["tokenizer.json"] = _lazy(lambda: tokenizer_json(data))
        files["tokenizer_config.json"] = _lazy(lambda: tokenizer_config_json(data))
    log.info(
        "gguf.opened",
        path=str(path),
        arch=arch,
        tensors=len(tensors),
        types=sorted({t.tensor_type.name for t in tensors}),
    )
    return ModelSource(
        path=path,
        format="gguf",
        config=config,
        iter_tensors=iter_tensors,
        files=files,
        generation_config=gen,
        chat_template=templates.get("default"),
        model_id=str(meta.get("general.name") or path.stem),
    )


def _check_complete(config: dict[str, Any], hf_names: set[str]) -> None:
    """Every tensor a decoder layer needs is present (names from the file, not guessed)."""
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config["num_hidden_layers"]):
        for part in ("input_layernorm", "post_attention_layernorm"):
            required.append(f"model.layers.{i}.{part}.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            required.append(f"model.layers.{i}.self_attn.{proj}.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            required.append(f"model.layers.{i}.mlp.{proj}.weight")
    missing = [n for n in required if n not in hf_names]
    if missing:
        raise GGUFError(f"GGUF lacks {len(missing)} required tensors, e.g. {missing[:3]}")


def _lazy(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` evaluated once, on first call."""
    return cache(fn)


__all__ = [
    "ARCHITECTURES",
    "GGUFError",
    "GGUFTokenizerError",
    "build_config",
    "dequantize",
    "generation_defaults",
    "hf_tensor_name",
    "open_gguf",
    "read_metadata",
    "unpermute_qk",
]
