"""The engine refuses to start beside a foreign top-level ``kernels`` package.

Hugging Face's ``kernels`` distribution (a dependency of transformers >= 5.25) installs a
package of the same name as this project's ``kernels/``; whichever comes first on ``sys.path``
wins, so the engine checks that it got deepwell's and says what to do otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_engine(extra_path: Path | None, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    paths = [str(ROOT)] if extra_path is None else [str(extra_path), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run([sys.executable, "-c", "import engine_service, kernels; print(kernels.__file__)"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_engine_imports_with_deepwells_kernels(tmp_path: Path) -> None:
    proc = _import_engine(None, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve() == ROOT / "kernels" / "__init__.py"


def test_engine_refuses_a_foreign_kernels_package(tmp_path: Path) -> None:
    fake = tmp_path / "site"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "__init__.py").write_text('"""Not deepwell\'s kernels."""\n')
    proc = _import_engine(fake, tmp_path)
    assert proc.returncode != 0
    assert "is not deepwell's" in proc.stderr
    assert "pip uninstall kernels" in proc.stderr
