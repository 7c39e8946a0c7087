"""The real SmolLM2-135M-Instruct GGUF for tests, fetched once per machine.

Use from any test suite::

    from tests.engine.fixtures_smollm2 import smollm2_gguf_path
    path = smollm2_gguf_path()          # pathlib.Path to the .gguf (92 MB, read-only use)

or request the session-scoped pytest fixture ``smollm2_gguf`` after importing it into your
module or conftest (``from tests.engine.fixtures_smollm2 import smollm2_gguf  # noqa: F401``).

``smollm2_source()`` is our ``ModelSource`` for it (opened once; ``iter_tensors()`` may be
called again). ``hf_smollm2_model()`` is the transformers reference (``LlamaForCausalLM``, fp32, loaded from
the same GGUF), loaded once and kept until ``release_hf_smollm2_model()`` (each module that
uses it releases it when done); it imports transformers only when called.

The file lives in the shared model cache (``$DEEPWELL_MODEL_CACHE`` or
``~/.cache/deepwell/models``; never inside the repository), so the download from PyPI
happens once per machine and every suite shares it. Treat it as read-only.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from deepwell.engine_service.default_model import DefaultModelError, ensure_default_model, offline


@functools.cache
def _gguf_path() -> Path:
    return ensure_default_model()


def smollm2_gguf_path() -> Path:
    """Path to ``SmolLM2-135M-Instruct.Q4_1.gguf`` (downloaded and cached on first use). With
    ``DEEPWELL_OFFLINE=1`` (the device suite before every model part has arrived) a test that
    needs a model that is not there skips, saying so; elsewhere it fails."""
    try:
        return _gguf_path()
    except DefaultModelError as exc:
        if offline():
            pytest.skip(f"SmolLM2 GGUF not here and DEEPWELL_OFFLINE is set: {exc}")
        raise


@functools.cache
def smollm2_source() -> Any:
    """``open_model(smollm2_gguf_path())``, opened once per session (treat as read-only)."""
    from deepwell.engine_service.loading import open_model

    return open_model(smollm2_gguf_path())


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Session-scoped fixture form of :func:`smollm2_gguf_path`."""
    return smollm2_gguf_path()


def release_hf_smollm2_model() -> None:
    """Drop the cached transformers model (call when a module's last use of it ends): a test
    process holding its ~0.8 GB makes every engine process started later in the session
    start markedly slower on the CI VM (measured: `deepwell up` 22 -> 34 s)."""
    import gc

    hf_smollm2_model.cache_clear()
    gc.collect()


@functools.cache
def hf_smollm2_model() -> Any:
    """transformers' fp32 model from the same GGUF (eval mode; shared, do not modify)."""
    import torch
    import transformers.modeling_utils as hf_modeling
    from transformers import AutoModelForCausalLM

    import gguf

    path = smollm2_gguf_path()
    with pytest.MonkeyPatch.context() as mp:
        # transformers refuses GGUF files unless `accelerate` is installed (it is not a
        # deepwell dependency); its CPU GGUF path never calls into it.
        mp.setattr(hf_modeling, "is_accelerate_available", lambda: True)
        # speed only (same tensors): transformers opens the file twice and rebuilds gguf's
        # tensor-name map once per tensor (~20 of its ~35 s on the 2-core CI machine)
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
