"""``TorchModelRunner``: the ``runner_api.ModelRunner`` over the torch decoder.

``build_runner(open_model(path), device, dtype, kv_dtype)`` builds the model from the
source's config (registry), streams its weights in (``models.loader``), and returns a
runner whose pools are created by ``allocate``. One ``forward`` runs a whole
``ForwardBatch``: per-token work (projections, MLPs) is batched over every slice; per
sequence, attention reads the pool through the slice's block table and GDN layers advance
the slice's state slot.

KV pools: a float ``memory.KVPool`` for ``kv_dtype`` auto/bf16/fp16/fp32, or a
``kv_quant.QuantKVPool`` (the ``kernels/`` paged cache) for fp8/int8/nvfp4 — then the page
size must be 64 and head_dim one of 64/128/256 (``ValueError`` at construction), the step
context carries int32 block tables instead of gather indices, and ``calibrate_kv``
(called once after ``allocate``) sets the global scales from a scratch forward that
touches neither pool nor any state slot.

Checked per step (``ValueError`` with the reason, nothing written): token count matches
the slices, ``num_tokens >= 1``, block tables cover ``start + num_tokens`` with page ids
in the pool, token ids in the vocabulary, and for hybrid models distinct state slots in
range whose state is at exactly ``start`` tokens (the runner tracks each slot's position:
``forward`` advances it, ``reset_state`` zeroes it, ``restore_state``/``copy_state`` set
it; ``snapshot_state(slot, p)`` refuses unless the slot is at ``p``).
Same code on CPU and CUDA; nothing here assumes a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from deepwell.logs import get_logger
from engine_service import kv_quant, kv_selfcheck
from engine_service.kv_calibration import KVCalibration, RecordingPool, calibrate_layers, rotation_sizes
from engine_service.kv_quant import (
    CENTER_K_MODES,
    FEEDBACK_BY_DEFAULT,
    K_ROUNDING_MODES,
    SCALED_FORMATS,
    KVSettingsError,
    QuantKVPool,
    describe,
    is_quantized,
    quant_layout,
    resolve_hadamard,
)
from engine_service.kv_selfcheck import KVKernelCheck
from engine_service.layers.backend import ReferenceBackend, get_backend
from engine_service.layers.context import DecodeGroup, PageTables, SeqInfo, StepContext
from engine_service.layers.rope import inv_freq_and_scale
from engine_service.loading.source import ModelSource
from engine_service.memory import (
    KVLayout,
    KVPool,
    StateLayout,
    StatePool,
    StateSnapshotData,
    resolve_kv_dtype,
)
from engine_service.models import build_model, load_weights
from engine_service.models.decoder import CausalLM
from engine_service.runner_api import ForwardBatch, MemorySpec, SeqSlice
from kernels.backend import ReferenceBackend as ReferenceKVBackend
from kernels.calibration import ScaleCounts, stationary_channels
from kernels.page_center import max_pages_for, page_stationary, rope_table

log = get_logger(__name__)

DEFAULT_PAGE_SIZE = 64


@dataclass(frozen=True)
class _EmptySnapshot:
    position: int


class TorchModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
        page_size: int = DEFAULT_PAGE_SIZE,
        kv_hadamard: str = "auto",
        ops: ReferenceBackend | None = None,
        kv_center_k: str = "auto",
        kv_k_rounding: str = "auto",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.model = model
        self.args = model.args
        self._device = device
        self.dtype = dtype
        self.ops = ops or ReferenceBackend()
        self.page_size = page_size
        a = self.args
        quantized = is_quantized(kv_dtype)
        if not quantized and kv_hadamard in ("on", "layer"):
            raise KVSettingsError(f"kv_hadamard {kv_hadamard!r} needs a quantized kv dtype (fp8, int8, nvfp4), "
                                  f"not {kv_dtype!r}: use auto or off")
        if kv_center_k not in CENTER_K_MODES:
            raise KVSettingsError(f"kv_center_k {kv_center_k!r} must be one of {', '.join(CENTER_K_MODES)}")
        if kv_center_k in ("on", "page") and kv_dtype not in SCALED_FORMATS:
            raise KVSettingsError(f"kv_center_k {kv_center_k!r} needs a calibrated kv dtype "
                                  f"({', '.join(SCALED_FORMATS)}), not {kv_dtype!r}: use auto or off")
        self.kv_center_k = kv_center_k != "off" and kv_dtype in SCALED_FORMATS
        # auto: per page (kernels.page_center; KL to the unquantized cache -33% / -36% for nvfp4 /
        # fp8 on SmolLM2, decode a few % slower: docs/kernels.md); on: one fixed offset
        self.kv_center_page = kv_center_k in ("auto", "page") and kv_dtype in SCALED_FORMATS
        if kv_k_rounding not in K_ROUNDING_MODES:
            raise KVSettingsError(f"kv_k_rounding {kv_k_rounding!r} must be one of {', '.join(K_ROUNDING_MODES)}")
        if kv_k_rounding == "feedback" and kv_dtype not in SCALED_FORMATS:
            raise KVSettingsError(f"kv_k_rounding 'feedback' needs a calibrated kv dtype ({', '.join(SCALED_FORMATS)}), "
                                  f"not {kv_dtype!r}: use auto or nearest")
        self.kv_k_rounding_feedback = kv_k_rounding == "feedback" or (
            kv_k_rounding == "auto" and kv_dtype in FEEDBACK_BY_DEFAULT)
        # float pools: the KV dtype; quantized: the model dtype (used by the calibration scratch pool)
        self.kv_dtype = dtype if quantized else resolve_kv_dtype(kv_dtype, dtype)
        self.kv_layout = KVLayout(
            num_layers=len(a.attention_layers),
            num_kv_heads=a.attention.num_kv_heads,
            head_dim=a.attention.head_dim,
            page_size=page_size,
            dtype=self.kv_dtype,
        )
        self.quant_layout = (
            quant_layout(kv_dtype, a.attention.num_kv_heads, a.attention.head_dim, page_size, kv_hadamard)
            if quantized and self.kv_layout.num_layers else None
        )
        # layer: the calibration chooses each attention layer's K rotation (auto for fp8 / nvfp4)
        self.kv_hadamard_per_layer = self.quant_layout is not None and resolve_hadamard(kv_dtype, kv_hadamard) == "layer"
        self.kv_calibration: KVCalibration | None = None
        self._kv_written = False  # a forward has written the serving KV pool (scales are then fixed)
        self._kv_samples: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # calibration K/V, for the check
        self.kv_kernel_check: KVKernelCheck | None = None  # the last ``check_kv_kernels``
        self.state_layout: StateLayout | None = None
        if a.gdn is not None and a.recurrent_layers:
            self.state_layout = StateLayout(
                num_layers=len(a.recurrent_layers),
                conv_dim=a.gdn.conv_dim,
                conv_width=a.gdn.conv_kernel - 1,
                num_v_heads=a.gdn.num_v_heads,
                head_k_dim=a.gdn.head_k_dim,
                head_v_dim=a.gdn.head_v_dim,
                conv_dtype=dtype,
            )
        self.kv: KVPool | QuantKVPool | None = None
        self.state: StatePool | None = None
        self._slot_pos: list[int] = []  # tokens each state slot's contents correspond to

    # -- runner_api.ModelRunner ------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_context(self) -> int:
        return self.args.max_context

    @property
    def architecture(self) -> str:
        return self.args.architecture

    @property
    def kv_dtype_name(self) -> str:
        """The KV format as reported in ModelInfo: ``nvfp4``/``fp8``/``int8`` or the float dtype."""
        if self.quant_layout is not None:
            return self.quant_layout.fmt.value
        return str(self.kv_dtype).removeprefix("torch.")

    @property
    def kv_bytes_per_page(self) -> int:
        """True bytes of one page over every attention layer (K and V, all KV heads)."""
        if self.quant_layout is not None:
            return QuantKVPool.page_bytes(self.quant_layout, self.kv_layout.num_layers)
        return self.kv_layout.bytes_per_page

    def memory_spec(self) -> MemorySpec:
        return MemorySpec(
            page_size=self.page_size,
            bytes_per_page=self.kv_bytes_per_page,
            bytes_per_state_slot=self.state_layout.bytes_per_slot if self.state_layout else 0,
            num_attention_layers=self.kv_layout.num_layers,
            num_recurrent_layers=self.state_layout.num_layers if self.state_layout else 0,
        )

    def allocate(self, num_pages: int, num_state_slots: int) -> None:
        if self.kv is not None or self.state is not None:
            raise RuntimeError("pools are already allocated")
        if self.quant_layout is not None:
            self.kv = QuantKVPool(self.quant_layout, self.kv_layout.num_layers, num_pages, self._device)
        elif self.kv_layout.num_layers:
            self.kv = KVPool(self.kv_layout, num_pages, self._device, self.ops)
        if self.state_layout is not None:
            self.state = StatePool(self.state_layout, num_state_slots, self._device)
            self._slot_pos = [0] * num_state_slots
        log.info(
            "pools_allocated",
            num_pages=num_pages,
            num_state_slots=num_state_slots if self.state_layout else 0,
            kv_format=describe(self.quant_layout) if self.quant_layout else self.kv_dtype_name,
            k_rotation="per layer, chosen at calibration" if self.kv_hadamard_per_layer else None,
            kv_backend=self.kv.backend.name if isinstance(self.kv, QuantKVPool) else self.ops.name,
            bytes_per_page=self.kv_bytes_per_page,
            kv_bytes=num_pages * self.kv_bytes_per_page,
        )

    # -- quantized KV: global scales ----------------------------------------------------
    def kv_scales(self) -> list[torch.Tensor]:
        """Every attention layer's global scales fp32 ``[2, Hkv]`` (quantized KV only)."""
        return self._quant_pool().scales()

    def set_kv_scales(self, scales: Sequence[torch.Tensor], k_offsets: Sequence[torch.Tensor] | None = None,
                      k_feedback: Sequence[torch.Tensor] | None = None,
                      page_means: Sequence[torch.Tensor] | None = None,
                      sink_keys: Sequence[torch.Tensor] | None = None,
                      hadamard: Sequence[bool | int] | None = None) -> None:
        """Install per-layer global scales (and K centering offsets fp32 ``[Hkv, d]``, K rounding
        feedback fp32 ``[Hkv, d/16, 16, 16]``, or K centering per page: pre-RoPE means fp32
        ``[Hkv, d]``, ``kernels.page_center``, with the model's RoPE, and page 0's sink keys fp32
        ``[Hkv, d]``, and each layer's K rotation: True / False or a Hadamard size 0 / 16 /
        head_dim) by hand (quantized KV only, before the first forward)."""
        pool = self._scales_settable()
        if hadamard is not None:
            pool.set_hadamard(hadamard)
        pool.set_scales(scales)
        if k_offsets is not None:
            pool.set_k_offsets(k_offsets)
        if k_feedback is not None:
            pool.set_k_feedback(k_feedback)
        if page_means is not None:
            inv_freq, _ = inv_freq_and_scale(self.args.rope)
            pool.set_page_centers(page_means, rope_table(inv_freq, max_pages_for(self.max_context)), sink_keys)
        elif sink_keys is not None:
            raise ValueError("sink keys center page 0 of a per-page centering: pass page_means too")

    def kv_page_means(self) -> list[torch.Tensor | None]:
        """Every attention layer's per-page centering mean fp32 ``[Hkv, d]`` (None: not centered per page)."""
        return self._quant_pool().page_means()

    def kv_sink_keys(self) -> list[torch.Tensor | None]:
        """Every attention layer's page-0 sink key fp32 ``[Hkv, d]`` (None: no sink key)."""
        return self._quant_pool().sink_keys()

    def kv_scale_counts(self) -> tuple[ScaleCounts, ScaleCounts] | None:
        """(K, V) block-scale counts of everything the serving pool has stored (fp8 / nvfp4),
        None otherwise; a small device-to-host copy (the engine reads it at most once a second)."""
        return self.kv.scale_counts() if isinstance(self.kv, QuantKVPool) else None

    def kv_k_offsets(self) -> list[torch.Tensor | None]:
        """Every attention layer's K centering offset fp32 ``[Hkv, d]`` (None: not centered)."""
        return self._quant_pool().k_offsets()

    def kv_hadamard(self) -> list[int]:
        """Per attention layer K's Hadamard size (0 not rotated, 16 per 16-element block, head_dim
        the whole head; quantized KV only)."""
        return self._quant_pool().hadamard()

    def kv_k_feedback(self) -> list[torch.Tensor | None]:
        """Every attention layer's K rounding feedback fp32 ``[Hkv, d/16, 16, 16]`` (None: nearest)."""
        return self._quant_pool().k_feedbacks()

    def _quant_pool(self) -> QuantKVPool:
        if not isinstance(self.kv, QuantKVPool):
            raise ValueError(f"kv dtype {self.kv_dtype_name!r} has no global scales (not a quantized pool, "
                             "or allocate() was not called)")
        return self.kv

    def _scales_settable(self) -> QuantKVPool:
        pool = self._quant_pool()
        if self._kv_written:
            raise RuntimeError("global scales are fixed once the KV pool holds tokens (they were encoded with "
                               "the current scales): set or calibrate them before the first forward")
        return pool

    def calibrate_kv(self, token_ids: Sequence[int], source: str = "token_ids",
                     max_position: int | None = None, sink: bool = True) -> KVCalibration | None:
        """Set the quantized pool's global scales (and K centering offsets, ``kv_center_k``, and K feedback, ``kv_k_rounding``)
        from one scratch forward of ``token_ids``. ``max_position``: the most positions any
        sequence will use (the served context; default the model's) — K is centered on the
        channels that RoPE turns by at most pi/4 over that many positions. ``sink``: with K
        centered per page, page 0 is centered on the key ``token_ids[0]`` gets at position 0
        (``KVCalibration.sink_keys``; False: on the page's mean, an ablation).

        The forward writes a temporary float KV pool and a temporary state slot only, so
        the serving pools and slots are untouched. Returns ``None`` (nothing to do) for
        float pools and int8; ``ValueError`` for an empty sequence or before ``allocate``;
        ``RuntimeError`` once a forward has written the pool (call it before serving).
        """
        if self.quant_layout is None:
            return None
        pool = self._scales_settable()
        if self.quant_layout.fmt.value not in SCALED_FORMATS:
            log.info("kv_calibration_skipped", kv_format=self.kv_dtype_name, reason="format has no global scales")
            return None
        ids = [int(t) for t in token_ids][: self.max_context]
        if not ids:
            raise ValueError("calibration needs at least one token id")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"calibration token ids must be in [0, {self.vocab_size})")
        n, ps = len(ids), self.page_size
        pages = -(-n // ps)
        lay = self.quant_layout
        bases = (rotation_sizes(lay) if self.kv_hadamard_per_layer
                 else (lay.hadamard_size,) if self.kv_k_rounding_feedback else ())
        scratch = RecordingPool(KVPool(self.kv_layout, pages, self._device, self.ops), q_bases=bases)
        state = StatePool(self.state_layout, 1, self._device) if self.state_layout is not None else None
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long),
                             [SeqSlice(0 if state else -1, list(range(pages)), 0, n, need_logits=False)])
        ctx = self._context(batch, scratch, state, [0])
        with torch.inference_mode():
            self.model(batch.input_ids.to(self._device), ctx, scratch, state)  # type: ignore[arg-type]
        keep = page_rope = None
        if self.kv_center_k:
            inv_freq, _ = inv_freq_and_scale(self.args.rope)
            if self.kv_center_page:  # per page: the channels still at their page's middle within half a page
                keep, page_rope = page_stationary(inv_freq, self.quant_layout.head_dim), inv_freq
            else:
                keep = stationary_channels(inv_freq, self.quant_layout.head_dim, max_position or self.max_context)
        fb = self.kv_k_rounding_feedback
        captured = scratch.captured()
        if not isinstance(pool.backend, ReferenceKVBackend):  # kept for the kernel check before serving
            self._kv_samples = [(k[:kv_selfcheck.CHECK_TOKENS], v[:kv_selfcheck.CHECK_TOKENS]) for k, v in captured]
        report = calibrate_layers(lay, captured, source=source, tokens=n, name=describe(lay),
                                  center_k=keep, page_rope=page_rope, q_covariances=scratch.query_covariances(),
                                  k_feedback=fb, choose_rotation=self.kv_hadamard_per_layer,
                                  nearest_rows=1 if fb and kv_quant.position0_nearest(lay) else 0,
                                  sink=sink and page_rope is not None)
        report = replace(report, kv_format=describe(lay, report.hadamard))
        pool.set_hadamard(report.hadamard)
        pool.set_scales(report.scales)
        if report.k_offsets is not None:
            pool.set_k_offsets(report.k_offsets)
        if report.page_means is not None and page_rope is not None:
            pool.set_page_centers(report.page_means, rope_table(page_rope, max_pages_for(self.max_context)),
                                  report.sink_keys)
        if report.k_feedback is not None:
            pool.set_k_feedback(report.k_feedback)
        self.kv_calibration = report
        (k_lo, k_hi), (v_lo, v_hi) = report.scale_range(0), report.scale_range(1)
        log.info("kv_calibrated", kv_format=report.kv_format, tokens=n, source=source,
                 k_scale_min=k_lo, k_scale_max=k_hi, v_scale_min=v_lo, v_scale_max=v_hi,
                 k_blocks=report.k.blocks, k_zero=report.k.zero, k_subnormal=report.k.subnormal,
                 k_saturated=report.k.saturated, v_blocks=report.v.blocks, v_zero=report.v.zero,
                 v_subnormal=report.v.subnormal, v_saturated=report.v.saturated,
                 k_centered_channels=report.centered_channels,
                 k_center="page" if report.page_means is not None else ("offset" if report.k_offsets else "off"),
                 k_page0=None if report.page_means is None else ("sink" if report.sink_keys is not None else "mean"),
                 k_rounding="feedback" if report.k_feedback else "nearest",
                 k_rotated_whole=report.layers_rotated(lay.head_dim), k_rotated_16_blocks=report.layers_rotated(16),
                 k_unrotated=report.layers_rotated(0),
                 k_rotation="layer" if self.kv_hadamard_per_layer else ("on" if lay.hadamard else "off"),
                 digest=report.digest(),
                 k_energy_removed=round(report.k_energy_removed, 4))
        return report

    def check_kv_kernels(self) -> KVKernelCheck | None:
        """Before serving: compare the quantized pool's kernels on this device with the reference
        (``kv_selfcheck``: cache bytes, decode and prefill attention, every layer's own settings)
        on the calibration's K/V (synthetic ones for int8). None for float pools and on CPU (the
        pool runs the reference itself). Falls back to the Triton append / decode where the Gluon
        one disagrees (logged as a warning); ``KVKernelCheckError`` where no kernel agrees."""
        samples, self._kv_samples = self._kv_samples, None
        if self.quant_layout is None:
            return None
        pool = self._quant_pool()
        if isinstance(pool.backend, ReferenceKVBackend):
            return None
        samples = samples or kv_selfcheck.synthetic_samples(
            len(pool.caches), pool.layout.num_kv_heads, pool.layout.head_dim, kv_selfcheck.CHECK_TOKENS)
        check = kv_selfcheck.check_pool(pool, samples, self.args.attention.num_heads, self.dtype)
        self.kv_kernel_check = check
        if check.fallback:
            log.warning("kv_append_fallback", reason=check.fallback, append_kernel=check.append_kernel)
        if check.decode_fallback:
            log.warning("kv_decode_fallback", reason=check.decode_fallback, decode_kernel=check.decode_kernel)
        log.info("kv_kernels_checked", backend=check.backend, layers=check.layers, tokens=check.tokens,
                 append_kernel=check.append_kernel, decode_kernel=check.decode_kernel,
                 decode_error=f"{check.decode_error:.2e}",
                 prefill_error=f"{check.prefill_error:.2e}", seconds=round(check.seconds, 3))
        return check

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.kv is None and self.kv_layout.num_layers:
            raise RuntimeError("allocate() must be called before forward()")
        ctx = self._context(batch, self.kv, self.state, self._slot_pos)
        self._kv_written = self.kv is not None
        ids = batch.input_ids.to(self._device, torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        with torch.inference_mode():
            hidden = self.model(ids, ctx, self.kv, self.state)
            if self.state is not None:
                for s in ctx.seqs:
                    self._slot_pos[s.state_slot] = s.start + s.num_tokens
            rows = []
            for s, q in zip(ctx.seqs, batch.seqs, strict=True):
                if q.all_logits:
                    rows.extend(range(s.offset, s.offset + s.num_tokens))
                elif q.need_logits:
                    rows.append(s.offset + s.num_tokens - 1)
            if not rows:
                return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self._device)
            index = torch.tensor(rows, dtype=torch.long, device=self._device)
            return self.model.logits(hidden.index_select(0, index))

    def reset_state(self, slot: int) -> None:
        if self.state is not None:
            self.state.reset(slot)
            self._slot_pos[slot] = 0

    def slot_position(self, slot: int) -> int:
        """How many tokens the state in ``slot`` has consumed (0 after reset)."""
        if self.state is None:
            raise ValueError("this model has no recurrent state slots")
        self.state.check_slot(slot)
        return self._slot_pos[slot]

    def snapshot_state(self, slot: int, position: int) -> StateSnapshotData | _EmptySnapshot:
        if self.state is None:
            return _EmptySnapshot(position)
        if self.slot_position(slot) != position:
            raise ValueError(
                f"state slot {slot} holds position {self._slot_pos[slot]}, not {position}"
            )
        return self.state.snapshot(slot, position)

    def restore_state(self, slot: int, snapshot: object) -> None:
        if self.state is None:
            return
        if not isinstance(snapshot, StateSnapshotData):
            raise ValueError("not a snapshot of this runner's state pool")
        self.state.restore(slot, snapshot)
        self._slot_pos[slot] = snapshot.position

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        if self.state is not None:
            self.state.copy(src_slot, dst_slot)
            self._slot_pos[dst_slot] = self._slot_pos[src_slot]

    # -- step metadata --------------------------------------------------------------
    def _context(self, batch: ForwardBatch, kv: Any, state: StatePool | None,
                 slot_pos: list[int]) -> StepContext:
        """Validate ``batch`` against ``kv``/``state`` (whose slots are at ``slot_pos``) and
        build the step metadata: gather indices for a float pool, page tables for a
        quantized one."""
        if not batch.seqs:
            raise ValueError("empty batch")
        total = sum(s.num_tokens for s in batch.seqs)
        if total != batch.num_tokens:
            raise ValueError(f"slices cover {total} tokens but input_ids has {batch.num_tokens}")
        ps = self.page_size
        quant = isinstance(kv, QuantKVPool)
        num_pages = kv.num_pages if kv is not None else 0
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        seqs: list[SeqInfo] = []
        tables: list[list[int]] = []  # per slice, quantized pool only
        used_slots: set[int] = set()
        offset = 0
        for s in batch.seqs:
            if s.num_tokens < 1 or s.start < 0:
                raise ValueError(f"bad slice: start={s.start}, num_tokens={s.num_tokens}")
            end = s.start + s.num_tokens
            if end > self.max_context:
                raise ValueError(f"position {end} exceeds the model's context {self.max_context}")
            if state is not None:
                state.check_slot(s.state_slot)
                if s.state_slot in used_slots:
                    raise ValueError(f"state slot {s.state_slot} used twice in one batch")
                if slot_pos[s.state_slot] != s.start:
                    raise ValueError(
                        f"state slot {s.state_slot} holds position {slot_pos[s.state_slot]} "
                        f"but the slice starts at {s.start} (reset or restore the slot first)"
                    )
                used_slots.add(s.state_slot)
            token_index = None
            if kv is not None:
                need = -(-end // ps)
                if len(s.block_table) < need:
                    raise ValueError(
                        f"block table has {len(s.block_table)} pages, "
                        f"{need} needed for {end} tokens"
                    )
                pages = [int(p) for p in s.block_table[:need]]
                if min(pages) < 0 or max(pages) >= num_pages:
                    raise ValueError(f"page ids must be in [0, {num_pages})")
                table = torch.tensor(pages, dtype=torch.long)
                if quant:
                    tables.append(pages)
                    pos = torch.arange(s.start, end)
                    slots.append((table[pos // ps] * ps + pos % ps).to(self._device))
                else:
                    pos = torch.arange(end)
                    token_index = (table[pos // ps] * ps + pos % ps).to(self._device)
                    slots.append(token_index[s.start :])
            positions.append(torch.arange(s.start, end))
            seqs.append(SeqInfo(offset, s.num_tokens, s.start, s.state_slot, token_index))
            offset += s.num_tokens
        multi_i = [i for i, s in enumerate(seqs) if s.num_tokens > 1]
        single_i = [i for i, s in enumerate(seqs) if s.num_tokens == 1]
        prefill = dec_pages = None
        if quant:
            prefill = self._page_tables([seqs[i] for i in multi_i], [tables[i] for i in multi_i])
            dec_pages = self._page_tables([seqs[i] for i in single_i], [tables[i] for i in single_i])
        single = [seqs[i] for i in single_i]
        return StepContext(
            positions=torch.cat(positions).to(self._device),
            kv_slots=torch.cat(slots) if slots else None,
            seqs=tuple(seqs),
            multi=tuple(seqs[i] for i in multi_i),
            decode=self._decode_group(single, dec_pages) if single else None,
            prefill=prefill,
        )

    def _page_tables(self, seqs: list[SeqInfo], tables: list[list[int]]) -> PageTables | None:
        if not seqs:
            return None
        dev = self._device
        width = max(len(t) for t in tables)
        padded = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        rows = torch.cat([torch.arange(s.offset, s.offset + s.num_tokens) for s in seqs])
        lens = torch.tensor([s.start + s.num_tokens for s in seqs], dtype=torch.int32)
        return PageTables(rows=rows.to(dev), block_tables=padded.to(dev), context_lens=lens.to(dev),
                          q_lens=tuple(s.num_tokens for s in seqs))

    def _decode_group(self, single: list[SeqInfo], pages: PageTables | None) -> DecodeGroup:
        dev = self._device
        index = lengths = None
        if single[0].token_index is not None:
            lens = [s.start + 1 for s in single]
            padded = torch.zeros(len(single), max(lens), dtype=torch.long, device=dev)
            for i, s in enumerate(single):
                assert s.token_index is not None
                padded[i, : lens[i]] = s.token_index
            index, lengths = padded, torch.tensor(lens, dtype=torch.long, device=dev)
        return DecodeGroup(
            rows=torch.tensor([s.offset for s in single], dtype=torch.long, device=dev),
            state_slots=torch.tensor([s.state_slot for s in single], dtype=torch.long, device=dev),
            token_index=index,
            lengths=lengths,
            pages=pages,
        )


def build_runner(
    source: ModelSource,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_dtype: str = "auto",
    page_size: int = DEFAULT_PAGE_SIZE,
    backend: str = "reference",
    kv_hadamard: str = "auto",
    kv_center_k: str = "auto",
    kv_k_rounding: str = "auto",
) -> TorchModelRunner:
    """Build the model for ``source`` on ``device`` and stream its weights in.

    The runner (and so every KV setting) is checked before the weights load."""
    dev = torch.device(device)
    ops = get_backend(backend)
    model, family, text_cfg = build_model(source.config, dev, dtype, ops)
    runner = TorchModelRunner(model, dev, dtype, kv_dtype, page_size, kv_hadamard, ops, kv_center_k, kv_k_rounding)
    load_weights(model, family, text_cfg, source.iter_tensors())
    log.info(
        "runner_built",
        model_id=source.model_id,
        architecture=model.args.architecture,
        device=str(dev),
        dtype=str(dtype),
        kv_dtype=runner.kv_dtype_name,
    )
    return runner
