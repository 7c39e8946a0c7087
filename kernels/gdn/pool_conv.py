"""The causal conv1d decode step of B sequences (one token each, SiLU after the conv) with the
conv states read from, and written back to, the state pool by slot, in one Triton launch.

Meaning: ``conv_pool_reference`` — gather ``pool[slots]``, ``conv_decode_fp32``
(window = the K-1 carried inputs then x; y = silu(sum_j window_j * w_j); the new state is the
window's last K-1 values), scatter. A decode step's conv then costs one kernel per GDN layer
instead of a gather, a padded copy (fla's state layout), fla's update kernel and a scatter.

Arithmetic: window values in the weight dtype (the carried inputs and x cast to it, as the
reference's ``cat`` does), then the K products, their sum and SiLU in fp32 and one rounding to
x's dtype, the arithmetic of fla's update kernel (and of HF's GPU path), which the CUDA backend's
decode conv ran before; the plain-torch reference instead multiplies and sums in the weight dtype
(16-bit: one rounding per product). On an H100 the per-product rounding, though it matched the
reference, flipped one clear top-1 position of two tiny parity configs against HF (token by
token, ``tests/engine/test_parity_gpu.py``). So the meaning is ``conv_decode_fp32``
(``conv_decode_step`` on fp32 copies, y cast back), which the kernel matches to fp32 summation
order; the written state is the bits the reference writes (the carried values moved by one, x
cast through the weight dtype).

One program per (channel block, sequence): grid ``(C / BLOCK_C, B)``; it loads its slot from
``slots`` on the device, so nothing is read back to the host (CUDA-graph capturable). Programs
own disjoint ``(slot, channel)`` ranges (slots distinct), so the state is updated in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deepwell.kernels.fused.common import KIND, round_to, silu_f32
from deepwell.kernels.gdn.pool_reference import conv_decode_step

DEFAULT_BLOCK_C = 256
MAX_KERNEL = 8  # conv kernel widths the kernel unrolls (Qwen3.5 / Qwen3-Next: 4)


@triton.jit
def _conv_pool_kernel(x_ptr, pool_ptr, slots_ptr, w_ptr, y_ptr, C, sx_b, sy_b, sp_s, sp_c, sw_c,
                      KM1: tl.constexpr, BC: tl.constexpr, KIND_W: tl.constexpr, KIND_Y: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    rc = tl.program_id(0) * BC + tl.arange(0, BC)
    ok = rc < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state = pool_ptr + slot * sp_s + rc.to(tl.int64) * sp_c
    # x through the weight dtype, as the reference's cat does (exact when the dtypes agree)
    x = round_to(tl.load(x_ptr + b * sx_b + rc, mask=ok, other=0.0).to(tl.float32), KIND_W)
    # products, their sum and SiLU in fp32; one rounding, to x's dtype, at the end
    acc = x * tl.load(w_ptr + rc * sw_c + KM1, mask=ok, other=0.0).to(tl.float32)
    prev = x
    for j in tl.static_range(KM1):  # newest carried input first: window slot KM1 - 1 - j
        s = round_to(tl.load(state + (KM1 - 1 - j), mask=ok, other=0.0).to(tl.float32), KIND_W)
        acc += s * tl.load(w_ptr + rc * sw_c + (KM1 - 1 - j), mask=ok, other=0.0).to(tl.float32)
        tl.store(state + (KM1 - 1 - j), prev.to(pool_ptr.dtype.element_ty), mask=ok)  # shift by one
        prev = s
    tl.store(y_ptr + b * sy_b + rc, round_to(silu_f32(acc), KIND_Y).to(y_ptr.dtype.element_ty), mask=ok)


def conv_decode_fp32(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``conv_decode_step`` computed in fp32 (window values first cast to the weight dtype), y
    rounded once to x's dtype, the states as ``conv_decode_step`` writes them: the kernel's
    meaning (module doc)."""
    wd = weight.dtype
    y, new = conv_decode_step(x.to(wd).float(), states.to(wd).float(), weight.float())
    return y.to(x.dtype), new.to(states.dtype)


def conv_pool_reference(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                        decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] = conv_decode_fp32) -> torch.Tensor:
    """``pool[slots]`` gathered, one decode step (``decode``: default the kernel's meaning,
    ``conv_decode_fp32``; a layer backend passes its own ``causal_conv1d_decode``), the new
    states scattered back. Returns y ``[B, C]`` in x's dtype."""
    y, new = decode(x, pool.index_select(0, slots), weight)
    pool.index_copy_(0, slots, new.to(pool.dtype))
    return y


def check_args(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or pool.dim() != 3:
        raise ValueError(f"x must be [B, C], weight [C, K], pool [S, C, K-1]; got {list(x.shape)}, "
                         f"{list(weight.shape)}, {list(pool.shape)}")
    c, k = weight.shape
    if x.shape[1] != c or pool.shape[1] != c or pool.shape[2] != k - 1:
        raise ValueError(f"x {list(x.shape)}, pool {list(pool.shape)} and weight {list(weight.shape)} disagree on "
                         "channels or kernel width")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0] or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 / int64 [{x.shape[0]}], got {slots.dtype} {list(slots.shape)}")


def supports(x: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these (else the reference)."""
    return (x.dtype in KIND and pool.dtype in KIND and weight.dtype in KIND and 2 <= weight.shape[-1] <= MAX_KERNEL
            and x.stride(-1) == 1 and pool.stride(-1) == 1 and weight.stride(-1) == 1)


def conv_pool(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
              block_c: int = DEFAULT_BLOCK_C) -> torch.Tensor:
    """``conv_pool_reference``'s op in one launch (module doc): y ``[B, C]`` in x's dtype;
    ``pool[slots]`` updated in place. ``slots`` distinct."""
    check_args(x, pool, slots, weight)
    if not supports(x, pool, weight):
        raise ValueError(f"the conv pool kernel takes fp32 / bf16 / fp16 with unit last strides and kernel widths "
                         f"2..{MAX_KERNEL}; got x {x.dtype}, pool {pool.dtype}, weight {weight.dtype} "
                         f"{list(weight.shape)}")
    if block_c < 16 or block_c & (block_c - 1):
        raise ValueError(f"block_c must be a power of two >= 16, got {block_c}")
    b, c = x.shape
    y = torch.empty_like(x)
    if b == 0 or c == 0:
        return y
    _conv_pool_kernel[(triton.cdiv(c, block_c), b)](
        x, pool, slots, weight, y, c, x.stride(0), y.stride(0), pool.stride(0), pool.stride(1), weight.stride(0),
        KM1=weight.shape[1] - 1, BC=block_c, KIND_W=KIND[weight.dtype], KIND_Y=KIND[x.dtype])
    return y


def self_check(channels: int, kernel: int, dtype: torch.dtype, device: torch.device) -> float:
    """The kernel against ``conv_pool_reference`` on this device (3 sequences, slots 2 / 0 / 3 of
    4): the largest relative error of y and of the written-back states, or ``inf`` if the
    kernel raised or touched the slot it was not given. Reads back to the host: call it outside
    CUDA-graph capture, once per shape."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, channels, generator=gen).to(device, dtype)
    weight = torch.randn(channels, kernel, generator=gen).to(device, dtype)
    pool = torch.randn(4, channels, kernel - 1, generator=gen).to(device, dtype)
    slots = torch.tensor([2, 0, 3], dtype=torch.long, device=device)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = conv_pool_reference(x, want_pool, slots, weight)
    try:
        got = conv_pool(x, got_pool, slots, weight)
    except Exception:  # noqa: BLE001 - a kernel this Triton / GPU cannot build or run
        return float("inf")
    if not torch.equal(got_pool[1], pool[1]):
        return float("inf")

    def rel(a: torch.Tensor, w: torch.Tensor) -> float:
        return float((a.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))

    return max(rel(got, want), rel(got_pool, want_pool))
