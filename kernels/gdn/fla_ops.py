"""Gated DeltaNet ops on fla-core's Triton kernels, in the engine's tensor conventions.

fla-core (``pip install deepwell[cuda]``) is optional: nothing here imports it until a wrapper
runs, and ``available()`` says whether it can (``import_error()`` says why not). The wrappers
take what the engine holds and hand fla what it expects:

- tokens of N sequences back to back (``[T, ...]``, no batch dim) with ``cu_seqlens`` [N+1]
  (``cu_seqlens_from_lengths``; ``packed_rows`` gathers slices that are not adjacent in a
  step's batch), fla's varlen form ``[1, T, ...]``; decode steps (one token for each of B
  sequences) use fla's batch form ``[B, 1, ...]``;
- recurrent states ``[N, Hv, Dk, Dv]`` fp32 in and out (fla's key-first layout; the final
  state comes back fp32 whatever the activations' dtype; the initial state is only read);
- conv states ``[N, C, K-1]`` (the last K-1 inputs): fla keeps ``[N, C, K]`` whose column 0 it
  never reads, so the state travels with one zero column in front (``F.pad``) and leaves
  without it: a copy of the small conv state, the layout otherwise unchanged;
- the reference conventions, passed explicitly: q and k l2-normalised in the kernel
  (``use_qk_l2norm_in_kernel``, ``x / sqrt(sum(x^2) + 1e-6)``, same eps as the reference),
  q scaled by ``Dk ** -0.5``, ``g`` the log-space decay, ``beta`` after the sigmoid, grouped
  value heads (Hv a multiple of Hk, value head h reads key head ``h // (Hv // Hk)``, the
  reference's ``repeat_interleave``), SiLU after the conv, no conv bias.

Outputs: ``o`` in the activations' dtype (``q.dtype``), ``y`` in ``x.dtype``, new conv states
in the given states' dtype. ``gather_states`` / ``scatter_states`` move a step's rows of a
state pool (dim 0 = slot) in and out by slot index. Only torch is imported at module level
(kernels/ layering: no engine_service, no fla until used).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class FlaEntryPoints:
    """The four fla functions the wrappers call (tests substitute reference maths here)."""

    chunk_gated_delta_rule: Callable[..., Any]
    fused_recurrent_gated_delta_rule: Callable[..., Any]
    causal_conv1d: Callable[..., Any]
    causal_conv1d_update: Callable[..., Any]


_IMPORT_ERROR: list[str] = []


@functools.cache
def _load() -> FlaEntryPoints | None:
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d, causal_conv1d_update
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as exc:  # ImportError, or fla failing its own import on this torch/triton
        _IMPORT_ERROR.append(f"{type(exc).__name__}: {exc}")
        return None
    return FlaEntryPoints(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, causal_conv1d,
                          causal_conv1d_update)


def entry_points() -> FlaEntryPoints:
    """fla's functions; ``RuntimeError`` if fla-core is not importable."""
    fla = _load()
    if fla is None:
        raise RuntimeError(f"fla-core is not importable ({import_error()}); install deepwell[cuda]")
    return fla


def available() -> bool:
    return _load() is not None


def import_error() -> str | None:
    return None if available() else (_IMPORT_ERROR[-1] if _IMPORT_ERROR else "not imported")


# ----------------------------------------------------------------------------- varlen layout
def cu_seqlens_from_lengths(lengths: Sequence[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens on device, the same on the host)``, int64 ``[N+1]``: ``[0, l0, l0+l1, ...]``.
    The host copy lets fla lay out its chunks without reading the device tensor back."""
    if any(n < 1 for n in lengths):
        raise ValueError(f"every sequence needs >= 1 token, got lengths {list(lengths)}")
    host = torch.zeros(len(lengths) + 1, dtype=torch.long)
    host[1:] = torch.tensor(list(lengths), dtype=torch.long).cumsum(0)
    return host.to(device), host


def packed_rows(offsets: Sequence[int], lengths: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Batch rows of N slices (``offsets[i] .. offsets[i] + lengths[i] - 1``) back to back:
    ``x[rows]`` is the packed varlen input, ``out[rows] = y`` scatters the result back."""
    if len(offsets) != len(lengths):
        raise ValueError("offsets and lengths differ in length")
    if not offsets:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(o, o + n, dtype=torch.long) for o, n in zip(offsets, lengths)]).to(device)


def gather_states(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows ``pool[slots]`` (a contiguous copy: fla reads it as the initial states)."""
    return pool.index_select(0, slots)


def scatter_states(pool: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """``pool[slots] = states`` in place (slots distinct)."""
    pool.index_copy_(0, slots, states.to(pool.dtype))


# ----------------------------------------------------------------------------- gated delta rule
def _check_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"Hv ({v.shape[1]}) must be a multiple of Hk ({q.shape[1]})")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"g and beta must be [T, Hv] = {list(v.shape[:2])}, got {list(g.shape)}, {list(beta.shape)}")


def _check_states(states: torch.Tensor, n: int, q: torch.Tensor, v: torch.Tensor) -> None:
    want = (n, v.shape[1], q.shape[2], v.shape[2])
    if tuple(states.shape) != want:
        raise ValueError(f"recurrent states must be {list(want)}, got {list(states.shape)}")


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed back to back: q, k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]``, g, beta
    ``[T, Hv]``, ``states`` ``[N, Hv, Dk, Dv]`` (state after each sequence's earlier tokens),
    ``cu_seqlens`` ``[N+1]`` (None: one sequence). ``chunked``: fla's chunked kernels (prefill),
    else the fused recurrent one. Returns ``(o [T, Hv, Dv] in q.dtype, final states fp32)``."""
    _check_gdn(q, k, v, g, beta)
    n = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _check_states(states, n, q, v)
    fla = entry_points()
    kwargs: dict[str, Any] = dict(
        scale=q.shape[-1] ** -0.5,
        initial_state=states.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
    )
    if chunked:
        if cu_seqlens_cpu is not None:
            kwargs["cu_seqlens_cpu"] = cu_seqlens_cpu
        fn = fla.chunk_gated_delta_rule
    else:
        fn = fla.fused_recurrent_gated_delta_rule
    o, final = fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g=g.unsqueeze(0), beta=beta.unsqueeze(0), **kwargs)
    return o.squeeze(0), final.float()


def gated_delta_rule_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences (the reference's ``gated_delta_rule_decode``): q, k
    ``[B, Hk, Dk]``, v ``[B, Hv, Dv]``, g, beta ``[B, Hv]``, states ``[B, Hv, Dk, Dv]`` ->
    ``(o [B, Hv, Dv] in q.dtype, new states fp32)``: ``gated_delta_rule_multi`` with T = 1."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hk, Dk], got {list(q.shape)}")
    o, final = gated_delta_rule_multi(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1),
                                      beta.unsqueeze(1), states)
    return o.squeeze(1), final


def gated_delta_rule_multi(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens for each of B sequences: q, k ``[B, T, Hk, Dk]``, v ``[B, T, Hv, Dv]``, g, beta
    ``[B, T, Hv]``, states ``[B, Hv, Dk, Dv]`` -> ``(o [B, T, Hv, Dv] in q.dtype, final states
    fp32)``; fla's fused recurrent kernel, batch form (the decode kernel with T steps)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, Hk, Dk], got {list(q.shape)}")
    b, t = q.shape[:2]
    _check_gdn(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), g.flatten(0, 1), beta.flatten(0, 1))
    _check_states(states, b, q.flatten(0, 1), v.flatten(0, 1))
    fla = entry_points()
    o, final = fla.fused_recurrent_gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
        scale=q.shape[-1] ** -0.5, initial_state=states.float().contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o, final.float()


# ----------------------------------------------------------------------------- causal conv
def _check_conv(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, n: int) -> None:
    c, kw = weight.shape
    if x.dim() != 2 or x.shape[1] != c:
        raise ValueError(f"x must be [T, {c}], got {list(x.shape)}")
    if tuple(states.shape) != (n, c, kw - 1):
        raise ValueError(f"conv states must be {[n, c, kw - 1]}, got {list(states.shape)}")


def _to_fla_conv_state(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, C, K-1]`` -> fla's ``[N, C, K]`` (column 0, which fla never reads, zero)."""
    return F.pad(states.to(dtype), (1, 0)).contiguous()


def causal_conv1d_varlen(
    x: torch.Tensor,
    states: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of N sequences packed back to back: ``x [T, C]``, ``states
    [N, C, K-1]`` (each sequence's last K-1 inputs before these), ``weight [C, K]`` ->
    ``(y [T, C] in x.dtype, new states [N, C, K-1] in states.dtype)``.

    Rounded where the reference and HF round: fla's conv (fp32 accumulation) rounds to x's
    dtype, then the SiLU rounds again (``F.silu``). fla's fused SiLU would round once, more
    exact against fp32, but a different bf16 result from the meaning; on the ill-conditioned
    tiny parity configs it moved the KL to HF by 5-10x (docs/kernels.md, "Running the GPU
    suite"). The extra pass reads and writes ``[T, C]`` once per GDN layer of a prefill chunk."""
    n = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _check_conv(x, states, weight, n)
    fla = entry_points()
    kwargs: dict[str, Any] = {}
    if cu_seqlens is not None:
        kwargs = dict(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    y, final = fla.causal_conv1d(  # x may be columns of a wider projection: fla reads it contiguous
        x.contiguous().unsqueeze(0), weight=weight, initial_state=_to_fla_conv_state(states, x.dtype), output_final_state=True,
        activation=None, **kwargs,
    )
    return F.silu(y.squeeze(0)), final[..., 1:].to(states.dtype)


def causal_conv1d_decode(
    x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: ``x [B, C]``, ``states [B, C, K-1]`` -> ``(y [B, C]
    in x.dtype, new states [B, C, K-1])``; fla's update kernel on a padded copy of the states."""
    _check_conv(x, states, weight, x.shape[0])
    fla = entry_points()
    cache = _to_fla_conv_state(states, states.dtype)
    y, cache = fla.causal_conv1d_update(x.contiguous(), cache, weight=weight, activation="silu")
    return y, cache[..., 1:]
