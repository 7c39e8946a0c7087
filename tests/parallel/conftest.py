"""Tiny HF models shared by the tensor-parallel tests (written once per session)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.helpers_models import save_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tp_tiny")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            save_tiny(name, root / name)
            made[name] = root / name
        return made[name]

    return get
