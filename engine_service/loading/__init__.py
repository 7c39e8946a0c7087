"""deepwell.engine_service.loading — checkpoint formats -> ``ModelSource`` (see ``source.py``).

``open_model(path)``: a directory with ``config.json`` opens as Hugging Face safetensors
(``hf.open_hf``); a ``.gguf`` file (or a directory holding exactly one ``.gguf`` and no
``config.json``) opens through ``gguf.open_gguf`` (imported lazily). Anything else fails
with the reason.
"""

from __future__ import annotations

from pathlib import Path

from deepwell.engine_service.loading.source import ModelSource


def open_model(path: str | Path, weights: bool = True) -> ModelSource:
    """A HF directory or a .gguf file; ``weights=False`` opens a HF directory without reading or
    requiring its weight files (``--random-weights``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"model path {p} does not exist")
    if p.is_file():
        if p.suffix == ".gguf":
            from deepwell.engine_service.loading.gguf import open_gguf

            return open_gguf(p)
        raise ValueError(f"{p} is not a model: expected a HF directory or a .gguf file")
    if (p / "config.json").is_file():
        from deepwell.engine_service.loading.hf import open_hf

        return open_hf(p, weights)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        from deepwell.engine_service.loading.gguf import open_gguf

        return open_gguf(ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"{p} holds several .gguf files; pass one: {[g.name for g in ggufs]}")
    raise ValueError(f"{p} has neither config.json nor a .gguf file")


__all__ = ["ModelSource", "open_model"]
