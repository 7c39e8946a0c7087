"""The start-up check of the device's KV kernels (``engine_service.kv.selfcheck``): the Triton
backend (through the interpreter on CPU) passes it with every layer's own settings; an append
that stores other bytes or an attention that returns other values fails it, naming the layer
and what to do; a Gluon append that disagrees falls back to the Triton one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepwell import configs
from deepwell.engine_service.kv.quant_pool import QuantKVPool
from deepwell.engine_service.kv.selfcheck import KVKernelCheckError, check_pool, synthetic_samples
from deepwell.engine_service.metrics import EngineMetrics
from deepwell.kernels.backend import KVCacheLayer, ReferenceBackend, TritonBackend
from deepwell.kernels.calibration import calibrate
from deepwell.kernels.kv_formats.feedback import from_block_covariance
from deepwell.kernels.kv_formats.layout import KVLayout
from deepwell.kernels.page_center import rope_table

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs the Triton interpreter (CPU)")
TOKENS = 70  # two pages: the page boundary 63 / 64 / 65 inside the sample
HQ = 3  # query heads (one KV head)


def _pool(fmt: str = "nvfp4", rotations: tuple[bool | int, ...] = (16, True), d: int = 64, hkv: int = 1,
          tokens: int = TOKENS, device: str = "cpu") -> tuple[QuantKVPool, list[Any]]:
    """A pool of len(rotations) layers, each with its own rotation, global scales calibrated on
    its sample, and for fp8 / nvfp4 K centered per page with a sink key and rounded with
    feedback; plus the samples."""
    samples = synthetic_samples(len(rotations), hkv, d, tokens, seed=3)
    pool = QuantKVPool(KVLayout.make(fmt, hkv, d, True), len(rotations), -(-tokens // 64), torch.device(device))
    pool.set_hadamard(list(rotations))
    if fmt in ("fp8", "nvfp4"):
        pool.set_scales([calibrate(c.layout, k, v) for c, (k, v) in zip(pool.caches, samples, strict=True)])
        g = torch.Generator().manual_seed(5)
        a = torch.randn(hkv, d // 16, 16, 16, generator=g, dtype=torch.float64)
        pool.set_k_feedback([from_block_covariance(a @ a.transpose(-1, -2) / 16) for _ in rotations])
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        pool.set_page_centers([torch.randn(hkv, d, generator=g) for _ in rotations], rope_table(inv_freq, 16),
                              [k[0] for k, _ in samples])
    return pool, samples


@interpreter
@pytest.mark.parametrize("fmt,rotations", [("nvfp4", (16, True)), ("fp8", (False, True)), ("int8", (False,))])
def test_triton_backend_passes_with_every_layers_settings(fmt: str, rotations: tuple[bool | int, ...]) -> None:
    pool, samples = _pool(fmt, rotations)
    before = [c.data.clone() for c in pool.caches]
    be = TritonBackend()
    check = check_pool(pool, samples, HQ, torch.float32, backend=be)
    assert (check.backend, check.layers, check.tokens, check.append_kernel, check.fallback) == (
        "triton", len(rotations), TOKENS, "triton", "")
    assert check.decode_error < 1e-3 and check.prefill_error < 1e-3
    assert all(torch.equal(a, c.data) for a, c in zip(before, pool.caches, strict=True))  # scratch pages only
    assert be.append_impl == "auto"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_cuda_kernels_pass_the_check(fmt: str, d: int) -> None:
    """On the GPU: the Gluon append (nvfp4 / fp8 on Hopper; K rotated per 16-element block, as a
    whole and not at all) and the decode / prefill kernels agree with the reference without a
    fallback, on the 27B head layout (24 query heads, 4 KV heads) with bf16 K/V."""
    rotations = (16, True, False) if fmt == "nvfp4" else (16, True) if fmt == "fp8" else (False, 16)
    pool, samples = _pool(fmt, rotations, d, hkv=4, tokens=300, device="cuda")
    check = check_pool(pool, samples, 24, torch.bfloat16)
    print(check)
    assert check.fallback == "" and check.decode_fallback == "" and check.tokens == 300
    assert check.decode_error < 1e-2 and check.prefill_error < 1e-2


class _Faulty(TritonBackend):
    """The reference's results, with a fault: a Gluon append (``append_impl`` auto) or every
    append storing one byte more, or decode attention off by ``decode_noise``."""

    name = "faulty"

    def __init__(self, append_fault: str = "", decode_noise: float = 0.0, gluon_decode: bool = False) -> None:
        super().__init__()
        self.ref = ReferenceBackend()
        self.append_fault, self.decode_noise, self.gluon_decode = append_fault, decode_noise, gluon_decode

    def uses_gluon(self, layout: KVLayout, group: int, tokens_per_seq: int, device: torch.device) -> bool:
        # gluon_decode: a Gluon decode (off once gluon_max_tokens is 0), the only one with the noise
        return self.gluon_decode and tokens_per_seq <= self.gluon_max_tokens

    def append_kernel(self, layout: KVLayout, device: torch.device) -> str:
        return "gluon" if self.append_impl == "auto" else "triton"

    def append(self, layer: KVCacheLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor | None = None, *, validate: bool = True) -> None:
        if self.append_fault == "raise" and self.append_impl == "auto":
            raise RuntimeError("PassManager::run failed")  # as a Gluon kernel this Triton cannot compile
        self.ref.append(layer, k, v, slots, positions)
        if self.append_fault == "always" or (self.append_fault == "gluon" and self.append_impl == "auto"):
            layer.data.view(-1)[-1] = 0x5A  # (the sample leaves the last page's end unwritten: 0)

    def decode_attention(self, q: torch.Tensor, layer: KVCacheLayer, *args: Any, **kw: Any) -> torch.Tensor:
        if self.decode_noise < 0:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        out = self.ref.decode_attention(q, layer, *args, **kw)
        if self.gluon_decode and not self.uses_gluon(layer.layout, 3, 1, q.device):
            return out  # the Triton decode: right
        return out + self.decode_noise * out.abs().max()

    def prefill_attention(self, q: torch.Tensor, layer: KVCacheLayer, *args: Any, **kw: Any) -> torch.Tensor:
        return self.ref.prefill_attention(q, layer, *args, **kw)


def test_a_gluon_append_that_disagrees_falls_back_to_triton() -> None:
    pool, samples = _pool()
    be = _Faulty(append_fault="gluon")
    check = check_pool(pool, samples, HQ, torch.float32, backend=be)
    assert be.append_impl == "triton" and check.append_kernel == "triton"
    assert "layer 0 (nvfp4+hadamard16): the gluon append stored 1 of" in check.fallback
    m = EngineMetrics("t")  # what /metrics shows of it
    m.set_kv_kernel_check(check)
    got = m.registry.get_sample_value
    assert got("deepwell_engine_kv_append_kernel", {"model": "t", "kernel": "triton"}) == 1
    assert got("deepwell_engine_kv_append_kernel", {"model": "t", "kernel": "gluon"}) == 0
    assert got("deepwell_engine_kv_kernel_check_error", {"model": "t", "kind": "decode"}) == check.decode_error == 0


def test_a_gluon_append_that_raises_falls_back_to_triton() -> None:
    pool, samples = _pool()
    be = _Faulty(append_fault="raise")
    check = check_pool(pool, samples, HQ, torch.float32, backend=be)
    assert be.append_impl == "triton" and check.append_kernel == "triton"
    assert check.fallback == ("layer 0 (nvfp4+hadamard16): the gluon append failed (RuntimeError: PassManager::run "
                              "failed)")


def test_an_append_that_disagrees_everywhere_stops_the_start() -> None:
    pool, samples = _pool()
    with pytest.raises(KVKernelCheckError, match=r"layer 0 .*the gluon append stored 1 of .*; layer 0 .*the triton "
                                                 r"append stored 1 of .*another --kv-dtype \(bf16 is always exact\) or with "
                                                 r"--kv-hadamard on"):
        check_pool(pool, samples, HQ, torch.float32, backend=_Faulty(append_fault="always"))


def test_attention_that_disagrees_stops_the_start() -> None:
    pool, samples = _pool()
    with pytest.raises(KVKernelCheckError, match=r"layer 0 .*faulty decode attention of 1 queries over 70 tokens "
                                                 r"differs from the reference by"):
        check_pool(pool, samples, HQ, torch.float32, backend=_Faulty(decode_noise=0.05))
    with pytest.raises(KVKernelCheckError, match=r"layer 0 .*faulty decode attention of 1 queries over 70 tokens "
                                                 r"failed \(RuntimeError: CUDA error: an illegal memory access"):
        check_pool(pool, samples, HQ, torch.float32, backend=_Faulty(decode_noise=-1))
    check = check_pool(pool, samples, HQ, torch.float32, backend=_Faulty(decode_noise=1e-4))  # rounding-sized: passes
    assert 0 < check.decode_error < 1e-3 and check.prefill_error == 0.0


def test_a_gluon_decode_that_disagrees_falls_back_to_triton() -> None:
    pool, samples = _pool()
    be = _Faulty(decode_noise=0.05, gluon_decode=True)
    check = check_pool(pool, samples, HQ, torch.float32, backend=be)
    assert be.gluon_max_tokens == 0 and check.decode_kernel == "triton" and check.append_kernel == "gluon"
    assert check.decode_fallback.startswith("layer 0 (nvfp4+hadamard16): the gluon decode differs from the reference")
    assert check.decode_error < 0.05  # the Gluon decode's error is not the one serving
    m = EngineMetrics("t")
    m.set_kv_kernel_check(check)
    assert m.registry.get_sample_value("deepwell_engine_kv_decode_kernel", {"model": "t", "kernel": "triton"}) == 1
    ok = check_pool(pool, samples, HQ, torch.float32, backend=_Faulty(gluon_decode=True))  # a right Gluon decode stays
    assert (ok.decode_kernel, ok.decode_fallback) == ("gluon", "")


def test_check_refuses_bad_samples() -> None:
    pool, samples = _pool()
    with pytest.raises(ValueError, match="need K/V samples for 2 attention layers, got 1"):
        check_pool(pool, samples[:1], HQ, torch.float32, backend=_Faulty())
    with pytest.raises(ValueError, match="at least 2 sample tokens"):
        check_pool(pool, [(k[:1], v[:1]) for k, v in samples], HQ, torch.float32, backend=_Faulty())


@interpreter
def test_runner_checks_its_kernels_after_calibration(tmp_path: Path) -> None:
    """The engine's own path: the tiny hybrid model calibrated on this device, its pool on the
    Triton backend (interpreter), checked on the calibration's K/V; on the reference backend
    (CPU) there is nothing to compare."""
    from deepwell.engine_service.kv.calibration import calibration_token_ids
    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import build_runner
    from tests.engine.test_kv_quant import save_hybrid

    save_hybrid(tmp_path)
    r = build_runner(open_model(tmp_path), device="cpu", dtype=torch.float32, kv_dtype="nvfp4")
    r.allocate(4, 1)
    assert r.check_kv_kernels() is None  # the reference backend on CPU
    r.kv.backend = TritonBackend()  # type: ignore[union-attr]
    r.calibrate_kv(calibration_token_ids(None, r.vocab_size)[0][:TOKENS], source="random_ids")
    check = r.check_kv_kernels()
    assert check is not None and check.tokens == TOKENS and check.layers == len(r.kv_store.quant_pool().scales())
    assert check.fallback == "" and check.decode_error < 1e-3 and check.prefill_error < 1e-3
    assert r.kv_store._samples is None and r.kv_kernel_check is check  # samples released after the check


def test_build_core_turns_a_failed_check_into_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepwell.engine_service import cli

    class Runner:
        def check_kv_kernels(self) -> None:
            raise KVKernelCheckError("layer 0 (nvfp4): the triton append stored 1 of 9 bytes other than the reference")

    monkeypatch.setattr(cli, "calibrate_kv", lambda *a, **kw: None)
    monkeypatch.setattr("deepwell.engine_service.engine.EngineCore", lambda *a, **kw: type("Core", (), {"max_context": 64})())
    monkeypatch.setattr(cli, "size_pools", lambda *a, **kw: (4, 0))
    spec = type("Spec", (), {})()
    runner = Runner()
    runner.memory_spec = lambda: spec  # type: ignore[attr-defined]
    runner.max_context, runner.device = 64, torch.device("cpu")  # type: ignore[attr-defined]
    source = type("Source", (), {"text_config": lambda self: {}, "generation_config": {}})()
    cfg = cli.EngineConfig(kv_dtype="nvfp4")
    with pytest.raises(configs.ConfigError, match=r"invalid kv_dtype='nvfp4' on this device: layer 0 \(nvfp4\)"):
        cli.build_core(cfg, source, runner)
