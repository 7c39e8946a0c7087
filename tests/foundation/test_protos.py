"""The committed stubs (deepwell/*/v1, gateway/v1) are exactly what protoc makes of protos/."""

from __future__ import annotations

import importlib
import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


GEN = runpy.run_path(str(REPO / "protos" / "generate.py"))


def _generate(out: Path) -> list[Path]:
    return GEN["generate"](out)


def test_generated_stubs_match_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools comes with the dev extra")
    fresh = _generate(tmp_path)
    assert fresh, "protoc produced nothing"
    committed = GEN["committed_stubs"](REPO)
    assert committed == fresh, "stub files differ from the .proto set: run python protos/generate.py"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (REPO / rel).read_bytes(), (
            f"{rel} drifted from protos/: run `python protos/generate.py` and commit the result"
        )


@pytest.mark.parametrize(
    ("module", "service"),
    [
        ("deepwell.engine.v1.engine_pb2", "deepwell.engine.v1.Engine"),
        ("deepwell.kvcache.v1.kvcache_pb2", "deepwell.kvcache.v1.KVCache"),
        ("deepwell.gateway.v1.chat_pb2", "deepwell.gateway.v1.Chat"),
    ],
)
def test_services_are_versioned(module: str, service: str) -> None:
    mod = importlib.import_module(module)
    names = {s.full_name for s in mod.DESCRIPTOR.services_by_name.values()}
    assert service in names
    assert mod.DESCRIPTOR.package.endswith(".v1")


def test_every_proto_has_a_stub() -> None:
    for proto in (REPO / "protos").rglob("*.proto"):
        rel = proto.relative_to(REPO / "protos").with_suffix("")
        stub = REPO / GEN["repo_path"](str(rel.parent / f"{rel.name}_pb2.py"))
        assert stub.exists(), f"no stub for {proto}: run python protos/generate.py"
