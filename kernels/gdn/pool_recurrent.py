"""The gated delta rule over B sequences x T tokens (T = 1..16) with the recurrent states read
from, and written back to, the state pool by slot, in one Triton launch.

Meaning: ``pool_reference.gated_delta_rule_pool`` (= ``ReferenceBackend.gated_delta_rule_decode``
token by token). A decode step (T = 1) and a speculative verify step (T = k + 1, outputs only) and
its group commit (states only, the first ``lengths[b]`` tokens) each become one kernel per GDN
layer: no gather of ``pool[slots]`` before, no scatter after, no masked copies of g / beta
(fla's ``fused_recurrent_gated_delta_rule`` reads and writes contiguous ``[B, ...]`` states only).

Design: one program per (value-column block, sequence x value head): grid
``(Dv / BV, B * Hv)``. The program loads its slot (``slots[b]``, on the device) and keeps the
``[Dk, BV]`` fp32 tile ``pool[slot, h, :, v0:v0+BV]`` in registers for all T tokens (unrolled:
T is a compile-time constant, so the loads of later tokens' q / k / v / g / beta do not wait on
the state); per token it loads q and k of key head ``h // (Hv / Hk)`` (all Dk), l2-normalises them
in fp32 (``x * rsqrt(sum(x^2) + 1e-6)``), scales q by ``Dk ** -0.5``, and runs
``S *= exp(g)``, ``pred = sum_k k S``, ``S += k (x) (v - pred) beta``, ``o = sum_k q S`` (fp32
FMAs, no tensor cores: every value an fp32 IEEE product; ``exp`` is libdevice's ``expf``, torch's).
With ``lengths`` the tile to store is selected per token (``t < lengths[b]``, exact) and the store
is masked off for ``lengths[b] == 0``. Programs own disjoint tiles (slots distinct), so the state
is updated in place. Defaults ``BV = 8``, one warp (fla's fused recurrent kernel's choice for this
problem: B * Hv * Dv / 8 programs, a 128 x 8 tile = 32 fp32 registers a thread). Shapes are the
arguments' shapes; nothing is read back to the host: a CUDA graph can capture a call.

Inputs: q, k, v in fp32 / bf16 / fp16 with any strides but a unit last one (views of the fused
conv output go in as they are); g, beta any float dtype; pool fp32 contiguous; slots / lengths
int64 (or int32). Dk and Dv powers of two from 16 to 256 (``supports``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels.fused.common import exp_acc
from deepwell.kernels.gdn.pool_reference import L2_EPS, MAX_TOKENS, check_args

#: value columns a program owns, and its warps (see the module doc)
DEFAULT_BLOCK_V = 8
DEFAULT_WARPS = 1
_DIMS = (16, 32, 64, 128, 256)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _pool_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, slots_ptr, len_ptr, o_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sbe_b, sbe_t,
    scale, eps,
    T: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BV: tl.constexpr, HAS_LEN: tl.constexpr, OUT: tl.constexpr, WRITE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // HV).to(tl.int64)
    h = i_bh % HV
    hk = h // GROUP
    rk = tl.arange(0, DK)
    rv = i_v * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p_s = pool_ptr + (slot * HV + h) * (DK * DV) + rk[:, None] * DV + rv[None, :]
    s = tl.load(p_s)  # [DK, BV] fp32
    if HAS_LEN:
        n = tl.load(len_ptr + b)
        keep = s
    p_q = q_ptr + b * sq_b + hk * sq_h + rk
    p_k = k_ptr + b * sk_b + hk * sk_h + rk
    p_v = v_ptr + b * sv_b + h * sv_h + rv
    p_g = g_ptr + b * sg_b + h
    p_beta = beta_ptr + b * sbe_b + h
    p_o = o_ptr + ((b * T) * HV + h) * DV + rv
    for t in tl.static_range(T):
        kt = tl.load(p_k + t * sk_t).to(tl.float32)
        vt = tl.load(p_v + t * sv_t).to(tl.float32)
        gt = tl.load(p_g + t * sg_t).to(tl.float32)
        bt = tl.load(p_beta + t * sbe_t).to(tl.float32)
        kt = kt * tl.math.rsqrt(tl.sum(kt * kt, axis=0) + eps)
        s = s * exp_acc(gt)
        pred = tl.sum(kt[:, None] * s, axis=0)  # [BV]
        delta = (vt - pred) * bt
        s = s + kt[:, None] * delta[None, :]
        if OUT:
            qt = tl.load(p_q + t * sq_t).to(tl.float32)
            qt = qt * tl.math.rsqrt(tl.sum(qt * qt, axis=0) + eps) * scale
            tl.store(p_o + t * (HV * DV), tl.sum(qt[:, None] * s, axis=0))
        if HAS_LEN:
            keep = tl.where(n > t, s, keep)
    if WRITE:
        if HAS_LEN:
            tl.store(p_s, keep, mask=(rk[:, None] * 0 + n) > 0)  # a tensor mask: lengths 0 stores nothing
        else:
            tl.store(p_s, s)


def supports(q: torch.Tensor, v: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes (else the reference: ``pool_reference``)."""
    return (q.dim() == 4 and v.dim() == 4 and q.shape[-1] in _DIMS and v.shape[-1] in _DIMS
            and 0 < q.shape[1] <= MAX_TOKENS and q.dtype in _FLOATS and v.dtype in _FLOATS
            and pool.dtype == torch.float32 and pool.is_contiguous())


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def gated_delta_rule_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor | None = None,
    out: bool = True,
    write_back: bool = True,
    block_v: int = DEFAULT_BLOCK_V,
    num_warps: int = DEFAULT_WARPS,
) -> torch.Tensor | None:
    """``pool_reference.gated_delta_rule_pool``'s op in one launch (module doc): o ``[B,T,Hv,Dv]``
    fp32 (None without ``out``); ``pool[slots]`` updated in place with ``write_back``."""
    check_args(q, k, v, g, beta, pool, slots, lengths)
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if dk not in _DIMS or dv not in _DIMS:
        raise ValueError(f"Dk and Dv must be powers of two from 16 to 256, got {dk} and {dv}")
    if t > MAX_TOKENS:
        raise ValueError(f"T must be at most {MAX_TOKENS} tokens per sequence, got {t}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous (it is updated in place)")
    if block_v < 1 or block_v & (block_v - 1) or block_v > dv:
        raise ValueError(f"block_v ({block_v}) must be a power of two dividing Dv ({dv})")
    o = torch.empty(b, t, hv, dv, dtype=torch.float32, device=q.device) if out else None
    if b == 0 or t == 0 or not (out or write_back):
        return o
    q, k, v, g, beta = (_unit_last(x) for x in (q, k, v, g, beta))
    grid = (dv // block_v, b * hv)
    _pool_kernel[grid](
        q, k, v, g, beta, pool, slots, lengths if lengths is not None else slots, o if out else pool,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        dk ** -0.5, L2_EPS,
        T=t, HV=hv, GROUP=hv // hk, DK=dk, DV=dv, BV=block_v,
        HAS_LEN=lengths is not None, OUT=out, WRITE=write_back, num_warps=num_warps,
    )
    return o


def self_check(num_k_heads: int, num_v_heads: int, dk: int, dv: int, dtype: torch.dtype,
               device: torch.device) -> float:
    """The kernel against ``pool_reference`` on this device at these head shapes (random inputs,
    3 sequences x 5 tokens, lengths 5 / 2 / 0, one slot not named): the largest relative error
    of the outputs and the written-back states, or ``inf`` if the kernel raised or touched a slot
    it was not given. Reads back to the host: call it outside CUDA-graph capture, once per shape."""
    from deepwell.kernels.gdn import pool_reference

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    b, t = 3, 5
    q, k = rnd(b, t, num_k_heads, dk).to(dtype), rnd(b, t, num_k_heads, dk).to(dtype)
    v = rnd(b, t, num_v_heads, dv).to(dtype)
    g = -torch.rand(b, t, num_v_heads, generator=gen).to(device)
    beta = torch.rand(b, t, num_v_heads, generator=gen).to(device)
    pool = rnd(4, num_v_heads, dk, dv, scale=0.1).contiguous()
    slots = torch.tensor([2, 0, 3], dtype=torch.long, device=device)
    lengths = torch.tensor([5, 2, 0], dtype=torch.long, device=device)
    want_pool = pool.clone()
    want = pool_reference.gated_delta_rule_pool(q, k, v, g, beta, want_pool, slots, lengths)
    got_pool = pool.clone()
    try:
        got = gated_delta_rule_pool(q, k, v, g, beta, got_pool, slots, lengths)
    except Exception:  # a kernel this Triton / GPU cannot build or run
        return float("inf")
    assert got is not None and want is not None
    if not torch.equal(got_pool[1], pool[1]):  # the slot nobody named
        return float("inf")

    def rel(a: torch.Tensor, w: torch.Tensor) -> float:
        return float((a.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))

    return max(rel(got, want), rel(got_pool, want_pool))
