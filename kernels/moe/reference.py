"""The routed experts of a mixture-of-experts layer in plain torch: the meaning of
``triton_kernel.moe_experts`` and the CPU path.

``x [N, H]``, ``gate_up [E, 2I, H]`` (gate rows, then up rows), ``down [E, H, I]``,
``topk_idx [N, k]`` (expert of each of a token's k picks), ``topk_w [N, k]`` (its weight, in
x's dtype). Each pick ``(n, j)`` with expert ``e`` gives

    g, u = round(x[n] @ gate_up[e].T).chunk(2)    # a GEMM's result in x's dtype
    h    = round(round(silu(g)) * u)               # torch's F.silu(g) * u
    y    = round(round(h @ down[e].T) * topk_w[n, j])

and the token's output is the sum of its k ``y``. ``moe_experts`` (the engine's
``ReferenceBackend`` op) groups the picks by expert, one GEMM pair per expert that has any,
and adds each ``y`` into the output in x's dtype in expert order (HF's ``index_add_``): the
number of experts with picks decides the launches, and reading the counts back is a host
sync, so this form cannot be captured in a CUDA graph. ``moe_experts_summed`` is the same
maths with the k picks of a token added in fp32 and rounded once, the kernel's order: the
oracle the kernel tests compare with.

FP8 experts (``Scales``): ``gate_up`` / ``down`` hold E4M3 codes (``float8_e4m3fn``) with fp32
block scales ``[E, ceil(rows / bn), ceil(cols / bk)]`` (the Qwen / DeepSeek FP8 checkpoint
layout, ``kernels.fp8_gemm``); an expert's weight is ``code * scale`` formed in fp32 and
rounded to x's dtype (``fp8_gemm.reference.dequantize``), then the maths above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepwell.kernels.fp8_gemm import reference as fp8_ref

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Act = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Scales:
    """The block scales of FP8 experts: ``gate_up [E, ceil(2I / bn), ceil(H / bk)]``,
    ``down [E, ceil(H / bn), ceil(I / bk)]`` (fp32), ``block = (bn, bk)``."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int]


def expert_weight(w: torch.Tensor, e: int, scales: torch.Tensor | None, block: tuple[int, int],
                  dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s weight in ``dtype``: ``w[e]`` itself, or its FP8 codes dequantized."""
    if scales is None:
        return w[e]
    return fp8_ref.dequantize(w[e], scales[e], block, dtype)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
          topk_w: torch.Tensor, scales: Scales | None = None) -> None:
    """Shapes (and FP8 experts' codes and scales) agree (a ValueError that names them otherwise)."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"moe_experts needs x [N, H], gate_up [E, 2I, H], down [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    e, two_i, h = gate_up.shape
    if two_i % 2 or h != x.shape[1] or tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(f"expert shapes disagree: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)}")
    if topk_idx.shape != topk_w.shape or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} and topk_w {tuple(topk_w.shape)} must both be "
                         f"[N={x.shape[0]}, k]")
    fp8 = (gate_up.dtype == torch.float8_e4m3fn, down.dtype == torch.float8_e4m3fn)
    if scales is None:
        if any(fp8):
            raise ValueError("FP8 expert weights need their block scales")
        return
    if not all(fp8):
        raise ValueError(f"block scales given for expert weights of {gate_up.dtype} / {down.dtype}, not E4M3 codes")
    bn, bk = scales.block
    for name, w, sc in (("gate_up", gate_up, scales.gate_up), ("down", down, scales.down)):
        grid = (w.shape[0], -(-w.shape[1] // bn), -(-w.shape[2] // bk))
        if tuple(sc.shape) != grid or sc.dtype != torch.float32:
            raise ValueError(f"{name} block scales must be fp32 {grid} for {tuple(w.shape)} codes in "
                             f"{scales.block} blocks, got {sc.dtype} {tuple(sc.shape)}")


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
                topk_w: torch.Tensor, linear: Linear = _linear, silu_and_mul: Act = _silu_and_mul,
                scales: Scales | None = None) -> torch.Tensor:
    """Per expert with picks: its tokens' SwiGLU, weighted, added into the output (HF's order);
    FP8 experts dequantized as they are picked."""
    check(x, gate_up, down, topk_idx, topk_w, scales)
    block = scales.block if scales else (1, 1)
    out = torch.zeros_like(x)
    flat_idx = topk_idx.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)
    counts = torch.bincount(flat_idx, minlength=gate_up.shape[0]).tolist()
    token_of = order // topk_idx.shape[1]
    weight_of = topk_w.reshape(-1)[order]
    pos = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[pos : pos + n]
        gu = expert_weight(gate_up, e, scales.gate_up if scales else None, block, x.dtype)
        dn = expert_weight(down, e, scales.down if scales else None, block, x.dtype)
        y = linear(silu_and_mul(linear(x[tok], gu)), dn)
        y = y * weight_of[pos : pos + n, None].to(x.dtype)
        out.index_add_(0, tok, y)
        pos += n
    return out


def moe_experts_summed(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
                       topk_w: torch.Tensor, scales: Scales | None = None) -> torch.Tensor:
    """The same picks, each token's k results added in fp32 and rounded once (the kernel's sum)."""
    check(x, gate_up, down, topk_idx, topk_w, scales)
    block = scales.block if scales else (1, 1)
    n, k = topk_idx.shape
    ys = torch.empty(n, k, x.shape[1], dtype=x.dtype, device=x.device)
    for j in range(k):
        for e in topk_idx[:, j].unique().tolist():
            rows = (topk_idx[:, j] == e).nonzero().squeeze(1)
            gu = expert_weight(gate_up, e, scales.gate_up if scales else None, block, x.dtype)
            dn = expert_weight(down, e, scales.down if scales else None, block, x.dtype)
            y = _linear(_silu_and_mul(_linear(x[rows], gu)), dn)
            ys[rows, j] = y * topk_w[rows, j, None].to(x.dtype)
    return ys.float().sum(1).to(x.dtype)
