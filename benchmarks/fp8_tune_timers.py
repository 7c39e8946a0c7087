"""How the FP8 tune's two timers see the few-row kernels at the 27B shapes (CUDA only).

    python3 benchmarks/fp8_tune_timers.py [--rows 1 5] [--bw TB_S]

Per weight shape (N x K), row count and few-row kernel (``FEW_ROW_KERNELS``), the time of one
call by ``tune.cuda_timer`` (``triton.testing.do_bench``: each call alone, L2 flushed before
it) and by ``tune.graph_timer`` (calls replayed in one CUDA graph over weight copies too large
for L2: what the tune uses), and the graph time as a fraction of ``--bw`` (the weight codes and
block scales read once). Where do_bench's time is far above the graph's, it timed the call's
Python and launches, not the kernel.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import kernels  # noqa: F401  (the deepwell package alias, before the repo root goes on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from deepwell.kernels.fp8_gemm import triton_kernel as tk  # noqa: E402
from deepwell.kernels.fp8_gemm import tune  # noqa: E402

# (N, K) of the Qwen3.5-27B FP8 linear layers as the engine stacks them
SHAPES = [(1024, 5120), (5120, 6144), (5120, 17408), (12288, 5120), (16384, 5120), (17408, 5120)]
BLOCK = (128, 128)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5], help="activation rows (tokens)")
    ap.add_argument("--bw", type=float, default=3.02, help="HBM bandwidth in TB/s for the fraction (H100: ~3.0)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    t0 = time.time()
    bench, graph = tune.cuda_timer(dev, dtype, BLOCK), tune.graph_timer(dev, dtype, BLOCK)
    for n, k in SHAPES:
        nbytes = n * k + (-(-n // BLOCK[0])) * (-(-k // BLOCK[1])) * 4
        for m in args.rows:
            cells = []
            for kind in tk.FEW_ROW_KERNELS:
                tb, tg = bench(kind, m, n, k), graph(kind, m, n, k)
                cells.append(f"{kind} {tb * 1e6:6.1f} / {tg * 1e6:6.1f} ({nbytes / tg / (args.bw * 1e12):4.0%})")
            print(f"{n}x{k} rows={m}: " + "  ".join(cells), flush=True)
    print(f"done in {time.time() - t0:.0f} s; each cell: do_bench us / graph us (graph time as a fraction of {args.bw} TB/s)")


if __name__ == "__main__":
    main()
