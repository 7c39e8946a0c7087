"""Plain-torch meaning of ``gated_delta_rule_pool``: the gated delta rule over B sequences x T
tokens with each sequence's recurrent state read from, and written back to, a state pool by slot.

    gated_delta_rule_pool(q [B,T,Hk,Dk], k [B,T,Hk,Dk], v [B,T,Hv,Dv], g [B,T,Hv], beta [B,T,Hv],
                          pool [S,Hv,Dk,Dv] fp32, slots [B], lengths [B] or None,
                          out=True, write_back=True) -> o [B,T,Hv,Dv] fp32 or None

Per sequence b: ``S = pool[slots[b]]``; for each token t in order (``decode_step``, the arithmetic
of ``ReferenceBackend.gated_delta_rule_decode``): q and k l2-normalised in fp32
(``x * rsqrt(sum(x^2) + 1e-6)``; key head ``h // (Hv // Hk)`` serves value head h), q scaled by
``Dk ** -0.5``, ``S = S * exp(g)``, ``pred = k . S``, ``delta = (v - pred) * beta``,
``S = S + k (x) delta``, ``o[b, t] = q . S``. With ``write_back``, ``pool[slots[b]]`` becomes the
state after the first ``lengths[b]`` tokens (all T when ``lengths`` is None; 0 keeps the slot's
value); tokens past ``lengths[b]`` still give outputs. ``out=False`` returns None. Slots must be
distinct. Nothing reads a device tensor back to the host (``lengths`` selects states with
``torch.where``), so on CUDA a call can be captured in a graph.

This module is the CPU path and the kernel's test oracle (``pool_recurrent`` is the Triton
kernel); ``step`` lets a layer backend run its own decode op (the reference backend passes
its ``gated_delta_rule_decode``, so its bits are those of T decode steps). Only torch here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

L2_EPS = 1e-6
MAX_TOKENS = 16  # T the kernel is written for (decode: 1; a speculative verify step: k + 1)

Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k ``[B,Hk,Dk]``, v ``[B,Hv,Dv]``, g, beta ``[B,Hv]``, states
    ``[B,Hv,Dk,Dv]`` -> (o ``[B,Hv,Dv]`` fp32, new states fp32); what
    ``ReferenceBackend.gated_delta_rule_decode`` runs."""
    hk, hv = q.shape[1], v.shape[1]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    q, k, v = l2norm(q.float()), l2norm(k.float()), v.float()
    q = q * (q.shape[-1] ** -0.5)
    s = states.float() * g.float().exp()[..., None, None]
    pred = torch.einsum("bhk,bhkv->bhv", k, s)
    delta = (v - pred) * beta.float()[..., None]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def conv_decode_step(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal conv's decode step of B sequences: ``x [B, C]``, ``states [B, C, K-1]`` (the
    last K-1 inputs), ``weight [C, K]`` -> (``silu(sum_j window_j * w_j)`` in x's dtype, the new
    states in theirs), computed in the weight dtype; what ``ReferenceBackend.causal_conv1d_decode``
    runs (``pool_conv`` is its in-pool kernel)."""
    full = torch.cat([states.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)
    y = (full * weight.unsqueeze(0)).sum(-1)  # [B, C]
    return torch.nn.functional.silu(y).to(x.dtype), full[..., 1:].to(states.dtype)


def check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               pool: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor | None) -> None:
    """``ValueError`` naming what is wrong with the shapes, dtypes or devices (shapes only: no
    device tensor is read)."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, Dk], got {list(q.shape)} and {list(k.shape)}")
    b, t, hk, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, Hv, Dv] with B, T = {b}, {t}, got {list(v.shape)}")
    hv, dv = v.shape[2], v.shape[3]
    if hk == 0 or hv % hk:
        raise ValueError(f"Hv ({hv}) must be a multiple of Hk ({hk})")
    if g.shape != (b, t, hv) or beta.shape != (b, t, hv):
        raise ValueError(f"g and beta must be [B, T, Hv] = {[b, t, hv]}, got {list(g.shape)} and {list(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"pool must be [S, Hv, Dk, Dv] = [S, {hv}, {dk}, {dv}], got {list(pool.shape)}")
    if pool.dtype != torch.float32:
        raise ValueError(f"pool must be float32 (the recurrent states), got {pool.dtype}")
    if slots.shape != (b,) or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be int64 [B] = [{b}], got {slots.dtype} {list(slots.shape)}")
    if lengths is not None and (lengths.shape != (b,) or lengths.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"lengths must be int64 [B] = [{b}] or None, got {lengths.dtype} {list(lengths.shape)}")
    devices = {x.device for x in (q, k, v, g, beta, pool, slots) + ((lengths,) if lengths is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


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
    step: Step | None = None,
) -> torch.Tensor | None:
    """The module doc's op in plain torch: ``step`` (default ``decode_step``) token by token on
    the gathered states ``pool[slots]``; the states to write back selected per token by
    ``t < lengths`` (exact values: no arithmetic on them)."""
    check_args(q, k, v, g, beta, pool, slots, lengths)
    step = step or decode_step
    states = pool.index_select(0, slots)
    final = states
    outs = []
    for t in range(q.shape[1]):
        o, states = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], states)
        if out:
            outs.append(o)
        if lengths is not None:
            final = torch.where((lengths > t).view(-1, 1, 1, 1), states, final)
    if lengths is None:
        final = states
    if write_back:
        pool.index_copy_(0, slots, final.to(pool.dtype))
    if not out:
        return None
    if not outs:
        return torch.empty(v.shape, dtype=torch.float32, device=v.device)
    return torch.stack(outs, 1)
