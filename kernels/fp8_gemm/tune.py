"""Start-up choice between the two few-token FP8 kernels, timed on the device that serves.

``triton_kernel.matmul`` runs ``fma_matmul`` (no tensor cores, one conversion and one FMA per
weight byte, up to ``FMA_ROWS`` rows per program) for calls of at most ``FMA_MAX_TOKENS`` rows,
and ``w8a16_matmul`` (tensor cores over a 16-row tile) above. Which is faster depends on the
card and the shapes, so ``tune_fma_rows`` times both at the model's own linear shapes for 1 ..
``MAX_ROWS`` rows and keeps the FMA kernel for the longest run of row counts from 1 where it
wins (their sum over the shapes). ``apply`` sets ``FMA_MAX_TOKENS``; the engine calls it once
after loading FP8 weights on CUDA, before capturing graphs (``layers.fp8_linear.tune``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from deepwell.kernels.fp8_gemm import reference
from deepwell.kernels.fp8_gemm import triton_kernel as tk

MAX_ROWS = 8  # FMA_ROWS: more rows read each weight again
KERNELS = ("fma", "w8a16")
Timer = Callable[[str, int, int, int], float]  # (kernel, rows, N, K) -> seconds


def choose(shapes: Iterable[tuple[int, int]], timer: Timer, max_rows: int = MAX_ROWS
           ) -> tuple[int, dict[int, tuple[float, float]]]:
    """(the largest ``m`` such that FMA is faster at every row count ``1..m``, summed over
    ``shapes``; 0 if it loses at one row), and per row count (fma, w8a16) seconds."""
    shapes = sorted(set(shapes))
    times: dict[int, tuple[float, float]] = {}
    best = 0
    for m in range(1, max_rows + 1):
        fma, dot = (sum(timer(kind, m, n, k) for n, k in shapes) for kind in KERNELS)
        times[m] = (fma, dot)
        if fma >= dot:
            break
        best = m
    return best, times


def cuda_timer(device: torch.device, dtype: torch.dtype, block: tuple[int, int]) -> Timer:
    """Median time of one call (``triton.testing.do_bench``: L2 flushed between calls) on random
    codes of each shape, made once per shape."""
    from triton.testing import do_bench

    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def timer(kind: str, m: int, n: int, k: int) -> float:
        if (n, k) not in weights:
            weights[(n, k)] = reference.quantize(torch.randn(n, k, device=device) * 0.02, block)
        codes, scales = weights[(n, k)]
        x = torch.randn(m, k, device=device, dtype=dtype)
        fn = tk.fma_matmul if kind == "fma" else tk.w8a16_matmul
        return do_bench(lambda: fn(x, codes, scales, block), warmup=5, rep=20) * 1e-3

    return timer


def check(shape: tuple[int, int], device: torch.device, dtype: torch.dtype, block: tuple[int, int] = (128, 128),
          rows: Iterable[int] = (1, 5, MAX_ROWS)) -> float:
    """The largest relative L2 difference between ``fma_matmul`` and ``w8a16_matmul`` over
    ``rows`` at ``shape`` (random codes): the two differ by the rounding of each weight to the
    activation dtype, ~1e-3 for bf16."""
    g = torch.Generator(device=device).manual_seed(0)
    n, k = shape
    codes, scales = reference.quantize(torch.randn(n, k, device=device, generator=g) * 0.02, block)
    worst = 0.0
    for m in rows:
        x = torch.randn(m, k, device=device, generator=g).to(dtype)
        want = tk.w8a16_matmul(x, codes, scales, block).float()
        got = tk.fma_matmul(x, codes, scales, block).float()
        worst = max(worst, float((got - want).norm() / want.norm().clamp(min=1e-30)))
    return worst


CHECK_TOLERANCE = 1e-2  # bf16 / fp16 weights rounded once each: ~1e-3; a wrong kernel: ~1


def tune_fma_rows(shapes: Iterable[tuple[int, int]], device: torch.device, dtype: torch.dtype,
                  block: tuple[int, int] = (128, 128)) -> tuple[int, dict[int, tuple[float, float]]]:
    """``choose`` with ``cuda_timer``: on ``device`` (CUDA) for activations of ``dtype``; 0 with
    no times when the FMA kernel misses ``check`` at the smallest shape (``RuntimeError``
    there is the caller's to log)."""
    shapes = sorted(set(shapes))
    if not shapes:
        return 0, {}
    err = check(min(shapes, key=lambda s: s[0] * s[1]), device, dtype, block)
    if not err < CHECK_TOLERANCE:
        raise RuntimeError(f"fma_matmul differs from w8a16_matmul by {err:.3g} (relative L2, tolerance "
                           f"{CHECK_TOLERANCE:g}): not served")
    return choose(shapes, cuda_timer(device, dtype, block))


def apply(max_tokens: int) -> None:
    """Serve calls of up to ``max_tokens`` rows with ``fma_matmul`` (0: never)."""
    if not 0 <= max_tokens < tk.DEQUANT_MIN_TOKENS:
        raise ValueError(f"FMA max tokens must be in [0, {tk.DEQUANT_MIN_TOKENS - 1}], got {max_tokens}")
    tk.FMA_MAX_TOKENS = max_tokens
