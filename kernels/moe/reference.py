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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Act = Callable[[torch.Tensor], torch.Tensor]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
          topk_w: torch.Tensor) -> None:
    """Shapes agree (a ValueError that names them otherwise)."""
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


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
                topk_w: torch.Tensor, linear: Linear = _linear, silu_and_mul: Act = _silu_and_mul) -> torch.Tensor:
    """Per expert with picks: its tokens' SwiGLU, weighted, added into the output (HF's order)."""
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
        y = linear(silu_and_mul(linear(x[tok], gate_up[e])), down[e])
        y = y * weight_of[pos : pos + n, None].to(x.dtype)
        out.index_add_(0, tok, y)
        pos += n
    return out


def moe_experts_summed(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
                       topk_w: torch.Tensor) -> torch.Tensor:
    """The same picks, each token's k results added in fp32 and rounded once (the kernel's sum)."""
    check(x, gate_up, down, topk_idx, topk_w)
    n, k = topk_idx.shape
    ys = torch.empty(n, k, x.shape[1], dtype=x.dtype, device=x.device)
    for j in range(k):
        for e in topk_idx[:, j].unique().tolist():
            rows = (topk_idx[:, j] == e).nonzero().squeeze(1)
            y = _linear(_silu_and_mul(_linear(x[rows], gate_up[e])), down[e])
            ys[rows, j] = y * topk_w[rows, j, None].to(x.dtype)
    return ys.float().sum(1).to(x.dtype)
