"""The routed experts of one MoE layer on a CUDA device: the engine's loop (``reference``)
against the two Triton launches (``triton_kernel``), eager and in a CUDA graph.

    python -m deepwell.kernels.moe.bench [--tokens 1 4 8 32 256] [--shape 256 8 2048 512] [--fp8]

The default shape is a Qwen3.6-35B-A3B layer (256 experts, top-8, hidden 2048, expert
intermediate 512; bf16 experts, or with ``--fp8`` block-scaled FP8 ones; random weights, random
routing). First the HBM copy bandwidth (a 2 GiB
device-to-device copy). Then per token count: the mean time of one layer's routed experts over
``--calls`` calls, each with its own routing (so most experts a call reads are not in L2),
timed with CUDA events around all of them:

- ``loop``: the reference's one GEMM pair per picked expert (a host sync per call; eager only);
- ``kernel``: ``triton_kernel.moe_experts``, eager;
- ``kernel graph``: the same calls captured in one CUDA graph and replayed (a decode step's case);

and for each the bytes of the distinct experts each call picks over its time, as a fraction of
the copy bandwidth (a decode step reads each picked expert once, so this is the roofline).
``--tiles 16x32x64 16x16x128x4x4 ...`` adds a graphed time per launch shape
(``triton_kernel.Tiles``: BMxBNxBK[xWARPS[xSTAGES]], a trailing ``p`` for a tile per pick), each checked against the default shape's
output first.
"""

from __future__ import annotations

import argparse

import torch

from deepwell.kernels import fp8_gemm
from deepwell.kernels.gemv.bench import copy_bandwidth
from deepwell.kernels.moe import reference, triton_kernel

FP8_BLOCK = (128, 128)


def _time(fn, calls: int) -> float:
    """Mean seconds per call of ``fn(i)`` for i in range(calls), after one warm-up round."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / calls


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [fp8_gemm.quantize(w[e], FP8_BLOCK) for e in range(w.shape[0])]
    return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


def _graphed(fn, calls: int) -> float:
    """Mean seconds per call of ``fn(j)``, j < calls, all captured in one CUDA graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(calls):
            fn(j)
    return _time(lambda j: graph.replay() if j == 0 else None, 1) / calls


def run(tokens: list[int], shape: tuple[int, int, int, int], calls: int, fp8: bool,
        tiles: list[triton_kernel.Tiles]) -> None:
    e, k, h, i = shape
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(dev)}: HBM copy {bw / 1e12:.2f} TB/s; experts {e}, top-{k}, hidden {h}, "
          f"intermediate {i}, {'FP8 (128 x 128 blocks)' if fp8 else 'bf16'} experts, bf16 activations, {calls} "
          "calls each with its own routing")
    gu = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) / h**0.5
    dn = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) / i**0.5
    scales = None
    if fp8:
        (gu, gs), (dn, ds) = _fp8(gu), _fp8(dn)
        scales = reference.Scales(gs, ds, FP8_BLOCK)
    expert_bytes = (gu[0].numel() + dn[0].numel()) * gu.element_size() + (
        (scales.gate_up[0].numel() + scales.down[0].numel()) * 4 if scales else 0)
    for n in tokens:
        x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
        idx = [torch.rand(n, e, device=dev).topk(k, dim=-1).indices for _ in range(calls)]
        w = [torch.rand(n, k, device=dev, dtype=torch.bfloat16) for _ in range(calls)]
        read = sum(int(t.unique().numel()) for t in idx) / calls * expert_bytes
        ref = reference.moe_experts(x, gu, dn, idx[0], w[0], scales=scales)
        got = triton_kernel.moe_experts(x, gu, dn, idx[0], w[0], scales)
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        times = {
            "loop": _time(lambda j: reference.moe_experts(x, gu, dn, idx[j], w[j], scales=scales), calls),
            "kernel": _time(lambda j: triton_kernel.moe_experts(x, gu, dn, idx[j], w[j], scales), calls),
        }
        times["kernel graph"] = _graphed(lambda j: triton_kernel.moe_experts(x, gu, dn, idx[j], w[j], scales), calls)
        for ts in tiles:
            alt = triton_kernel.moe_experts(x, gu, dn, idx[0], w[0], scales, ts)
            diff = ((alt.float() - got.float()).norm() / got.float().norm()).item()
            name = ts.name
            times[name] = _graphed(lambda j, ts=ts: triton_kernel.moe_experts(x, gu, dn, idx[j], w[j], scales, ts),
                                   calls)
            print(f"tokens {n:4d} tiles {name}: rel L2 to the default tiles {diff:.1e}")
        for name, t in times.items():
            print(f"tokens {n:4d} {name:13s} {t * 1e6:9.1f} us  {read / t / 1e9:7.0f} GB/s = "
                  f"{read / t / bw:5.1%} of copy  (experts read {read / 2**20:.0f} MiB)")
        print(f"tokens {n:4d} kernel vs loop: rel L2 {rel:.1e}; graph {times['loop'] / times['kernel graph']:.1f}x "
              "faster than the loop")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32, 256])
    ap.add_argument("--shape", type=int, nargs=4, default=[256, 8, 2048, 512], metavar=("E", "K", "H", "I"))
    ap.add_argument("--calls", type=int, default=20, help="calls timed per figure, each with its own routing")
    ap.add_argument("--fp8", action="store_true", help="FP8 experts (block-scaled E4M3, 128 x 128 blocks)")
    ap.add_argument("--tiles", nargs="*", default=[], metavar="BMxBNxBK[xW[xS]][p]",
                    help="more launch shapes to time, graphed (triton_kernel.Tiles)")
    args = ap.parse_args()
    try:
        tiles = [triton_kernel.Tiles.parse(t) for t in args.tiles]
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    run(args.tokens, tuple(args.shape), args.calls, args.fp8, tiles)


if __name__ == "__main__":
    main()
