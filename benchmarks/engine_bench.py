"""Engine throughput on this machine: prefill and decode tokens/s at 1 and N concurrent requests.

    python benchmarks/engine_bench.py                      # SmolLM2-135M GGUF (embedded default), CPU fp32
    python benchmarks/engine_bench.py --model DIR --device cuda --concurrency 1 4 16
    python benchmarks/engine_bench.py --kv-dtype nvfp4            # quantized KV (calibrated at start)
    python benchmarks/engine_bench.py --batch-invariant           # the batch-invariant CPU mode's cost

Runs the real ``EngineCore`` (scheduler + runner + sampler, no gRPC) in this process.
Prefill: ``c`` requests of ``--prompt`` random tokens with ``max_tokens=1``; figure =
prompt tokens / wall time. Decode: ``c`` requests with ``--decode`` new tokens each
(``ignore_eos``, greedy); figure = tokens generated after every request had its first
token / the time that took. Prints one line per setting; not a test.
"""

from __future__ import annotations

import argparse
import time

import torch

from deepwell.engine_service.cli import calibrate_kv
from deepwell.engine_service.config import KV_DTYPES, KV_HADAMARD
from deepwell.engine_service.engine import EngineCore, EngineLimits, TokensEvent
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import build_runner
from deepwell.engine_service.sampling import SamplingParams


def _prompts(c: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for _ in range(c)]


def _drain(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def prefill_tps(core: EngineCore, c: int, n: int) -> float:
    for p in _prompts(c, n, core.runner.vocab_size, seed=c):
        core.submit(core.make_request(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
    t0 = time.perf_counter()
    _drain(core)
    return c * n / (time.perf_counter() - t0)


def decode_tps(core: EngineCore, c: int, n: int, d: int) -> float:
    counts = [0] * c
    for i, p in enumerate(_prompts(c, n, core.runner.vocab_size, seed=100 + c)):
        def sink(ev, i=i) -> None:
            if isinstance(ev, TokensEvent):
                counts[i] += len(ev.token_ids)
        core.submit(core.make_request(p, SamplingParams(temperature=0.0, max_tokens=d, ignore_eos=True), sink=sink))
    while min(counts) == 0:
        core.step()
    start_tokens, t0 = sum(counts), time.perf_counter()
    _drain(core)
    return (sum(counts) - start_tokens) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir or .gguf ('' = embedded SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--decode", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPES),
                    help="KV cache format (as deepwell engine --kv-dtype)")
    ap.add_argument("--kv-hadamard", default="auto", choices=list(KV_HADAMARD),
                    help="Hadamard rotation of K for quantized formats (as deepwell engine --kv-hadamard)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="as deepwell engine --batch-invariant (CPU: row-padded linears, per-row attention)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model
    if not path:
        from deepwell.engine_service.default_model import ensure_default_model

        path = str(ensure_default_model())
    dtype = getattr(torch, args.dtype)
    source = open_model(path)
    runner = build_runner(source, device=args.device, dtype=dtype, page_size=64, kv_dtype=args.kv_dtype,
                          kv_hadamard=args.kv_hadamard, batch_invariant=args.batch_invariant)
    c_max = max(args.concurrency)
    pages = c_max * -(-(args.prompt + args.decode) // 64) + 1
    core = EngineCore(runner, EngineLimits(num_pages=pages, num_state_slots=c_max, max_concurrency=c_max,
                                           token_budget=args.token_budget, queue_size=c_max, max_context=1 << 30))
    calibrate_kv(source, runner)  # quantized fp8 / nvfp4 only, as the engine does at start-up
    prefill_tps(core, 1, 32)  # warm-up
    print(f"model={path} device={args.device} dtype={args.dtype} kv={runner.kv_dtype_name}"
          f"{'+hadamard' if runner.kv_spec.quant_layout is not None and runner.kv_spec.quant_layout.hadamard else ''} "
          f"bytes/page={runner.memory_spec().bytes_per_page} threads={torch.get_num_threads()} "
          f"prompt={args.prompt} decode={args.decode} token_budget={args.token_budget}")
    for c in args.concurrency:
        p = prefill_tps(core, c, args.prompt)
        d = decode_tps(core, c, args.prompt, args.decode)
        print(f"concurrency={c:3d}  prefill {p:9.1f} tok/s   decode {d:8.1f} tok/s (aggregate)", flush=True)


if __name__ == "__main__":
    main()
