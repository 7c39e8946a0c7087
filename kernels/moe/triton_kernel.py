"""The routed experts of a mixture-of-experts layer in two Triton launches, with no host sync
and fixed launch shapes for a given token count: capturable in a CUDA graph.

``reference.moe_experts_summed`` is the meaning. The picks ``(token, j)`` are sorted by expert
on the GPU (``plan``) and cut into tiles of ``BM`` picks of one expert; a tile's program reads
its expert's weights once for all its picks (tensor-core products, fp32 sums):

1. ``_gate_up_kernel`` over (tile, block of I): the gate and up columns of the block,
   ``h = round(round(silu(round(g))) * round(u))`` stored per pick (``h [P, I]``);
2. ``_down_kernel`` over (tile, block of H): ``y = round(round(h @ down[e].T) * w)`` per pick;

then each token's k picks are added in fp32 and rounded once (torch). FP8 experts
(``reference.Scales``) are read as E4M3 bytes, each tile's codes times their block scale formed
in fp32 and rounded to x's dtype before the product: the dequantized weight's exact bits, so
half the bytes of bf16 experts are read for the same result.

``plan_one_launch`` does the same in one program for a decode step's few picks, and one token's picks
(distinct experts) each get a tile of their own with no plan at all (``Tiles.per_pick``).

The grid is the most tiles any routing of ``P = N * k`` picks can need,
``(P + min(P, E) (BM - 1)) // BM`` (each expert with picks wastes under one tile): with ``E``
large and ``N`` small that is ``P`` tiles, the experts a step actually reads. A tile past the plan's
last one returns at once (its expert is -1), so no weight is read for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepwell.kernels.e4m3_unpack import e4m3_f16, has_fp8_conversion
from deepwell.kernels.fused.common import INTERPRET, KIND, round_to, silu_f32
from deepwell.kernels.moe import reference

BLOCK_K = 64  # K per step; an FP8 scale block spans a multiple of it
# picks per launch pair: a longer prefill chunk runs in slices of tokens, so the per-pick buffers
# (h [picks, I], y [picks, H] in x's dtype) stay within ~64 MiB at H = 2048
MAX_PICKS = 16384


@dataclass(frozen=True)
class Plan:
    """The picks sorted by expert and cut into tiles (all on x's device, fixed shapes).

    ``order [P]``: pick ids (``token * k + j``) sorted by expert, stable; ``tile_expert [T]``:
    each tile's expert, -1 past the last tile; ``tile_row0`` / ``tile_row1 [T]``: the tile's
    picks are ``order[row0:row1]`` (at most ``block_m``)."""

    order: torch.Tensor
    tile_expert: torch.Tensor
    tile_row0: torch.Tensor
    tile_row1: torch.Tensor
    block_m: int


def max_tiles(picks: int, num_experts: int, block_m: int) -> int:
    """The most tiles ``picks`` picks over ``num_experts`` experts can fill: with ``a`` experts
    picked, ``sum ceil(c_e / BM) <= (picks + a (BM - 1)) / BM``, and ``a <= min(picks, E)``."""
    return (picks + min(picks, num_experts) * (block_m - 1)) // block_m


def plan(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> Plan:
    """Sort the picks by expert and tile them, with device ops only (no host sync)."""
    flat = topk_idx.reshape(-1).to(torch.int64)
    picks = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(max_tiles(picks, num_experts, block_m), dtype=torch.int64, device=dev)
    e = torch.searchsorted(tile_end, t, right=True)  # tiles before t's expert end at or before t
    valid = e < num_experts
    ec = e.clamp(max=num_experts - 1)
    row0 = (ends - counts)[ec] + (t - (tile_end - tiles)[ec]) * block_m
    row1 = torch.minimum(ends[ec], row0 + block_m)
    return Plan(order=order, tile_expert=torch.where(valid, ec, -1).to(torch.int32),
                tile_row0=row0.to(torch.int32), tile_row1=row1.to(torch.int32), block_m=block_m)


# the most picks ``plan_one_launch`` takes (its pairwise [P, P] comparisons fit one program)
PLAN_ONE_LAUNCH_PICKS = 128


@triton.jit
def _plan_kernel(idx_ptr, order_ptr, te_ptr, r0_ptr, r1_ptr, P, T, BM: tl.constexpr, BP: tl.constexpr,
                 BT: tl.constexpr):
    """``plan`` in one program by pairwise counts over the ``P`` picks: pick i's place in the
    stable sort by expert is (picks of lower experts) + (earlier picks of its expert), its rank;
    a pick whose rank is a multiple of ``BM`` leads a tile, whose index is the number of leaders
    of lower experts plus rank // BM. Tiles past the last: expert -1, rows [0, 0)."""
    i = tl.arange(0, BP)
    ok = i < P
    e = tl.load(idx_ptr + i, mask=ok, other=0).to(tl.int32)
    e = tl.where(ok, e, 2147483647)  # padding: above every expert, never counted
    ei, ej, okj = e[:, None], e[None, :], ok[None, :]
    same = (ei == ej) & okj
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    lower = (ej < ei) & okj
    pos = tl.sum(lower.to(tl.int32), axis=1) + rank
    tl.store(order_ptr + pos, i, mask=ok)
    lead = ok & (rank % BM == 0)
    tile = tl.sum((lower & lead[None, :]).to(tl.int32), axis=1) + rank // BM
    tl.store(te_ptr + tile, e, mask=lead)
    tl.store(r0_ptr + tile, pos, mask=lead)
    tl.store(r1_ptr + tile, pos + tl.minimum(count - rank, BM), mask=lead)
    t = tl.arange(0, BT)
    dead = (t >= tl.sum(lead.to(tl.int32), axis=0)) & (t < T)
    zero = tl.zeros([BT], dtype=tl.int32)
    tl.store(te_ptr + t, zero - 1, mask=dead)
    tl.store(r0_ptr + t, zero, mask=dead)
    tl.store(r1_ptr + t, zero, mask=dead)


def plan_one_launch(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> Plan:
    """``plan`` for at most ``PLAN_ONE_LAUNCH_PICKS`` picks in one Triton launch (``plan``'s
    torch ops are ~25 small launches, which a decode step's few picks do not amortize); the same
    order and tiles (tiles past the last: rows [0, 0))."""
    flat = topk_idx.reshape(-1).contiguous()
    picks = flat.numel()
    if not 0 < picks <= PLAN_ONE_LAUNCH_PICKS:
        raise ValueError(f"plan_one_launch takes 1..{PLAN_ONE_LAUNCH_PICKS} picks, got {picks}")
    tiles = max_tiles(picks, num_experts, block_m)
    dev = flat.device
    order = torch.empty(picks, dtype=torch.int32, device=dev)
    te, r0, r1 = (torch.empty(tiles, dtype=torch.int32, device=dev) for _ in range(3))
    _plan_kernel[(1,)](flat, order, te, r0, r1, picks, tiles, BM=block_m, BP=triton.next_power_of_2(picks),
                       BT=triton.next_power_of_2(tiles), num_warps=4)
    return Plan(order=order, tile_expert=te, tile_row0=r0, tile_row1=r1, block_m=block_m)


@triton.jit
def _tile_rows(order_ptr, te_ptr, r0_ptr, r1_ptr, TOPK, BM: tl.constexpr, PER_PICK: tl.constexpr):
    """This program's tile: its expert, its picks' ids, which rows hold one, their tokens.
    ``PER_PICK``: tile t is pick t alone (``te_ptr`` the flat expert ids; no plan)."""
    t = tl.program_id(0)
    if PER_PICK:
        e = tl.load(te_ptr + t).to(tl.int32)
        r = tl.arange(0, BM)
        ok = r < 1
        pick = t + r * 0
    else:
        e = tl.load(te_ptr + t)
        r = tl.load(r0_ptr + t) + tl.arange(0, BM)
        ok = r < tl.load(r1_ptr + t)
        pick = tl.load(order_ptr + r, mask=ok, other=0)
    return e, pick, ok, pick // TOPK


@triton.jit
def _weight_tile(cols, rows, rows_ok, k, k_ok, k0, s_cols, stride_sn, SBN: tl.constexpr, SBK: tl.constexpr,
                 FP8: tl.constexpr, FP8_HW: tl.constexpr, KIND_X: tl.constexpr, IEEE: tl.constexpr, x_dtype):
    """A ``[BK, BN]`` weight tile (columns ``cols`` = row pointers of the weight, ``rows`` their
    indices) for ``tl.dot``: 16-bit as stored; FP8 codes times their block's scale (one per
    column: the step lies in one block along K), formed in fp32 and rounded to x's dtype
    (``fp8_gemm.reference.dequantize``: the same bits). ``IEEE``: fp32."""
    w = tl.load(cols + k[:, None], mask=k_ok[:, None] & rows_ok[None, :], other=0)
    if FP8:
        sc = tl.load(s_cols + (rows // SBN) * stride_sn + k0 // SBK, mask=rows_ok, other=0.0)
        w = round_to(e4m3_f16(w, FP8_HW).to(tl.float32) * sc[None, :], KIND_X)
        if not IEEE:
            w = w.to(x_dtype)
    if IEEE:
        w = w.to(tl.float32)
    return w


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, order_ptr, te_ptr, r0_ptr, r1_ptr, s_ptr, H, I, TOPK,
                    stride_x, stride_we, stride_wn, stride_h, stride_se, stride_sn,
                    KIND_X: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                    FP8_HW: tl.constexpr, PER_PICK: tl.constexpr):
    e, pick, ok, tok = _tile_rows(order_ptr, te_ptr, r0_ptr, r1_ptr, TOPK, BM, PER_PICK)
    if e < 0:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < I
    rk = tl.arange(0, BK)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_x
    w_e = w_ptr + e.to(tl.int64) * stride_we
    g_cols = w_e + n.to(tl.int64)[None, :] * stride_wn  # gate rows n, up rows I + n, as [BK, BN]
    u_cols = w_e + (I + n).to(tl.int64)[None, :] * stride_wn
    s_e = s_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        k = k0 + rk
        k_ok = k < H
        a = tl.load(x_rows + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        wg = _weight_tile(g_cols, n, n_ok, k, k_ok, k0, s_e, stride_sn, SBN, SBK, FP8, FP8_HW, KIND_X, IEEE,
                          a.dtype)
        wu = _weight_tile(u_cols, I + n, n_ok, k, k_ok, k0, s_e, stride_sn, SBN, SBK, FP8, FP8_HW, KIND_X, IEEE,
                          a.dtype)
        if IEEE:  # fp32 operands (16-bit ones widened: exact), fp32 products
            a = a.to(tl.float32)
            acc_g += tl.dot(a, wg, input_precision="ieee")
            acc_u += tl.dot(a, wu, input_precision="ieee")
        else:
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
    g = round_to(acc_g, KIND_X)
    u = round_to(acc_u, KIND_X)
    h = round_to(round_to(silu_f32(g), KIND_X) * u, KIND_X)
    tl.store(h_ptr + pick.to(tl.int64)[:, None] * stride_h + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, tw_ptr, y_ptr, order_ptr, te_ptr, r0_ptr, r1_ptr, s_ptr, H, I, TOPK,
                 stride_h, stride_we, stride_wn, stride_y, stride_se, stride_sn,
                 KIND_X: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                 FP8_HW: tl.constexpr, PER_PICK: tl.constexpr):
    e, pick, ok, tok = _tile_rows(order_ptr, te_ptr, r0_ptr, r1_ptr, TOPK, BM, PER_PICK)
    if e < 0:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < H
    rk = tl.arange(0, BK)
    h_rows = h_ptr + pick.to(tl.int64)[:, None] * stride_h
    w_cols = w_ptr + e.to(tl.int64) * stride_we + n.to(tl.int64)[None, :] * stride_wn
    s_e = s_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + rk
        k_ok = k < I
        a = tl.load(h_rows + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_cols, n, n_ok, k, k_ok, k0, s_e, stride_sn, SBN, SBK, FP8, FP8_HW, KIND_X, IEEE, a.dtype)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    wt = tl.load(tw_ptr + pick, mask=ok, other=0.0).to(tl.float32)
    y = round_to(round_to(acc, KIND_X) * wt[:, None], KIND_X)
    tl.store(y_ptr + pick.to(tl.int64)[:, None] * stride_y + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Tiles:
    """A launch's tile shape: ``bm`` picks x ``bn`` columns per program, ``bk`` along K per step
    (a multiple of 16 that divides an FP8 scale block), ``warps`` per program, ``stages`` of
    software pipelining of the K loop. ``per_pick``: no plan, each pick its own tile (one row of
    ``bm`` used): none of the plan's ~25 small launches, but an expert picked twice is read twice
    (a single token's top-k experts are distinct)."""

    bm: int
    bn: int
    bk: int = BLOCK_K
    warps: int = 4
    stages: int = 3
    per_pick: bool = False

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {v}")
        if self.warps not in (1, 2, 4, 8) or not 1 <= self.stages <= 8:
            raise ValueError(f"Tiles: warps must be 1, 2, 4 or 8 and stages 1..8, got {self.warps}, {self.stages}")

    @classmethod
    def parse(cls, spec: str) -> "Tiles":
        """``BMxBNxBK[xWARPS[xSTAGES]][p]`` (e.g. ``16x32x128x4``; a trailing ``p``: ``per_pick``);
        ValueError naming the form."""
        low = spec.lower()
        per_pick = low.endswith("p")
        parts = low.removesuffix("p").split("x")
        if not 3 <= len(parts) <= 5 or not all(p.isdigit() for p in parts):
            raise ValueError(f"tiles {spec!r}: expected BMxBNxBK[xWARPS[xSTAGES]][p], e.g. 16x32x64")
        return cls(*map(int, parts), per_pick=per_pick)

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}x{self.warps}x{self.stages}{'p' if self.per_pick else ''}"


def tiles_for(picks: int, tokens: int, fp8_block_k: int | None = None) -> Tiles:
    """One token: a tile per pick (its experts are distinct; no plan launches). A decode step's
    few picks: 16 per tile and narrow column blocks (more programs reading weights), 128 along K;
    FP8 experts keep those up to 1024 picks. Prefill chunks: 64 x 64. K steps of 128 where an
    FP8 scale block allows them. (H100, one Qwen3.6-35B-A3B layer, graphed, `f894aa7`: 16 x 32 x
    128 against the 16 x 32 x 64 tiles 79 / 198 against 83 / 200 us at 1 / 8 tokens of bf16
    experts; FP8 80 / 191 / 511 against 83 / 201 and 64 x 64's 664 us at 1 / 8 / 64 tokens.)"""
    bk = 128 if fp8_block_k is None or fp8_block_k % 128 == 0 else BLOCK_K
    if tokens == 1:
        return Tiles(16, 32, bk, per_pick=True)
    if picks <= 128 or (fp8_block_k is not None and picks <= 1024):
        return Tiles(16, 32, bk)
    return Tiles(64, 64)


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
                topk_w: torch.Tensor, scales: reference.Scales | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """``reference.moe_experts_summed`` in two launches: x fp32 / bf16 / fp16 with weights of the
    same dtype, or (``scales``) FP8 expert codes whose scale blocks span a multiple of 64 along
    K; fp32 products in IEEE fp32, not TF32. ``tiles``: the launch shape (default ``tiles_for``
    the pick count; the benchmark sweeps others)."""
    reference.check(x, gate_up, down, topk_idx, topk_w, scales)
    if x.dtype not in KIND:
        raise ValueError(f"moe_experts takes x in fp32 / bf16 / fp16, got {x.dtype}")
    if scales is None and (gate_up.dtype != x.dtype or down.dtype != x.dtype):
        raise ValueError(f"moe_experts takes x and weights of one dtype (or FP8 weights with scales), got x "
                         f"{x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}")
    if scales is not None and scales.block[1] % BLOCK_K:
        raise ValueError(f"FP8 expert scale blocks must span a multiple of {BLOCK_K} along K, got {scales.block}")
    if scales is not None and tiles is not None and scales.block[1] % tiles.bk:
        raise ValueError(f"tiles.bk={tiles.bk} must divide the FP8 scale block along K ({scales.block[1]})")
    n_tok, k = topk_idx.shape
    if n_tok * k > MAX_PICKS:  # a long prefill chunk: in slices of tokens (bounded h and y buffers)
        step = max(1, MAX_PICKS // k)
        return torch.cat([_moe(x[i : i + step], gate_up, down, topk_idx[i : i + step], topk_w[i : i + step], scales,
                               tiles) for i in range(0, n_tok, step)])
    return _moe(x, gate_up, down, topk_idx, topk_w, scales, tiles)


def _moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_idx: torch.Tensor,
         topk_w: torch.Tensor, scales: reference.Scales | None, tiles: Tiles | None) -> torch.Tensor:
    n_tok, k = topk_idx.shape
    num_e, two_i, hid = gate_up.shape
    inter = two_i // 2
    picks = n_tok * k
    if picks == 0:
        return torch.zeros_like(x)
    sbn, sbk = scales.block if scales else (1, BLOCK_K)
    ts = tiles or tiles_for(picks, n_tok, scales.block[1] if scales else None)
    bm, bn = ts.bm, ts.bn
    if ts.per_pick:  # tile t = pick t: the flat expert ids stand in for the plan (order, row ranges unread)
        flat = topk_idx.reshape(-1).contiguous()
        tile_args = (flat, flat, flat, flat)
        n_tiles = picks
    else:
        p = (plan_one_launch if picks <= PLAN_ONE_LAUNCH_PICKS else plan)(topk_idx, num_e, bm)
        tile_args = (p.order, p.tile_expert, p.tile_row0, p.tile_row1)
        n_tiles = p.tile_expert.numel()
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    if scales is not None:  # the kernels read the codes as bytes
        gate_up, down = gate_up.view(torch.uint8), down.view(torch.uint8)
    # the block scales [E, rows / bn, cols / bk] and their expert and row strides (unread without FP8)
    s_gu, s_dn = (scales.gate_up.contiguous(), scales.down.contiguous()) if scales else (x, x)
    st_gu, st_dn = (s_gu.stride()[:2], s_dn.stride()[:2]) if scales else ((0, 0), (0, 0))
    tw = topk_w.reshape(-1).to(x.dtype).contiguous()
    h = torch.empty(picks, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(picks, hid, dtype=x.dtype, device=x.device)
    # fp32 in IEEE fp32 (not TF32); under the interpreter 16-bit tiles are widened first (its
    # 16-bit products are wrong), which gives the tensor cores' exact products and fp32 sums
    common = dict(KIND_X=KIND[x.dtype], IEEE=x.dtype == torch.float32 or INTERPRET, BM=bm, BK=ts.bk,
                  FP8=scales is not None, SBN=sbn, SBK=sbk, FP8_HW=has_fp8_conversion(x.device), num_warps=ts.warps,
                  num_stages=ts.stages, PER_PICK=ts.per_pick)
    _gate_up_kernel[(n_tiles, triton.cdiv(inter, bn))](
        x, gate_up, h, *tile_args, s_gu, hid, inter, k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), *st_gu, BN=bn, **common)
    _down_kernel[(n_tiles, triton.cdiv(hid, bn))](
        h, down, tw, y, *tile_args, s_dn, hid, inter, k,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0), *st_dn, BN=bn, **common)
    return y.view(n_tok, k, hid).float().sum(1).to(x.dtype)
