"""``KVStore``: every KV page pool and the state pool of one runner, behind one object.

The runner asks for a store (``KVStore(spec, ...)``), has it ``allocate`` the pools, and
hands ``kv`` / ``state`` to the model. Everything else about KV lives here too:

- the quantized pool's start-up calibration (``calibrate``: the runner supplies the scratch
  forward; global scales, K centering, K rounding feedback and each layer's K rotation are
  installed here and are then fixed: ``written`` turns True at the first serving forward);
- the start-up check of the device's KV kernels against the reference (``check_kernels``);
- the byte movers the prefix cache needs (``kv.pool``): copy a page or a state slot on the
  device (copy-on-write of a shared page, a state image), export / import an entry's pages
  and state slot to / from a byte ``Region`` (spill to and restore from the daemon's arena:
  the pages row-major, then the slot). They are the same calls for the float and the
  quantized pools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from deepwell.logs import get_logger
from deepwell.engine_service.kv import quant_pool, selfcheck
from deepwell.engine_service.kv.calibration import KVCalibration, RecordingPool, calibrate_layers, rotation_sizes
from deepwell.engine_service.kv.float_pool import KVPool
from deepwell.engine_service.kv.pool import Region, copy_rows, export_rows, import_rows, row_nbytes
from deepwell.engine_service.kv.quant_pool import QuantKVPool, describe
from deepwell.engine_service.kv.selfcheck import KVKernelCheck
from deepwell.engine_service.kv.settings import KVSpec
from deepwell.engine_service.kv.state import StateLayout, StatePool
from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.kernels.backend import ReferenceBackend as ReferenceKVBackend
from deepwell.kernels.calibration import ScaleCounts, stationary_channels
from deepwell.kernels.page_center import max_pages_for, page_stationary, rope_table

log = get_logger(__name__)

# runs the model over token ids with a scratch KV pool and a scratch state pool (or None)
ScratchForward = Callable[[list[int], RecordingPool, "StatePool | None"], None]


class KVStore:
    def __init__(self, spec: KVSpec, state_layout: StateLayout | None, device: torch.device, ops: ReferenceBackend,
                 *, inv_freq: torch.Tensor, max_context: int, num_q_heads: int, model_dtype: torch.dtype) -> None:
        self.spec = spec
        self.state_layout = state_layout
        self.device = device
        self.ops = ops
        self.inv_freq = inv_freq  # the model's RoPE frequencies (K centering per page)
        self.max_context = max_context
        self.num_q_heads = num_q_heads
        self.model_dtype = model_dtype
        self.kv: KVPool | QuantKVPool | None = None
        self.state: StatePool | None = None
        self.calibration: KVCalibration | None = None
        self.kernel_check: KVKernelCheck | None = None
        self.written = False  # a serving forward has written the KV pool: its settings are fixed
        self._samples: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # calibration K/V, for the check

    # -- pools ---------------------------------------------------------------------------
    def allocate(self, num_pages: int, num_state_slots: int) -> None:
        if self.kv is not None or self.state is not None:
            raise RuntimeError("pools are already allocated")
        spec = self.spec
        if spec.quant_layout is not None:
            self.kv = QuantKVPool(spec.quant_layout, spec.float_layout.num_layers, num_pages, self.device)
        elif spec.float_layout.num_layers:
            self.kv = KVPool(spec.float_layout, num_pages, self.device, self.ops)
        if self.state_layout is not None:
            self.state = StatePool(self.state_layout, num_state_slots, self.device)
        log.info("pools_allocated", num_pages=num_pages,
                 num_state_slots=num_state_slots if self.state_layout else 0,
                 kv_format=describe(spec.quant_layout) if spec.quant_layout else spec.name,
                 k_rotation="per layer, chosen at calibration" if spec.per_layer_rotation else None,
                 kv_backend=self.kv.backend.name if isinstance(self.kv, QuantKVPool) else self.ops.name,
                 bytes_per_page=spec.bytes_per_page, kv_bytes=num_pages * spec.bytes_per_page)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page over every attention layer (0 without attention layers)."""
        return row_nbytes(self.kv.page_tensors()) if self.kv is not None else 0

    @property
    def slot_nbytes(self) -> int:
        return self.state.slot_nbytes if self.state is not None else 0

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Pages ``dst[i]`` become byte copies of pages ``src[i]`` in every attention layer."""
        if self.kv is not None:
            self._check_pages([*src, *dst])
            copy_rows(self.kv.page_tensors(), src, dst)

    def export_entry(self, pages: Sequence[int], slot: int, out: Region) -> None:
        """Write ``pages`` (row-major over every attention layer: ``kv.pool``) and then, when
        ``slot >= 0``, that state slot's row into ``out``: the bytes of a host cache entry."""
        n = 0
        if self.kv is not None and pages:
            self._check_pages(pages)
            export_rows(self.kv.page_tensors(), pages, out)
            n = len(pages) * self.page_nbytes
        if slot >= 0 and self.state is not None:
            self.state.check_slot(slot)
            export_rows(self.state.slot_tensors(), [slot], out, start=n)

    def import_entry(self, pages: Sequence[int], slot: int, src: Region, entry_pages: int) -> None:
        """Fill ``pages`` from the first pages of an entry of ``entry_pages`` pages (a prefix of
        it: ``kv.pool``'s row-major order) and, when ``slot >= 0``, the slot from its state row."""
        if self.kv is not None and pages:
            self._check_pages(pages)
            import_rows(self.kv.page_tensors(), pages, src)
            self.written = True
        if slot >= 0 and self.state is not None:
            self.state.check_slot(slot)
            import_rows(self.state.slot_tensors(), [slot], src, start=entry_pages * self.page_nbytes)

    def _check_pages(self, pages: Sequence[int]) -> None:
        assert self.kv is not None
        bad = [p for p in pages if not 0 <= p < self.kv.num_pages]
        if bad:
            raise ValueError(f"page ids {bad[:4]} outside [0, {self.kv.num_pages})")

    # -- quantized KV: settings ---------------------------------------------------------
    def quant_pool(self) -> QuantKVPool:
        if not isinstance(self.kv, QuantKVPool):
            raise ValueError(f"kv dtype {self.spec.name!r} has no global scales (not a quantized pool, "
                             "or allocate() was not called)")
        return self.kv

    def _settable(self) -> QuantKVPool:
        pool = self.quant_pool()
        if self.written:
            raise RuntimeError("global scales are fixed once the KV pool holds tokens (they were encoded with "
                               "the current scales): set or calibrate them before the first forward")
        return pool

    def set_scales(self, scales: Sequence[torch.Tensor], k_offsets: Sequence[torch.Tensor] | None = None,
                   k_feedback: Sequence[torch.Tensor] | None = None,
                   page_means: Sequence[torch.Tensor] | None = None,
                   sink_keys: Sequence[torch.Tensor] | None = None,
                   hadamard: Sequence[bool | int] | None = None) -> None:
        """Install per-layer global scales (and K centering offsets fp32 ``[Hkv, d]``, K rounding
        feedback fp32 ``[Hkv, d/16, 16, 16]``, or K centering per page: pre-RoPE means fp32
        ``[Hkv, d]``, ``kernels.page_center``, with the model's RoPE, and page 0's sink keys fp32
        ``[Hkv, d]``, and each layer's K rotation: True / False or a Hadamard size 0 / 16 /
        head_dim) by hand (quantized KV only, before the first forward)."""
        pool = self._settable()
        if hadamard is not None:
            pool.set_hadamard(hadamard)
        pool.set_scales(scales)
        if k_offsets is not None:
            pool.set_k_offsets(k_offsets)
        if k_feedback is not None:
            pool.set_k_feedback(k_feedback)
        if page_means is not None:
            pool.set_page_centers(page_means, rope_table(self.inv_freq, max_pages_for(self.max_context)), sink_keys)
        elif sink_keys is not None:
            raise ValueError("sink keys center page 0 of a per-page centering: pass page_means too")

    def scale_counts(self) -> tuple[ScaleCounts, ScaleCounts] | None:
        """(K, V) block-scale counts of everything the serving pool has stored (fp8 / nvfp4),
        None otherwise; a small device-to-host copy (the engine reads it at most once a second)."""
        return self.kv.scale_counts() if isinstance(self.kv, QuantKVPool) else None

    # -- quantized KV: calibration ------------------------------------------------------
    def calibrate(self, forward: ScratchForward, token_ids: Sequence[int], vocab_size: int, source: str = "token_ids",
                  max_position: int | None = None, sink: bool = True) -> KVCalibration | None:
        """Set the quantized pool's global scales (and K centering, K feedback, K rotations) from
        one scratch ``forward`` of ``token_ids`` through a float pool that records K/V and the
        query products, and a scratch state slot: the serving pools and slots are untouched.
        ``max_position``: the most positions any sequence will use (the served context) — K is
        centered on the channels RoPE turns by at most pi/4 over that many positions. ``sink``:
        with K centered per page, page 0 is centered on the key ``token_ids[0]`` gets at position
        0 (False: on the page's mean, an ablation). None for float pools and int8; ``ValueError``
        for an empty sequence or before ``allocate``; ``RuntimeError`` once the pool holds tokens."""
        spec, lay = self.spec, self.spec.quant_layout
        if lay is None:
            return None
        pool = self._settable()
        if lay.fmt.value not in quant_pool.SCALED_FORMATS:
            log.info("kv_calibration_skipped", kv_format=spec.name, reason="format has no global scales")
            return None
        ids = [int(t) for t in token_ids][: self.max_context]
        if not ids:
            raise ValueError("calibration needs at least one token id")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"calibration token ids must be in [0, {vocab_size})")
        n, ps = len(ids), spec.float_layout.page_size
        bases = (rotation_sizes(lay) if spec.per_layer_rotation
                 else (lay.hadamard_size,) if spec.k_feedback else ())
        scratch = RecordingPool(KVPool(spec.float_layout, -(-n // ps), self.device, self.ops), q_bases=bases)
        state = StatePool(self.state_layout, 1, self.device) if self.state_layout is not None else None
        forward(ids, scratch, state)
        keep = page_rope = None
        if spec.center_k:
            if spec.center_page:  # per page: the channels still at their page's middle within half a page
                keep, page_rope = page_stationary(self.inv_freq, lay.head_dim), self.inv_freq
            else:
                keep = stationary_channels(self.inv_freq, lay.head_dim, max_position or self.max_context)
        fb = spec.k_feedback
        captured = scratch.captured()
        if not isinstance(pool.backend, ReferenceKVBackend):  # kept for the kernel check before serving
            self._samples = [(k[:selfcheck.CHECK_TOKENS], v[:selfcheck.CHECK_TOKENS]) for k, v in captured]
        report = calibrate_layers(lay, captured, source=source, tokens=n, name=describe(lay),
                                  center_k=keep, page_rope=page_rope, q_covariances=scratch.query_covariances(),
                                  k_feedback=fb, choose_rotation=spec.per_layer_rotation,
                                  nearest_rows=1 if fb and quant_pool.position0_nearest(lay) else 0,
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
        self.calibration = report
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
                 k_rotation="layer" if spec.per_layer_rotation else ("on" if lay.hadamard else "off"),
                 digest=report.digest(),
                 k_energy_removed=round(report.k_energy_removed, 4))
        return report

    def check_kernels(self) -> KVKernelCheck | None:
        """Before serving: compare the quantized pool's kernels on this device with the reference
        (``kv.selfcheck``: cache bytes, decode and prefill attention, every layer's own settings)
        on the calibration's K/V (synthetic ones for int8). None for float pools and on CPU (the
        pool runs the reference itself). Falls back to the Triton append / decode where the Gluon
        one disagrees (logged as a warning); ``KVKernelCheckError`` where no kernel agrees."""
        samples, self._samples = self._samples, None
        if self.spec.quant_layout is None:
            return None
        pool = self.quant_pool()
        if isinstance(pool.backend, ReferenceKVBackend):
            return None
        samples = samples or selfcheck.synthetic_samples(
            len(pool.caches), pool.layout.num_kv_heads, pool.layout.head_dim, selfcheck.CHECK_TOKENS)
        check = selfcheck.check_pool(pool, samples, self.num_q_heads, self.model_dtype)
        self.kernel_check = check
        if check.fallback:
            log.warning("kv_append_fallback", reason=check.fallback, append_kernel=check.append_kernel)
        if check.decode_fallback:
            log.warning("kv_decode_fallback", reason=check.decode_fallback, decode_kernel=check.decode_kernel)
        if check.prefill_fallback:
            log.warning("kv_prefill_fallback", reason=check.prefill_fallback)
        log.info("kv_kernels_checked", backend=check.backend, layers=check.layers, tokens=check.tokens,
                 append_kernel=check.append_kernel, decode_kernel=check.decode_kernel,
                 decode_error=f"{check.decode_error:.2e}",
                 prefill_error=f"{check.prefill_error:.2e}", seconds=round(check.seconds, 3))
        return check
