"""Prefill attention: the engine's Triton kernel against torch's SDPA backends on a CUDA GPU.

    python3 benchmarks/prefill_sdpa.py [--chunk 4096] [--prefixes 65536 262144] [--engine-only] [--formats nvfp4 bf16]

Why: a cold 414k-token prefill spends most of its time in attention (a 4k chunk late in the
prompt attends ~400k keys), so the prefill kernel's TFLOP/s decides that figure. This measures,
at the Qwen3.5-27B attention layout (24 query heads, 4 KV heads, d = 256, bf16/fp16):

- ``engine call FMT, cudnn | triton``: ``TritonBackend.prefill_attention`` as the engine calls
  it, with its cuDNN path (``paged_attention.dense_prefill``) and without;
- ``deepwell workspace``: ``kernels.paged_attention`` over a dequantized fp16 workspace of the
  context, as ``TritonBackend.prefill_attention`` serves nvfp4 / fp8 / int8 chunks of >= 1024 rows
  (the chunk causal at the end of the context);
- ``sdpa <backend> [gqa|expanded]``: ``F.scaled_dot_product_attention`` of the same chunk over
  the prefix alone, no mask (the part that dominates at long context), with K/V of 4 heads and
  ``enable_gqa=True``, or K/V expanded to 24 heads; backends flash, cudnn, efficient (one that
  refuses the shape prints its error).

FLOPs: 4 x d x Hq x (visible query-key pairs); TFLOP/s = FLOPs / the median time
(``triton.testing.do_bench``). Not a test: prints one line per figure.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from kv_attention import D, HKV, HQ, bench, prefill_case  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def deepwell_workspace(prefix: int, chunk: int) -> None:
    """The engine's workspace attention alone (the dequantization launch not timed)."""
    from deepwell.kernels.kv_dequant import reference as dq_ref
    from deepwell.kernels.kv_dequant import triton_kernel as dq_tk
    from deepwell.kernels.paged_attention import triton_kernel as attn_tk

    layout, cache, tables, ctx_lens, q, q_start, q_len, flops = prefill_case("nvfp4", prefix, chunk)
    scales = layout.default_scales("cuda")
    ws = dq_ref.allocate(layout, tables)
    dq_tk.dequantize(cache, layout, tables, ctx_lens, ws)
    ws_scales, wl, wt = dq_ref.workspace_scales(layout, scales), dq_ref.workspace_layout(layout), dq_ref.workspace_tables(tables)
    out = torch.empty_like(q)
    work = attn_tk.work_items([chunk], HQ // HKV, 128, q.device)
    sec = bench(lambda: attn_tk.paged_attention(q, ws, wl, ws_scales, wt, ctx_lens, q_start, q_len, D**-0.5,
                                                 q_lens_host=[chunk], num_splits=1, block_m=128, out=out, work=work,
                                                 num_warps=8, num_stages=2, pages_per_tile=1, page_max=False,
                                                 dequantized=True))
    print(f"prefill {chunk} over {prefix}: {'deepwell workspace (causal chunk at the end)':44s} "
          f"{sec*1e3:8.2f} ms {flops/sec/1e12:6.1f} TFLOP/s", flush=True)


def engine_calls(prefix: int, chunk: int, fmt: str) -> None:
    """``TritonBackend.prefill_attention`` as the engine calls it, cuDNN on and off (interleaved
    rounds, the best of each)."""
    from deepwell.kernels.backend import KVCacheLayer, TritonBackend

    layout, cache, tables, ctx_lens, q, _, _, flops = prefill_case(fmt, prefix, chunk)
    layer = KVCacheLayer(layout, cache, layout.default_scales("cuda"))
    out = torch.empty_like(q)
    best: dict[str, float] = {}
    for _ in range(2):
        for name, be in (("cudnn", TritonBackend()), ("triton", TritonBackend(prefill_dense=False))):
            sec = bench(lambda be=be: be.prefill_attention(q, layer, tables, ctx_lens, [chunk], sm_scale=D**-0.5,
                                                           out=out))
            best[name] = min(best.get(name, sec), sec)
    for name, sec in best.items():
        print(f"prefill {chunk} over {prefix}: {f'engine call {fmt}, {name}':44s} {sec*1e3:8.2f} ms "
              f"{flops/sec/1e12:6.1f} TFLOP/s", flush=True)
    print(f"prefill {chunk} over {prefix}: engine call {fmt}, cudnn / triton time {best['cudnn'] / best['triton']:.3f}",
          flush=True)


def sdpa(prefix: int, chunk: int, dtype: torch.dtype) -> None:
    q = torch.randn(1, HQ, chunk, D, device="cuda", dtype=dtype)
    k = torch.randn(1, HKV, prefix, D, device="cuda", dtype=dtype)
    v = torch.randn(1, HKV, prefix, D, device="cuda", dtype=dtype)
    flops = 4 * D * HQ * chunk * prefix
    for mode in ("gqa", "expanded"):
        kk, vv = (k, v) if mode == "gqa" else (k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1))
        for name, backend in BACKENDS.items():
            label = f"sdpa {name} {mode} {str(dtype)[6:]} (prefix only, no mask)"
            try:
                with sdpa_kernel([backend]):
                    fn = lambda: F.scaled_dot_product_attention(q, kk, vv, enable_gqa=mode == "gqa")  # noqa: E731
                    fn()
                    sec = bench(fn)
            except Exception as exc:  # a backend that refuses the shape says why
                print(f"prefill {chunk} over {prefix}: {label:44s} FAILED {type(exc).__name__}: {str(exc)[:160]}",
                      flush=True)
                continue
            print(f"prefill {chunk} over {prefix}: {label:44s} {sec*1e3:8.2f} ms {flops/sec/1e12:6.1f} TFLOP/s",
                  flush=True)
        # the private op that also returns the log-sum-exp (what merging a prefix part with the
        # chunk's causal part needs); K/V heads as given
        label = f"cudnn op + lse {mode} {str(dtype)[6:]} (prefix only, no mask)"
        try:
            fn = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(  # noqa: E731
                q, kk, vv, None, True, 0.0, False, False, scale=D**-0.5)
            fn()
            sec = bench(fn)
            print(f"prefill {chunk} over {prefix}: {label:44s} {sec*1e3:8.2f} ms {flops/sec/1e12:6.1f} TFLOP/s",
                  flush=True)
        except Exception as exc:
            print(f"prefill {chunk} over {prefix}: {label:44s} FAILED {type(exc).__name__}: {str(exc)[:160]}",
                  flush=True)
        del kk, vv
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--prefixes", type=int, nargs="+", default=[65536, 262144])
    ap.add_argument("--engine-only", action="store_true", help="only the engine's call, cuDNN on and off")
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "bf16"], help="the engine call's KV formats")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cudnn {torch.backends.cudnn.version()}", flush=True)
    for prefix in args.prefixes:
        for fmt in args.formats:
            engine_calls(prefix, args.chunk, fmt)
            torch.cuda.empty_cache()
        if args.engine_only:
            continue
        deepwell_workspace(prefix, args.chunk)
        torch.cuda.empty_cache()
        for dtype in (torch.bfloat16, torch.float16):
            sdpa(prefix, args.chunk, dtype)


if __name__ == "__main__":
    main()
