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


def interpreter_rerun(test_file: str, expected_passed: int) -> Callable[[], None]:
    """The test that reruns ``test_file`` under the interpreter where this process has none."""

    @pytest.mark.skipif(INTERPRETED, reason="this process has the Triton interpreter: the tests run here")
    def test_in_a_triton_interpreter_process() -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                              cwd=Path(test_file).resolve().parents[2], env=env, capture_output=True, text=True,
                              timeout=280)
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
        assert re.search(rf"\b{expected_passed} passed", proc.stdout), proc.stdout[-2000:]

    return test_in_a_triton_interpreter_process
