"""Triton gated activations: SwiGLU's ``silu(gate) * up`` and the attention output gate
``o * sigmoid(gate)``, one launch each over rows of any leading shape.

Maths (``references``), torch's dtype path: the activation is evaluated in fp32 on the widened
operand and rounded to that operand's dtype ``A`` (``F.silu(g)`` / ``torch.sigmoid(g)`` of a
bf16 tensor is bf16), then multiplied by the other operand in fp32 and rounded to
``P = promote(A, other.dtype)``: ``round_P(round_A(act(af)) * bf)``.

- ``silu_mul(gate, up)``: the MLP's ``F.silu(gate_proj(x)) * up_proj(x)``;
- ``silu_and_mul(gate_up)``: the same on one ``[..., 2I]`` projection, gate half first (HF's
  ``gate_up_proj`` row order, as ``moe.py`` chunks it); no split copies;
- ``sigmoid_gate_mul(o, gate)``: Qwen3.5 / Qwen3-Next attention ``o * sigmoid(gate)``; ``gate``
  may be the strided ``[T, H, D]`` half of ``q_proj``'s ``[query | gate]`` heads (no copy) and
  ``o`` any shape of the same element count (``[T, H * D]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels import pdl
from deepwell.kernels.fused.common import INTERPRET, kind, launch_kwargs, round_to, rows, sigmoid_f32, silu_f32


@triton.jit
def _act_mul_kernel(
    a_ptr, b_ptr, out_ptr, n_rows, stride_a, stride_b, stride_o,
    N: tl.constexpr, ACT: tl.constexpr, A_KIND: tl.constexpr, P_KIND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """``out = round_P(round_A(act(a)) * b)``; ACT 0: silu, 1: sigmoid."""
    pdl.enter(PDL)
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (row < n_rows)[:, None] & (col < N)[None, :]
    r64 = row.to(tl.int64)[:, None]
    col2 = col[None, :]
    a = tl.load(a_ptr + r64 * stride_a + col2, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + col2, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = silu_f32(a)
    else:
        a = sigmoid_f32(a)
    out = round_to(round_to(a, A_KIND) * b, P_KIND)
    tl.store(out_ptr + r64 * stride_o + col2, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(act: int, a: torch.Tensor, b: torch.Tensor, out_shape: torch.Size) -> torch.Tensor:
    n = a.shape[-1]
    p = torch.promote_types(a.dtype, b.dtype)
    out = torch.empty(out_shape, dtype=p, device=a.device)
    a2, b2 = rows(a, n), rows(b, n)
    r = a2.shape[0]
    if r == 0 or n == 0:
        return out
    block_n = min(triton.next_power_of_2(n), 1024)
    cap = 4096 * (16 if INTERPRET else 1)
    block_r = max(1, min(cap // block_n, triton.next_power_of_2(r)))
    grid = (triton.cdiv(r, block_r), triton.cdiv(n, block_n))
    _act_mul_kernel[grid](
        a2, b2, out, r, a2.stride(0), b2.stride(0), n,
        N=n, ACT=act, A_KIND=kind(a.dtype), P_KIND=kind(p), BLOCK_R=block_r, BLOCK_N=block_n,
        num_warps=4, **launch_kwargs(a.device),
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (same shapes ``[..., I]``)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} differ")
    return _launch(0, gate, up, gate.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``g, u = gate_up.chunk(2, -1)``: ``[..., 2I] -> [..., I]``."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even, got {gate_up.shape[-1]}")
    i = gate_up.shape[-1] // 2
    return _launch(0, gate_up[..., :i], gate_up[..., i:], gate_up.shape[:-1] + (i,))


def sigmoid_gate_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o * torch.sigmoid(gate)`` with ``o`` viewed in ``gate``'s row length; shape of ``o``."""
    if o.numel() != gate.numel():
        raise ValueError(f"o {list(o.shape)} and gate {list(gate.shape)} differ in size")
    d = gate.shape[-1]
    if not o.is_contiguous():
        o = o.contiguous()
    out = _launch(1, gate, o.view(-1, d), o.shape)
    return out
