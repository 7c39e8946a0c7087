'''Start-up calibration of the quantized KV cache's global scales.

After the pools are allocated the engine runs ONE forward of ``CALIBRATION_TEXT`` (English
prose, Python code and JSON tool-call-like text, ~400 tokens) through the model with a
scratch float KV pool and a scratch state slot (``TorchModelRunner.calibrate_kv``), so
nothing is written to the serving pools or to any serving state slot. ``RecordingPool``
captures every attention layer's K (after RoPE, unrotated) and V on their way into the
scratch pool; ``calibrate_layers`` turns them into per-layer power-of-two global scales
with ``kernels.calibration.calibrate`` and counts the block scales that the calibration
K/V would get under those scales (``ScaleCounter``: zero / subnormal / saturated of total).

With K centering per page (``--kv-center-k page``, what auto means for fp8 and nvfp4) each
layer also gets the calibration K's mean turned back to position 0
(``kernels.page_center.pre_rope_mean``), on the channels RoPE turns by at most pi/4 over half a
page; the cache subtracts it turned to each key's page middle, and attention adds each page's
term back. Page 0 is centered instead on the key the calibration's first token gets at position
0 (``KVCalibration.sink_keys``, ``PageCenter.sink``; the mean then leaves that token out): the
engine starts the calibration with the chat template's first token (``sink_token_id``), so every
chat request's attention sink encodes to zero, and any other sequence's position 0 — a sink too,
with a key much like it — to a small residual.

With one fixed offset (``--kv-center-k on``) each layer gets instead
a K offset [Hkv, d] — the calibration K's mean, ``kernels.calibration.k_offset``, on the
channels that RoPE turns by at most pi/4 over the served context (the engine's
``max_context``; ``stationary_channels``; all channels past the rotary dims) — which the cache subtracts
from every key before encoding (exact for attention: the softmax cancels a shift shared
by all keys); the global scales are then calibrated on the centered K.

With query-weighted rounding of K (``--kv-k-rounding``: feedback for fp8 and nvfp4 by default)
``RecordingPool`` also sums each layer's query products per 16-channel block in K's
stored basis (Q Hadamard-rotated when the layout rotates K: the basis the codes live in),
and ``calibrate_layers`` turns their means into the layer's feedback matrices
(``kernels.kv_formats.feedback.from_block_covariance``), which the append then uses to
pick K's codes.

With the rotation chosen per layer (``--kv-hadamard layer``, what auto means for fp8 and
nvfp4) ``RecordingPool`` sums the query products in every candidate basis
(``rotation_sizes``: the whole head's Hadamard transform, none, and for nvfp4 one transform per
16-element block), and ``calibrate_layers`` encodes each layer's centered calibration keys in
each by the cache's own rule (the basis's global scales and feedback, nvfp4's position 0 to
nearest) and keeps the basis whose error the queries feel least
(``kernels.calibration.k_error_energy``). The whole-head rotation spreads a key's energy evenly
over all its blocks, which helps when a few channels dominate K; the per-block one evens out
each nvfp4 block (its largest element against its block scale) without moving energy between
blocks; with per-head RMS-normalized Q and K (QK-norm: Qwen3, Qwen3.5, Gemma 3) some layers'
keys are better left as they are. Gemma 3 270M: KL to the bf16 cache -38% for nvfp4 (three
ways) and -39% for fp8 (two) against rotating every layer as a whole; SmolLM2 unchanged
(docs/kernels.md). The choice is per layer, for all of its KV heads, and part of the digest.

Only fp8 and nvfp4 use global scales; float pools and int8 skip calibration. The token ids
come from the model's ``tokenizer.json``; a model without a usable one is calibrated on a
fixed pseudo-random sequence of token ids (seeded, logged as ``source="random_ids"``):
real activations of the model, but less representative than text.
'''

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from deepwell.engine_service.layers.context import StepContext
from deepwell.engine_service.kv.float_pool import FloatLayerKV, KVPool
from deepwell.kernels.calibration import ScaleCounter, ScaleCounts, calibrate, k_error_energy, k_offset
from deepwell.kernels.hadamard.reference import fwht
from deepwell.kernels.kv_formats import feedback
from deepwell.kernels.kv_formats.layout import PAGE_LAYOUT_VERSION, KVLayout
from deepwell.kernels.page_center import PAGE_SIZE, PageCenter, max_pages_for, pre_rope_mean, rope_table

CALIBRATION_TEXT = '''The harbour was quiet that morning. Fishing boats rocked against the pier while gulls \
argued over scraps, and the old lighthouse keeper wrote in his log: wind from the north-east, \
visibility good, two ships expected before noon. Nobody remembered when the bell had last rung.

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping [start, end) intervals; the result is sorted by start."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged

class Cache(dict):
    def __missing__(self, key):
        value = self[key] = compute(key) * 0.5 + 1e-3
        return value

<tool_call>
{"name": "read_file", "arguments": {"path": "src/server/config.yaml", "offset": 120, "limit": 64}}
</tool_call>
{"role": "tool", "content": "port: 8080\\nworkers: 4\\nlog_level: debug\\ntimeout_s: 30.5", "ok": true}
<tool_call>
{"name": "search", "arguments": {"query": "ValueError: invalid literal for int() with base 10", "max_results": 5}}
</tool_call>

Results were mixed. In 1987, 42% of respondents said they preferred tea; by 2023 that share \
had fallen to 31%, while coffee rose from 38% to 55%. Prices: EUR 3.20, USD 2.99, JPY 450.
Q: What is 17 * 23? A: 391. Check: 17 * 20 = 340, 17 * 3 = 51, and 340 + 51 = 391.
'''

RANDOM_IDS = 400  # length of the fallback sequence
_SEED = 1234


SINK_TOKEN_TEXT = "<|im_start|>"  # ChatML's first token (Qwen, SmolLM2 chat templates)


def sink_token_id(tokenizer_json: bytes | None, bos_token_id: object, vocab_size: int) -> int | None:
    """The token a chat request starts with, whose key at position 0 centers page 0 (module doc):
    ``SINK_TOKEN_TEXT`` where the tokenizer has it as a token of its own, else the BOS token,
    else None (the calibration text's own first token then)."""
    if tokenizer_json:
        try:
            data = json.loads(tokenizer_json.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            data = {}
        for tok in data.get("added_tokens") or () if isinstance(data, dict) else ():
            if isinstance(tok, dict) and tok.get("content") == SINK_TOKEN_TEXT:
                tid = tok.get("id")
                if isinstance(tid, int) and 0 <= tid < vocab_size:
                    return tid
    if isinstance(bos_token_id, int) and not isinstance(bos_token_id, bool) and 0 <= bos_token_id < vocab_size:
        return bos_token_id
    return None


def calibration_token_ids(tokenizer_json: bytes | None, vocab_size: int) -> tuple[list[int], str]:
    """``(token ids, source)``: ``CALIBRATION_TEXT`` tokenized by ``tokenizer_json``, or a
    fixed pseudo-random id sequence (``source="random_ids"``) when there is no usable one."""
    if tokenizer_json:
        try:
            from tokenizers import Tokenizer

            ids = Tokenizer.from_str(tokenizer_json.decode("utf-8")).encode(CALIBRATION_TEXT).ids
        except Exception:  # tokenizers raises a plain Exception for a file it cannot parse
            ids = []
        ids = [i for i in ids if 0 <= i < vocab_size]
        if ids:
            return ids, "tokenizer"
    gen = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (RANDOM_IDS,), generator=gen).tolist(), "random_ids"


@dataclass
class _QuerySums:
    """Running sums of one layer's query block products (``feedback.block_covariance``)."""

    products: torch.Tensor | None = None
    count: int = 0

    def add(self, products: torch.Tensor, count: int) -> None:
        self.products = products if self.products is None else self.products + products
        self.count += count

    def mean(self) -> torch.Tensor:
        if self.products is None or not self.count:
            raise RuntimeError("queries were not recorded (q_rotate unset, or no forward ran)")
        return self.products / self.count


@dataclass
class _RecordingLayer:
    """Stores into the scratch float layer and keeps fp32 copies of what it stored."""

    inner: FloatLayerKV
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    q_sums: dict[int, _QuerySums]  # basis (the Hadamard size: 0 none, 16 per block, d whole) -> running sums
    num_kv_heads: int

    def write(self, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None:
        self.k.append(k.detach().float().cpu())
        self.v.append(v.detach().float().cpu())
        self.inner.write(k, v, ctx)

    def attend(self, q: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor:
        if self.q_sums:
            qs = q.detach().float()
            for size, sums in self.q_sums.items():
                prod, count = feedback.block_covariance(fwht(qs, size) if size else qs, self.num_kv_heads)
                sums.add(prod.cpu(), count)
        return self.inner.attend(q, ctx, scale)


class RecordingPool:
    """A scratch float ``KVPool`` whose layers record the K/V written to them and, for each
    basis in ``q_bases`` (a Hadamard size, ``KVLayout.hadamard_size``: 0 as is, 16 per 16-element
    block, ``d`` the whole head), the block products of the queries they attend with in that
    basis (K's stored basis when K is rotated likewise)."""

    def __init__(self, pool: KVPool, q_bases: Sequence[int] = ()) -> None:
        self.pool = pool
        self.q_bases = tuple(dict.fromkeys(int(b) for b in q_bases))
        n = pool.layout.num_layers
        self.k: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.q_sums = [{b: _QuerySums() for b in self.q_bases} for _ in range(n)]

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def layer(self, i: int) -> _RecordingLayer:
        return _RecordingLayer(self.pool.layer(i), self.k[i], self.v[i], self.q_sums[i],
                               self.pool.layout.num_kv_heads)

    def captured(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(k, v)`` fp32 ``[N, Hkv, D]`` (CPU)."""
        return [(torch.cat(k), torch.cat(v)) for k, v in zip(self.k, self.v, strict=True)]

    def query_covariances(self) -> dict[int, list[torch.Tensor]]:
        """Per recorded basis, per layer the mean query block products fp64 ``[Hkv, d/16, 16, 16]`` (CPU)."""
        return {b: [s[b].mean() for s in self.q_sums] for b in self.q_bases}


@dataclass(frozen=True)
class KVCalibration:
    """Outcome of one calibration: per-layer scales and the block-scale health counts."""

    kv_format: str
    source: str  # "tokenizer" or "random_ids"
    tokens: int
    scales: tuple[torch.Tensor, ...] = field(repr=False)  # per attention layer fp32 [2, Hkv]
    k: ScaleCounts = ScaleCounts()
    v: ScaleCounts = ScaleCounts()
    # K centering: per attention layer fp32 [Hkv, d] (None: off), channels centered, and
    # the share of the calibration K's energy (sum of squares) the offsets remove
    k_offsets: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    centered_channels: int = 0
    k_energy_removed: float = 0.0
    # K centered per page (``kernels.page_center``): per attention layer the pre-RoPE mean fp32
    # [Hkv, d] (None: not per page; then ``k_offsets`` may hold fixed offsets)
    page_means: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    # page 0's center (``PageCenter.sink``): per attention layer the key of the calibration's
    # first token at position 0, fp32 [Hkv, d] (None: page 0 on the mean like every page)
    sink_keys: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    # query-weighted rounding of K: per attention layer fp32 [Hkv, d/16, 16, 16] (None: nearest)
    k_feedback: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    # per attention layer K's Hadamard size (``KVLayout.hadamard_size``: 0 not rotated, 16 per
    # 16-element block, d the whole head; empty: every layer as the layout says)
    hadamard: tuple[int, ...] = ()
    # with the rotation chosen per layer: per layer {size: K error energy under the calibration
    # queries} (``kernels.calibration.k_error_energy``), the figures the choice compared
    rotation_energy: tuple[dict[int, float], ...] | None = field(default=None, repr=False)

    def layers_rotated(self, size: int) -> int:
        """Attention layers whose K has Hadamard size ``size`` (``hadamard``; 0: not rotated)."""
        return sum(1 for r in self.hadamard if r == size)

    def digest(self) -> str:
        """sha256 (hex, 16 chars) of the format, the page layout's version, the layers' K
        rotation, every global scale, K offset and K feedback matrix: what the cached bytes mean. Pages kept outside this
        process (the KV daemon) may only be reused by an engine whose calibration has the same
        digest."""
        h = hashlib.sha256(self.kv_format.encode())
        h.update(f";page_layout={PAGE_LAYOUT_VERSION}".encode())
        if self.k_feedback is not None:  # nvfp4 rounds position 0 to nearest (quant_pool.position0_nearest)
            h.update(b"k_feedback;position0=nearest" if self.kv_format.startswith("nvfp4") else b"k_feedback;all")
        if self.page_means is not None:  # what each key had subtracted: its page's turn of the mean
            h.update(f";k_center=page;page={PAGE_SIZE}".encode())
        if self.sink_keys is not None:  # page 0's keys had the sink key subtracted instead
            h.update(b";page0=sink")
        if self.hadamard:  # which layers' K (and Q) are rotated, and by which transform
            h.update((";hadamard=" + ",".join(str(r) for r in self.hadamard)).encode())
        for t in (*self.scales, *(self.k_offsets or ()), *(self.page_means or ()), *(self.sink_keys or ()),
                  *(self.k_feedback or ())):
            h.update(t.detach().cpu().to(torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def scale_range(self, kv: int) -> tuple[float, float]:
        """(min, max) global scale over every layer and head, for K (0) or V (1)."""
        vals = torch.stack([s[kv] for s in self.scales])
        return float(vals.min()), float(vals.max())


def rotation_sizes(layout: KVLayout) -> tuple[int, ...]:
    """The K rotations a layer's calibration chooses among (``--kv-hadamard layer``), as Hadamard
    sizes in order of preference between equals: the whole head, none and, for nvfp4, each
    16-element block (its block scales' span; for fp8, whose error is relative to each element,
    the block rotation measured worse on both models: docs/kernels.md)."""
    d = layout.head_dim
    return (d, 0, 16) if layout.fmt.value == "nvfp4" else (d, 0)


def calibrate_layers(layout: KVLayout, captured: list[tuple[torch.Tensor, torch.Tensor]], *, source: str,
                     tokens: int, name: str, center_k: torch.Tensor | None = None,
                     q_covariances: Mapping[int, Sequence[torch.Tensor]] | None = None,
                     k_feedback: bool = False, choose_rotation: bool = False, nearest_rows: int = 0,
                     page_rope: torch.Tensor | None = None, sink: bool = False) -> KVCalibration:
    """Global scales of every layer from its captured K/V, and their block-scale counts.

    ``center_k``: bool [d], the channels to center (``stationary_channels``); None = no
    K centering. ``page_rope``: RoPE's ``inv_freq`` — K centered per page instead
    (``kernels.page_center``: the captured keys, positions 0.. in order, turned back to position
    0 and averaged on ``center_k``'s channels, which the caller takes from ``page_stationary``);
    ``sink`` (with ``page_rope``): page 0 centered on the first captured key (position 0), which
    the mean then leaves out.
    ``q_covariances``: per basis (a Hadamard size: ``rotation_sizes``) per layer the mean query
    block products (``RecordingPool.query_covariances``). ``k_feedback``: K rounded with feedback
    made from them in K's stored basis (else nearest rounding); the first ``nearest_rows`` keys
    (nvfp4's position 0) to nearest all the same. ``choose_rotation``: each layer's K rotated by
    the whole head's transform, not at all or (nvfp4) by one per 16-element block, whichever
    leaves the smaller error under its queries (``k_error_energy`` of the captured, centered keys encoded by
    this very rule in each basis; needs every basis's products; ties go to the whole transform,
    then to none); otherwise every layer as ``layout`` says."""
    bases = rotation_sizes(layout) if choose_rotation else (layout.hadamard_size,)
    if k_feedback or choose_rotation:
        missing = [b for b in bases if q_covariances is None or b not in q_covariances]
        if missing:
            raise ValueError(f"need the query products in the basis of Hadamard size {missing[0]}")
        assert q_covariances is not None
        for b in bases:
            if len(q_covariances[b]) != len(captured):
                raise ValueError(f"need query covariances for {len(captured)} layers, got {len(q_covariances[b])}")
    if page_rope is not None and center_k is None:
        raise ValueError("page centering needs the channels to center (center_k)")
    if sink and page_rope is None:
        raise ValueError("a sink key centers page 0 of a per-page centering (page_rope)")
    counter = ScaleCounter()
    scales, offsets, sinks, feedbacks, rotated, energies = [], [], [], [], [], []
    energy = centered_energy = 0.0
    if page_rope is not None:  # one table of page middles for every layer's calibration keys
        n_max = max((k.shape[0] for k, _ in captured), default=1)
        table = rope_table(page_rope, max_pages_for(n_max))
    for i, (k, v) in enumerate(captured):
        if center_k is not None:
            if page_rope is None:
                mu = k_offset(k, center_k)
                shift = mu
            else:
                pos = torch.arange(k.shape[0])
                first = 1 if sink and k.shape[0] > 1 else 0  # the sink key stays out of the mean
                mu = torch.where(center_k, pre_rope_mean(k[first:], pos[first:], page_rope), torch.zeros(()))
                sk = k[0].to(torch.float32).contiguous() if sink else None
                pc = PageCenter(mu.contiguous(), table, sk)
                shift = pc.offsets(pos)
                sinks.append(sk)
            offsets.append(mu)
            energy += float(k.double().square().sum())
            k = k - shift
            centered_energy += float(k.double().square().sum())
        choice = {}  # basis -> (layout, global scales, feedback or None)
        for rot in bases:
            lay = KVLayout.make(layout.fmt, layout.num_kv_heads, layout.head_dim, rot)
            fb = feedback.from_block_covariance(q_covariances[rot][i]) if k_feedback and q_covariances else None
            choice[rot] = (lay, calibrate(lay, k, v), fb)
        if choose_rotation:
            assert q_covariances is not None
            e = {rot: k_error_energy(lay, k, g, q_covariances[rot][i], fb, min(nearest_rows, k.shape[0]))
                 for rot, (lay, g, fb) in choice.items()}
            energies.append(e)
            pick = min(bases, key=lambda r: e[r])  # the first of equals: bases' order
        else:
            pick = layout.hadamard_size
        lay, g, fb = choice[pick]
        rotated.append(pick)
        feedbacks.append(fb)
        counter.update(lay, k, v, g)
        scales.append(g)
    return KVCalibration(kv_format=name, source=source, tokens=tokens, scales=tuple(scales),
                         k=counter.k, v=counter.v,
                         k_offsets=tuple(offsets) if center_k is not None and page_rope is None else None,
                         page_means=tuple(offsets) if page_rope is not None else None,
                         sink_keys=tuple(sinks) if sink else None,
                         centered_channels=int(center_k.sum()) if center_k is not None else 0,
                         k_energy_removed=1.0 - centered_energy / energy if energy > 0 else 0.0,
                         k_feedback=tuple(feedbacks) if k_feedback else None,  # type: ignore[arg-type]
                         hadamard=tuple(rotated), rotation_energy=tuple(energies) if choose_rotation else None)
