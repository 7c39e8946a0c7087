"""The 16-bit split-K GEMV against cuBLAS at Qwen3.5-27B's linear shapes on a CUDA device.

    python -m deepwell.kernels.gemv.bench [--tokens 1 2 4 8 16] [--shapes "mlp down" lm_head]

First the HBM copy bandwidth: a 2 GiB device-to-device copy, bytes read plus bytes written over
its time (the practical ceiling; an H100 moves about 3.0 TB/s). Then, per shape and token count
(bf16 activations and weight), the median time (µs, ``triton.testing.do_bench``, which clears
the L2 cache between runs), the weight bytes over that time (GB/s, and as a fraction of the copy
bandwidth: decode reads each weight once, so this is the number to push up) and the relative L2
error against ``F.linear`` of the same bf16 values in fp32 (no TF32) of:

- ``torch F.linear``: cuBLAS, what the engine serves with today;
- ``gemv default``: ``kernels.gemv.linear`` with its defaults (``variant="auto"``);
- ``<variant> bn=<32|64|128> split=<auto|1>``: the kernel with each inner product (``dot``:
  tensor-core tiles of 16 rows; ``fma``: fp32 multiply-and-sum without tensor cores), each
  ``block_n``, with ``split_count``'s K split and without splitting K.

A variant that fails prints its error instead of a time. The last line of each shape and token
count names the fastest. ``--variants`` / ``--block-n`` / ``--split`` narrow the grid;
``--block-k`` / ``--warps`` / ``--stages`` widen it with the kernel's tuning knobs (0: its
default) for sweeps. The default grid is sized for about a minute on an H100 (not yet timed there).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from deepwell.kernels.fp8_gemm.bench import SHAPES as FP8_SHAPES
from deepwell.kernels.gemv.triton_kernel import linear

# name: (N, K) of the 27B shape's linear layers (kernels.fp8_gemm.bench's), plus the LM head
SHAPES = {**FP8_SHAPES, "lm_head": (248320, 5120)}
WARMUP_MS, REP_MS = 5, 20


def copy_bandwidth(gib: int = 2) -> float:
    """Bytes read plus bytes written per second of a ``gib`` GiB device-to-device copy."""
    src = torch.empty((gib << 30) // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=WARMUP_MS, rep=4 * REP_MS, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def _variants(x: torch.Tensor, w: torch.Tensor, args: argparse.Namespace) -> dict[str, Callable[[], torch.Tensor]]:
    out: dict[str, Callable[[], torch.Tensor]] = {
        "torch F.linear": lambda: F.linear(x, w),
        "gemv default": lambda: linear(x, w),
    }
    for variant in args.variants:
        for bn in args.block_n:
            for split in args.split:
                for bk in args.block_k:
                    for nw in args.warps:
                        for ns in args.stages:
                            name = f"{variant} bn={bn} split={split}"
                            name += f" bk={bk}" if bk else ""
                            name += f" w={nw}" if nw else ""
                            name += f" st={ns}" if ns else ""
                            s = None if split == "auto" else int(split)
                            out[name] = lambda v=variant, b=bn, s=s, bk=bk, nw=nw, ns=ns: linear(
                                x, w, block_n=b, split_k=s, variant=v, block_k=bk or None, num_warps=nw or None,
                                num_stages=ns or None)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE",
                    help=f"a subset of {list(SHAPES)}")
    ap.add_argument("--variants", nargs="+", default=["dot", "fma"], choices=["dot", "fma"])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--split", nargs="+", default=["auto", "1"], help="'auto' (split_count) or a number")
    # tuning knobs, each 0 = the kernel's default
    ap.add_argument("--block-k", type=int, nargs="+", default=[0])
    ap.add_argument("--warps", type=int, nargs="+", default=[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[0])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    hbm = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"HBM copy bandwidth (2 GiB, read + write): {hbm / 1e9:.0f} GB/s")
    print(f"{'shape':20s} {'tokens':>6s} {'variant':32s} {'µs':>9s} {'weight GB/s':>11s} {'of copy':>7s} "
          f"{'rel err':>9s}")
    for name in args.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wbytes = n * k * w.element_size()
        for t in args.tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            times: dict[str, float] = {}
            for vname, fn in _variants(x, w, args).items():
                try:
                    y = fn()
                    ms = do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - report the failing variant and go on
                    print(f"{name:20s} {t:6d} {vname:32s} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                err = ((y.float() - ref).norm() / ref.norm()).item()
                gbs = wbytes / (ms * 1e-3)
                times[vname] = ms
                print(f"{name:20s} {t:6d} {vname:32s} {ms * 1e3:9.1f} {gbs / 1e9:11.0f} {gbs / hbm:7.2f} {err:9.2e}")
            if times:
                best = min(times, key=times.__getitem__)
                base = times.get("torch F.linear")
                vs = f", {base / times[best]:.2f}x torch F.linear" if base else ""
                print(f"{name:20s} {t:6d} fastest: {best} ({times[best] * 1e3:.1f} µs, "
                      f"{wbytes / (times[best] * 1e-3) / hbm:.2f} of copy{vs})")
            del ref
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
