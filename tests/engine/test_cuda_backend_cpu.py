"""The "cuda" layer backend's fused kernels wired into the real layers, run on CPU through the
Triton interpreter: a tiny model per architecture gives the reference backend's logits within
the kernels' rounding, token by token, in chunks and in a mixed step (so every call site — the
residual add fused with the next norm, RoPE, the output gate, SwiGLU, the GDN gating and its
output norm — takes its kernel and agrees)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepwell.kernels.fused import ops as fused_ops


# These tests run the Triton kernels on CPU tensors through the interpreter. tests/conftest.py
# sets TRITON_INTERPRET=1 only where no GPU is visible (triton reads it when a kernel is
# defined), so under CUDA this process compiles kernels for the GPU and cannot run them: there
# test_in_a_triton_interpreter_process runs this file in a child process with the interpreter
# and no GPU, as on a CPU machine.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_the_interpreter = pytest.mark.skipif(not INTERPRETED, reason="no Triton interpreter in this process: run by "
                                        "test_in_a_triton_interpreter_process")


EXPECTED_PASSED = 3  # the architectures below


@pytest.mark.skipif(INTERPRETED, reason="this process has the Triton interpreter: the tests run here")
def test_in_a_triton_interpreter_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert re.search(rf"\b{EXPECTED_PASSED} passed", proc.stdout), proc.stdout[-2000:]


def _logits(path: Path, backend: str, calls: list[str] | None = None) -> torch.Tensor:
    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import build_runner
    from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice
    from tests.engine.helpers_models import prompt, run_chunks

    r = build_runner(open_model(path), device="cpu", dtype=torch.float32, page_size=8, backend=backend)
    if backend == "cuda":
        r.ops.fused_on_cpu = True
    r.allocate(num_pages=24, num_state_slots=3)
    ids, other = prompt(24), prompt(10, seed=9)
    out = []
    for chunks in ([24], [5, 5, 5, 5, 4], [1] * 6):
        r.reset_state(1)
        out += run_chunks(r, ids[: sum(chunks)], chunks, [7, 2, 9], slot=1)
    r.reset_state(2)
    batch = ForwardBatch(torch.tensor([ids[6]] + other), [SeqSlice(1, [7, 2, 9], 6, 1),
                                                           SeqSlice(2, [10, 11], 0, 10)])
    out += list(r.forward(batch))
    return torch.stack(out).float()


@in_the_interpreter
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_fused_kernels_in_the_layers_match_the_reference(arch: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.engine.helpers_models import save_tiny

    save_tiny(arch, tmp_path)
    used: set[str] = set()
    for name in ("add_rms_norm", "rms_norm", "rope", "silu_mul", "gdn_gating", "sigmoid_gate_mul",
                 "gated_rms_norm"):
        for module in (fused_ops.norm, fused_ops.activation, fused_ops.rotary, fused_ops.gdn):
            fn = getattr(module, name, None)
            if fn is not None:
                def spy(*a, _fn=fn, _name=name, **kw):
                    used.add(_name)
                    return _fn(*a, **kw)
                monkeypatch.setattr(module, name, spy)
    ref = _logits(tmp_path, "reference")
    assert not used  # the reference backend never takes a kernel
    fused = _logits(tmp_path, "cuda")
    expected = {"add_rms_norm", "rms_norm", "rope", "silu_mul"}
    if arch == "qwen3_5":  # gated attention and Gated DeltaNet
        expected |= {"gdn_gating", "sigmoid_gate_mul", "gated_rms_norm"}
    assert expected <= used, expected - used
    err = float((fused.double() - ref.double()).norm() / ref.double().norm())
    assert err <= 1e-5, err
    assert torch.equal(fused.argmax(-1), ref.argmax(-1))
