"""Global-scale calibration and block-scale health counters for the scaled KV formats.

``calibrate(layout, k, v)`` picks one power-of-two fp32 global scale per (K|V, KV head)
from K/V seen on a calibration prompt (K rotated first when the layout rotates):

- nvfp4: the ``percentile`` of block amaxes ``P`` should give a block scale
  ``P / (6 g)`` at or below ``448 / headroom`` (near the top of E4M3's normal range, with
  ``headroom`` to spare for blocks larger than the calibration saw), i.e.
  ``g = pow2_ceil(P / (6 * 448 / headroom))``; ``g`` is raised further if needed so the
  largest block seen does not saturate. The nvfp4 encoder searches block scales from about
  amax/8.5 to amax/3 (``kv_formats.nvfp4``), i.e. up to 2x the amax/6 scale, which the 4x
  headroom keeps below 448 for all but the largest blocks (where the search just tries fewer
  codes: candidates are capped at 448).
- fp8: the same rule on element magnitudes: ``g = pow2_ceil(P / (448 / headroom))``,
  raised so the largest element seen does not saturate.
- bf16 / int8: 1.0 (their scales are not global).

``k_offset(k, keep)`` is K centering: the per-(head, channel) mean of K over the calibration
tokens, subtracted from every key before encoding (``kv_append``). It is exact for attention
— a shift ``mu`` shared by every key of a head changes query ``q``'s every score by the same
``q . mu``, which the softmax cancels — and it removes the part of K that quantization
would otherwise spend its range on (keys of a head share a large common component: on
SmolLM2 centering takes fp8's perplexity change from +0.88% to +0.27% and nvfp4's from
+5.1% to +3.9%, ``benchmarks/kv_quality.py``). After RoPE, though, a channel of frequency
``w`` turns by ``w * position``: a mean measured on a short prompt is a fixed direction
only for channels that barely rotate over the whole served context (and for channels past
the rotary dims). ``stationary_channels`` picks those (rotation at most ``max_angle`` over
``max_position`` tokens: the removed component then never grows past ``2 sin(max_angle/2)``,
0.77 of itself at pi/4); the offset is zero elsewhere.

Powers of two keep quantization exact-arithmetic (``1/g`` is exact) at a cost of at most
one bit of headroom. ``count_scales`` reports, per K and V, how many block scales (nvfp4)
or elements (fp8) are zero, subnormal (``0 < scale < 2**-6``, including those that round to
zero) and saturated (``> 448``) — int8: token scales that are zero or saturated (above
``int8.SCALE_MAX``; it has no subnormal range); ``ScaleCounter`` accumulates those for metrics.

``k_error_energy`` measures how well a layout stores a layer's calibration keys as the
queries see it: K encoded exactly as the append would (in its rotation, with or without
query-weighted rounding), and its error ``e`` weighed by the queries' mean block products,
``sum e_b^T C_b e_b`` over keys and 16-blocks. Computed in each candidate basis it chooses how a
layer's K is Hadamard-rotated: as a whole, per 16-element block, or not at all
(``engine_service.kv.calibration``, ``--kv-hadamard layer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepwell.kernels.kv_append.reference import encode_rows, stored_rows
from deepwell.kernels.kv_formats import feedback as kfeedback
from deepwell.kernels.kv_formats import int8, nvfp4
from deepwell.kernels.kv_formats.e4m3 import E4M3_MAX, E4M3_MIN_NORMAL
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout, pow2_at_least


@dataclass(frozen=True)
class ScaleCounts:
    blocks: int = 0
    zero: int = 0
    subnormal: int = 0
    saturated: int = 0

    def __add__(self, other: ScaleCounts) -> ScaleCounts:
        return ScaleCounts(
            self.blocks + other.blocks,
            self.zero + other.zero,
            self.subnormal + other.subnormal,
            self.saturated + other.saturated,
        )


def counted_per_row(layout: KVLayout) -> int:
    """Scale inputs counted per token row of one head: nvfp4 block scales (d / 16), fp8
    elements (d), int8 token scales (1); 0 for bf16."""
    if layout.fmt is KVFormat.NVFP4:
        return layout.head_dim // nvfp4.BLOCK
    return {KVFormat.FP8: layout.head_dim, KVFormat.INT8: 1}.get(layout.fmt, 0)


def _scale_inputs(layout: KVLayout, x: torch.Tensor, kv: int, g: torch.Tensor) -> torch.Tensor | None:
    """What the scales are made of, shaped [N, H, blocks]: block amax * enc (nvfp4), |x| / g
    (fp8) or the row's amax / 127 (int8)."""
    return _rotated_scale_inputs(layout, stored_rows(x, layout, kv), g)


def _rotated_scale_inputs(layout: KVLayout, rows: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    n, h, d = rows.shape
    gg = g.to(torch.float32).to(rows.device).view(1, h, 1)
    if layout.fmt is KVFormat.NVFP4:
        amax = rows.abs().view(n, h, d // nvfp4.BLOCK, nvfp4.BLOCK).amax(-1)
        return amax * (nvfp4.INV_6 * (1.0 / gg))
    if layout.fmt is KVFormat.FP8:
        return rows.abs() * (1.0 / gg)
    if layout.fmt is KVFormat.INT8:  # the token scale before it saturates (no subnormal range)
        return rows.abs().amax(-1, keepdim=True) * int8.INV_127
    return None


def _bounds(fmt: KVFormat) -> tuple[float, float]:
    """(the smallest normal scale, the largest unsaturated one) of a scaled format."""
    return (0.0, int8.SCALE_MAX) if fmt is KVFormat.INT8 else (E4M3_MIN_NORMAL, E4M3_MAX)


def head_counts(layout: KVLayout, rows: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """Zero / subnormal / saturated scale inputs per KV head, on the rows' device without a
    host copy: int64 [H, 3] for rows [N, H, d] (rotated K or V) under global scales ``g`` [H];
    None for bf16."""
    s = _rotated_scale_inputs(layout, rows.to(torch.float32), g)
    if s is None:
        return None
    tiny, top = _bounds(layout.fmt)
    return torch.stack([(s == 0).sum((0, 2)), ((s > 0) & (s < tiny)).sum((0, 2)), (s > top).sum((0, 2))], -1)


def count_rows(layout: KVLayout, rows: torch.Tensor, g: torch.Tensor) -> ScaleCounts:
    """``count_scales`` for rows [N, H, d] that are already rotated (K) or never are (V)."""
    n, h, _ = rows.shape
    per_head = head_counts(layout, rows, g)
    if per_head is None:
        return ScaleCounts(blocks=n * h)
    zero, subnormal, saturated = per_head.sum(0).tolist()
    return ScaleCounts(n * h * counted_per_row(layout), zero, subnormal, saturated)


def count_scales(layout: KVLayout, k: torch.Tensor, v: torch.Tensor, global_scales: torch.Tensor) -> dict[str, ScaleCounts]:
    """Zero / subnormal / saturated block scales of encoding ``k``, ``v`` [N, H, d]."""
    return {name: count_rows(layout, stored_rows(x, layout, kv), global_scales[kv])
            for kv, name, x in ((0, "k", k), (1, "v", v))}


def calibrate(
    layout: KVLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    percentile: float = 99.9,
    headroom: float = 4.0,
) -> torch.Tensor:
    """Power-of-two global scales fp32 [2, H] for ``k``, ``v`` [N, H, d] (see module doc)."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"invalid percentile={percentile}: must be in (0, 100]")
    if headroom < 1.0:
        raise ValueError(f"invalid headroom={headroom}: must be >= 1")
    h = layout.num_kv_heads
    scales = torch.ones(2, h, dtype=torch.float32)
    if layout.fmt not in (KVFormat.NVFP4, KVFormat.FP8):
        return scales
    unit = torch.ones(h, dtype=torch.float32)
    divisor = 6.0 if layout.fmt is KVFormat.NVFP4 else 1.0
    for kv, x in ((0, k), (1, v)):
        # magnitudes at g = 1, undoing nvfp4's 1/6 so both formats compare against 448
        s = _scale_inputs(layout, x, kv, unit).float().cpu() * divisor
        for head in range(h):
            vals = s[:, head].reshape(-1)
            vals = vals[vals > 0]
            if vals.numel() == 0:
                continue
            p = float(torch.quantile(vals[: 1 << 24], percentile / 100.0))
            g = pow2_at_least(p / (divisor * E4M3_MAX / headroom))
            g = max(g, pow2_at_least(float(vals.max()) / (divisor * E4M3_MAX)))
            scales[kv, head] = g
    return scales


def stationary_channels(inv_freq: torch.Tensor, head_dim: int, max_position: int,
                        max_angle: float = math.pi / 4) -> torch.Tensor:
    """Bool [head_dim]: channels (NeoX half-split RoPE over the first ``2 * len(inv_freq)``
    dims; the rest are not rotated) that turn by at most ``max_angle`` over ``max_position``."""
    rot = 2 * inv_freq.numel()
    if rot > head_dim or max_position < 1:
        raise ValueError(f"need 2 * len(inv_freq) <= head_dim and max_position >= 1, got {rot}, {head_dim}, {max_position}")
    slow = inv_freq.to(torch.float64).cpu() * max_position <= max_angle
    return torch.cat([slow, slow, torch.ones(head_dim - rot, dtype=torch.bool)])


def k_offset(k: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """K centering offset fp32 [H, d]: the mean of ``k`` [N, H, d] (after RoPE, unrotated)
    over its tokens, zero on channels where ``keep`` [d] is False (see the module doc)."""
    if k.dim() != 3 or k.shape[0] == 0:
        raise ValueError(f"k must be [N >= 1, H, d], got {list(k.shape)}")
    mu = k.to(torch.float64).mean(0).to(torch.float32).cpu()
    if keep is not None:
        if tuple(keep.shape) != (k.shape[2],):
            raise ValueError(f"keep must be [{k.shape[2]}], got {list(keep.shape)}")
        mu = torch.where(keep.cpu(), mu, torch.zeros((), dtype=torch.float32))
    return mu.contiguous()


class ScaleCounter:
    """Running totals of ``count_scales`` (for metrics and tests)."""

    def __init__(self) -> None:
        self.k = ScaleCounts()
        self.v = ScaleCounts()

    def update(self, layout: KVLayout, k: torch.Tensor, v: torch.Tensor, global_scales: torch.Tensor) -> None:
        c = count_scales(layout, k, v, global_scales)
        self.k = self.k + c["k"]
        self.v = self.v + c["v"]

    def add(self, kv: int, counts: ScaleCounts) -> None:
        if kv == 0:
            self.k = self.k + counts
        else:
            self.v = self.v + counts


def k_error_energy(layout: KVLayout, k: torch.Tensor, global_scales: torch.Tensor, q_blocks: torch.Tensor,
                   k_feedback: torch.Tensor | None = None, nearest_rows: int = 0) -> float:
    """``sum over keys, heads and 16-blocks of e_b^T C_b e_b``: the error ``e`` of K ``k`` [N, H, d]
    (after RoPE and centering, unrotated) stored in ``layout`` (rotated first if it rotates)
    under ``global_scales`` [2, H], weighed by the queries' mean block products ``q_blocks``
    fp64 [H, d/16, 16, 16] in that stored basis (``kv_formats.feedback.block_covariance`` over
    its count). ``k_feedback``: K rounded with it (as the append does), except the first
    ``nearest_rows`` keys, rounded to nearest (nvfp4's position 0). See the module doc."""
    n, h, d = k.shape
    want = kfeedback.shape(h, d)
    if tuple(q_blocks.shape) != want:
        raise ValueError(f"q_blocks must be {list(want)}, got {list(q_blocks.shape)}")
    if not 0 <= nearest_rows <= n:
        raise ValueError(f"nearest_rows must be in [0, {n}], got {nearest_rows}")
    rows = stored_rows(k.cpu(), layout, 0)
    parts = []
    for lo, hi, fb in ((0, nearest_rows, None), (nearest_rows, n, k_feedback)):
        if hi > lo:
            parts.append(encode_rows(k[lo:hi], layout, 0, global_scales, rows=rows[lo:hi], k_feedback=fb))
    codes = torch.cat([c for c, _ in parts])
    scales = torch.cat([s for _, s in parts])
    g = global_scales[0].to(torch.float32).expand(n, h).reshape(-1)
    got = layout.codec.decode(codes.reshape(n * h, -1), scales.reshape(n * h, -1), g).view(n, h, d)
    e = (got - rows).double().view(n, h, d // kfeedback.BLOCK, kfeedback.BLOCK)
    return float(torch.einsum("nhbi,hbij,nhbj->", e, q_blocks.double(), e))
