"""Regenerate the Python stubs for every .proto under protos/ (requires grpcio-tools).

    python protos/generate.py            # writes deepwell/<pkg>/v1/*_pb2*.py
    python protos/generate.py --out DIR  # writes into DIR instead (used by the drift test)

The generated modules are committed; tests/test_protos.py fails when they drift from the
.proto sources. The proto package path (deepwell/engine/v1/...) is also the Python module
path, so generated cross-imports resolve inside the `deepwell` package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto; return the generated files (relative to out_dir)."""
    from grpc_tools import protoc  # dev dependency
    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    generated = (out_dir / "deepwell").rglob("*_pb2*.py*")
    return sorted(p.relative_to(out_dir) for p in generated)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
