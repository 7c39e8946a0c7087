"""K centered per page: each key minus the calibration's mean key turned to its page's middle.

A fixed offset (``KVCacheLayer.k_offset``) can only center the channels that RoPE hardly turns
over the whole served context (none of the rotated ones at 1M positions); a shared component of
the keys on the other channels turns with the position. Centering each key by the calibration's
*pre-RoPE* mean ``mu`` turned to the middle of the key's own 64-token page, ``R(p_mid) mu``, is
exact on every channel that turns by at most pi/4 over half a page, whatever the context
(``kernels.calibration.stationary_channels(inv_freq, d, 32)``; ``mu`` is zero elsewhere).
docs/kernels.md ("K centering per page") has the screening figures.

``PageCenter`` (one per attention layer; the table is the model's, shared by every layer):

- ``mu``: fp32 ``[Hkv, d]``, the pre-RoPE mean key (channels past the rotary dims are never
  turned: there it is a fixed offset);
- ``table``: fp32 ``[max_pages, r]``: for page ``P``, ``cos(p_mid * theta_j)`` for ``j < r/2``
  then ``sin(p_mid * theta_j)``, ``p_mid = 64 P + 32``, ``theta`` RoPE's frequencies over the
  first ``r`` channels in NeoX's half-split pairs ``(j, j + r/2)`` (the engine's ``apply_rope``).

What the cache holds for a key ``k`` at position ``p`` (page ``P = p // 64``) is ``k - c_P`` with

    c_P[j]       = mu[j] * cos_j - mu[j + h] * sin_j        (j < h = r/2)
    c_P[j + h]   = mu[j + h] * cos_j + mu[j] * sin_j
    c_P[k]       = mu[k]                                     (k >= r)

each product and sum rounded on its own in fp32 (``offsets``: torch element-wise operations,
the same bits on CPU and CUDA; the appends subtract them like a fixed offset). Attention adds
back ``q . c_P`` per (query, page): ``sum_j A_j cos_j + B_j sin_j`` with ``A_j = q_j mu_j +
q_{j+h} mu_{j+h}`` and ``B_j = q_{j+h} mu_j - q_j mu_{j+h}`` (``query_terms``, from the
unrotated query) plus ``q . mu`` over the unrotated channels, the same for every page, which the
softmax cancels and the kernels therefore leave out.

Page 0 may have a center of its own, ``sink`` fp32 ``[Hkv, d]`` (every channel): the key of the
chat template's first token at position 0, calibrated once (``engine_service.kv.calibration``).
A sequence's position 0 is an attention sink whatever its token, and its key is much the same
for any token there, so centering page 0 on that key leaves the sink's residual near zero — and
exactly zero for a sequence that starts with that token (every chat request); the screening
measured the KL to bf16 −33% (nvfp4) / −24% (fp8) on corpus windows that do not start with it
(docs/kernels.md, "Page 0 centered on the sink key"). Attention then adds ``q . sink`` for page 0
instead of ``q . c_0``, less the same unrotated-channel constant as every other page:
``q . sink_adj`` with ``sink_adj`` = ``sink`` minus ``mu`` on the channels past ``r``
(``sink_terms``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepwell.kernels.kv_formats.layout import PAGE_SIZE

MID = PAGE_SIZE // 2


def rope_table(inv_freq: torch.Tensor, max_pages: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[max_pages, 2 * len(inv_freq)]``: cos then sin of each page middle's angles
    (computed in fp64, so far pages stay exact to fp32's precision)."""
    if inv_freq.dim() != 1 or inv_freq.numel() == 0:
        raise ValueError(f"inv_freq must be a non-empty 1-D tensor, got {list(inv_freq.shape)}")
    if max_pages < 1:
        raise ValueError(f"max_pages must be >= 1, got {max_pages}")
    mid = torch.arange(max_pages, dtype=torch.float64) * PAGE_SIZE + MID
    ang = mid[:, None] * inv_freq.to(torch.float64).cpu()[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(torch.float32).contiguous().to(device)


@dataclass
class PageCenter:
    """One layer's per-page K centering (module doc)."""

    mu: torch.Tensor  # fp32 [Hkv, d]
    table: torch.Tensor  # fp32 [max_pages, r], shared by the model's layers
    sink: torch.Tensor | None = None  # fp32 [Hkv, d]: page 0's center (None: c_0 as every page)
    # fp32 [Hkv, d]: ``sink`` less ``mu`` on the channels past the rotary dims (what every other
    # page's term leaves out), so page 0's term is ``q . sink_adj``; None without a sink
    sink_adj: torch.Tensor | None = field(init=False, default=None, repr=False)
    # fp32 [max_pages, r + 1]: ``table`` with one more column, 1 on page 0's row and 0 elsewhere,
    # and page 0's own entries 0: with ``query_terms`` extended by ``sink_terms`` (``kernel_terms``)
    # one sum gives every page's term, page 0's included; None without a sink
    sink_table: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        mu, table, sink = self.mu, self.table, self.sink
        if mu.dim() != 2 or mu.dtype != torch.float32 or not mu.is_contiguous():
            raise ValueError(f"mu must be contiguous float32 [num_kv_heads, head_dim], got {mu.dtype} {list(mu.shape)}")
        if table.dim() != 2 or table.dtype != torch.float32 or not table.is_contiguous():
            raise ValueError(f"table must be contiguous float32 [max_pages, rotary_dim], got {table.dtype} "
                             f"{list(table.shape)}")
        r = table.shape[1]
        if r % 2 or not 0 < r <= mu.shape[1]:
            raise ValueError(f"the table's rotary dims ({r}) must be even and at most head_dim ({mu.shape[1]})")
        if mu.device != table.device:
            raise ValueError(f"mu is on {mu.device} but the table on {table.device}")
        if not bool(torch.isfinite(mu).all()):
            raise ValueError("mu must be finite")
        if sink is not None and (sink.shape != mu.shape or sink.dtype != torch.float32 or not sink.is_contiguous()
                                 or sink.device != mu.device or not bool(torch.isfinite(sink).all())):
            raise ValueError(f"sink must be a finite contiguous float32 {list(mu.shape)} tensor on {mu.device} "
                             f"(mu's shape), got {sink.dtype} {list(sink.shape)} on {sink.device}")
        if sink is not None:
            self.sink_adj = torch.cat([sink[:, :r], sink[:, r:] - mu[:, r:]], dim=1).contiguous()
            ext = torch.cat([table, torch.zeros_like(table[:, :1])], dim=1)
            ext[0] = 0.0
            ext[0, r] = 1.0
            self.sink_table = ext.contiguous()

    @property
    def rotary_dim(self) -> int:
        return self.table.shape[1]

    @property
    def max_positions(self) -> int:
        return self.table.shape[0] * PAGE_SIZE

    def check_positions(self, positions: torch.Tensor) -> None:
        """ValueError unless ``positions`` are int tokens' positions the table covers (metadata
        only when ``positions`` is empty; reads the maximum back otherwise)."""
        if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions must be an int32/int64 vector, got {positions.dtype} {list(positions.shape)}")
        if positions.numel() and (int(positions.max()) >= self.max_positions or int(positions.min()) < 0):
            raise ValueError(f"positions must lie in [0, {self.max_positions}) (the page table's length); got "
                             f"{int(positions.min())}..{int(positions.max())}")

    def offsets(self, positions: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, Hkv, d]``: ``c_P`` of each token's page (module doc), rounded step by step."""
        h = self.rotary_dim // 2
        cs = self.table[(positions.to(self.table.device).long() // PAGE_SIZE)]  # [N, r]
        cos, sin = cs[:, None, :h], cs[:, None, h:]
        mu = self.mu[None]  # [1, Hkv, d]
        lo, hi = mu[..., :h], mu[..., h : 2 * h]
        first = lo * cos - hi * sin  # two products, one difference
        second = hi * cos + lo * sin
        rest = mu[..., 2 * h :].expand(cs.shape[0], -1, -1)
        out = torch.cat([first, second, rest], dim=-1)
        if self.sink is not None:  # page 0 centered on the sink key
            first_page = (positions.to(out.device).long() < PAGE_SIZE)[:, None, None]
            out = torch.where(first_page, self.sink[None], out)
        return out.contiguous()

    def query_terms(self, q: torch.Tensor) -> torch.Tensor:
        """fp32 ``[Nq, Hq, r]``: ``A`` then ``B`` (module doc) of unrotated queries ``q`` [Nq, Hq, d]
        (query head ``i`` reads KV head ``i // (Hq / Hkv)``)."""
        nq, hq, d = q.shape
        hkv = self.mu.shape[0]
        if d != self.mu.shape[1] or hq % hkv:
            raise ValueError(f"q must be [tokens, Hq, {self.mu.shape[1]}] with Hq a multiple of {hkv}, got {list(q.shape)}")
        h = self.rotary_dim // 2
        mu = self.mu.to(q.device).repeat_interleave(hq // hkv, dim=0)[None]  # [1, Hq, d]
        qf = q.to(torch.float32)
        q1, q2, m1, m2 = qf[..., :h], qf[..., h : 2 * h], mu[..., :h], mu[..., h : 2 * h]
        return torch.cat([q1 * m1 + q2 * m2, q2 * m1 - q1 * m2], dim=-1).contiguous()

    def kernel_terms(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(terms, table)`` such that page ``P``'s term for query row ``n`` is ``terms[n] .
        table[P]``: ``query_terms`` and ``table``, or with a sink both extended by one column
        (``sink_terms``; ``sink_table``) — what the Triton attention's ``page_center=`` takes."""
        terms = self.query_terms(q)
        if self.sink_table is None:
            return terms, self.table
        return torch.cat([terms, self.sink_terms(q)[..., None]], dim=-1).contiguous(), self.sink_table

    def sink_terms(self, q: torch.Tensor) -> torch.Tensor | None:
        """fp32 ``[Nq, Hq]``: page 0's term ``q . sink_adj`` of unrotated queries ``q`` [Nq, Hq, d]
        (fp64 sums); None without a sink."""
        adj = self.sink_adj
        if adj is None:
            return None
        nq, hq, d = q.shape
        if d != adj.shape[1] or hq % adj.shape[0]:
            raise ValueError(f"q must be [tokens, Hq, {adj.shape[1]}] with Hq a multiple of {adj.shape[0]}, "
                             f"got {list(q.shape)}")
        s = adj.to(device=q.device, dtype=torch.float64).repeat_interleave(hq // adj.shape[0], dim=0)
        return torch.einsum("nhd,hd->nh", q.to(torch.float64), s).to(torch.float32)


def page_bias(pc: PageCenter, q: torch.Tensor, tokens_per_seq: int, columns: int, width: int,
              scale: float) -> torch.Tensor:
    """fp32 ``[B, Hkv, width, columns]``: ``scale * q . c_P`` per (sequence, KV head, page,
    column) for decode / verify, what the Gluon kernel adds to a page's scores (in its log2
    units with ``scale = sm_scale * log2(e)``); column ``n = t * G + g`` is query token ``b * T +
    t`` of query head ``kvh * G + g`` (``G`` query heads per KV head), columns past ``T * G``
    hold 0. Pages past the table read its last row (as the Triton kernel's clamp). Defined in
    fp64 from ``query_terms``; the constant ``q . mu`` over the unrotated channels is left out
    (the softmax cancels it). With a ``sink``, page 0's entries are ``q . sink_adj`` (fp64 sums
    rounded to fp32, then scaled). ``q`` [B * T, Hq, d] unrotated."""
    nq, hq, d = q.shape
    hkv = pc.mu.shape[0]
    t = tokens_per_seq
    g = hq // hkv if hkv else 0
    if t < 1 or nq % t or columns < t * g or width < 0:
        raise ValueError(f"page_bias needs q [B * T, Hq, d] with T = {t} >= 1 and columns >= T * G = {t * g}, "
                         f"width >= 0; got q {list(q.shape)}, columns {columns}, width {width}")
    b = nq // t
    terms = pc.query_terms(q).to(torch.float64)  # [B * T, Hq, r]
    rows = torch.arange(width, device=pc.table.device).clamp(max=pc.table.shape[0] - 1)
    tab = pc.table[rows].to(device=q.device, dtype=torch.float64)  # [width, r]
    dots = torch.einsum("nhr,pr->nhp", terms, tab)  # [B * T, Hq, width]
    if pc.sink is not None and width > 0:  # page 0: q . sink_adj
        dots[..., 0] = pc.sink_terms(q).to(torch.float64)
    dots = dots * scale
    cols = dots.view(b, t, hkv, g, width).permute(0, 2, 4, 1, 3).reshape(b, hkv, width, t * g)
    out = torch.zeros(b, hkv, width, columns, dtype=torch.float32, device=q.device)
    out[..., : t * g] = cols.to(torch.float32)
    return out


def workspace_centers(pc: PageCenter, width: int, hadamard: int,
                      rotate: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 ``[width, Hkv, d]``: each page's offset ``c_P`` (``PageCenter.offsets`` of its first
    token: every token of a page has the same; pages past the table its last row), rotated like
    K by the Hadamard transform of size ``hadamard`` (``KVLayout.hadamard_size``; 0: not rotated;
    ``rotate(x, size)``: the reference ``fwht`` unless given a bit-identical one) -- what a
    dequantized workspace adds back to K so attention over it needs no page term."""
    from deepwell.kernels.hadamard.reference import fwht

    pos = torch.arange(width, dtype=torch.int64, device=pc.table.device).clamp(max=pc.table.shape[0] - 1) * PAGE_SIZE
    c = pc.offsets(pos)
    return ((rotate or fwht)(c, hadamard) if hadamard else c).contiguous()


def page_stationary(inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """bool ``[head_dim]``: the channels a page-centered ``mu`` may use (RoPE turns them by at
    most pi/4 over half a page; channels past the rotary dims always)."""
    from deepwell.kernels.calibration import stationary_channels

    return stationary_channels(inv_freq, head_dim, MID)


def pre_rope_mean(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """fp32 ``[Hkv, d]``: the mean of keys ``k`` [N, Hkv, d] (after RoPE, at ``positions``)
    turned back to position 0 (fp64 angles), on every channel; ``page_stationary`` says which
    of them a ``PageCenter`` keeps."""
    h = inv_freq.numel()
    ang = positions.to(torch.float64).cpu()[:, None] * inv_freq.to(torch.float64).cpu()[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = k.to(torch.float64).cpu()
    x1, x2 = x[..., :h], x[..., h : 2 * h]
    back = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin, x[..., 2 * h :]], dim=-1)
    return back.mean(0).to(torch.float32).contiguous()


def max_pages_for(max_positions: int) -> int:
    return max(1, math.ceil(max_positions / PAGE_SIZE))
