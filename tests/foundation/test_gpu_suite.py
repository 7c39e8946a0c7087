"""``benchmarks/gpu_suite.py``: the model split into parts that fit one device call, staged
over several calls and assembled only when every part has arrived intact."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks import gpu_suite


def test_parts_are_staged_across_calls_and_assembled_when_complete(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(10_000))
    parts = tmp_path / "parts"
    assert gpu_suite.split(model, parts, 3_000) == 4
    manifest = json.loads((parts / "manifest.json").read_text())
    assert [p["bytes"] for p in manifest["parts"]] == [3000, 3000, 3000, 1000]

    cache = tmp_path / "cache"
    first, second = tmp_path / "call1", tmp_path / "call2"
    for d, names in ((first, ["part-0", "part-1"]), (second, ["part-2", "part-3", "manifest.json"])):
        d.mkdir()
        for n in names:
            (d / n).write_bytes((parts / n).read_bytes())
    assert "no model manifest" in gpu_suite.stage_model(first, cache)
    assert not (cache / "m.gguf").exists()
    (second / "part-3").unlink()  # the last part has not arrived yet
    assert "2/4" not in gpu_suite.stage_model(second, cache)  # 3 of 4 staged, the 4th still owed
    assert "part-3" in gpu_suite.stage_model(second, cache)
    (second / "part-3").write_bytes((parts / "part-3").read_bytes())
    assert "assembled" in gpu_suite.stage_model(second, cache)
    assert (cache / "m.gguf").read_bytes() == model.read_bytes()
    assert "ready" in gpu_suite.stage_model(second, cache)


def test_a_corrupt_part_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(5_000))
    parts = tmp_path / "parts"
    gpu_suite.split(model, parts, 2_000)
    (parts / "part-1").write_bytes(b"x" * 2_000)
    assert "part-1 is corrupt" in gpu_suite.stage_model(parts, tmp_path / "cache")
    assert not (tmp_path / "cache" / "m.gguf").exists()
