"""Services stay independent: they meet only through protos/ (the deepwell.* stubs)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# package -> top-level modules it must never import
FORBIDDEN: dict[str, set[str]] = {
    "gateway": {"engine_service", "kvcache_daemon"},
    "kvcache_daemon": {"torch", "triton", "engine_service", "gateway"},
    "engine_service": {"gateway", "kvcache_daemon"},
    "kernels": {"gateway", "kvcache_daemon", "engine_service"},
    # the shared foundation is imported by everyone, so it imports none of them
    # (the CLI dispatcher reaches services by module name, never by an import statement)
    "deepwell": {"torch", "triton", "gateway", "kvcache_daemon", "engine_service", "kernels"},
}


PACKAGES = ("gateway", "kvcache_daemon", "engine_service", "kernels")  # installed as deepwell.<name>


def _package_of(module: str) -> str:
    """The package a module belongs to: ``deepwell.engine_service.x`` -> ``engine_service``; the
    generated stubs (``deepwell.gateway.v1`` too, which lives in gateway/v1) -> ``deepwell``."""
    parts = module.split(".")
    if parts[0] == "deepwell" and len(parts) > 1 and parts[1] in PACKAGES:
        return "deepwell" if parts[1:3] == ["gateway", "v1"] else parts[1]
    return parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, _package_of(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, _package_of(node.module)))
    return found


def test_imports_are_classified_by_their_deepwell_package() -> None:
    assert _package_of("deepwell.engine_service.runner") == "engine_service"
    assert _package_of("deepwell.gateway.v1.chat_pb2") == "deepwell"
    assert _package_of("deepwell.gateway.http.app") == "gateway"
    assert _package_of("deepwell.logs") == "deepwell" and _package_of("torch.nn") == "torch"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package: str) -> None:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        if package == "gateway" and path.parent.name == "v1":
            continue  # the generated deepwell.gateway.v1 stubs
        for lineno, top in _imports(path):
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(REPO)}:{lineno} imports {top}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def _import_all_without(package: str, banned: list[str]) -> subprocess.CompletedProcess[str]:
    code = f"""
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {banned!r}:
            raise ImportError('blocked in this test: ' + name)
        return None
sys.meta_path.insert(0, Block())
pkg = importlib.import_module({"deepwell." + package if package in PACKAGES else package!r})
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):
    if info.name.endswith('__main__'):
        continue
    importlib.import_module(info.name)
leaked = [m for m in {banned!r} if m in sys.modules]
assert not leaked, leaked
print('ok')
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize(
    ("package", "banned"),
    [("kvcache_daemon", ["torch", "triton"]), ("deepwell", ["torch", "triton"])],
)
def test_imports_in_an_environment_without_torch(package: str, banned: list[str]) -> None:
    """Every module of the package imports with torch made unimportable."""
    result = _import_all_without(package, banned)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
