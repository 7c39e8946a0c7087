"""The routed experts of one MoE layer on a CUDA device: the engine's loop (``reference``)
against the two Triton launches (``triton_kernel``), eager and in a CUDA graph.

    python -m deepwell.kernels.moe.bench [--tokens 1 4 8 32 256] [--shape 256 8 2048 512]

The default shape is a Qwen3.6-35B-A3B layer (256 experts, top-8, hidden 2048, expert
intermediate 512; bf16, random weights, random routing). First the HBM copy bandwidth (a 2 GiB
device-to-device copy). Then per token count: the mean time of one layer's routed experts over
``--calls`` calls, each with its own routing (so most experts a call reads are not in L2),
timed with CUDA events around all of them:

- ``loop``: the reference's one GEMM pair per picked expert (a host sync per call; eager only);
- ``kernel``: ``triton_kernel.moe_experts``, eager;
- ``kernel graph``: the same calls captured in one CUDA graph and replayed (a decode step's case);

and for each the bytes of the distinct experts each call picks over its time, as a fraction of
the copy bandwidth (a decode step reads each picked expert once, so this is the roofline).
"""

from __future__ import annotations

import argparse

import torch

from deepwell.kernels.gemv.bench import copy_bandwidth
from deepwell.kernels.moe import reference, triton_kernel


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


def run(tokens: list[int], shape: tuple[int, int, int, int], calls: int) -> None:
    e, k, h, i = shape
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(dev)}: HBM copy {bw / 1e12:.2f} TB/s; experts {e}, top-{k}, hidden {h}, "
          f"intermediate {i}, bf16, {calls} calls each with its own routing")
    gu = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) / h**0.5
    dn = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) / i**0.5
    expert_bytes = (gu[0].numel() + dn[0].numel()) * gu.element_size()
    for n in tokens:
        x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
        idx = [torch.rand(n, e, device=dev).topk(k, dim=-1).indices for _ in range(calls)]
        w = [torch.rand(n, k, device=dev, dtype=torch.bfloat16) for _ in range(calls)]
        read = sum(int(t.unique().numel()) for t in idx) / calls * expert_bytes
        ref = reference.moe_experts(x, gu, dn, idx[0], w[0])
        got = triton_kernel.moe_experts(x, gu, dn, idx[0], w[0])
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        times = {
            "loop": _time(lambda j: reference.moe_experts(x, gu, dn, idx[j], w[j]), calls),
            "kernel": _time(lambda j: triton_kernel.moe_experts(x, gu, dn, idx[j], w[j]), calls),
        }
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(calls):
                triton_kernel.moe_experts(x, gu, dn, idx[j], w[j])
        times["kernel graph"] = _time(lambda j: graph.replay() if j == 0 else None, 1) / calls
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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    run(args.tokens, tuple(args.shape), args.calls)


if __name__ == "__main__":
    main()
