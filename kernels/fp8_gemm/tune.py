"""Start-up choice between the two few-token FP8 kernels, timed on the device that serves.

``triton_kernel.matmul`` runs ``fma_matmul`` (no tensor cores, one conversion and one FMA per
weight byte, up to ``FMA_ROWS`` rows per program) for calls of at most ``FMA_MAX_TOKENS`` rows,
and ``w8a16_matmul`` (tensor cores over a 16-row tile) above. Which is faster depends on the
card and the shapes, so ``tune_fma_rows`` times both at the model's own linear shapes for 1 ..
``MAX_ROWS`` rows and keeps, per shape, the FMA kernel for the longest run of row counts from 1
where it wins. ``apply`` sets ``FMA_ROWS_BY_SHAPE`` (and ``FMA_MAX_TOKENS`` for other shapes); the
engine calls it once after loading FP8 weights on CUDA, before capturing graphs
(``layers.fp8_linear.tune``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from deepwell.kernels.fp8_gemm import reference
from deepwell.kernels.fp8_gemm import triton_kernel as tk

MAX_ROWS = 8  # FMA_ROWS: more rows read each weight again
KERNELS = ("fma", "w8a16")
Timer = Callable[[str, int, int, int], float]  # (kernel, rows, N, K) -> seconds


Shape = tuple[int, int]  # (N, K) of a weight


def choose(shapes: Iterable[Shape], timer: Timer, max_rows: int = MAX_ROWS
           ) -> tuple[dict[Shape, int], dict[Shape, dict[int, tuple[float, float]]]]:
    """Per shape, the largest ``m`` such that FMA is faster at every row count ``1..m`` (0 if it
    loses at one row), and per shape and row count the (fma, w8a16) seconds timed."""
    rows: dict[Shape, int] = {}
    times: dict[Shape, dict[int, tuple[float, float]]] = {}
    for n, k in sorted(set(shapes)):
        times[(n, k)] = {}
        rows[(n, k)] = 0
        for m in range(1, max_rows + 1):
            fma, dot = (timer(kind, m, n, k) for kind in KERNELS)
            times[(n, k)][m] = (fma, dot)
            if fma >= dot:
                break
            rows[(n, k)] = m
    return rows, times


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


def tune_fma_rows(shapes: Iterable[Shape], device: torch.device, dtype: torch.dtype,
                  block: tuple[int, int] = (128, 128)
                  ) -> tuple[dict[Shape, int], dict[Shape, dict[int, tuple[float, float]]]]:
    """``choose`` with ``cuda_timer``: on ``device`` (CUDA) for activations of ``dtype``. First
    the FMA kernel must pass ``check`` at the smallest shape (else ``RuntimeError``, the
    caller's to log)."""
    shapes = sorted(set(shapes))
    if not shapes:
        return {}, {}
    err = check(min(shapes, key=lambda s: s[0] * s[1]), device, dtype, block)
    if not err < CHECK_TOLERANCE:
        raise RuntimeError(f"fma_matmul differs from w8a16_matmul by {err:.3g} (relative L2, tolerance "
                           f"{CHECK_TOLERANCE:g}): not served")
    return choose(shapes, cuda_timer(device, dtype, block))


def apply(max_tokens: int, by_shape: dict[Shape, int] | None = None) -> None:
    """Serve calls of up to ``by_shape[(N, K)]`` rows (a weight shape listed there) or
    ``max_tokens`` rows (any other) with ``fma_matmul`` (0: never)."""
    for name, v in [("FMA max tokens", max_tokens), *((f"FMA rows of {s}", r) for s, r in (by_shape or {}).items())]:
        if not 0 <= v < tk.DEQUANT_MIN_TOKENS:
            raise ValueError(f"{name} must be in [0, {tk.DEQUANT_MIN_TOKENS - 1}], got {v}")
    tk.FMA_MAX_TOKENS = max_tokens
    tk.FMA_ROWS_BY_SHAPE = dict(by_shape or {})
