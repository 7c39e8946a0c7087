"""Speed of the KV kernels on a CUDA GPU (prints tables; needs only torch + triton).

    python benchmarks/kv_attention.py [--quick] [--json results.json]

Figures (Qwen3.5-27B attention layout: 24 query heads, 4 KV heads, head_dim 256):
1. decode attention effective bandwidth = (KV bytes of the context + Q + output) / time,
   and its fraction of the H200's 4.8 TB/s, for contexts 2k..1M and batch 1..64;
2. nvfp4 / fp8 / int8 vs bf16 decode time at 128k; verify T=4 vs T=1 time at >= 16k;
3. prefill attention TFLOP/s for a 4k chunk over a 64k nvfp4 prefix (causal FLOPs:
   4 * d * Hq * sum over queries of visible keys): the engine's call (quantized formats: through an
   fp16 workspace of the context, ``kv_dequant``) and the kernel over the packed pages; shorter
   chunks both ways; the same for fp8 and int8 (``prefill_fp8``, ``prefill_int8``);
4. fused append time per layer for a 64-sequence decode step (CUDA-graph replay);
5. the engine's decode call (``TritonBackend.decode_attention``: Q rotation, attention,
   split merge) captured in a CUDA graph, against the attention kernel alone;
6. programmatic dependent launch (``kernels.pdl``: by default for the append, Q rotation and
   merge kernels on Hopper) against none (``DEEPWELL_PDL=0``) and all kernels in the same
   process, for appends, decode calls and a whole layer (``--only pdl``). Every other table
   runs with the default; ``DEEPWELL_PDL=0 python benchmarks/kv_attention.py`` runs without;
7. K centered per page (``--kv-center-k page``) against a fixed offset: the engine's decode and
   prefill calls, the ratio of their times (``--only center``).
nvfp4, fp8 and int8 rows time the kernel the engine runs: on Hopper, decode and verify (T =
1-5 here) run the Gluon one (``gluon_decode``), timed beside the Triton kernel.
Caches hold random valid codes (no NaN patterns), block tables are random permutations.
Times are medians of ``triton.testing.do_bench`` over CUDA-graph replays (decode, verify,
append, the engine step: the GPU's time, as the engine runs them) or of eager calls (prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from deepwell.kernels.backend import KVCacheLayer, TritonBackend  # noqa: E402
from deepwell.kernels.calibration import calibrate  # noqa: E402
from deepwell.kernels.kv_append import triton_kernel as append_tk  # noqa: E402
from deepwell.kernels.kv_formats import KVLayout  # noqa: E402
from deepwell.kernels.paged_attention import gluon_decode  # noqa: E402
from deepwell.kernels.paged_attention import triton_kernel as attn_tk  # noqa: E402

HQ, HKV, D = 24, 4, 256
PEAK = 4.8e12


def random_cache(layout: KVLayout, num_pages: int) -> torch.Tensor:
    """Valid random codes: bf16 ~N(0,1); fp8/nvfp4 scales in a tame E4M3 range; int8 scales 0.02."""
    if layout.fmt.value == "bf16":
        return torch.randn(num_pages, 2, HKV, layout.head_page_bytes // 2, device="cuda", dtype=torch.bfloat16).view(torch.uint8)
    cache = torch.randint(0, 256, (num_pages, 2, HKV, layout.head_page_bytes), dtype=torch.uint8, device="cuda")
    codes = cache[..., : layout.scale_offset]
    if layout.fmt.value == "fp8":
        codes.copy_(torch.randint(0, 0x70, codes.shape, dtype=torch.uint8, device="cuda") | (codes & 0x80))
    if layout.fmt.value == "nvfp4":
        cache[..., layout.scale_offset :] = torch.randint(0x30, 0x40, cache[..., layout.scale_offset :].shape, dtype=torch.uint8, device="cuda")
    if layout.fmt.value == "int8":
        cache[..., layout.scale_offset :].view(torch.float32).fill_(0.02)
    return cache


def decode_case(fmt: str, batch: int, ctx: int, t: int = 1):
    layout = KVLayout.make(fmt, HKV, D)
    pages_per_seq = triton.cdiv(ctx, 64)
    num_pages = batch * pages_per_seq
    cache = random_cache(layout, num_pages)
    tables = torch.randperm(num_pages, device="cuda").view(batch, pages_per_seq).to(torch.int32)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * t, HQ, D, device="cuda").to(torch.bfloat16)
    return layout, cache, tables, ctx_lens, q


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e-3


def graph_time(fn, reps: int) -> float:
    """GPU time of one ``fn()`` call: ``reps`` calls captured in one CUDA graph, replays timed."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    sec = bench(graph.replay) / reps
    del graph
    return sec


def bench_graph(fn, reps: int = 20) -> float:
    """``graph_time`` of a decode call (as the engine runs a step). Eager timing of small calls
    measures the host's launch overhead instead (tens of microseconds per Triton launch from
    Python); calls over a millisecond are timed eagerly (the GPU is the bottleneck either way)."""
    eager = bench(fn)
    return eager if eager > 1e-3 else graph_time(fn, reps)


def decode_call(fmt: str, batch: int, ctx: int, t: int = 1, splits: int | None = None, impl: str = "auto", **kw):
    """(the engine's decode call of one shape as a closure, its split count, the bytes it reads:
    KV of the contexts + Q + output). ``impl``: "auto" is the engine's choice
    (``TritonBackend.uses_gluon``: the Gluon kernel for nvfp4 / fp8 / int8 decode on Hopper, else the Triton
    kernel); "triton" forces the Triton kernel, which takes ``kw`` (its tuning arguments)."""
    layout, cache, tables, ctx_lens, q = decode_case(fmt, batch, ctx, t)
    be = TritonBackend()
    gluon = impl == "auto" and be.uses_gluon(layout, HQ // HKV, t, q.device)
    if splits is None:
        dev = torch.device("cuda")
        splits = (be.gluon_splits(batch, HKV, dev, gluon_decode.programs_per_sm(t, HQ // HKV, D, layout.fmt)) if gluon
                  else be.default_splits(batch, HKV, dev))
    scales = layout.default_scales("cuda")
    out = torch.empty_like(q)
    scratch = (torch.empty(batch * t * HQ * splits * D, device="cuda"), torch.empty(batch * t * HQ * splits, device="cuda"))

    def run():  # the engine's decode call (uniform_t: row blocks derived in-kernel), Q pre-rotated
        if gluon:
            gluon_decode.paged_decode(q, cache, layout, scales, tables, ctx_lens, D**-0.5, tokens_per_seq=t,
                                      num_splits=splits, out=out, scratch=scratch)
            return
        attn_tk.paged_attention(q, cache, layout, scales, tables, ctx_lens, None, None, D**-0.5,
                                num_splits=splits, out=out, scratch=scratch, uniform_t=t, **kw)

    return run, splits, batch * ctx * HKV * 2 * layout.token_bytes + 2 * q.numel() * 2


def time_decode(fmt, batch, ctx, t=1, splits=None, warps=None, stages=None, asm=None, nv_load_k=None, nv_load_v=None,
                ppt=None, maxreg=None, bm=None, impl="auto"):
    """(seconds per call, bytes per second, splits) of ``decode_call``."""
    run, splits, nbytes = decode_call(fmt, batch, ctx, t, splits, impl, num_warps=warps, num_stages=stages,
                                      unpack_asm=asm, nv_load_k=nv_load_k, nv_load_v=nv_load_v, pages_per_tile=ppt,
                                      max_registers=maxreg, block_m=bm)
    sec = bench_graph(run)
    del run  # frees the cache
    return sec, nbytes / sec, splits


BEST: dict[str, dict] = {}


def decode_table(quick: bool) -> list[dict]:
    rows = []
    ctxs = [2048, 16384, 131072, 1048576] if not quick else [16384, 131072]
    batches = [1, 8, 64] if not quick else [1, 8]
    for fmt in ("nvfp4", "bf16", "fp8", "int8"):
        cfg = BEST.get(fmt, {}) if fmt != "nvfp4" else {}  # nvfp4: the engine's kernel choice
        for ctx in ctxs:
            for batch in batches:
                tokens = batch * ctx
                cap = 16 << 20 if fmt == "nvfp4" else 8 << 20
                if tokens > cap or (fmt in ("fp8", "int8") and ctx < 16384):
                    continue
                sec, bw, splits = time_decode(fmt, batch, ctx, **cfg)
                rows.append(dict(fmt=fmt, ctx=ctx, batch=batch, splits=splits, us=sec * 1e6, tbps=bw / 1e12, frac=bw / PEAK))
                print(f"decode {fmt:6s} ctx={ctx:8d} B={batch:3d} splits={splits:3d} {sec*1e6:9.1f} us {bw/1e12:6.2f} TB/s {bw/PEAK:6.1%}", flush=True)
    # the Triton kernel at the same points, where the engine runs the Gluon one (nvfp4, fp8, int8 on Hopper)
    for fmt in ("nvfp4", "fp8", "int8"):
        for ctx, batch in ((16384, 64), (131072, 1), (131072, 8), (131072, 64)):
            if quick and batch == 64:
                continue
            sec, bw, splits = time_decode(fmt, batch, ctx, impl="triton", **BEST.get(fmt, {}))
            rows.append(dict(fmt=f"{fmt}-triton", ctx=ctx, batch=batch, splits=splits, us=sec * 1e6, tbps=bw / 1e12,
                             frac=bw / PEAK))
            print(f"decode {fmt} (Triton kernel) ctx={ctx:8d} B={batch:3d} splits={splits:3d} {sec*1e6:9.1f} us "
                  f"{bw/1e12:6.2f} TB/s {bw/PEAK:6.1%}", flush=True)
    return rows


def sweep(fmt: str, batch: int, ctx: int) -> list[dict]:
    """Time decode variants at one point; remember the fastest in BEST[fmt]."""
    rows = []
    if fmt == "nvfp4":
        # (K, V) ways of reaching block scales; see kernels/paged_attention/triton_kernel.py
        pairs = [(2, 2), (2, 5), (2, 6), (5, 5)]
        cfgs = [dict(warps=4, stages=2, asm=True, nv_load_k=k, nv_load_v=v, ppt=n) for k, v in pairs for n in (1, 2)]
        cfgs += [dict(warps=w, stages=s, asm=True, nv_load_k=2, nv_load_v=6, ppt=2) for w, s in ((4, 3), (8, 2))]
        cfgs += [dict(warps=4, stages=2, asm=False, nv_load_k=2, nv_load_v=2, ppt=2)]
        # register caps: one page per tile fits 128 registers without spills (4 CTAs per SM
        # instead of 3); two pages at 168 (3 by registers, but ~96 KB of shared memory)
        cfgs += [dict(warps=4, stages=s, asm=True, nv_load_k=2, nv_load_v=v, ppt=1, maxreg=128) for s in (2, 3) for v in (5, 6)]
        cfgs += [dict(warps=4, stages=3, asm=True, nv_load_k=2, nv_load_v=6, ppt=2, maxreg=168)]
    else:
        cfgs = [dict(warps=4, stages=s) for s in (2, 3)]
    for cfg in cfgs:
        try:
            sec, bw, _ = time_decode(fmt, batch, ctx, **cfg)
        except Exception as exc:  # report and continue: a variant may not compile
            print(f"sweep {fmt} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        rows.append(dict(fmt=fmt, batch=batch, ctx=ctx, us=sec * 1e6, frac=bw / PEAK, **cfg))
        print(f"sweep {fmt} B={batch} ctx={ctx} {cfg}: {sec*1e6:8.1f} us {bw/PEAK:6.1%}", flush=True)
    if rows:
        best = min(rows, key=lambda r: r["us"])
        BEST[fmt] = {k: best[k] for k in ("warps", "stages", "asm", "nv_load_k", "nv_load_v", "ppt", "maxreg") if k in best}
        print(f"best {fmt}: {BEST[fmt]}", flush=True)
    return rows


def verify_table() -> list[dict]:
    """T=4 vs T=1 with the kernels the engine uses (Gluon on Hopper), then the Triton kernel's
    T=4 variants at 128k x 8 (against the engine's T=1)."""
    rows = []
    for fmt in ("nvfp4", "fp8", "int8"):
        for ctx in (16384, 131072):
            for batch in (1, 8, 64):
                t1, _, _ = time_decode(fmt, batch, ctx, 1)
                t4, _, _ = time_decode(fmt, batch, ctx, 4)
                rows.append(dict(fmt=fmt, ctx=ctx, batch=batch, t1_us=t1 * 1e6, t4_us=t4 * 1e6, ratio=t4 / t1))
                print(f"verify {fmt} ctx={ctx} B={batch}: T=1 {t1*1e6:.1f} us, T=4 {t4*1e6:.1f} us, ratio {t4/t1:.2f}",
                      flush=True)
    t1, _, _ = time_decode("nvfp4", 8, 131072, 1)
    for warps, stages, ppt in [(4, 2, 2), (4, 3, 2), (8, 2, 2)]:  # the Triton kernel's T = 4
        t4, _, _ = time_decode("nvfp4", 8, 131072, 4, warps=warps, stages=stages, ppt=ppt, impl="triton")
        rows.append(dict(ctx=131072, batch=8, warps=warps, stages=stages, ppt=ppt, t1_us=t1 * 1e6, t4_us=t4 * 1e6,
                         ratio=t4 / t1))
        print(f"verify T=4 variant warps={warps} stages={stages} ppt={ppt}: {t4*1e6:.1f} us, ratio {t4/t1:.2f}", flush=True)
    return rows


def prefill_case(fmt: str, prefix: int, chunk: int):
    """One sequence's ``chunk`` new tokens over a ``prefix``-token cache: (layout, cache,
    tables, context lens, q, q_start, q_len, causal FLOPs)."""
    layout, cache, tables, ctx_lens, _ = decode_case(fmt, 1, prefix + chunk)
    q = torch.randn(chunk, HQ, D, device="cuda").to(torch.bfloat16)
    q_len = torch.tensor([chunk], dtype=torch.int32, device="cuda")
    q_start = torch.zeros(1, dtype=torch.int32, device="cuda")
    flops = 4 * D * HQ * (chunk * prefix + chunk * (chunk + 1) // 2)
    return layout, cache, tables, ctx_lens, q, q_start, q_len, flops


def prefill_table(fmt: str = "nvfp4", prefix: int = 65536, chunk: int = 4096) -> list[dict]:
    """The prefill of ``chunk`` tokens over a ``prefix``: the engine's call
    (``TritonBackend.prefill_attention``: Q rotation, then for nvfp4 / fp8 / int8 chunks of >= 1024 query rows
    the context unpacked once into an fp16 workspace and attention over it; Q rotation and the
    dequantization included), the attention kernel over the packed pages in three
    configurations (Q already rotated; the first is the backend's for short chunks), and the
    workspace's two launches apart; then the engine's call against the packed pages for shorter
    chunks (``--only prefill``: where the workspace starts to pay)."""
    from deepwell.kernels.kv_dequant import reference as dq_ref
    from deepwell.kernels.kv_dequant import triton_kernel as dq_tk

    rows = []
    layout, cache, tables, ctx_lens, q, q_start, q_len, flops = prefill_case(fmt, prefix, chunk)
    scales = layout.default_scales("cuda")
    out = torch.empty_like(q)
    layer = KVCacheLayer(layout, cache, scales)

    def report(name: str, sec: float, **kw) -> None:
        rows.append(dict(fmt=fmt, prefix=prefix, chunk=chunk, case=name, ms=sec * 1e3, tflops=flops / sec / 1e12, **kw))
        print(f"prefill {fmt} {chunk} over {prefix}: {name:58s} {sec*1e3:8.2f} ms {flops/sec/1e12:6.1f} TFLOP/s",
              flush=True)

    be = TritonBackend()
    report("engine call (TritonBackend.prefill_attention)",
           bench(lambda: be.prefill_attention(q, layer, tables, ctx_lens, [chunk], sm_scale=D**-0.5, out=out)))
    for bm, warps, stages in ((64, 4, 2), (64, 4, 1), (128, 8, 1)):
        work = attn_tk.work_items([chunk], HQ // HKV, bm, q.device)
        try:
            sec = bench(lambda: attn_tk.paged_attention(q, cache, layout, scales, tables, ctx_lens, q_start, q_len, D**-0.5,
                                                        q_lens_host=[chunk], num_splits=1, block_m=bm, out=out, work=work,
                                                        num_warps=warps, num_stages=stages, pages_per_tile=1,
                                                        page_max=False))
        except Exception as exc:
            print(f"prefill {fmt} bm={bm} warps={warps} stages={stages}: FAILED {type(exc).__name__}: {str(exc)[:200]}",
                  flush=True)
            continue
        report(f"packed pages: bm={bm} warps={warps} stages={stages}", sec, block_m=bm, warps=warps, stages=stages)
    if fmt in ("nvfp4", "fp8", "int8"):
        ws = dq_ref.allocate(layout, tables)
        ws_scales = dq_ref.workspace_scales(layout, scales)
        wl, wt = dq_ref.workspace_layout(layout), dq_ref.workspace_tables(tables)
        work = attn_tk.work_items([chunk], HQ // HKV, 128, q.device)
        deq = lambda: dq_tk.dequantize(cache, layout, tables, ctx_lens, ws)  # noqa: E731
        att = lambda: attn_tk.paged_attention(q, ws, wl, ws_scales, wt, ctx_lens, q_start, q_len, D**-0.5,  # noqa: E731
                                              q_lens_host=[chunk], num_splits=1, block_m=128, out=out, work=work,
                                              num_warps=8, num_stages=2, pages_per_tile=1, page_max=False,
                                              dequantized=True)
        sec_d = bench(deq)
        print(f"prefill {fmt} {chunk} over {prefix}: workspace dequantization {sec_d*1e3:.3f} ms "
              f"({(prefix + chunk) * HKV * 2 * (layout.token_bytes + 2 * D) / sec_d / 1e12:.2f} TB/s read + written)",
              flush=True)
        report("workspace attention alone: bm=128 warps=8 stages=2", bench(att))
        del ws
        for long_prefix in (262144, 1048576) if chunk == 4096 and prefix == 65536 else ():
            rows.append(engine_call_variants(fmt, long_prefix, chunk, (
                ("packed", dict(prefill_workspace_bytes=0)), ("workspace", {}),
                # budgets the context exceeds: attended in segments of its pages
                ("segments within 1 GiB", dict(prefill_workspace_bytes=1 << 30)),
                ("segments within 512 MiB", dict(prefill_workspace_bytes=512 << 20)))))
            torch.cuda.empty_cache()  # its cache is gone with the call
        for short in (512, 128, 32, 8) if chunk == 4096 else ():
            rows.append(engine_call_variants(fmt, prefix, short, (
                ("packed, unsplit", dict(prefill_workspace_bytes=0, max_splits=1)),
                ("packed", dict(prefill_workspace_bytes=0)),
                ("workspace", dict(prefill_dequant_min_rows=1)))))
            torch.cuda.empty_cache()
    return rows


def engine_call_variants(fmt: str, prefix: int, chunk: int, variants) -> dict:
    """The engine's prefill call (``TritonBackend.prefill_attention``) of ``chunk`` tokens over
    ``prefix`` under each ``(name, TritonBackend keyword arguments)`` of ``variants``; the row
    names the backend's default choice too."""
    layout, cache, tables, lens, q, _, _, flops = prefill_case(fmt, prefix, chunk)
    layer = KVCacheLayer(layout, cache, layout.default_scales("cuda"))
    out = torch.empty_like(q)
    times = {}
    for name, kw in variants:
        be = TritonBackend(**kw)
        times[name] = bench(lambda: be.prefill_attention(q, layer, tables, lens, [chunk], sm_scale=D**-0.5, out=out))
    default = "workspace" if TritonBackend()._dequantizes(layout, chunk * HQ // HKV) else "packed"
    print(f"prefill {fmt} {chunk} over {prefix}: engine call (default: {default}) "
          + ", ".join(f"{k} {v*1e3:.3f} ms ({flops/v/1e12:.1f} TFLOP/s)" for k, v in times.items()), flush=True)
    return dict(fmt=fmt, prefix=prefix, chunk=chunk, case="engine call variants", default=default,
                **{k + "_ms": v * 1e3 for k, v in times.items()})


def append_case(fmt: str, counted: bool, fed: bool, rotation: bool | int | None = None):
    """One layer's append of a 64-sequence decode step: (layout, cache, k, v, slots, global
    scales, K offset (fp8/nvfp4), block-scale counts (``counted``, as the engine), K feedback
    matrices (``fed``)); ``rotation``: K's Hadamard (``KVLayout.make``; 16: per 16-element block)."""
    layout = KVLayout.make(fmt, HKV, D, rotation)
    cache = layout.allocate(64 * 4, "cuda")
    k = torch.randn(64, HKV, D, device="cuda").to(torch.bfloat16)
    v = torch.randn(64, HKV, D, device="cuda").to(torch.bfloat16)
    slots = torch.arange(64, device="cuda") * 256 + 17
    offset = torch.randn(HKV, D, device="cuda") * 0.1 if fmt in ("fp8", "nvfp4") else None
    # global scales calibrated on the step's own K (centered) and V, as the engine calibrates
    # them: the counted kinds then occur about as rarely as in service (fp8 at g = 1 would make
    # ~1% of these Gaussian elements subnormal, and every program would add to the counters)
    k_cal = k.float() - (offset if offset is not None else 0.0)
    scales = calibrate(layout, k_cal.cpu(), v.float().cpu()).to("cuda")
    counts = torch.zeros(2, HKV, 3, dtype=torch.int64, device="cuda") if counted else None
    # --kv-k-rounding feedback: calibrated-like matrices (the cost does not depend on the values)
    fb = torch.triu(torch.randn(HKV, D // 16, 16, 16, device="cuda") * 0.1, 1).contiguous() if fed else None
    return layout, cache, k, v, slots, scales, offset, counts, fb


def append_table() -> list[dict]:
    """One layer's append of a 64-sequence decode step (K centered and block scales counted,
    as the engine does for fp8/nvfp4; int8's token scales counted as the engine does), per
    kernel, tokens-per-program and warps; the first of
    each format is the default (nvfp4 and fp8 on Hopper: the Gluon kernel, with or without K feedback)."""
    rows = []
    cases = [("nvfp4", "auto", None, None, True, False), ("nvfp4", "auto", None, None, False, False),
             ("nvfp4", "auto", None, 2, True, False), ("nvfp4", "auto", None, 4, True, False),
             ("nvfp4", "triton", None, None, True, False), ("nvfp4", "triton", None, None, False, False),
             ("nvfp4", "auto", None, None, True, True), ("nvfp4", "gluon", None, None, True, True),
             ("nvfp4", "gluon", None, 1, True, True)]
    cases += [("bf16", "auto", None, None, False, False), ("fp8", "auto", None, None, True, False),
              ("fp8", "auto", None, None, False, False), ("fp8", "auto", None, 2, True, False),
              ("fp8", "triton", None, None, True, False), ("fp8", "triton", 4, None, False, False),
              ("fp8", "auto", None, None, True, True), ("fp8", "auto", None, 2, True, True),
              ("fp8", "triton", None, None, True, True), ("int8", "auto", None, None, True, False),
              ("int8", "auto", None, None, False, False)]
    # K rotated per 16-element block (what --kv-hadamard layer chooses for most nvfp4 layers of QK-norm models)
    cases += [("nvfp4", "auto", None, None, True, True, 16), ("nvfp4", "auto", None, None, True, False, 16)]
    for fmt, impl, bt, warps, counted, fed, *rot in cases:
        rotation = rot[0] if rot else None
        layout, cache, k, v, slots, scales, offset, counts, fb = append_case(fmt, counted, fed, rotation)

        def call():
            append_tk.append(cache, layout, k, v, slots, scales, offset, counts, fb, validate=False, block_t=bt,
                             num_warps=warps, impl=impl)

        sec = graph_time(call, 100)
        eager = bench(call)
        kernel = append_tk.append_kernel(layout, k.device, impl=impl, block_t=bt)
        rows.append(dict(fmt=fmt, kernel=kernel, block_t=bt or "default", warps=warps or "default", counted=counted,
                         k_feedback=fed, hadamard=layout.hadamard_size, graph_us=sec * 1e6, eager_us=eager * 1e6))
        print(f"append {fmt:6s} 64 tokens x 4 heads {kernel:6s} block_t={bt or 'default'} warps={warps or 'default'} "
              f"counted={counted} k_feedback={fed} hadamard={layout.hadamard_size}: "
              f"{sec*1e6:6.2f} us/layer in a graph, {eager*1e6:6.2f} us eager", flush=True)
    return rows


def step_table() -> list[dict]:
    rows = []
    for batch, ctx in ((8, 131072), (64, 4096)):
        layout, cache, tables, ctx_lens, q = decode_case("nvfp4", batch, ctx, 1)
        layer = KVCacheLayer(layout, cache, layout.default_scales("cuda"))
        be = TritonBackend()
        out = torch.empty_like(q)

        def call():
            be.decode_attention(q, layer, tables, ctx_lens, sm_scale=D**-0.5, out=out, validate=False)

        step = graph_time(call, 1)
        kernel, _, splits = time_decode("nvfp4", batch, ctx, 1)
        rows.append(dict(batch=batch, ctx=ctx, step_us=step * 1e6, kernel_us=kernel * 1e6))
        print(f"step nvfp4 B={batch} ctx={ctx}: backend decode call in a graph {step*1e6:8.1f} us, "
              f"attention kernel alone {kernel*1e6:8.1f} us", flush=True)
        del cache
    return rows


def _layer_call(batch: int, ctx: int, fed: bool):
    """One attention layer of a decode step as the engine runs it: the backend's append of one
    token per sequence (K centered, block scales counted, K feedback if ``fed``), then its decode
    call (Q rotation, attention, split merge)."""
    layout, cache, tables, ctx_lens, q = decode_case("nvfp4", batch, ctx, 1)
    layer = KVCacheLayer(layout, cache, layout.default_scales("cuda"), k_offset=torch.randn(HKV, D, device="cuda") * 0.1,
                         scale_counts=torch.zeros(2, HKV, 3, dtype=torch.int64, device="cuda"),
                         k_feedback=(torch.triu(torch.randn(HKV, D // 16, 16, 16, device="cuda") * 0.1, 1).contiguous()
                                     if fed else None))
    k = torch.randn(batch, HKV, D, device="cuda").to(torch.bfloat16)
    v = torch.randn(batch, HKV, D, device="cuda").to(torch.bfloat16)
    slots = tables[:, (ctx - 1) // 64].long() * 64 + (ctx - 1) % 64
    be = TritonBackend()
    out = torch.empty_like(q)

    def call():
        be.append(layer, k, v, slots, validate=False)
        be.decode_attention(q, layer, tables, ctx_lens, sm_scale=D**-0.5, out=out, validate=False)
    return call


def pdl_table(rounds: int = 3, selections: tuple[str, ...] = ("0", "all", "append,rotate,merge")) -> list[dict]:
    """Programmatic dependent launch (``kernels.pdl``) by kernel family (``DEEPWELL_PDL``: 0 =
    none, all, or a list; "append,rotate,merge" is the default), same process, interleaved rounds (minimum of each): the append and decode
    calls of the tables above and one whole attention layer of a decode step (append + the
    backend's decode call), each timed over CUDA-graph replays of back-to-back calls; ratios
    against no PDL."""
    rows = []
    cases = []
    for counted, fed in ((True, False), (True, True)):
        def make(counted=counted, fed=fed):
            layout, cache, k, v, slots, scales, offset, counts, fb = append_case("nvfp4", counted, fed)
            return lambda: append_tk.append(cache, layout, k, v, slots, scales, offset, counts, fb, validate=False)
        cases.append((f"append nvfp4 64 tokens counted={counted} k_feedback={fed}", make, 100))
    for fmt, batch, ctx, t in (("nvfp4", 1, 2048, 1), ("nvfp4", 1, 16384, 1), ("nvfp4", 1, 16384, 4),
                               ("nvfp4", 1, 131072, 1), ("bf16", 1, 131072, 1), ("nvfp4", 8, 16384, 1),
                               ("nvfp4", 8, 16384, 4), ("nvfp4", 8, 131072, 1), ("bf16", 8, 131072, 1)):
        cases.append((f"decode {fmt} {ctx // 1024}k x {batch} T={t}",
                      lambda fmt=fmt, batch=batch, ctx=ctx, t=t: decode_call(fmt, batch, ctx, t)[0], 20))
    for batch, ctx, fed in ((64, 4096, False), (64, 4096, True), (8, 131072, True), (1, 131072, True)):
        cases.append((f"layer nvfp4 {ctx // 1024}k x {batch} k_feedback={fed}",
                      lambda batch=batch, ctx=ctx, fed=fed: _layer_call(batch, ctx, fed), 10))
    prev = os.environ.get("DEEPWELL_PDL")
    try:
        for name, make, reps in cases:
            call = make()
            best = {sel: float("inf") for sel in selections}
            for _ in range(rounds):
                for sel in selections:
                    os.environ["DEEPWELL_PDL"] = sel
                    best[sel] = min(best[sel], graph_time(call, reps))
            base = best["0"] if "0" in best else best[selections[0]]
            rows.append(dict(case=name, us={sel: best[sel] * 1e6 for sel in selections}))
            print(f"pdl {name}: " + ", ".join(f"[{sel}] {best[sel] * 1e6:.2f} us ({best[sel] / base:.3f})"
                                            for sel in selections), flush=True)
            del call
            torch.cuda.empty_cache()
    finally:
        if prev is None:
            os.environ.pop("DEEPWELL_PDL", None)
        else:
            os.environ["DEEPWELL_PDL"] = prev
    return rows


def _page_center(max_pages: int, sink: bool = True):
    """A per-page K centering for the 27B layout (64 rotary dims of 256, Qwen's theta): a random
    ``mu`` on the channels a page may center (``kernels.page_center``) and, with ``sink`` (the
    engine's default), a random sink key for page 0."""
    from deepwell.kernels.page_center import PageCenter, page_stationary, rope_table

    inv = 1.0 / 10_000_000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    mu = torch.randn(HKV, D) * torch.where(page_stationary(inv, D), 1.0, 0.0)
    return PageCenter(mu.contiguous().cuda(), rope_table(inv, max_pages, "cuda"),
                      torch.randn(HKV, D, device="cuda") if sink else None)


def _best_prefill(be, q, tables, lens, rounds: int, layers: dict) -> dict[str, float]:
    """Seconds per engine prefill call (one sequence, all of ``q``) for each named layer,
    minimum over ``rounds`` interleaved rounds."""
    out = torch.empty_like(q)
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, lay in layers.items():
            sec = bench(lambda lay=lay: be.prefill_attention(q, lay, tables, lens, [q.shape[0]], sm_scale=D**-0.5,
                                                             out=out))
            best[name] = min(best.get(name, sec), sec)
    return best


def center_table(rounds: int = 3, kernels: bool = True) -> list[dict]:
    """K centered per page (``--kv-center-k page``) against a fixed offset (nothing at attention
    time): the engine's decode call (``TritonBackend.decode_attention``: Q rotation, the page
    terms' launch, attention, merge; CUDA-graph replays) and prefill call (a 4k chunk over a 64k
    prefix: the workspace with the page offsets added back), the same cache either way, minimum
    over ``rounds`` interleaved rounds and the ratio centered / fixed; with ``kernels``, where
    the Gluon kernel runs, its time alone without and with the page terms and the page terms'
    launch alone."""
    rows = []
    be = TritonBackend()
    for fmt in ("nvfp4", "fp8"):
        # T = 8 (48 columns) runs the Triton kernel (with the precomputed page terms)
        for ctx, batch, t in ((131072, 1, 1), (131072, 8, 1), (16384, 64, 1), (131072, 8, 2), (131072, 8, 4),
                              (131072, 8, 8)):
            layout, cache, tables, lens, q = decode_case(fmt, batch, ctx, t)
            scales = layout.default_scales("cuda")
            plain = KVCacheLayer(layout, cache, scales)
            cen = KVCacheLayer(layout, cache, scales, page_center=_page_center(tables.shape[1]))
            nosink = KVCacheLayer(layout, cache, scales, page_center=_page_center(tables.shape[1], sink=False))
            out = torch.empty_like(q)
            calls = {name: (lambda lay=lay: be.decode_attention(q, lay, tables, lens, tokens_per_seq=t,
                                                                 sm_scale=D**-0.5, out=out))
                     for name, lay in (("fixed", plain), ("page", cen), ("page_nosink", nosink))}
            best: dict[str, float] = {}
            for _ in range(rounds):
                for name, fn in calls.items():
                    sec = bench_graph(fn)
                    best[name] = min(best.get(name, sec), sec)
            rows.append(dict(fmt=fmt, ctx=ctx, batch=batch, t=t, fixed_us=best["fixed"] * 1e6,
                             page_us=best["page"] * 1e6, page_nosink_us=best["page_nosink"] * 1e6,
                             ratio=best["page"] / best["fixed"]))
            print(f"center {fmt} decode ctx={ctx} B={batch} T={t}: fixed {best['fixed']*1e6:.1f} us, "
                  f"page {best['page']*1e6:.1f} us (page 0 on a sink key; without {best['page_nosink']*1e6:.1f}), "
                  f"ratio {best['page']/best['fixed']:.3f}", flush=True)
            if kernels and be.uses_gluon(layout, HQ // HKV, t, q.device):  # the parts: Gluon kernel alone, page terms alone
                from deepwell.kernels.paged_attention import page_bias as pb_mod

                cols = gluon_decode.num_columns(t, HQ // HKV)
                bias = pb_mod.page_bias(cen.page_center, q, t, cols, tables.shape[1], D**-0.5 * gluon_decode.LOG2E)
                splits = be.gluon_splits(batch, HKV, q.device, gluon_decode.programs_per_sm(t, HQ // HKV, D, layout.fmt))
                scratch = (torch.empty(batch * t * HQ * splits * D, device="cuda"),
                           torch.empty(batch * t * HQ * splits, device="cuda"))
                parts = {"kernel": lambda: gluon_decode.paged_decode(
                    q, cache, layout, scales, tables, lens, D**-0.5, tokens_per_seq=t, num_splits=splits, out=out,
                    scratch=scratch)}
                parts["kernel+terms"] = lambda: gluon_decode.paged_decode(
                    q, cache, layout, scales, tables, lens, D**-0.5, tokens_per_seq=t, num_splits=splits, out=out,
                    scratch=scratch, page_bias=bias)
                parts["page_bias alone"] = lambda: pb_mod.page_bias(cen.page_center, q, t, cols, tables.shape[1], 1.0,
                                                                    out=bias)
                parts["page_bias without the sink"] = lambda: pb_mod.page_bias(nosink.page_center, q, t, cols,
                                                                               tables.shape[1], 1.0, out=bias)
                pbest: dict[str, float] = {}
                for _ in range(rounds):
                    for name, fn in parts.items():
                        sec = bench_graph(fn)
                        pbest[name] = min(pbest.get(name, sec), sec)
                rows[-1].update({k.replace(" ", "_") + "_us": v * 1e6 for k, v in pbest.items()})
                print(f"center {fmt} parts ctx={ctx} B={batch} T={t}: "
                      + ", ".join(f"{k} {v*1e6:.1f} us" for k, v in pbest.items()), flush=True)
            torch.cuda.empty_cache()
        layout, cache, tables, lens, q, _, _, flops = prefill_case(fmt, 65536, 4096)
        scales = layout.default_scales("cuda")
        best = _best_prefill(be, q, tables, lens, rounds, {
            "fixed": KVCacheLayer(layout, cache, scales),
            "page": KVCacheLayer(layout, cache, scales, page_center=_page_center(tables.shape[1]))})
        rows.append(dict(fmt=fmt, case="prefill 4k over 64k", fixed_tflops=flops / best["fixed"] / 1e12,
                         page_tflops=flops / best["page"] / 1e12, ratio=best["page"] / best["fixed"]))
        print(f"center {fmt} prefill 4k over 64k: fixed {flops/best['fixed']/1e12:.1f} TFLOP/s, page "
              f"{flops/best['page']/1e12:.1f} TFLOP/s, time ratio {best['page']/best['fixed']:.3f}", flush=True)
        # a short chunk reads the packed pages (under the workspace's row threshold): the page
        # terms summed in the Triton kernel's tile, r + 1 of them with page 0's sink term
        layout, cache, tables, lens, q, _, _, flops = prefill_case(fmt, 65536, 256)
        best = _best_prefill(be, q, tables, lens, rounds, {
            "page": KVCacheLayer(layout, cache, scales, page_center=_page_center(tables.shape[1])),
            "page_nosink": KVCacheLayer(layout, cache, scales, page_center=_page_center(tables.shape[1], sink=False))})
        rows.append(dict(fmt=fmt, case="prefill 256 over 64k (packed pages)", sink_us=best["page"] * 1e6,
                         nosink_us=best["page_nosink"] * 1e6, ratio=best["page"] / best["page_nosink"]))
        print(f"center {fmt} prefill 256 over 64k (packed pages): page 0 on a sink key {best['page']*1e6:.1f} us, "
              f"without {best['page_nosink']*1e6:.1f} us, ratio {best['page']/best['page_nosink']:.3f}", flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--sweep", action="store_true", help="sweep decode warps/stages at 128k first")
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument("--only", default=None, help="comma-separated sections to run (append, sweep_FMT, decode, verify, "
                                                 "prefill, prefill_fp8, prefill_int8, step, pdl, center)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    res: dict = {}
    sections = [("append", append_table)]
    if args.sweep:
        for fmt in ("nvfp4", "bf16", "fp8", "int8"):
            sections.append((f"sweep_{fmt}", lambda fmt=fmt: sweep(fmt, 8, 131072)))
    sections += [("decode", lambda: decode_table(args.quick)), ("verify", verify_table), ("prefill", prefill_table),
                 ("prefill_fp8", lambda: prefill_table("fp8")), ("prefill_int8", lambda: prefill_table("int8")),
                 ("step", step_table), ("pdl", pdl_table), ("center", center_table)]
    if args.only:
        keep = set(args.only.split(","))
        sections = [(n, f) for n, f in sections if n in keep]
    for name, fn in sections:
        try:
            res[name] = fn()
        except Exception as exc:  # keep going: later sections still report
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    by = {(r["fmt"], r["ctx"], r["batch"]): r["us"] for r in res.get("decode", [])}
    for b in (1, 8, 64):
        for fmt in ("nvfp4", "fp8", "int8"):
            if (fmt, 131072, b) in by and ("bf16", 131072, b) in by:
                print(f"128k B={b}: bf16 / {fmt} time = {by['bf16', 131072, b] / by[fmt, 131072, b]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
