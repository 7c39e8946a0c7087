"""A/B timing of a kernel module against another version of it, in one process (CUDA GPU).

    git show main:kernels/paged_attention/gluon_decode.py > base_gluon_decode.py
    python benchmarks/kernel_ab.py --module gluon_decode --base base_gluon_decode.py

Between machine starts these kernels' times spread by about +-7%, more than most single
changes gain, so a change is judged by both versions timed alternately in one process: per
case the minimum over ``--rounds`` interleaved rounds, and the ratio new / base. The "new"
version is the working tree's module. Modules and cases (Qwen3.5-27B layout: 24 query
heads, 4 KV heads, d = 256):

- ``gluon_decode``: decode / verify (T = 1, 2, 4) at the engine's split counts, CUDA-graph
  replays, without and with per-page K terms (``page_bias``);
- ``triton_kernel``: prefill of a 4k chunk over a 64k nvfp4 prefix (eager, TFLOP/s) and the
  Triton decode kernel (T = 1, graph replays);
- ``kv_append``: one layer's append of a 64-sequence nvfp4 decode step (K centered, block
  scales counted; nearest rounding and query-weighted rounding of K);
- ``gluon_append``: the same, and fp8's, through the Gluon append's ``launch`` directly (so a
  base copy of that module is what runs), at one, two and four warps per program, nvfp4 at eight too (a case that
  one version refuses with ValueError, e.g. fp8 at four warps before its counts were widened,
  is reported as skipped).

Caches hold random valid codes and both versions read the same bytes, so when the page
layout differs between them only the timing is comparable, not the outputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
from types import ModuleType
from typing import Callable, Iterator

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.kv_attention import (D, HKV, HQ, append_case, bench, bench_graph, decode_case,  # noqa: E402
                                     graph_time, prefill_case)
from deepwell.kernels.backend import TritonBackend  # noqa: E402
from deepwell.kernels.hadamard.reference import scale as hadamard_scale  # noqa: E402

MODULES = {
    "gluon_decode": "deepwell.kernels.paged_attention.gluon_decode",
    "triton_kernel": "deepwell.kernels.paged_attention.triton_kernel",
    "kv_append": "deepwell.kernels.kv_append.triton_kernel",
    "gluon_append": "deepwell.kernels.kv_append.gluon_append",
}
DECODE_CASES = [(1, 64, 16384), (1, 1, 131072), (1, 8, 131072), (1, 64, 131072), (2, 8, 131072), (2, 64, 131072),
                (4, 1, 16384), (4, 64, 16384), (4, 8, 131072), (4, 64, 131072)]

Case = tuple[str, dict[str, Callable[[], float]], Callable[[float], str]]


def load_file(path: str, name: str) -> ModuleType:
    """The module at ``path`` under the name ``name`` (its imports resolve in this repository)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path} as a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def gluon_cases(mods: dict[str, ModuleType]) -> Iterator[Case]:
    """Cases one at a time (each case's cache is freed before the next is built)."""
    be = TritonBackend()
    for t, batch, ctx in DECODE_CASES:
        layout, cache, tables, lens, q = decode_case("nvfp4", batch, ctx, t)
        scales = layout.default_scales("cuda")
        nbytes = batch * ctx * HKV * 2 * layout.token_bytes
        cols = next(iter(mods.values())).num_columns(t, HQ // HKV)
        # plain, then with per-page K terms (K centered per page, ``page_bias``)
        for label, bias in (("decode", None),
                            ("decode+page terms", torch.randn(batch, HKV, tables.shape[1], cols, device="cuda") * 0.5)):
            fns = {}
            for name, m in mods.items():
                splits = be.gluon_splits(batch, HKV, q.device, m.programs_per_sm(t, HQ // HKV))
                o = torch.empty_like(q)
                scr = (torch.empty(batch * t * HQ * splits * D, device="cuda"),
                       torch.empty(batch * t * HQ * splits, device="cuda"))
                extra = {} if bias is None else {"page_bias": bias}
                call = (lambda m=m, s=splits, o=o, scr=scr, extra=extra: m.paged_decode(
                    q, cache, layout, scales, tables, lens, D**-0.5, tokens_per_seq=t, num_splits=s, out=o,
                    scratch=scr, **extra))
                fns[name] = lambda call=call: bench_graph(call)
            yield (f"{label} T={t} B={batch} ctx={ctx}", fns,
                   lambda sec, n=nbytes: f"{sec * 1e6:9.1f} us {n / sec / 4.8e12 * 100:5.1f}%")


def triton_cases(mods: dict[str, ModuleType]) -> Iterator[Case]:
    chunk, prefix = 4096, 65536
    layout, cache, tables, lens, q, q_start, q_len, flops = prefill_case("nvfp4", prefix, chunk)
    scales = layout.default_scales("cuda")
    o = torch.empty_like(q)
    fns = {}
    for name, m in mods.items():
        work = m.work_items([chunk], HQ // HKV, 64, q.device)
        call = (lambda m=m, work=work: m.paged_attention(
            q, cache, layout, scales, tables, lens, q_start, q_len, D**-0.5, q_lens_host=[chunk], num_splits=1,
            block_m=64, out=o, work=work, num_warps=4, num_stages=2, pages_per_tile=1, page_max=False))
        fns[name] = lambda call=call: bench(call)
    yield (f"prefill {chunk} over {prefix}", fns, lambda sec: f"{sec * 1e3:8.2f} ms {flops / sec / 1e12:6.1f} TFLOP/s")
    del cache
    be = TritonBackend()
    for batch, ctx in ((8, 131072), (64, 16384)):
        layout, cache, tables, lens, q = decode_case("nvfp4", batch, ctx, 1)
        splits = be.default_splits(batch, HKV, q.device)
        o = torch.empty_like(q)
        scr = (torch.empty(batch * HQ * splits * D, device="cuda"), torch.empty(batch * HQ * splits, device="cuda"))
        fns = {}
        for name, m in mods.items():
            call = (lambda m=m, o=o, scr=scr: m.paged_attention(
                q, cache, layout, scales, tables, lens, None, None, D**-0.5, num_splits=splits, out=o, scratch=scr,
                uniform_t=1))
            fns[name] = lambda call=call: bench_graph(call)
        yield (f"triton decode B={batch} ctx={ctx}", fns, lambda sec: f"{sec * 1e6:9.1f} us")


def append_cases(mods: dict[str, ModuleType]) -> Iterator[Case]:
    layout, cache, k, v, slots, scales, offset, counts, fb = append_case("nvfp4", True, True)
    for label, feedback in (("nearest", None), ("feedback", fb)):
        fns = {}
        for name, m in mods.items():
            call = (lambda m=m, feedback=feedback: m.append(cache, layout, k, v, slots, scales, offset, counts, feedback,
                                                             validate=False))
            fns[name] = lambda call=call: graph_time(call, 100)
        yield (f"append nvfp4 64 x {HKV} heads, {label}", fns, lambda sec: f"{sec * 1e6:7.2f} us")


def gluon_append_cases(mods: dict[str, ModuleType]) -> Iterator[Case]:
    for fmt, warp_counts in (("nvfp4", (1, 2, 4, 8)), ("fp8", (1, 2, 4))):
        layout, cache, k, v, slots, scales, offset, counts, fb = append_case(fmt, True, True)
        for label, feedback in (("nearest", None), ("feedback", fb)):
            for warps in warp_counts:
                fns = {}
                for name, m in mods.items():
                    # versions before 2026-12-05 took K's Hadamard scale as an argument
                    hs = (hadamard_scale(D),) if "hadamard_scale" in inspect.signature(m.launch).parameters else ()
                    call = (lambda m=m, feedback=feedback, warps=warps, layout=layout, cache=cache, k=k, v=v,
                            slots=slots, scales=scales, offset=offset, counts=counts, hs=hs: m.launch(
                                cache, layout, k, v, slots, scales, offset, counts, feedback, *hs,
                                num_warps=warps))
                    fns[name] = lambda call=call: graph_time(call, 100)
                yield (f"gluon append {fmt} 64 x {HKV}, {label}, {warps} warps", fns,
                       lambda sec: f"{sec * 1e6:7.2f} us")


CASES = {"gluon_decode": gluon_cases, "triton_kernel": triton_cases, "kv_append": append_cases,
         "gluon_append": gluon_append_cases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", required=True, choices=sorted(MODULES), help="which kernel module to compare")
    ap.add_argument("--base", required=True, help="file of the base version of that module (e.g. from git show)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case (minimum kept)")
    ap.add_argument("--cases", default="", help="only the cases whose name contains this text")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if not os.path.isfile(args.base):
        ap.error(f"--base {args.base}: no such file")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    new = importlib.import_module(MODULES[args.module])
    mods = {"base": load_file(args.base, f"_ab_base_{args.module}"), "new": new}
    rows = []
    for label, fns, fmt in CASES[args.module](mods):
        if args.cases not in label:
            continue
        best = {name: float("inf") for name in fns}
        refused = {}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                if name in refused:
                    continue
                try:
                    best[name] = min(best[name], fn())
                except ValueError as e:  # a case one version does not support (e.g. more warps)
                    refused[name] = str(e)
        if refused:
            print(f"{label:40s} skipped: {refused}", flush=True)
            continue
        ratio = best["new"] / best["base"]
        print(f"{label:40s} base {fmt(best['base'])}  new {fmt(best['new'])}  new/base {ratio:.3f}", flush=True)
        rows.append(dict(case=label, base_s=best["base"], new_s=best["new"], ratio=ratio))
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
