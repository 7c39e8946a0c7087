"""Start-up choice among the few-token FP8 kernels, timed on the device that serves.

Below ``DEQUANT_MIN_TOKENS`` rows ``triton_kernel.matmul`` runs one of ``FEW_ROW_KERNELS``:
the tensor-core W8A16 kernel over 16-row tiles ("w8a16"), the same with the weight as the
MMA's first operand ("swap", "swap128": 64- and 128-wide weight tiles), or the kernel without
tensor cores ("fma": one conversion and one FMA per weight byte and row). Which is fastest
depends on the card, the weight's shape and the row count (a decode step has 1 row per
sequence, a speculative verify step K + 1), so ``tune_kernels`` times every candidate at the
model's own linear shapes for 1 .. ``MAX_ROWS`` rows and keeps the fastest per shape and row
count; a candidate must first match "w8a16" (``check``). ``apply`` installs the choice
(``KERNEL_BY_SHAPE``); the engine calls it once after loading FP8 weights on CUDA, before
capturing graphs (``layers.fp8_linear.tune``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from deepwell.kernels.fp8_gemm import reference
from deepwell.kernels.fp8_gemm import triton_kernel as tk

MAX_ROWS = 8  # a verify step of up to 7 drafts; more rows: "w8a16"
Timer = Callable[[str, int, int, int], float]  # (kernel, rows, N, K) -> seconds
Shape = tuple[int, int]  # (N, K) of a weight


def choose(shapes: Iterable[Shape], timer: Timer, kernels: Sequence[str] = tk.FEW_ROW_KERNELS,
           max_rows: int = MAX_ROWS) -> tuple[dict[Shape, tuple[str, ...]], dict[Shape, dict[int, dict[str, float]]]]:
    """Per shape, the fastest of ``kernels`` at each row count ``1..max_rows`` (the first listed
    wins a tie), and per shape and row count every kernel's seconds."""
    choice: dict[Shape, tuple[str, ...]] = {}
    times: dict[Shape, dict[int, dict[str, float]]] = {}
    for n, k in sorted(set(shapes)):
        times[(n, k)] = {m: {kind: timer(kind, m, n, k) for kind in kernels} for m in range(1, max_rows + 1)}
        choice[(n, k)] = tuple(min(kernels, key=t.__getitem__) for t in times[(n, k)].values())
    return choice, times


def graph_timer(device: torch.device, dtype: torch.dtype, block: tuple[int, int], calls: int = 16,
                cold_bytes: int = 256 << 20, replays: int = 5) -> Timer:
    """Time of one call as a decode step serves it: ``calls`` calls (the split-K sum included)
    captured in one CUDA graph and replayed, so neither Python nor the launch is timed, only the
    kernels and the gaps between them in a graph; the median of ``replays`` replays / ``calls``.
    The calls cycle through copies of random codes whose bytes add up to ``cold_bytes``, so each
    call reads its weight from HBM, not from L2 (a step reads each weight once). The copies of
    the last shape asked for are kept; inf for a kernel that raises there."""
    state: dict[str, object] = {}

    def timer(kind: str, m: int, n: int, k: int) -> float:
        if state.get("shape") != (n, k):
            state.clear()
            copies = max(2, -(-cold_bytes // (n * k)))
            g = torch.Generator(device=device).manual_seed(0)
            state["shape"] = (n, k)
            state["weights"] = [reference.quantize(torch.randn(n, k, device=device, generator=g) * 0.02, block)
                                for _ in range(copies)]
        weights = state["weights"]
        x = torch.randn(m, k, device=device, dtype=dtype)
        try:
            for codes, scales in weights[:2]:  # compiled outside the capture
                tk.few_row_matmul(kind, x, codes, scales, block)
            torch.cuda.synchronize(device)
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                for i in range(calls):
                    codes, scales = weights[i % len(weights)]
                    tk.few_row_matmul(kind, x, codes, scales, block)
            graph.replay()  # warm
            times = []
            for _ in range(replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3 / calls)
            del graph
            return sorted(times)[len(times) // 2]
        except Exception:  # noqa: BLE001 - one that does not build or capture at this shape is never the fastest
            return float("inf")

    return timer


def cuda_timer(device: torch.device, dtype: torch.dtype, block: tuple[int, int]) -> Timer:
    """Median time of one call (``triton.testing.do_bench``: L2 flushed between calls) on random
    codes of each shape, made once per shape; inf for a kernel that raises there. Times the
    Python and launch of each call too wherever they take longer than the flush before it: the
    tune uses ``graph_timer``."""
    from triton.testing import do_bench

    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def timer(kind: str, m: int, n: int, k: int) -> float:
        if (n, k) not in weights:
            weights[(n, k)] = reference.quantize(torch.randn(n, k, device=device) * 0.02, block)
        codes, scales = weights[(n, k)]
        x = torch.randn(m, k, device=device, dtype=dtype)
        try:
            return do_bench(lambda: tk.few_row_matmul(kind, x, codes, scales, block), warmup=5, rep=20) * 1e-3
        except Exception:  # noqa: BLE001 - one that does not build at this shape is never the fastest
            return float("inf")

    return timer


def check(shape: tuple[int, int], device: torch.device, dtype: torch.dtype, block: tuple[int, int] = (128, 128),
          rows: Iterable[int] = (1, 5, MAX_ROWS), kernels: Sequence[str] = tk.FEW_ROW_KERNELS) -> dict[str, float]:
    """Per kernel, the largest relative L2 difference from ``w8a16_matmul`` over ``rows`` at
    ``shape`` (random codes): "fma" differs by the rounding of each weight to the activation
    dtype (~1e-3 for bf16), the others by the fp32 summation order; inf for one that raises
    (does not build here)."""
    g = torch.Generator(device=device).manual_seed(0)
    n, k = shape
    codes, scales = reference.quantize(torch.randn(n, k, device=device, generator=g) * 0.02, block)
    worst = dict.fromkeys(kernels, 0.0)
    for m in rows:
        x = torch.randn(m, k, device=device, generator=g).to(dtype)
        want = tk.w8a16_matmul(x, codes, scales, block).float()
        for kind in kernels:
            try:
                got = tk.few_row_matmul(kind, x, codes, scales, block).float()
            except Exception:  # noqa: BLE001 - a kernel this Triton / GPU cannot build or run is not served
                worst[kind] = float("inf")
                continue
            err = float((got - want).norm() / want.norm().clamp(min=1e-30))
            worst[kind] = max(worst[kind], err if err == err else float("inf"))  # NaN: fails
    return worst


CHECK_TOLERANCE = 1e-2  # bf16 / fp16 weights rounded once each: ~1e-3; a wrong kernel: ~1


def tune_kernels(shapes: Iterable[Shape], device: torch.device, dtype: torch.dtype,
                 block: tuple[int, int] = (128, 128)
                 ) -> tuple[dict[Shape, tuple[str, ...]], dict[Shape, dict[int, dict[str, float]]], dict[str, float]]:
    """``choose`` with ``graph_timer`` on ``device`` (CUDA) for activations of ``dtype``, among the
    kernels that pass ``check`` at the smallest shape; also returns the ones that did not, with
    their error."""
    shapes = sorted(set(shapes))
    if not shapes:
        return {}, {}, {}
    errors = check(min(shapes, key=lambda s: s[0] * s[1]), device, dtype, block)
    passed = [kind for kind in tk.FEW_ROW_KERNELS if kind == "w8a16" or errors[kind] < CHECK_TOLERANCE]
    choice, times = choose(shapes, graph_timer(device, dtype, block), passed)
    return choice, times, {kind: err for kind, err in errors.items() if kind not in passed}


def apply(max_tokens: int, by_shape: dict[Shape, Sequence[str]] | None = None) -> None:
    """Serve a weight shape listed in ``by_shape`` with its kernel per row count (past the list:
    "w8a16"), any other with "fma" up to ``max_tokens`` rows (0: never) and "w8a16" above."""
    if not 0 <= max_tokens < tk.DEQUANT_MIN_TOKENS:
        raise ValueError(f"FMA max tokens must be in [0, {tk.DEQUANT_MIN_TOKENS - 1}], got {max_tokens}")
    table = {shape: tuple(kinds) for shape, kinds in (by_shape or {}).items()}
    for shape, kinds in table.items():
        if not len(kinds) < tk.DEQUANT_MIN_TOKENS or any(kind not in tk.FEW_ROW_KERNELS for kind in kinds):
            raise ValueError(f"kernels of {shape} must be fewer than {tk.DEQUANT_MIN_TOKENS} of "
                             f"{', '.join(tk.FEW_ROW_KERNELS)}, got {list(kinds)}")
    tk.FMA_MAX_TOKENS = max_tokens
    tk.KERNEL_BY_SHAPE = table


def summary(by_shape: dict[Shape, Sequence[str]]) -> dict[str, str]:
    """Per shape "NxK", its kernels as runs: "fma x2, swap x6"."""
    out = {}
    for (n, k), kinds in sorted(by_shape.items()):
        runs: list[list] = []
        for kind in kinds:
            if runs and runs[-1][0] == kind:
                runs[-1][1] += 1
            else:
                runs.append([kind, 1])
        out[f"{n}x{k}"] = ", ".join(f"{kind} x{count}" for kind, count in runs)
    return out
