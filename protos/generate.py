"""Regenerate the Python stubs for every .proto under protos/ (requires grpcio-tools).

    python protos/generate.py            # writes deepwell/{engine,kvcache}/v1/, gateway/v1/
    python protos/generate.py --out DIR  # writes into DIR instead (used by the drift test)

The generated modules are committed; tests/foundation/test_protos.py fails when they drift
from the .proto sources. The proto package path (deepwell/engine/v1/...) is also the Python
module path, so generated cross-imports resolve inside the `deepwell` package. The
``deepwell.gateway`` package is the repository's top-level ``gateway/`` folder (installed
under the ``deepwell`` namespace, see setup.py), so its stubs are written to ``gateway/v1/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
# Python package -> repository folder, where they differ (setup.py maps them the same way)
FOLDERS = {"deepwell/gateway/": "gateway/"}


def repo_path(module_path: str) -> str:
    """Where the generated file for ``module_path`` (deepwell/.../x_pb2.py) lives in the repository."""
    for pkg, folder in FOLDERS.items():
        if module_path.startswith(pkg):
            return folder + module_path[len(pkg):]
    return module_path


def committed_stubs(root: Path = REPO_ROOT) -> list[Path]:
    """The generated files under ``root``, relative to it."""
    found = [*(root / "deepwell").rglob("*_pb2*.py*"), *(root / "gateway" / "v1").glob("*_pb2*.py*")]
    return sorted(p.relative_to(root) for p in found)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto; return the generated files (relative to out_dir)."""
    from grpc_tools import protoc  # dev dependency
    import grpc_tools

    import shutil
    import tempfile

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="protoc-"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={tmp}",
        f"--pyi_out={tmp}",
        f"--grpc_python_out={tmp}",
        *files,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    out = []
    for p in sorted((tmp / "deepwell").rglob("*_pb2*.py*")):
        dest = out_dir / repo_path(str(p.relative_to(tmp)))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)
        out.append(dest.relative_to(out_dir))
    shutil.rmtree(tmp, ignore_errors=True)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
