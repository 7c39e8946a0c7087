"""FP8 weight GEMMs at Qwen3.5-27B's linear shapes on a CUDA device: which one to serve with.

    python -m deepwell.kernels.fp8_gemm.bench [--tokens 1 8 32 4096]

Per shape and token count, the median time (µs, ``triton.testing.do_bench``) and the error
against the bf16 product of the dequantized weight (relative L2) of:

- ``bf16``: ``x @ w.T`` with the dequantized bf16 weight (the speed of light for accuracy);
- ``served``: ``kernels.fp8_gemm.matmul``, what ``--weight-dtype fp8`` serves with (the W8A16
  kernel below ``DEQUANT_MIN_TOKENS`` tokens, ``dequant+gemm`` from there);
- ``w8a16 split=1`` / ``auto`` / ``bn=32`` / ``bn=128``: the W8A16 Triton kernel (block-scaled
  E4M3 weight, bf16 activations) without splitting K, with the default split, and with 32 and
  128 output columns per program (default split);
- ``swap`` / ``bn=128`` / ``bk=128`` / ``128/128`` (``w8``: 8 warps): the W8A16 kernel with the
  weight as the MMA's first operand (``swap=True``; out.T = w @ x.T), output columns / K step;
  ``w8a16 bk=128``: the unswapped kernel with a 128-wide K step;
- ``dequant+gemm``: the weight dequantized to bf16 by one Triton launch, then torch's GEMM;
- ``fma`` / ``bn=32`` / ``bn=128`` / ``split=1`` / ``warps=2`` / ``warps=8`` (up to 16 tokens): ``fma_matmul``, without tensor
  cores and with the block scale applied after each step's sum;
- ``scaled_mm block``: ``torch._scaled_mm`` with the same 128x128 weight blocks and the
  activations quantized to E4M3 per token and 128 channels (W8A8, DeepSeek-V3's recipe), the
  activation quantization included in the time;
- ``scaled_mm row``: ``torch._scaled_mm`` with one scale per weight row and per token (the
  weights requantized per row: not the checkpoint's codes), quantization included.

A variant this torch / GPU cannot run prints why instead of a time. The GB/s column is the
weight bytes (one per FP8 weight, two per bf16) over the time: decode (few tokens) is bound by
reading the weight once.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from triton.testing import do_bench

from deepwell.kernels import fp8_gemm
from deepwell.kernels.fp8_gemm.triton_kernel import dequant_matmul, fma_matmul, w8a16_matmul

SHAPES = {  # name: (N, K) of the 27B shape's linear layers
    "gdn in_proj_qkv": (10240, 5120),
    "attn q_proj (+gate)": (12288, 5120),
    "mlp gate+up": (34816, 5120),
    "mlp down": (5120, 17408),
    "attn o_proj": (5120, 6144),
}
FP8 = torch.float8_e4m3fn
FMAX = 448.0


def quant_act_blocks(x: torch.Tensor, bk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], fp32 scales [M, K / bk]) per token and ``bk`` channels."""
    m, k = x.shape
    g = x.float().view(m, k // bk, bk)
    s = g.abs().amax(-1).clamp(min=1e-12) / FMAX
    return (g / s[..., None]).to(FP8).view(m, k), s


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FMAX
    return (x.float() / s).to(FP8), s


def _variants(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, w: torch.Tensor
              ) -> dict[str, Callable[[], torch.Tensor]]:
    wt = w.t()
    out: dict[str, Callable[[], torch.Tensor]] = {
        "bf16": lambda: x @ wt,
        "served": lambda: fp8_gemm.matmul(x, codes, scales),
        "w8a16 split=1": lambda: w8a16_matmul(x, codes, scales, split_k=1),
        "w8a16 auto": lambda: w8a16_matmul(x, codes, scales),
        "w8a16 bn=32": lambda: w8a16_matmul(x, codes, scales, block_n=32),
        "w8a16 bn=128": lambda: w8a16_matmul(x, codes, scales, block_n=128),
        "dequant+gemm": lambda: dequant_matmul(x, codes, scales),
        "swap": lambda: w8a16_matmul(x, codes, scales, swap=True),
        "swap bn=128": lambda: w8a16_matmul(x, codes, scales, swap=True, block_n=128),
        "swap bk=128": lambda: w8a16_matmul(x, codes, scales, swap=True, block_k=128),
        "swap 128/128": lambda: w8a16_matmul(x, codes, scales, swap=True, block_n=128, block_k=128),
        "swap 128/128 w8": lambda: w8a16_matmul(x, codes, scales, swap=True, block_n=128, block_k=128, num_warps=8),
        "w8a16 bk=128": lambda: w8a16_matmul(x, codes, scales, block_k=128),
    }
    if x.shape[0] <= 16:  # the few-token form without tensor cores
        out["fma"] = lambda: fma_matmul(x, codes, scales)
        out["fma bn=32"] = lambda: fma_matmul(x, codes, scales, block_n=32)
        out["fma bn=128"] = lambda: fma_matmul(x, codes, scales, block_n=128)
        out["fma split=1"] = lambda: fma_matmul(x, codes, scales, split_k=1)
        out["fma warps=2"] = lambda: fma_matmul(x, codes, scales, num_warps=2)
        out["fma warps=8"] = lambda: fma_matmul(x, codes, scales, num_warps=8)
    b = codes.t()  # [K, N] column-major, as _scaled_mm wants its second operand
    sb = scales.t().contiguous()  # [K / 128, N / 128]

    layouts = {"row-major": lambda s: s, "outer-dim-major": lambda s: s.t().contiguous().t()}
    chosen = [layouts["row-major"]]
    for lay in layouts.values():  # cuBLAS's blockwise scales want the activation scales M-major
        try:
            a, sa = quant_act_blocks(x)
            torch._scaled_mm(a, b, scale_a=lay(sa), scale_b=lay(sb), out_dtype=torch.bfloat16)
            chosen[0] = lay
            break
        except Exception:  # noqa: BLE001 - the call below reports the error
            continue

    def block() -> torch.Tensor:
        a, sa = quant_act_blocks(x)
        lay = chosen[0]
        return torch._scaled_mm(a, b, scale_a=lay(sa), scale_b=lay(sb), out_dtype=torch.bfloat16)

    wr, swr = quant_rows(w)
    br, sbr = wr.t(), swr.t().contiguous()  # [K, N], [1, N]

    def row() -> torch.Tensor:
        a, sa = quant_rows(x)
        return torch._scaled_mm(a, br, scale_a=sa, scale_b=sbr, out_dtype=torch.bfloat16)

    out["scaled_mm block"] = block
    out["scaled_mm row"] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 4096])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{'shape':22s} {'tokens':>6s} {'variant':16s} {'µs':>9s} {'weight GB/s':>11s} {'rel err':>9s}")
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k, device="cuda") * 0.02
        codes, scales = fp8_gemm.quantize(w32)
        w = fp8_gemm.dequantize(codes, scales, dtype=torch.bfloat16)
        for t in args.tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            ref = (x.float() @ w.float().t())
            for vname, fn in _variants(x, codes, scales, w).items():
                try:
                    y = fn()
                    ms = do_bench(fn, warmup=10, rep=50)
                except Exception as exc:  # noqa: BLE001 - a variant this build cannot run
                    print(f"{name:22s} {t:6d} {vname:16s} n/a: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                err = ((y.float() - ref).norm() / ref.norm()).item()
                wbytes = n * k * (2 if vname == "bf16" else 1)
                print(f"{name:22s} {t:6d} {vname:16s} {ms * 1e3:9.1f} {wbytes / (ms * 1e-3) / 1e9:11.0f} {err:9.2e}")


if __name__ == "__main__":
    main()
