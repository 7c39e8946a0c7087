"""The "cuda" layer backend's fused kernels wired into the real layers, run on CPU through the
Triton interpreter: a tiny model per architecture gives the reference backend's logits within
the kernels' rounding, token by token, in chunks and in a mixed step (so every call site — the
residual add fused with the next norm, RoPE, the output gate, SwiGLU, the GDN gating and its
output norm — takes its kernel and agrees)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepwell.kernels.fused import ops as fused_ops
from tests.engine.helpers_interpreter import in_the_interpreter, interpreter_rerun


# Triton on CPU tensors: under CUDA this module reruns itself in an interpreter process
test_in_a_triton_interpreter_process = interpreter_rerun(__file__, expected_passed=3)  # the architectures below


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
