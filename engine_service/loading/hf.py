"""Open a Hugging Face model directory as a ``ModelSource``.

Reads ``config.json``; tensors stream from ``model.safetensors`` or the shards named by
``model.safetensors.index.json`` (or every ``*.safetensors`` file when there is no
index), one tensor at a time through ``safetensors.safe_open`` (memory-mapped, so peak
memory stays ~1x). FP8 block-scaled checkpoints (``quantization_config.quant_method ==
"fp8"``) are dequantized by ``engine_service.loading.fp8.dequantize_stream``. Side files
(tokenizer, tokenizer config, chat template, generation config, special tokens map) are
exposed lazily as bytes; the chat template comes from ``chat_template.jinja`` (preferred)
or ``tokenizer_config.json``'s ``chat_template`` (string, or the ``default`` entry of a
list of named templates).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from deepwell.engine_service.loading.source import ModelSource, TensorStream

SIDE_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        names = sorted(set(weight_map.values()))
        files = [path / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"shards named in {index.name} are missing: {', '.join(absent)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def _stream(files: list[Path]) -> TensorStream:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, handle.get_tensor(name)


def _chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tc_path = path / "tokenizer_config.json"
    if not tc_path.is_file():
        return None
    tmpl = _read_json(tc_path).get("chat_template")
    if isinstance(tmpl, str):
        return tmpl
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _reader(p: Path) -> Callable[[], bytes]:
    return p.read_bytes


def open_hf(path: str | Path, weights: bool = True) -> ModelSource:
    """The directory's model; ``weights=False``: its config and side files only (the tensor stream
    is empty: random-weight benchmarks of full-size shapes)."""
    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{root} has no config.json (not a Hugging Face model directory)")
    config = _read_json(cfg_path)
    files = safetensors_files(root) if weights else []
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    quant_method = quant.get("quant_method") if isinstance(quant, dict) else None
    if quant_method not in (None, "fp8"):
        raise ValueError(f"quantization method {quant_method!r} is not supported (only fp8)")

    def iter_tensors() -> TensorStream:
        stream = _stream(files)
        if quant_method == "fp8":
            from deepwell.engine_service.loading.fp8 import dequantize_stream

            return dequantize_stream(stream, config)
        return stream

    def iter_fp8() -> Iterator[tuple[str, Any]]:
        from deepwell.engine_service.loading.fp8 import pair_stream

        return pair_stream(_stream(files))

    gen_path = root / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    side = {n: _reader(root / n) for n in SIDE_FILES if (root / n).is_file()}
    return ModelSource(
        path=root,
        format="hf",
        config=config,
        iter_tensors=iter_tensors,
        iter_fp8=iter_fp8 if quant_method == "fp8" else None,
        files=side,
        generation_config=generation,
        chat_template=_chat_template(root),
        model_id=root.resolve().name,
    )
