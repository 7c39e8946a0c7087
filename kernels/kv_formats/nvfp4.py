"""NVFP4 KV: E2M1 codes, one E4M3 scale per 16 values, and a power-of-two global scale ``g``.

Token row of one head (head_dim ``d``): ``d/2`` code bytes then ``d/16`` scale bytes
(144 bytes for d = 256).

- Code = E2M1: a sign and a 3-bit index into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
- Packing ("half split"): byte ``j`` (``0 <= j < d/2``) holds element ``j`` (the "low"
  element) and element ``j + d/2`` (the "high" one), so a kernel unpacks a row into its two
  contiguous halves and never interleaves. Bits of byte ``j`` (``PAGE_LAYOUT_VERSION`` 3):
  7 = low sign, 3-1 = low index, 6-4 = high index, 0 = high sign. Placed so, the low element
  is already an fp16 high byte (sign at bit 7, index at bits 1-3: the fp16 value is the E2M1
  value times 2**-14) after one mask of the code word (``& 0x8E8E8E8E``), and the high one
  after two shifts, a mask and a merge (``(w >> 3) & 0x0E0E0E0E | (w << 7) & 0x80808080``):
  five operations per eight values where sign-in-nibble packing (version 2 and before: low
  nibble ``sign << 3 | index``, high nibble above it) needs seven.
- Scale byte ``b`` (``0 <= b < d/16``) is the E4M3 code of block ``b`` = elements
  ``[16b, 16b + 16)``.

Quantization of one block ``x[16]`` (fp32, after the optional Hadamard rotation). The
element rule is fixed (round-half-even onto the E2M1 grid of the block scale, saturating);
the block scale is chosen by an error search:

1. ``a = |x| * (1/g)`` (exact: ``g`` is a power of two), ``m = max(a)``;
   ``c6 = E4M3_RNE_saturating(amax(|x|) * enc)`` with ``enc = fp32(1/6) * (1/g)`` (amax -> 6)
   and ``c4 = E4M3_RNE_saturating(m * 0.25)`` (amax -> 4; the product is exact);
2. ``c6 == 0`` (all-zero block, or ``amax * enc`` below half of E4M3's smallest subnormal):
   scale code 0 and all codes 0. Otherwise the first candidate ``c0`` is ``c6`` when
   ``clip`` (K rows), and for V rows (``clip=False``) the first code that does not clip the
   block's largest value: ``c6 + 1`` if ``6 * E4M3(c6) < m`` (exact product), else ``c6``.
   The candidates, in this order, are ``c0``, with ``clip`` ``c0-1 .. c0-SEARCH_DOWN`` (kept
   >= 1), and ``c0+1 .. c0+UP_SPAN`` (kept <= ``max(min(c4 + SEARCH_UP, 126), c0)``): the
   E4M3 codes from about amax/7 (K) or amax/6 (V) up to amax/3, which contains "Four Over
   Six"'s pair (c6, c4); at most 10 (K) / 8 (V) evaluations. A wider search (c6-10 .. c4+4)
   picked the same codes on SmolLM2's K/V and on Gaussian, Laplace and Student-t blocks except
   in a handful of blocks: of the list before ``SEARCH_DOWN = 2, UP_SPAN = 7`` (K c0-3 ..,
   up to c0+8, which reached c4+2 also where c4 - c0 = 6), c0-3 won in fewer than 0.001% and
   c0+8 in none of SmolLM2's 737,280 K and V blocks of one window, and over 10 windows the
   shorter list measured KL 38.30 against 38.66 (1e-3 nats/token; perplexity +4.177% against
   +4.187% vs bf16) — and saves two of the append's twelve evaluations. K rows rounded with
   error feedback (``feedback``, the engine's default for K) search three codes only, in this
   order: ``c6``, ``c6-1`` (kept >= 1), ``c4`` — ``FEEDBACK_DOWN``, ``FEEDBACK_FOUR_LO ..
   FEEDBACK_FOUR_HI``: the append's K programs run the sixteen-step recursion after the search,
   and with ten codes they took 3.7-3.9 us per layer of a 64-sequence step (H200), with these
   three 2.97 (four, ``c4+1`` added, 3.11-3.13). On SmolLM2 (``benchmarks/kv_quality.py``, 10
   windows, docs/kernels.md) the three measured KL 19.81 against the ten's 18.26 (1e-3
   nats/token; perplexity +2.246% against +2.193% vs bf16) and the four 19.72.
   Why K and V differ: a scale that clips shrinks a block's largest values, which lowers the squared error but biases them toward
   zero; V's errors reach the attention output as a probability-weighted *sum* over tokens,
   so a bias shared by many tokens adds up, while a shift common to all keys cancels in the
   softmax. Measured on SmolLM2-135M (``benchmarks/kv_quality.py``, first 2 windows, 4094
   tokens, perplexity vs bf16): V alone with a clipping search +1.24%, plain amax/6 +0.82%,
   non-clipping search +0.39%; K alone (rotated): amax/6 +7.90%, non-clipping search
   +5.37%, clipping search +4.57%;
3. for a candidate scale value ``s``, the element index of ``a_i`` is the number of
   thresholds ``t_k * s`` that ``a_i`` passes, ``t = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)``
   — "passes" is ``>`` where a tie must round down to the even code and ``>=`` where it must
   round up: round-half-even of ``a / s`` onto the E2M1 grid, ``a > 5 s`` saturating to 6.
   Every ``t_k * s`` is exact in fp32, so no division happens;
4. its error is a fixed-point sum of squares: ``E = max(exponent(m), ERR_EXP_FLOOR)``,
   ``A_i = trunc(a_i * 2**(12 - E))``, ``step = trunc(s * 2**(11 - E))``, ``Q_i =
   h[idx_i] * step`` with ``h = 2 * E2M1 = (0, 1, 2, 3, 4, 6, 8, 12)``, ``err = sum((A_i -
   Q_i)**2)`` in int32. The candidate with the smallest ``err`` wins; ties keep the earlier one
   (so ``c6`` on a tie);
5. an element rounding to magnitude 0 never carries a sign bit.

Why step 4 gives the same answer on every device: the only floating-point operations are
products by powers of two (exact in fp32; nothing is added to them, so FMA contraction
cannot change them) and fp32 -> int32 truncations; everything after is integer arithmetic,
whose sum does not depend on the reduction order. No overflow: ``A_i <= m * 2**(12-E) <
2**13`` and ``|A_i - Q_i| < 2**13`` (``Q_i`` is within half a grid gap, at most ``s``, of
``A_i``, or below it when saturating), so the sum of 16 squares is below ``2**30``.
``step`` is an exact integer whenever ``s >= m / 16`` (every candidate, except in blocks
whose scale saturates E4M3 at 448); ``A_i`` keeps 12-13 bits of each value (the error is
measured with resolution ``m / 4096``, about 1/300 of the finest E2M1 step).

Dequantized value: ``±E2M1[index] * s * g``. Every E2M1 x E4M3 product is exact in bf16 and
fp16, so attention kernels dequantize in registers and apply ``g`` after the dot product.
"""

from __future__ import annotations

import functools

import torch

from deepwell.kernels.kv_formats import e4m3
from deepwell.kernels.kv_formats.feedback import round_blocks

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
INV_6 = float(torch.tensor(1.0 / 6.0, dtype=torch.float32).item())
# (threshold, inclusive): inclusive thresholds are those whose tie rounds up to the even code
THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
# block-scale search (module doc): codes tried below c6 = code(amax/6) and above c4 = code(amax/4)
SEARCH_DOWN = 2
SEARCH_UP = 2
# codes above c0: up to c4 + SEARCH_UP, at most UP_SPAN of them (code(amax/4) - code(amax/6) is
# 4-6, ratio <= 1.5 * 17/15; where it is 6 the list stops one short of c4 + 2, a code that
# never won on SmolLM2: module doc)
UP_SPAN = 7
# K rows rounded with error feedback: codes c6, c6-1 .. c6-FEEDBACK_DOWN, then c4+FEEDBACK_FOUR_LO ..
# c4+FEEDBACK_FOUR_HI (module doc: c6, c6-1, c4)
FEEDBACK_DOWN = 1
FEEDBACK_FOUR_LO = 0
FEEDBACK_FOUR_HI = 0
ERR_BITS = 12  # fixed-point fraction bits of the error: unit = 2**(exponent(amax) - 12)
ERR_EXP_FLOOR = -20  # exponent(amax) is clamped here (zero / tiny blocks: no int32 overflow)
_SEARCH_ELEMENTS = 1 << 22  # elements x candidates the scale search evaluates at once (its memory)
_HALVES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.int32)  # 2 * E2M1 value


@functools.lru_cache(maxsize=None)
def _halves_on(device: torch.device) -> torch.Tensor:
    """``_HALVES`` on ``device``, copied there once."""
    return _HALVES.to(device)


def code_bytes(d: int) -> int:
    return d // 2


def scale_bytes(d: int) -> int:
    return d // BLOCK


def block_scale_input(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``amax(|block|) * enc`` per block: [N, d] -> [N, d/16] (the value E4M3 rounds)."""
    n, d = x.shape
    amax = x.to(torch.float32).abs().view(n, d // BLOCK, BLOCK).amax(dim=-1)
    enc = INV_6 * (1.0 / g.to(torch.float32))
    return amax * enc[:, None]


def e2m1_index(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude index (0..7) of ``a >= 0`` under block scale value ``s`` (broadcast):
    the number of exact thresholds ``t * s`` passed (round-half-even, saturating); 0 where
    ``s == 0``."""
    idx = None
    for t, inclusive in THRESHOLDS:  # one comparison per threshold, counted (no 7-wide reduction)
        thr = s * t  # exact: t has at most 3 significant bits
        passed = a >= thr if inclusive else a > thr
        idx = passed.to(torch.int32) if idx is None else idx.add_(passed)
    return torch.where(s > 0, idx, 0)


def encode_with_scales(x: torch.Tensor, g: torch.Tensor, s_code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode fp32 rows [N, d] with given E4M3 block-scale codes [N, d/16] (uint8)."""
    x = x.to(torch.float32)
    n, d = x.shape
    sb = e4m3.decode(s_code)[:, :, None]
    a = (x.abs() * (1.0 / g.to(torch.float32))[:, None]).view(n, d // BLOCK, BLOCK)
    idx = e2m1_index(a, sb).view(n, d)
    return pack_codes(idx, x < 0), s_code


def first_candidate(c6: torch.Tensor, m: torch.Tensor, clip: bool) -> torch.Tensor:
    """int32 code evaluated first: ``c6``; without clipping, ``c6 + 1`` where ``6 * E4M3(c6) <
    m`` (``c6`` rounded amax/6 down, so amax would saturate) — exact: ``6 * s`` is exact."""
    c6i = c6.to(torch.int32)
    if clip:
        return c6i
    clips = 6.0 * e4m3.decode(c6) < m
    return torch.where(clips, torch.clamp(c6i + 1, max=126), c6i)


def scale_candidates(c0: torch.Tensor, c4: torch.Tensor, clip: bool, down: int = SEARCH_DOWN,
                     up: int = UP_SPAN) -> list[torch.Tensor]:
    """Candidate block-scale codes (int32, evaluation order): ``c0`` (``first_candidate``),
    then, with ``clip``, ``c0-1 .. c0-SEARCH_DOWN`` (kept >= 1), then ``c0+1 .. c0+UP_SPAN``
    (kept <= ``max(min(c4 + SEARCH_UP, 126), c0)``); duplicates are harmless."""
    top = torch.maximum(torch.clamp(c4.to(torch.int32) + SEARCH_UP, max=126), c0)
    out = [c0]
    if clip:
        out += [torch.clamp(c0 - k, min=1) for k in range(1, down + 1)]
    out += [torch.minimum(c0 + k, top) for k in range(1, up + 1)]
    return out


def block_error(a: torch.Tensor, unit: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 squared error [N, B], E2M1 index [N, B, 16]) of blocks ``a`` (|x|/g) under scale
    values ``s`` [N, B], in fixed point: ``A = trunc(a * unit)``, ``Q = halves(idx) *
    trunc(s * unit / 2)``, error ``sum((A - Q)**2)`` (see the module doc for why it is exact)."""
    idx = e2m1_index(a, s[..., None])
    big_a = (a * unit[..., None]).to(torch.int32)
    half_step = (s * (unit * 0.5)).to(torch.int32)
    q = _halves_on(a.device)[idx] * half_step[..., None]
    dd = big_a - q
    return (dd * dd).sum(-1, dtype=torch.int32), idx


def feedback_candidates(c6: torch.Tensor, c4: torch.Tensor) -> list[torch.Tensor]:
    """The shorter list of K rows rounded with error feedback (int32, evaluation order): ``c6``,
    ``c6-1 .. c6-FEEDBACK_DOWN``, then ``c4+FEEDBACK_FOUR_LO .. c4+FEEDBACK_FOUR_HI``, kept in
    1..126; duplicates are harmless (ties keep the earlier)."""
    c6i, c4i = c6.to(torch.int32), c4.to(torch.int32)
    return ([torch.clamp(c6i - k, 1, 126) for k in range(FEEDBACK_DOWN + 1)]
            + [torch.clamp(c4i + j, 1, 126) for j in range(FEEDBACK_FOUR_LO, FEEDBACK_FOUR_HI + 1)])


def search_inputs(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the scale search starts from, for fp32 rows [N, d]: (``c6`` uint8 [N, d/16], the
    E4M3 code of amax/6; ``a`` = |x| / g [N, d/16, 16]; ``m`` its block maxima; ``c4``, the code
    of amax/4)."""
    n, d = x.shape
    c6, _ = e4m3.encode_magnitude(block_scale_input(x, g))
    a = (x.abs() * (1.0 / g.to(torch.float32))[:, None]).view(n, d // BLOCK, BLOCK)
    m = a.amax(-1)
    c4, _ = e4m3.encode_magnitude(m * 0.25)
    return c6, a, m, c4


def choose_scale_codes(x: torch.Tensor, g: torch.Tensor, *, clip: bool = True, feedback: bool = False,
                       down: int = SEARCH_DOWN, up: int = UP_SPAN) -> torch.Tensor:
    """Block-scale codes uint8 [N, d/16] of fp32 rows [N, d] (the searched rule, module doc;
    ``feedback``: K rows rounded with error feedback, the three-code list; ``down`` / ``up``
    lengthen or shorten the ten-code list, for screening only)."""
    if feedback and not clip:
        raise ValueError("the feedback list is K's (clip=True)")
    c6, a, m, c4 = search_inputs(x, g)
    exp = torch.clamp((m.view(torch.int32) >> 23) - 127, min=ERR_EXP_FLOOR)
    unit = e4m3._pow2(ERR_BITS - exp)
    if feedback:
        cands = feedback_candidates(c6, c4)
    else:
        cands = scale_candidates(first_candidate(c6, m, clip), c4, clip, down, up)
    # every candidate's error at once ([C, rows, B], rows in slices of bounded size); the least
    # wins, ties the earliest listed (argmin's first minimum: as comparing them one by one with <)
    stacked = torch.stack(cands)
    best = torch.empty_like(cands[0])
    step = max(1, _SEARCH_ELEMENTS // (stacked.shape[0] * x.shape[1]))
    for r in range(0, x.shape[0], step):
        sl = stacked[:, r : r + step]
        err, _ = block_error(a[r : r + step], unit[r : r + step], e4m3.decode(sl.to(torch.uint8)))
        best[r : r + step] = sl.gather(0, err.argmin(0, keepdim=True))[0]
    return torch.where(c6 > 0, best, 0).to(torch.uint8)


def pack_codes(idx: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """E2M1 indices [N, d] (0..7) and signs -> half-split packed codes uint8 [N, d/2] (module
    doc: low sign at bit 7, low index at 1-3, high index at 4-6, high sign at 0; zero is never
    negative)."""
    d = idx.shape[1]
    idx = idx.to(torch.int32)
    neg = (negative & (idx > 0)).to(torch.int32)
    lo, hi = idx[:, : d // 2], idx[:, d // 2 :]
    return ((neg[:, : d // 2] << 7) | (lo << 1) | (hi << 4) | neg[:, d // 2 :]).to(torch.uint8)


def unpack_codes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes uint8 [N, d/2] -> (E2M1 indices int32 [N, d], negative bool [N, d])."""
    c = codes.to(torch.int32)
    idx = torch.cat(((c >> 1) & 7, (c >> 4) & 7), dim=-1)
    neg = torch.cat(((c >> 7) & 1, c & 1), dim=-1).bool()
    return idx, neg


def encode_with_feedback(x: torch.Tensor, g: torch.Tensor, s_code: torch.Tensor,
                         fb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode fp32 rows [N, d] with block-scale codes [N, d/16], elements rounded one block
    column at a time with error feedback ``fb`` [N, d/16, 16, 16] (``kv_formats.feedback``)."""
    x = x.to(torch.float32)
    n, d = x.shape
    sb = e4m3.decode(s_code)  # [N, d/16]
    inv_g = (1.0 / g.to(torch.float32))[:, None]
    gv = g.to(torch.float32)[:, None]
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    negative = torch.empty(n, d // BLOCK, BLOCK, dtype=torch.bool, device=x.device)

    # e2m1_index's thresholds t * s, computed once for the sixteen columns (the same products
    # and comparisons, fewer operations per step)
    incl = [t for t, inclusive in THRESHOLDS if inclusive]
    excl = [t for t, inclusive in THRESHOLDS if not inclusive]
    thr_in = sb[..., None] * torch.tensor(incl, dtype=torch.float32, device=x.device)
    thr_ex = sb[..., None] * torch.tensor(excl, dtype=torch.float32, device=x.device)
    scaled = sb > 0

    def quantize(col: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = (col.abs() * inv_g)[..., None]
        idx = (a >= thr_in).sum(-1, dtype=torch.int32) + (a > thr_ex).sum(-1, dtype=torch.int32)
        idx = torch.where(scaled, idx, 0)
        mag = lut[idx] * sb * gv
        negative[:, :, i] = col < 0
        return idx, torch.where(col < 0, -mag, mag)

    idx = round_blocks(x, fb, quantize)
    return pack_codes(idx, negative.view(n, d)), s_code


def encode(x: torch.Tensor, g: torch.Tensor, *, clip: bool = True,
           feedback: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [N, d], global scales [N] -> (codes uint8 [N, d/2], scales uint8 [N, d/16]).
    ``clip``: may the block scale clip the block's largest values (K: yes, V: no; module doc).
    ``feedback`` [N, d/16, 16, 16]: round with error feedback (``kv_formats.feedback``), the
    block scales from the three-code list (``feedback_candidates``; K rows only)."""
    x = x.to(torch.float32)
    d = x.shape[1]
    if d % 32:
        raise ValueError(f"nvfp4 needs head_dim divisible by 32, got {d}")
    s_code = choose_scale_codes(x, g, clip=clip, feedback=feedback is not None)
    if feedback is not None:
        return encode_with_feedback(x, g, s_code, feedback)
    return encode_with_scales(x, g, s_code)


def element_values(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes uint8 [N, d/2] -> the E2M1 values fp32 [N, d] they hold (before scales)."""
    idx, neg = unpack_codes(codes)
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[idx]
    return torch.where(neg, -mag, mag)


@functools.lru_cache(maxsize=8)
def _byte_values(device: torch.device) -> torch.Tensor:
    """fp32 [256, 2]: the (low, high) element values of every code byte (``element_values``)."""
    return element_values(torch.arange(256, dtype=torch.uint8, device=device)[:, None]).contiguous()


def decode(codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(codes [N, d/2], scales [N, d/16]) -> fp32 rows [N, d]: ``element_values`` times each
    block's E4M3 scale and the row's global scale (the elements through one table of the 256
    code bytes: the same values, fewer operations)."""
    n, half = codes.shape
    pair = _byte_values(codes.device)[codes.long()]  # [N, d/2, 2]: low half, high half
    val = pair.transpose(1, 2).reshape(n, 2 * half)
    s = e4m3.decode(scales).repeat_interleave(BLOCK, dim=-1)
    return val * s * g.to(torch.float32).view(n, 1)
