"""Quantized KV cache of the engine: ``--kv-dtype fp8 | int8 | nvfp4`` on ``kernels/``.

``QuantKVPool`` owns one ``kernels.backend.KVCacheLayer`` per attention layer (uint8
pages ``[num_pages, 2, Hkv, head_page_bytes]`` of 64 tokens, plus fp32 power-of-two
global scales ``[2, Hkv]``) and hands the model one ``QuantLayerKV`` per layer, the
``layers.attention.AttentionKV`` of this format:

- ``write``: ``backend.append`` of the step's K (after RoPE, unrotated) and V at
  ``ctx.kv_slots`` (``page * 64 + offset``; the same numbers as the float pool's rows).
  The backend quantizes (and Hadamard-rotates K when the layout says so).
- ``attend``: every multi-token slice in ONE varlen ``prefill_attention`` call
  (``ctx.prefill``) and every single-token slice in one batched ``decode_attention``
  (``ctx.decode.pages``); the kernels rotate Q themselves, V is never rotated.

The backend is ``kernels.backend.get_backend(device)``: the plain-torch reference on CPU,
the Triton kernels on CUDA; both write identical cache bytes.

Layouts: ``quant_layout`` refuses (``KVSettingsError``, a ``ValueError``, saying what to change) a page size other
than 64 and a head_dim outside (64, 128, 256). ``hadamard``: ``on``, ``off``, ``layer``
(chosen per attention layer by the start-up calibration, ``kv.calibration``: the whole head's
transform, none, or for nvfp4 one per 16-element block; fp8 / nvfp4; every layer rotated as a
whole until then), ``auto`` = ``layer`` for fp8 and nvfp4, off for int8 (``resolve_hadamard``);
``QuantKVPool.set_hadamard`` installs the per-layer choice (``KVLayout.hadamard_size``). Bytes per page of the whole model:
``num_layers * layout.page_bytes`` (nvfp4 at d=256: 144 B per token per head for K and
again for V, vs 512 for bf16).

Global scales start at 1.0; ``set_scales`` installs calibrated ones
(``engine_service.kv.calibration``), checked to be positive powers of two; ``set_k_offsets``
installs the K centering offsets (fp32 ``[Hkv, d]`` per layer, subtracted from K before
encoding; none by default) and ``set_k_feedback`` K's query-weighted rounding (fp32
``[Hkv, d/16, 16, 16]`` per layer, ``kernels.kv_formats.feedback``; fp8 / nvfp4, none by
default), which ``write`` applies to every token (nvfp4: but a sequence's position 0, rounded to
nearest: the attention sink; ``position0_nearest``). All are fixed once the pool holds tokens. For fp8 / int8 / nvfp4
every append also counts its block scales (``scale_counts``: zero / subnormal / saturated of the
total over every layer, the served counterpart of the calibration's counts; fp8 counts elements,
int8 token scales, whose saturation clamps values beyond +-1905: ``kv_formats.int8``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from deepwell.engine_service.layers.context import StepContext
from deepwell.kernels.backend import KVCacheLayer, ReferenceBackend, TritonBackend, get_backend
from deepwell.kernels.calibration import ScaleCounts, counted_per_row
from deepwell.kernels.kv_append.reference import SCALE_COUNT_KINDS, check_k_feedback, check_k_offset
from deepwell.kernels.kv_formats.layout import HEAD_DIMS, PAGE_SIZE, KVLayout, check_global_scales
from deepwell.kernels.page_center import PageCenter

QUANT_FORMATS = ("fp8", "int8", "nvfp4")
K_ROUNDING_MODES = ("auto", "nearest", "feedback")  # feedback: fp8 / nvfp4 only (kernels.kv_formats.feedback)
FEEDBACK_BY_DEFAULT = ("fp8", "nvfp4")  # auto: where query-weighted rounding measured better (docs/kernels.md)
HADAMARD_MODES = ("auto", "on", "off", "layer")  # layer: chosen per attention layer at calibration
CENTER_K_MODES = ("auto", "on", "off", "page")  # auto: page for the calibrated formats (kernels.page_center)
SCALED_FORMATS = ("fp8", "nvfp4")  # formats whose global scales matter (calibrated)


class KVSettingsError(ValueError):
    """KV settings this model / page size cannot use; the message says what to change."""


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in QUANT_FORMATS


def resolve_hadamard(fmt: str, hadamard: str) -> str:
    """``on`` / ``off`` / ``layer`` for a quantized ``fmt``, or ``KVSettingsError`` naming the fix:
    auto is ``layer`` for the calibrated formats (fp8, nvfp4) and ``off`` for int8 (whose
    per-token scales measured within +0.05% of bf16 unrotated); ``layer`` needs a calibrated
    format (the choice is made by the calibration)."""
    if hadamard not in HADAMARD_MODES:
        raise KVSettingsError(f"kv_hadamard {hadamard!r} must be one of {', '.join(HADAMARD_MODES)}")
    if hadamard == "auto":
        return "layer" if fmt in SCALED_FORMATS else "off"
    if hadamard == "layer" and fmt not in SCALED_FORMATS:
        raise KVSettingsError(f"kv_hadamard 'layer' is chosen by the start-up calibration of {', '.join(SCALED_FORMATS)}, "
                              f"which kv dtype {fmt!r} has none of: use on or off")
    return hadamard


def quant_layout(fmt: str, num_kv_heads: int, head_dim: int, page_size: int, hadamard: str = "auto") -> KVLayout:
    """The kernels' layout for one attention layer (``layer``: rotated until the calibration
    chooses per layer), or ``KVSettingsError`` naming the fix."""
    if fmt not in QUANT_FORMATS:
        raise KVSettingsError(f"kv dtype {fmt!r} is not a quantized format ({', '.join(QUANT_FORMATS)})")
    mode = resolve_hadamard(fmt, hadamard)
    if page_size != PAGE_SIZE:
        raise KVSettingsError(f"kv dtype {fmt!r} needs page_size {PAGE_SIZE} (the kernels' page), got {page_size}: "
                         f"set --page-size {PAGE_SIZE} or use a float --kv-dtype (auto, bf16, fp16, fp32)")
    if head_dim not in HEAD_DIMS:
        raise KVSettingsError(f"kv dtype {fmt!r} needs head_dim in {HEAD_DIMS}, but this model's is {head_dim}: "
                         "use a float --kv-dtype (auto, bf16, fp16, fp32) for it")
    return KVLayout.make(fmt, num_kv_heads, head_dim, mode != "off")


def _rotation_name(size: int, head_dim: int) -> str:
    return "" if size == 0 else "+hadamard" if size == head_dim else f"+hadamard{size}"


def describe(layout: KVLayout, sizes: Sequence[int] = ()) -> str:
    """``nvfp4+hadamard`` style name (logs; ``+hadamard16``: one transform per 16-element block):
    with per-layer Hadamard sizes ``sizes`` the one name they share, or the counts, e.g.
    ``nvfp4+hadamard[whole 1, 16-blocks 16, none 1]``."""
    fmt, d = layout.fmt.value, layout.head_dim
    if len(set(sizes)) <= 1:
        return fmt + _rotation_name(sizes[0] if sizes else layout.hadamard_size, d)
    counts = [(n, sum(1 for s in sizes if s == size)) for n, size in (("whole", d), ("16-blocks", 16), ("none", 0))]
    return f"{fmt}+hadamard[" + ", ".join(f"{n} {c}" for n, c in counts if c) + "]"


KVBackend = ReferenceBackend | TritonBackend


def position0_nearest(layout: KVLayout) -> bool:
    """With query-weighted rounding of K, nvfp4 stores a sequence's position 0 with nearest
    rounding; fp8 rounds every token with feedback (measured on SmolLM2: the rule cut nvfp4's
    first-token KL on chat prompts 0.095 -> 0.049, while for fp8 it lost on chat prompts,
    0.0033 -> 0.0040, and on long text, KL 2.94 -> 3.40; docs/kernels.md)."""
    return layout.fmt.value == "nvfp4"


def append_tokens(backend: KVBackend, cache: KVCacheLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor | None, sink_rows: Sequence[int]) -> None:
    """Append K/V rows at ``slots`` the way the engine stores them: ``sink_rows`` are the rows
    at a sequence's position 0; with query-weighted rounding of K and ``position0_nearest``
    those are rounded to nearest (the attention sink: feedback calibrated on the average query
    can put that one key's error where the queries leaning on it look; docs/kernels.md), in a
    second append call.

    The appends skip the checks that read values back to the host (a sync per layer, and none
    may happen inside a captured decode step): the pool checks its scales, K offsets, page
    centers and feedback where they are set, and the runner checks every position and slot
    against the pool before the step."""
    if cache.k_feedback is None or not sink_rows or not position0_nearest(cache.layout):
        backend.append(cache, k, v, slots, positions, validate=False)
        return
    rows = torch.tensor(list(sink_rows), dtype=torch.long, device=slots.device)
    backend.append(replace(cache, k_feedback=None), k.index_select(0, rows), v.index_select(0, rows),
                   slots.index_select(0, rows), None if positions is None else positions.index_select(0, rows),
                   validate=False)
    backend.append(cache, k, v, slots.index_fill(0, rows, -1), positions, validate=False)


@dataclass(frozen=True)
class QuantLayerKV:
    """``AttentionKV`` of one attention layer over its quantized paged cache. ``stored``
    (the first layer's only) counts the token rows written, for the block-scale totals."""

    cache: KVCacheLayer
    backend: KVBackend
    stored: list[int] | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None:
        assert ctx.kv_slots is not None
        slots = ctx.kv_slots
        # K centered per page: the append turns the mean to each token's page (its position)
        pos = ctx.positions.to(slots.device) if self.cache.page_center is not None else None
        sinks = [s.offset for s in ctx.seqs if s.start == 0 and s.num_tokens > 0]
        append_tokens(self.backend, self.cache, k, v, slots, pos, sinks)
        if self.stored is not None:
            self.stored[0] += k.shape[0]  # every row has a slot (the runner never skips one)

    def attend(self, q: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor:
        t = q.shape[0]
        grp = ctx.verify_group
        if grp is not None:  # B slices of T tokens, sequence-major: the decode kernels with T per sequence
            return self.backend.decode_attention(q.contiguous(), self.cache, grp.pages.block_tables,
                                                 grp.pages.context_lens, tokens_per_seq=grp.tokens_per_seq,
                                                 sm_scale=scale)
        pre, dec = ctx.prefill, ctx.decode
        dec_pages = dec.pages if dec is not None else None
        if dec is not None and dec_pages is None:
            raise RuntimeError("decode slices without page tables: the runner built a float-pool context")
        if pre is not None and pre.rows.numel() == t:  # only multi-token slices: rows are 0..t-1
            return self._prefill(q.contiguous(), pre.block_tables, pre.context_lens, pre.q_lens, scale)
        if dec_pages is not None and dec_pages.rows.numel() == t:  # only decodes
            return self._decode(q.contiguous(), dec_pages.block_tables, dec_pages.context_lens, scale)
        out = torch.empty_like(q)
        if pre is not None:
            out[pre.rows] = self._prefill(q.index_select(0, pre.rows), pre.block_tables, pre.context_lens,
                                          pre.q_lens, scale)
        if dec_pages is not None:
            out[dec_pages.rows] = self._decode(q.index_select(0, dec_pages.rows), dec_pages.block_tables,
                                               dec_pages.context_lens, scale)
        return out

    def _prefill(self, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, q_lens: Sequence[int],
                 scale: float) -> torch.Tensor:
        return self.backend.prefill_attention(q, self.cache, tables, lens, q_lens, sm_scale=scale)

    def _decode(self, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
        return self.backend.decode_attention(q, self.cache, tables, lens, tokens_per_seq=1, sm_scale=scale)


class QuantKVPool:
    """Every attention layer's quantized cache: the same layout for all layers but for whether K
    is Hadamard-rotated, which may differ per layer (``set_hadamard``)."""

    def __init__(self, layout: KVLayout, num_layers: int, num_pages: int, device: torch.device) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.backend: KVBackend = get_backend(device)
        self.caches = [KVCacheLayer.allocate(layout, num_pages, device) for _ in range(num_layers)]
        if counted_per_row(layout) > 0:  # block-scale health of everything appended
            self._counts = torch.zeros(num_layers, 2, layout.num_kv_heads, len(SCALE_COUNT_KINDS), dtype=torch.int64,
                                       device=device)
            for i, c in enumerate(self.caches):
                c.scale_counts = self._counts[i]
        else:
            self._counts = None
        self._stored = [0]  # token rows written to every layer

    def scale_counts(self) -> tuple[ScaleCounts, ScaleCounts] | None:
        """(K, V) totals over every layer of the block scales (fp8: elements) appended so far:
        zero / subnormal / saturated (counted by the append) of the total (int8: token scales);
        None for bf16. A small device-to-host copy."""
        if self._counts is None:
            return None
        total = self._stored[0] * len(self.caches) * self.layout.num_kv_heads * counted_per_row(self.layout)
        k, v = self._counts.sum((0, 2)).tolist()
        return ScaleCounts(total, k[0], k[1], k[2]), ScaleCounts(total, v[0], v[1], v[2])

    @staticmethod
    def page_bytes(layout: KVLayout, num_layers: int) -> int:
        """True bytes of one page across ``num_layers`` attention layers."""
        return num_layers * layout.page_bytes

    def count_stored(self, rows: int) -> None:
        """``rows`` more token rows were appended to every layer outside ``QuantLayerKV.write``
        (a replayed CUDA graph, whose Python ran once at capture)."""
        self._stored[0] += rows

    def layer(self, i: int) -> QuantLayerKV:
        return QuantLayerKV(self.caches[i], self.backend, self._stored if i == 0 else None)

    def page_tensors(self) -> list[torch.Tensor]:
        """Per layer the uint8 pages ``[num_pages, 2, Hkv, head_page_bytes]`` (``kv.pool``)."""
        return [c.data for c in self.caches]

    def hadamard(self) -> list[int]:
        """Per attention layer K's (and its queries') Hadamard size (``KVLayout.hadamard_size``:
        0 not rotated, 16 per 16-element block, head_dim the whole head)."""
        return [c.layout.hadamard_size for c in self.caches]

    def set_hadamard(self, rotation: Sequence[bool | int]) -> None:
        """K's rotation per attention layer (before any token is stored: the bytes depend on it):
        True / False, or a Hadamard size 0, 16 or head_dim (``KVLayout.make``)."""
        if len(rotation) != len(self.caches):
            raise ValueError(f"need a K rotation for {len(self.caches)} attention layers, got {len(rotation)}")
        if self._stored[0]:
            raise RuntimeError("the K rotation is fixed once the pool holds tokens")
        lay = self.layout
        layouts = [KVLayout.make(lay.fmt, lay.num_kv_heads, lay.head_dim, r) for r in rotation]  # checks each
        for c, new in zip(self.caches, layouts, strict=True):
            c.layout = new

    def scales(self) -> list[torch.Tensor]:
        """Copies of every layer's global scales fp32 ``[2, Hkv]`` (CPU)."""
        return [c.scales.detach().cpu().clone() for c in self.caches]

    def set_scales(self, scales: Sequence[torch.Tensor]) -> None:
        """Install per-layer global scales (positive powers of two, fp32 ``[2, Hkv]``)."""
        if len(scales) != len(self.caches):
            raise ValueError(f"need global scales for {len(self.caches)} attention layers, got {len(scales)}")
        for s in scales:
            check_global_scales(s.to(torch.float32).cpu(), self.layout)
        for c, s in zip(self.caches, scales, strict=True):
            c.scales.copy_(s.to(device=c.scales.device, dtype=torch.float32))

    def _copies(self, attr: str) -> list[torch.Tensor | None]:
        return [None if getattr(c, attr) is None else getattr(c, attr).detach().cpu().clone() for c in self.caches]

    def _install(self, attr: str, what: str, tensors: Sequence[torch.Tensor],
                 check: Callable[[torch.Tensor, KVLayout], None]) -> None:
        """Check every layer's fp32 tensor, then set ``attr`` of every cache (all or nothing)."""
        if len(tensors) != len(self.caches):
            raise ValueError(f"need {what} for {len(self.caches)} attention layers, got {len(tensors)}")
        for t in tensors:
            check(t.to(torch.float32).cpu().contiguous(), self.layout)
        for c, t in zip(self.caches, tensors, strict=True):
            setattr(c, attr, t.to(device=c.data.device, dtype=torch.float32).contiguous())

    def k_offsets(self) -> list[torch.Tensor | None]:
        """Copies of every layer's K centering offset fp32 ``[Hkv, d]`` (CPU), None where unset."""
        return self._copies("k_offset")

    def set_k_offsets(self, offsets: Sequence[torch.Tensor]) -> None:
        """Install per-layer K centering offsets (finite fp32 ``[Hkv, d]``)."""
        self._install("k_offset", "K offsets", offsets, check_k_offset)

    def set_page_centers(self, means: Sequence[torch.Tensor], table: torch.Tensor,
                         sinks: Sequence[torch.Tensor] | None = None) -> None:
        """Center K per page (``kernels.page_center``): per layer the pre-RoPE mean fp32
        ``[Hkv, d]``, and the model's RoPE table of page middles (shared by every layer), and
        optionally per layer page 0's sink key fp32 ``[Hkv, d]``; the layers' fixed K offsets are
        dropped (one centering or the other)."""
        if len(means) != len(self.caches):
            raise ValueError(f"need page-centering means for {len(self.caches)} attention layers, got {len(means)}")
        if sinks is not None and len(sinks) != len(self.caches):
            raise ValueError(f"need sink keys for {len(self.caches)} attention layers, got {len(sinks)}")
        dev = self.caches[0].data.device
        tab = table.to(device=dev, dtype=torch.float32).contiguous()

        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=dev, dtype=torch.float32).contiguous()

        centers = [PageCenter(f32(m), tab, None if sinks is None else f32(sinks[i])) for i, m in enumerate(means)]
        for c, pc in zip(self.caches, centers, strict=True):
            c.k_offset = None
            c.page_center = pc
            c.check()

    def page_means(self) -> list[torch.Tensor | None]:
        """Copies of every layer's page-centering mean fp32 ``[Hkv, d]`` (CPU), None where unset."""
        return [None if c.page_center is None else c.page_center.mu.detach().cpu().clone() for c in self.caches]

    def sink_keys(self) -> list[torch.Tensor | None]:
        """Copies of every layer's page-0 sink key fp32 ``[Hkv, d]`` (CPU), None where unset."""
        return [None if c.page_center is None or c.page_center.sink is None
                else c.page_center.sink.detach().cpu().clone() for c in self.caches]

    def k_feedbacks(self) -> list[torch.Tensor | None]:
        """Copies of every layer's K rounding feedback fp32 ``[Hkv, d/16, 16, 16]`` (CPU), None where unset."""
        return self._copies("k_feedback")

    def set_k_feedback(self, feedback: Sequence[torch.Tensor]) -> None:
        """Install per-layer K rounding feedback (finite fp32 ``[Hkv, d/16, 16, 16]``; fp8 / nvfp4)."""
        self._install("k_feedback", "K feedback", feedback, check_k_feedback)
