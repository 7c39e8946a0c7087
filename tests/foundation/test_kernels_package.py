"""deepwell's packages live under the ``deepwell`` namespace, so a foreign top-level ``kernels``
package (Hugging Face's distribution, a dependency of transformers >= 5.25) coexists with it.

Both are imported in one process with a fake top-level ``kernels`` first on ``sys.path``; the
engine still gets deepwell's kernels and the other package stays what it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_foreign_top_level_kernels_package_coexists(tmp_path: Path) -> None:
    fake = tmp_path / "site"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "__init__.py").write_text('"""Not deepwell\'s kernels."""\nFOREIGN = True\n')
    # keep the inherited entries (after ours): where the dependencies are not installed in the
    # interpreter (the GPU suite puts them on PYTHONPATH, /tmp/site) the engine needs them
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(ROOT), *inherited]))
    code = ("import kernels, deepwell.engine_service.runner, deepwell.kernels.backend as b; "
            "print(kernels.FOREIGN, kernels.__file__); print(b.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    foreign, ours = proc.stdout.strip().splitlines()
    assert foreign == f"True {fake / 'kernels' / '__init__.py'}"
    assert Path(ours).resolve() == ROOT / "kernels" / "backend.py"


def test_no_generic_top_level_package_is_installed() -> None:
    """What setup.py installs: only ``deepwell`` and its subpackages."""
    proc = subprocess.run([sys.executable, "-c", "import runpy, setuptools; "
                           "setuptools.setup = lambda **kw: print(sorted(kw['packages'])); "
                           "runpy.run_path('setup.py')"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    packages = eval(proc.stdout)  # noqa: S307 - our own printed list
    assert packages and all(p == "deepwell" or p.startswith("deepwell.") for p in packages)
    for name in ("deepwell.kernels", "deepwell.kernels.fused", "deepwell.engine_service.kv", "deepwell.gateway.http",
                 "deepwell.gateway.v1", "deepwell.kvcache_daemon"):
        assert name in packages
