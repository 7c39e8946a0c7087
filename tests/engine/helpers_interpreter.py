"""Tests that run Triton kernels on CPU tensors through the interpreter, on a machine with a GPU.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` only where no GPU is visible (Triton reads it
when a kernel is defined), so under CUDA a test process compiles kernels for the GPU and cannot
run them on CPU tensors. A test module marks such tests ``in_the_interpreter`` and adds
``test_in_a_triton_interpreter_process = interpreter_rerun(__file__, expected_passed)``: under
CUDA that test runs the module in a child process with the interpreter and no visible GPU, as
on a CPU machine, and checks the pass count; with the interpreter the tests run in place.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_the_interpreter = pytest.mark.skipif(not INTERPRETED, reason="no Triton interpreter in this process: run by "
                                        "test_in_a_triton_interpreter_process")


# a kernel with a loop bound known only at run time, as the modules' kernels have
_PROBE = """
import sys

import numpy, torch, triton, triton.language as tl

print(f"Triton {triton.__version__}, NumPy {numpy.__version__}", file=sys.stderr)


@triton.jit
def probe(o, n):
    acc = 0
    for _ in range(0, n):
        acc += 1
    tl.store(o, acc)


o = torch.zeros(1, dtype=torch.int32)
probe[(1,)](o, 3)
assert int(o) == 3, int(o)
"""


def interpreter_defect(env: dict[str, str], tmp: Path) -> str:
    """Why this machine's Triton interpreter cannot run the modules' kernels ("" if it can).
    Triton 3.6's interpreter holds a scalar as a one-element array and converts it with ``int()``,
    which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"; later Tritons squeeze
    it first): every loop with a run-time bound fails there, whatever the kernel."""
    script = tmp / "interpreter_probe.py"
    script.write_text(_PROBE)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0 or "only 0-dimensional arrays" not in proc.stderr:
        return ""  # works, or fails otherwise: then the rerun shows how
    versions = proc.stderr.splitlines()[0]
    return (f"this machine's Triton interpreter cannot run loops with run-time bounds ({versions}: int() of a "
            "one-element array); the module's interpreter tests run on CPU machines (CI)")


def interpreter_rerun(test_file: str, expected_passed: int) -> Callable[[], None]:
    """The test that reruns ``test_file`` under the interpreter where this process has none."""

    @pytest.mark.skipif(INTERPRETED, reason="this process has the Triton interpreter: the tests run here")
    def test_in_a_triton_interpreter_process(tmp_path: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                              cwd=Path(test_file).resolve().parents[2], env=env, capture_output=True, text=True,
                              timeout=280)
        if proc.returncode != 0 and "only 0-dimensional arrays" in proc.stdout + proc.stderr:
            defect = interpreter_defect(env, tmp_path)
            if defect:  # the interpreter's, not the module's
                pytest.skip(defect)
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
        assert re.search(rf"\b{expected_passed} passed", proc.stdout), proc.stdout[-2000:]

    return test_in_a_triton_interpreter_process
