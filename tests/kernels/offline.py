"""Offline builds of compiled Triton kernels for a GPU this machine may not have: the launches
some CPU calls would make are recorded (``JITFunction.run`` replaced), then each is compiled for
``sm_{arch}`` with Triton's bundled ptxas (``benchmarks/triton_archs.build``). Tests run
``offline_build`` in a subprocess with ``TRITON_INTERPRET=0`` (``run_offline_build``), so the
GPU code paths (libdevice, the hardware E4M3 conversion) are the ones built."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def has_ptxas() -> bool:
    """Whether this Triton has its NVIDIA backend (and so a ptxas to build with)."""
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def offline_build(calls: Callable[[], None], arch: int) -> int:
    """Record the launches ``calls()`` makes and build each for ``sm_{arch}``; prints a line per
    launch (``sm_{arch} <kernel>: ok (<shared> B shared)`` or ``FAIL ...``), returns the failures."""
    from triton.runtime.jit import JITFunction

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import triton_archs

    launches = []
    original = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))
    try:
        calls()
    finally:
        JITFunction.run = original
    failed = 0
    for fn, a, kw in launches:
        try:
            result = f"ok ({triton_archs.build(fn, a, kw, arch)} B shared)"
        except Exception as exc:  # report every failure
            failed += 1
            result = "FAIL " + str(exc)[-2000:]
        print(f"sm_{arch} {fn.fn.__name__}: {result}", flush=True)
    return failed


def run_offline_build(module: str, function: str, arch: int, cache: Path) -> str:
    """``sys.exit(offline_build(<module>.<function>, arch))`` in a subprocess without the
    interpreter; asserts it built every launch, returns its output."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache)}
    code = (f"import sys; from tests.kernels.offline import offline_build; from {module} import {function}; "
            f"sys.exit(offline_build({function}, {arch}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout
