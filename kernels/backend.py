"""The KV-cache/attention backend the engine calls: ``reference`` on CPU, ``triton`` on CUDA.

Usage (one attention layer; the engine keeps one ``KVCacheLayer`` per attention layer)::

    layout = KVLayout.make("nvfp4", num_kv_heads=4, head_dim=256)   # hadamard on by default
    layer = KVCacheLayer.allocate(layout, num_pages, device)        # bytes: layout.page_bytes/page
    layer.k_offset = calibration.k_offset(k_cal)                     # optional K centering
    layer.scales.copy_(calibration.calibrate(layout, k_cal - layer.k_offset, v_cal))  # else 1.0
    layer.k_feedback = feedback.from_block_covariance(cov)         # optional (fp8, nvfp4): K rounded
                                                                    # for the queries (kv_formats.feedback)
    be = get_backend(device)                                        # "triton" on CUDA

    # or K centered per page instead of by k_offset (kernels.page_center; positions then required):
    layer.page_center = PageCenter(mu_pre_rope, rope_table(inv_freq, max_pages))
    # every step: K after RoPE, both [N, Hkv, d]; tokens of many sequences in any order
    be.append(layer, k, v, slots, positions)    # slots[i] = page * 64 + offset, -1 = skip
    # decode / speculative verify: T = 1..16 new tokens per sequence, q [B * T, Hq, d]
    o = be.decode_attention(q, layer, block_tables, context_lens, tokens_per_seq=T, sm_scale=s)
    # prefill chunks (varlen): q [sum(q_lens), Hq, d], sequences back to back
    o = be.prefill_attention(q, layer, block_tables, context_lens, q_lens, sm_scale=s)

Contract:
- Append first, then attend: ``context_lens[b]`` counts every cached token of sequence
  ``b`` *including* the new ones; new token ``t`` of ``b`` is at position
  ``context_lens[b] - q_len[b] + t`` and sees positions up to its own (causal).
- ``block_tables``: int32 ``[B, max_pages]``, page ``block_tables[b, i]`` holds positions
  ``[64 i, 64 i + 64)``. ``slots_from_positions`` builds append slots from it.
- Q and K are given after RoPE and *unrotated*: the backend subtracts the layer's
  ``k_offset`` from K (if set: a per-head key shift, which the softmax cancels, so Q needs
  nothing) and applies the Hadamard transform (``layout.hadamard``) to K before
  quantization and to Q before QK; with ``k_feedback`` (fp8 / nvfp4) K's codes are chosen
  by query-weighted rounding (same format, other codes). Outputs have q's dtype
  (or ``out``'s, e.g. fp32). V is never rotated, so outputs need no inverse transform.
- ``page_center`` (instead of ``k_offset``): the append subtracts each token's page offset
  (``positions`` [N] required), attention adds each page's ``q . c_P`` back (the Triton
  backend: decode / verify from per-page terms one launch precomputes, ``page_bias``; a long
  prefill's workspace holds K with the offsets added back; a short one sums them in the tile).
- Both backends write identical cache bytes (the Triton append is bit-exact); attention
  agrees with an fp64 evaluation over the dequantized cache within 1e-3 relative L2.
- ``prefill_attention`` (Triton) splits the keys of short chunks over long prefixes
  (``prefill_splits``) and reads long quantized chunks' context from an fp16 workspace
  (``kernels.kv_dequant``; ``PREFILL_DEQUANT_MIN_ROWS``, ``PREFILL_WORKSPACE_BYTES``), a
  context longer than the workspace allows in segments of its pages (``_prefill_segments``:
  this path reads the context length back to the host once per call).
- ``decode_attention`` launches a grid that depends only on ``B``, ``T`` and
  ``num_splits`` (default from ``B`` and the SM count, never from context lengths), so a
  step is capturable in a CUDA graph; pass ``validate=False`` when capturing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deepwell.kernels.kv_append import reference as append_ref
from deepwell.kernels.kv_append.reference import slots_from_positions
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout, check_global_scales
from deepwell.kernels.paged_attention import reference as attn_ref
from deepwell.kernels.page_center import PageCenter
from deepwell.kernels.paged_attention.reference import rotate_q

__all__ = ["KVCacheLayer", "ReferenceBackend", "TritonBackend", "get_backend", "slots_from_positions"]


@dataclass
class KVCacheLayer:
    """One attention layer's cache: ``data`` uint8 [pages, 2, Hkv, head_page_bytes],
    power-of-two fp32 global ``scales`` [2, Hkv] (K row, V row) and the optional fp32
    ``k_offset`` [Hkv, d] subtracted from K before encoding (``kv_append.reference``).
    Scales and offset are part of what the bytes mean: fixed once tokens are written.
    ``scale_counts`` (optional int64 [2, Hkv, 3]: K, V x head x zero / subnormal / saturated)
    accumulates the block-scale health of every append (fp8 / nvfp4). ``k_feedback``
    (optional fp32 [Hkv, d/16, 16, 16], fp8 / nvfp4) rounds K with error feedback
    (``kv_formats.feedback``); like the offset, part of what the bytes mean."""

    layout: KVLayout
    data: torch.Tensor
    scales: torch.Tensor
    k_offset: torch.Tensor | None = None
    scale_counts: torch.Tensor | None = None
    k_feedback: torch.Tensor | None = None
    page_center: PageCenter | None = None

    @classmethod
    def allocate(cls, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu") -> KVCacheLayer:
        return cls(layout, layout.allocate(num_pages, device), layout.default_scales(device))

    def check(self) -> None:
        self.layout.check_cache(self.data)
        check_global_scales(self.scales, self.layout)
        if self.k_offset is not None:
            append_ref.check_k_offset(self.k_offset, self.layout)
        if self.k_feedback is not None:
            append_ref.check_k_feedback(self.k_feedback, self.layout)
        if self.page_center is not None:
            pc = self.page_center
            if self.k_offset is not None:
                raise ValueError("a layer centers K either by one offset (k_offset) or per page (page_center), not both")
            if tuple(pc.mu.shape) != (self.layout.num_kv_heads, self.layout.head_dim):
                raise ValueError(f"page_center.mu must be [{self.layout.num_kv_heads}, {self.layout.head_dim}], got "
                                 f"{list(pc.mu.shape)}")
            if pc.mu.device != self.data.device:
                raise ValueError(f"page_center is on {pc.mu.device} but the cache on {self.data.device}")

    def append_offset(self, n: int, positions: Tensor | None, validate: bool = True) -> Tensor | None:
        """What the append subtracts from K: ``k_offset``, or per token ``page_center.offsets`` of
        ``positions`` (required then: int [n] token positions; ``validate`` checks their range,
        which reads it back to the host)."""
        if self.page_center is None:
            return self.k_offset
        if positions is None or tuple(positions.shape) != (n,):
            raise ValueError(f"this layer centers K per page: the append needs positions [{n}], got "
                             f"{None if positions is None else list(positions.shape)}")
        if validate:
            self.page_center.check_positions(positions)
        return self.page_center.offsets(positions)


def _check_q(q: torch.Tensor, layer: KVCacheLayer) -> None:
    lay = layer.layout
    if q.dim() != 3 or q.shape[2] != lay.head_dim or q.shape[1] % lay.num_kv_heads:
        raise ValueError(f"q must be [tokens, Hq, {lay.head_dim}] with Hq a multiple of {lay.num_kv_heads}, got {list(q.shape)}")


def _seq_rows(q_lens: Sequence[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """(first query row, query count) per sequence on ``device`` without a stream sync, cached
    per shape and stream like ``triton_kernel.work_items`` (every layer asks the same): read-only."""
    from deepwell.kernels.paged_attention import triton_kernel

    return _seq_rows_cached(tuple(int(n) for n in q_lens), torch.device(device), triton_kernel.stream_key(device))


@functools.lru_cache(maxsize=64)
def _seq_rows_cached(q_lens: tuple[int, ...], device: torch.device, stream: int) -> tuple[Tensor, Tensor]:
    from deepwell.kernels.paged_attention import triton_kernel

    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    starts_t, lens_t = triton_kernel.host_int32(device, starts, q_lens)
    return starts_t, lens_t


class ReferenceBackend:
    """Plain torch (fp32 attention); the meaning of every op, and the CPU path."""

    name = "reference"

    def append(self, layer: KVCacheLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor | None = None, *, validate: bool = True) -> None:
        # the reference checks everything whatever ``validate`` says (the fast backends skip the
        # checks that read values back to the host when told)
        append_ref.append(layer.data, layer.layout, k, v, slots, layer.scales,
                          layer.append_offset(k.shape[0], positions), layer.scale_counts, layer.k_feedback)

    def _attend(self, q: Tensor, layer: KVCacheLayer, block_tables: Tensor, context_lens: Tensor,
                q_lens: list[int], sm_scale: float, out: Tensor | None) -> Tensor:
        _check_q(q, layer)
        if sum(q_lens) != q.shape[0]:
            raise ValueError(f"q has {q.shape[0]} tokens but q_lens sum to {sum(q_lens)}")
        qr = rotate_q(q, layer.layout)
        starts, lens = _seq_rows(q_lens, q.device)
        res = attn_ref.paged_attention(
            qr, layer.data, layer.layout, layer.scales, block_tables, context_lens, starts, lens, sm_scale,
            page_center=layer.page_center,
        )
        if out is None:
            return res.to(q.dtype)
        out.copy_(res)
        return out

    def decode_attention(self, q: Tensor, layer: KVCacheLayer, block_tables: Tensor, context_lens: Tensor, *,
                         tokens_per_seq: int = 1, sm_scale: float, num_splits: int | None = None,
                         out: Tensor | None = None, validate: bool = True) -> Tensor:
        b = block_tables.shape[0]
        return self._attend(q, layer, block_tables, context_lens, [tokens_per_seq] * b, sm_scale, out)

    def prefill_attention(self, q: Tensor, layer: KVCacheLayer, block_tables: Tensor, context_lens: Tensor,
                          q_lens: Sequence[int], *, sm_scale: float, out: Tensor | None = None) -> Tensor:
        return self._attend(q, layer, block_tables, context_lens, list(q_lens), sm_scale, out)


# decode / verify with up to this many tokens per sequence runs the Gluon kernel on Hopper (nvfp4,
# fp8, int8 where tokens x query heads per KV head <= 32, ``gluon_decode.supported``)
GLUON_MAX_TOKENS = 16
# ``TritonBackend.append_impl``: the Gluon append where it applies, or always the Triton one
APPEND_IMPLS = ("auto", "triton")
# a quantized prefill whose longest chunk has at least this many query rows (tokens x query
# heads of a KV head) unpacks the context once into an fp16 workspace (``kv_dequant``) and
# attends over that: every row block otherwise unpacks every page again (H200, 27B layout, 64k
# prefix, both split: nvfp4 a 4k chunk 297 -> 356 TFLOP/s, 512 tokens = 3072 rows 222 -> 253,
# 128 tokens = 768 rows 229 -> 220, so its line lies between; fp8 4k 318 -> 418, 512 tokens
# 258 -> 289, 128 tokens 299 -> 320; int8 4k 238 -> 415, 512 tokens 188 -> 290, 128 tokens
# 222 -> 322, 32 tokens = 192 rows 196 -> 134; docs/kernels.md)
PREFILL_DEQUANT_MIN_ROWS = {KVFormat.NVFP4: 1024, KVFormat.FP8: 768, KVFormat.INT8: 768}
# the most bytes such a workspace may take (per call, freed after it: the caching allocator
# keeps it), and at most half of the device memory free at the first long prefill
# (``_workspace_budget``);
# a call whose batch needs more runs one sequence at a time, and a sequence whose context
# needs more is attended in segments of its pages (``_prefill_segments``). 6 GiB hold 1.5M
# tokens of context at 4 KV heads x d = 256 (4 KB per token: fp16 K and V).
PREFILL_WORKSPACE_BYTES = 6 << 30
# the fewest pages a segment may hold (else the packed pages are read): every segment reads
# the chunk's queries again and folds its partial result into the others
PREFILL_SEGMENT_MIN_PAGES = 64
# the most bytes of fp32 split-K partials a prefill launch may take (``prefill_splits``)
PREFILL_SPLIT_SCRATCH_BYTES = 256 << 20
# the fewest pages a prefill split may hold (``prefill_splits``, and within segments)
PREFILL_SPLIT_MIN_PAGES = 8
# a bf16 cache's chunk with at least this many query rows per KV head goes through cuDNN over
# dense K / V (``paged_attention.dense_prefill``), when the device has it
DENSE_BF16_MIN_ROWS = 1024


class TritonBackend:
    """Triton kernels (CUDA; also the interpreter under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self, max_splits: int = 64, gluon_max_tokens: int = GLUON_MAX_TOKENS,
                 prefill_dequant_min_rows: int | None = None,
                 prefill_workspace_bytes: int = PREFILL_WORKSPACE_BYTES, append_impl: str = "auto",
                 prefill_dense: bool = True) -> None:
        if append_impl not in APPEND_IMPLS:
            raise ValueError(f"append_impl must be one of {APPEND_IMPLS}, got {append_impl!r}")
        if (prefill_dequant_min_rows is not None and prefill_dequant_min_rows < 1) or prefill_workspace_bytes < 0:
            raise ValueError(f"prefill_dequant_min_rows must be >= 1 and prefill_workspace_bytes >= 0, got "
                             f"{prefill_dequant_min_rows}, {prefill_workspace_bytes}")
        self.max_splits = max_splits
        self.gluon_max_tokens = gluon_max_tokens
        self.prefill_dequant_min_rows = prefill_dequant_min_rows
        self.prefill_workspace_bytes = prefill_workspace_bytes
        # which append kernel serves (``kv_append.triton_kernel.append``'s ``impl``): "auto" the
        # Gluon one where it applies; the engine's start-up check sets "triton" when the Gluon
        # kernel's bytes differ from the reference codec's (``engine_service.kv.selfcheck``)
        self.append_impl = append_impl
        # long chunks through cuDNN's attention over dense K / V where the device has it
        # (``paged_attention.dense_prefill``; ``DEEPWELL_PREFILL_CUDNN=0`` turns it off too)
        self.prefill_dense = prefill_dense
        self.dense_error = ""  # why a cuDNN call failed and turned ``prefill_dense`` off ("" if none did)
        self._budgets: dict[int, int] = {}  # CUDA device index -> workspace bytes (``_workspace_budget``)

    def append(self, layer: KVCacheLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor | None = None, *, validate: bool = True) -> None:
        from deepwell.kernels.kv_append import triton_kernel

        triton_kernel.append(layer.data, layer.layout, k, v, slots, layer.scales,
                             layer.append_offset(k.shape[0], positions, validate), layer.scale_counts,
                             layer.k_feedback, validate=validate, impl=self.append_impl)

    def append_kernel(self, layout: KVLayout, device: torch.device) -> str:
        """The kernel ``append`` runs for ``layout`` on ``device``: "gluon" or "triton"."""
        from deepwell.kernels.kv_append import triton_kernel

        return triton_kernel.append_kernel(layout, device, impl=self.append_impl)

    def default_splits(self, batch: int, num_kv_heads: int, device: torch.device) -> int:
        """Enough programs for ~2 waves of the GPU, from the batch shape only, and at least two
        splits (batch 64 x 4 KV heads on the H200: 2 splits 2-4% faster than 1, docs/kernels.md)."""
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        want = max(2, (2 * sms) // max(1, batch * num_kv_heads))
        return min(self.max_splits, 1 << (want.bit_length() - 1))

    def gluon_splits(self, batch: int, num_kv_heads: int, device: torch.device, per_sm: int = 3) -> int:
        """Splits for the Gluon kernel, from the batch shape only: as many as fill two whole
        waves of ``per_sm`` programs per SM (``gluon_decode.programs_per_sm``; one wave if that
        needs more than ``2 * max_splits``), rounded down so no further wave starts with a few
        programs (H200, 27B layout, docs/kernels.md: 128k x 8 -> 24 splits 459 us, 25 splits 511 us)."""
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        slots, work = per_sm * sms, max(1, batch * num_kv_heads)
        splits = 2 * slots // work
        if splits > 2 * self.max_splits:
            splits = min(2 * self.max_splits, slots // work)
        return max(1, splits)

    def uses_gluon(self, layout: KVLayout, group: int, tokens_per_seq: int, device: torch.device) -> bool:
        """Whether decode / verify of this shape runs the Gluon nvfp4 kernel (Hopper)."""
        if tokens_per_seq > self.gluon_max_tokens:
            return False
        try:
            from deepwell.kernels.paged_attention import gluon_decode
        except ImportError:  # a Triton without Gluon: the Triton kernel serves everything
            return False
        return gluon_decode.supported(layout, group, tokens_per_seq) and gluon_decode.available(device)

    def decode_attention(self, q: Tensor, layer: KVCacheLayer, block_tables: Tensor, context_lens: Tensor, *,
                         tokens_per_seq: int = 1, sm_scale: float, num_splits: int | None = None,
                         out: Tensor | None = None, validate: bool = True) -> Tensor:
        from deepwell.kernels.paged_attention import triton_kernel

        if validate:
            _check_q(q, layer)
        b, t = block_tables.shape[0], tokens_per_seq
        if validate and (q.shape[0] != b * t or not 1 <= t <= 16):
            raise ValueError(f"decode needs q [B * T, Hq, d] with 1 <= T <= 16; got {list(q.shape)} for B={b}, T={t}")
        h = layer.layout.num_kv_heads
        group = q.shape[1] // h
        gluon = self.uses_gluon(layer.layout, group, t, q.device)
        bias = None
        if layer.page_center is not None:  # each page's q . c_P, one launch: the Gluon kernel's
            # columns in its log2 units, the Triton kernel's rows (a power of two) in true units
            from deepwell.kernels.paged_attention import page_bias

            cols, scale = 1 << (t * group - 1).bit_length(), 1.0
            if gluon:
                from deepwell.kernels.paged_attention import gluon_decode

                cols, scale = gluon_decode.num_columns(t, group), sm_scale * gluon_decode.LOG2E
            bias = page_bias.page_bias(layer.page_center, q, t, cols, block_tables.shape[1], scale)
        if gluon:
            from deepwell.kernels.paged_attention import gluon_decode

            per_sm = gluon_decode.programs_per_sm(t, group, layer.layout.head_dim, layer.layout.fmt)
            return gluon_decode.paged_decode(
                _rotate_q(q, layer.layout), layer.data, layer.layout, layer.scales, block_tables, context_lens,
                sm_scale, tokens_per_seq=t, num_splits=num_splits or self.gluon_splits(b, h, q.device, per_sm), out=out,
                page_bias=bias,
            )
        splits = num_splits or self.default_splits(b, h, q.device)
        # two launches (Q rotation, attention) + the split merge (+ the page terms): global
        # scales and row blocks are derived in-kernel, so nothing else runs and a step is
        # graph-capturable
        return triton_kernel.paged_attention(
            _rotate_q(q, layer.layout), layer.data, layer.layout, layer.scales, block_tables, context_lens,
            None, None, sm_scale, num_splits=splits, out=out, uniform_t=t, page_bias=bias,
        )

    def prefill_attention(self, q: Tensor, layer: KVCacheLayer, block_tables: Tensor, context_lens: Tensor,
                          q_lens: Sequence[int], *, sm_scale: float, out: Tensor | None = None) -> Tensor:
        _check_q(q, layer)
        lens = [int(n) for n in q_lens]
        if sum(lens) != q.shape[0]:
            raise ValueError(f"q has {q.shape[0]} tokens but q_lens sum to {sum(lens)}")
        if out is None:
            out = torch.empty_like(q)
        qr = _rotate_q(q, layer.layout)
        group = q.shape[1] // layer.layout.num_kv_heads
        if self._dense(layer, max(lens, default=0) * group, q.device):
            return self._prefill_dense(q, qr, layer, block_tables, context_lens, lens, sm_scale, out)
        return self._prefill_triton(q, qr, layer, block_tables, context_lens, lens, sm_scale, out)

    def _prefill_triton(self, q: Tensor, qr: Tensor, layer: KVCacheLayer, block_tables: Tensor,
                        context_lens: Tensor, lens: list[int], sm_scale: float, out: Tensor) -> Tensor:
        """The Triton kernel over the packed pages, or for long chunks of a quantized cache over an
        fp16 workspace of them (one, one per sequence, or segments: module constants)."""
        group = q.shape[1] // layer.layout.num_kv_heads
        if not self._dequantizes(layer.layout, max(lens, default=0) * group):
            return self._prefill(qr, layer, block_tables, context_lens, lens, sm_scale, out, False,
                                 _page_terms(q, layer))
        from deepwell.kernels.kv_dequant.reference import workspace_layout

        page = workspace_layout(layer.layout).page_bytes
        b, w = block_tables.shape
        budget = self._workspace_budget(q.device)
        if b * w * page <= budget:  # (a workspace needs no page terms: it holds K with them back)
            return self._prefill(qr, layer, block_tables, context_lens, lens, sm_scale, out, True)
        # one sequence at a time (within the budget: the table's width bounds its pages), a
        # longer one in segments of its pages, each through the workspace
        for i, n, rows in _sequences(lens):
            one = (block_tables[i : i + 1], context_lens[i : i + 1])
            if n * group < self._min_rows(layer.layout.fmt):
                self._prefill(qr[rows], layer, *one, [n], sm_scale, out[rows], False, _page_terms(q[rows], layer))
            elif w * page <= budget:
                self._prefill(qr[rows], layer, *one, [n], sm_scale, out[rows], True)
            elif not self._prefill_segments(qr[rows], layer, *one, sm_scale, out[rows], budget):
                self._prefill(qr[rows], layer, *one, [n], sm_scale, out[rows], False, _page_terms(q[rows], layer))
        return out

    def _dense(self, layer: KVCacheLayer, rows: int, device: torch.device) -> bool:
        """Whether a prefill whose longest chunk has ``rows`` query rows per KV head goes through
        cuDNN (``paged_attention.dense_prefill``): enabled, a long chunk (the format's workspace
        threshold; bf16 1024 rows), d <= 256, a quantized cache whose values stay finite in fp16
        (``kv_dequant.reference.dense_fits``) or a bf16 one without page terms, and the device's
        cuDNN attention available."""
        from deepwell.kernels.kv_dequant.reference import FORMATS, dense_fits
        from deepwell.kernels.paged_attention import dense_prefill

        lay = layer.layout
        if not self.prefill_dense or device.type != "cuda" or lay.head_dim > 256 or self.prefill_workspace_bytes <= 0:
            return False
        if lay.fmt in FORMATS:
            if rows < self._min_rows(lay.fmt) or not dense_fits(lay, layer.scales):
                return False
        elif lay.fmt is not KVFormat.BF16 or layer.page_center is not None or rows < DENSE_BF16_MIN_ROWS:
            return False
        return dense_prefill.available(device)

    def _prefill_dense(self, q: Tensor, qr: Tensor, layer: KVCacheLayer, block_tables: Tensor, context_lens: Tensor,
                       lens: list[int], sm_scale: float, out: Tensor) -> Tensor:
        """Each sequence's chunk over dense K / V through cuDNN (``dense_prefill.attend``): its
        prefix in segments within the workspace budget, its own keys causally; a chunk with too
        few rows, or a budget that holds fewer than ``PREFILL_SEGMENT_MIN_PAGES`` pages, goes
        through ``_prefill`` as before. Reads the context lengths back (one sync per call)."""
        from deepwell.kernels.kv_dequant import reference as dq_ref
        from deepwell.kernels.kv_dequant import triton_kernel as dq
        from deepwell.kernels.paged_attention import dense_prefill

        lay = layer.layout
        h, d, ps = lay.num_kv_heads, lay.head_dim, lay.page_size
        group = q.shape[1] // h
        quantized = lay.fmt in dq_ref.FORMATS
        scales = dq_ref.dense_scales(lay, layer.scales) if quantized else None
        centers = _workspace_centers(layer, block_tables.shape[1]) if quantized else None
        page_bytes = 2 * h * ps * d * 2  # fp16 / bf16 K and V of one page
        budget = self._workspace_budget(q.device)
        ctx_host = [int(c) for c in context_lens.tolist()]
        for i, n, rows in _sequences(lens):
            one = (block_tables[i : i + 1], context_lens[i : i + 1])
            seg = (budget - 2 * n * q.shape[1] * (d + 1) * 4) // page_bytes - (-(-n // ps) + 1)
            min_rows = self._min_rows(lay.fmt) if quantized else DENSE_BF16_MIN_ROWS
            if n * group < min_rows:
                self._prefill(qr[rows], layer, *one, [n], sm_scale, out[rows], False, _page_terms(q[rows], layer))
                continue
            if seg < PREFILL_SEGMENT_MIN_PAGES and -(-ctx_host[i] // ps) > seg:
                self._prefill_triton(q[rows], qr[rows], layer, *one, [n], sm_scale, out[rows])
                continue

            def dense_kv(lo: int, hi: int, i: int = i) -> tuple[Tensor, Tensor]:
                if quantized:
                    buf = torch.empty(2, h, (hi - lo) * ps, d, dtype=torch.float16, device=q.device)
                    clen = (context_lens[i : i + 1] - lo * ps).clamp(0, (hi - lo) * ps).to(torch.int32)
                    dq.dequantize_dense(layer.data, lay, block_tables[i : i + 1, lo:hi].contiguous(), clen, buf,
                                        scales, None if centers is None else centers[lo:hi].contiguous())
                    return buf[0], buf[1]
                pages = layer.data.view(torch.bfloat16).view(-1, 2, h, ps, d)
                kv = pages.index_select(0, block_tables[i, lo:hi].long()).permute(1, 2, 0, 3, 4)
                kv = kv.reshape(2, h, (hi - lo) * ps, d)
                return kv[0], kv[1]

            try:
                dense_prefill.attend(qr[rows], dense_kv, ctx_host[i], ps, max(1, seg), sm_scale, out[rows])
            except RuntimeError as exc:  # a shape this cuDNN refuses: the Triton kernel from now on
                self.prefill_dense = False
                self.dense_error = f"{type(exc).__name__}: {exc}"
                self._prefill_triton(q[rows], qr[rows], layer, *one, [n], sm_scale, out[rows])
        return out

    def _prefill_segments(self, qr: Tensor, layer: KVCacheLayer, block_table: Tensor, context_len: Tensor,
                          sm_scale: float, out: Tensor, budget: int) -> bool:
        """One sequence's chunk ``qr`` (rotated) over a context whose workspace exceeds
        ``budget``: its pages in segments that fit (after the fp32 partial results of the chunk:
        a running one and one per split), each dequantized into the workspace and attended alone
        (``key_pages``; split along the keys like ``_prefill`` when the chunk's row blocks
        would leave SMs idle), the partial results folded together (``merge_partials``) — the
        same keys and values as one pass, summed in another order (a page-centered layer's
        segments hold its keys with their page offsets added back). False (nothing done) when a
        segment would hold fewer than ``PREFILL_SEGMENT_MIN_PAGES`` pages; a context that fits
        (only its table row is wider) goes through one workspace of its pages. Reads the context
        length back to the host (one sync per call: pages past the context need no segment)."""
        from deepwell.kernels.kv_dequant import reference as dq_ref
        from deepwell.kernels.kv_dequant import triton_kernel as dq
        from deepwell.kernels.paged_attention import triton_kernel

        lay = layer.layout
        ws_lay = dq_ref.workspace_layout(lay)
        n, hq, d = qr.shape
        dev = qr.device
        pages = min(block_table.shape[1], -(-int(context_len[0]) // lay.page_size))
        if pages * ws_lay.page_bytes <= budget:  # only the table is wider: one workspace of its pages
            self._prefill(qr, layer, block_table[:, : max(pages, 1)].contiguous(), context_len, [n], sm_scale, out,
                          True)
            return True
        # fastest measured over the workspace (``_prefill``): 128-row blocks, 8 warps, 2 stages,
        # one program per SM; a chunk of few row blocks splits each segment's keys as well
        work = triton_kernel.work_items([n], hq // lay.num_kv_heads, 128, dev)
        splits = self.prefill_splits(work[0].numel(), lay.num_kv_heads, pages, n * hq, d, _sm_count(dev), 1)
        row_bytes = n * hq * (d + 1) * 4  # one fp32 partial result of the chunk
        seg = (budget - (1 + splits) * row_bytes) // ws_lay.page_bytes
        if seg < PREFILL_SEGMENT_MIN_PAGES:
            return False
        splits = max(1, min(splits, min(seg, pages) // PREFILL_SPLIT_MIN_PAGES))  # of a segment, too
        f32 = dict(dtype=torch.float32, device=dev)
        o_run, lse_run = torch.zeros(qr.shape, **f32), torch.full(qr.shape[:2], float("-inf"), **f32)
        o_new, lse_new = torch.empty(n, hq, splits, d, **f32), torch.empty(n, hq, splits, **f32)
        ws = torch.empty(min(seg, pages), 2, lay.num_kv_heads, ws_lay.head_page_bytes, dtype=torch.uint8, device=dev)
        starts, q_len = _seq_rows([n], dev)
        ws_table = torch.zeros_like(block_table)
        ws_scales = dq_ref.workspace_scales(lay, layer.scales)
        centers = _workspace_centers(layer, pages)
        for lo in range(0, max(pages, 1), seg):
            hi = min(lo + seg, pages)
            seg_ctx = (context_len - lo * lay.page_size).clamp(0, (hi - lo) * lay.page_size).to(torch.int32)
            dq.dequantize(layer.data, lay, block_table[:, lo:hi].contiguous(), seg_ctx, ws[: hi - lo],
                          None if centers is None else centers[lo:hi])
            ws_table.zero_()
            ws_table[0, lo:hi] = torch.arange(hi - lo, dtype=torch.int32, device=dev)
            triton_kernel.paged_attention(
                qr, ws, ws_lay, ws_scales, ws_table, context_len, starts, q_len, sm_scale, q_lens_host=[n],
                dequantized=True, key_pages=(lo, hi), partial=(o_new, lse_new), num_splits=splits,
                work=work, block_m=128, num_warps=8, num_stages=2, pages_per_tile=1, page_max=False)
            triton_kernel.merge_partials(o_run, lse_run, o_new, lse_new)
        out.copy_(o_run)
        return True

    def _workspace_budget(self, device: torch.device) -> int:
        """Bytes a prefill workspace may take: ``prefill_workspace_bytes``, and on CUDA at most
        half of what was free at this device's first long prefill (the driver's free memory
        plus the caching allocator's unused blocks; the engine's KV pool, sized at start-up,
        leaves ``1 - memory_fraction`` of it). Asked once: the memory plan is fixed by then."""
        if device.type != "cuda":
            return self.prefill_workspace_bytes
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self._budgets:
            free, _ = torch.cuda.mem_get_info(device)
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            self._budgets[key] = min(self.prefill_workspace_bytes, (free + cached) // 2)
        return self._budgets[key]

    def _min_rows(self, fmt: KVFormat) -> int:
        """The fewest query rows of a chunk that go through a workspace: the constructor's
        ``prefill_dequant_min_rows``, else the format's ``PREFILL_DEQUANT_MIN_ROWS``."""
        if self.prefill_dequant_min_rows is not None:
            return self.prefill_dequant_min_rows
        return PREFILL_DEQUANT_MIN_ROWS.get(fmt, 1 << 62)

    def _dequantizes(self, layout: KVLayout, rows: int) -> bool:
        """Whether a prefill with ``rows`` query rows (longest chunk) may go through a workspace."""
        from deepwell.kernels.kv_dequant.reference import FORMATS

        return (layout.fmt in FORMATS and rows >= self._min_rows(layout.fmt)
                and self.prefill_workspace_bytes > 0)

    def prefill_splits(self, row_blocks: int, num_kv_heads: int, table_width: int, q_rows: int, head_dim: int,
                       sms: int, per_sm: int) -> int:
        """Split-K count for a prefill launch of ``row_blocks`` row blocks per KV head on ``sms``
        SMs (``_sm_count``), from host-known shapes only: enough programs for two waves of
        ``per_sm`` per SM when the row blocks alone leave the GPU idle (a short chunk over a long
        prefix: 32 tokens of the 27B layout are 12 programs for 132 SMs; H200, 64k prefix: 3.2 ->
        0.46 ms), at least 8 pages per split, and partials of at most ``PREFILL_SPLIT_SCRATCH_BYTES``."""
        programs = max(1, row_blocks * num_kv_heads)
        if programs >= per_sm * sms:
            return 1
        want = -(-2 * per_sm * sms // programs)
        scratch = max(1, PREFILL_SPLIT_SCRATCH_BYTES // max(1, q_rows * head_dim * 4))
        return max(1, min(self.max_splits, want, table_width // PREFILL_SPLIT_MIN_PAGES, scratch))

    def _prefill(self, qr: Tensor, layer: KVCacheLayer, block_tables: Tensor, context_lens: Tensor, lens: list[int],
                 sm_scale: float, out: Tensor, dequantize: bool, pc: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """One prefill launch over the cache's pages, or (``dequantize``) over an fp16 workspace
        of them: the same fp16 values meet the same products (outputs equal up to fp32
        summation order, 128-row blocks instead of 64; a page-centered layer's workspace holds
        its keys with the page offsets added back, one fp16 rounding away from the packed
        path's score term ``pc``); split-K where the row blocks alone would leave SMs idle
        (``prefill_splits``)."""
        from deepwell.kernels.paged_attention import triton_kernel

        dev = qr.device
        lay = layer.layout
        starts, q_len = _seq_rows(lens, dev)
        # fastest measured on the H200 (docs/kernels.md): over packed pages 64-row blocks, 4
        # warps, 2 stages; over the fp16 workspace 128-row blocks, 8 warps, 2 stages
        bm, warps, per_sm = (128, 8, 1) if dequantize else (64, 4, 2)
        group = qr.shape[1] // lay.num_kv_heads
        work = triton_kernel.work_items(lens, group, bm, dev)
        splits = self.prefill_splits(work[0].numel(), lay.num_kv_heads, block_tables.shape[1],
                                     qr.shape[0] * qr.shape[1], lay.head_dim, _sm_count(dev), per_sm)
        kw = dict(q_lens_host=lens, num_splits=splits, out=out, work=work, block_m=bm, num_warps=warps, num_stages=2,
                  pages_per_tile=1, page_max=False)
        if not dequantize:
            return triton_kernel.paged_attention(qr, layer.data, lay, layer.scales, block_tables, context_lens, starts,
                                                 q_len, sm_scale, page_center=pc, **kw)
        from deepwell.kernels.kv_dequant import reference as dq_ref
        from deepwell.kernels.kv_dequant import triton_kernel as dq

        tables = block_tables.contiguous()
        # K centered per page: the workspace holds the keys with their page offsets added back
        # (_workspace_centers), so the attention over it needs no page term
        ws = dq.dequantize(layer.data, lay, tables, context_lens, dq_ref.allocate(lay, tables),
                           _workspace_centers(layer, tables.shape[1]))
        return triton_kernel.paged_attention(qr, ws, dq_ref.workspace_layout(lay),
                                             dq_ref.workspace_scales(lay, layer.scales), dq_ref.workspace_tables(tables),
                                             context_lens, starts, q_len, sm_scale, dequantized=True, **kw)


def _sequences(lens: Sequence[int]) -> Iterator[tuple[int, int, slice]]:
    """``(index, tokens, rows)`` of each sequence of a packed prefill with tokens (empty ones skipped)."""
    start = 0
    for i, n in enumerate(lens):
        if n:
            yield i, n, slice(start, start + n)
        start += n


def _sm_count(device: torch.device) -> int:
    """SMs to plan split counts for; 1 off CUDA (the interpreter runs one program at a time, so
    splitting would only add work)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _page_terms(q: Tensor, layer: KVCacheLayer) -> tuple[Tensor, Tensor] | None:
    """The Triton kernel's ``page_center=(query terms, table)`` of a layer whose K is centered per
    page (``kernels.page_center``), from the unrotated ``q``. The table covers every cached key
    (the append refuses positions past it), so nothing is read back here."""
    pc = layer.page_center
    return None if pc is None else pc.kernel_terms(q)


def _workspace_centers(layer: KVCacheLayer, width: int) -> Tensor | None:
    """A page-centered layer's page offsets for the table's first ``width`` columns, rotated like
    K and in workspace units (``kv_dequant.reference.center_values``); None otherwise."""
    pc = layer.page_center
    if pc is None:
        return None
    from deepwell.kernels.hadamard import triton_fn
    from deepwell.kernels.kv_dequant import reference as dq_ref
    from deepwell.kernels.page_center import workspace_centers

    c = workspace_centers(pc, width, layer.layout.hadamard_size, triton_fn.rotate)
    return dq_ref.center_values(layer.layout, layer.scales, c)


def _rotate_q(q: Tensor, layout: KVLayout) -> Tensor:
    """``reference.rotate_q`` as one Triton launch (bit-identical)."""
    from deepwell.kernels.hadamard import triton_fn

    return triton_fn.rotate(q, layout.hadamard_size) if layout.hadamard else q


def get_backend(device: torch.device | str) -> ReferenceBackend | TritonBackend:
    """``triton`` on CUDA, ``reference`` elsewhere."""
    return TritonBackend() if torch.device(device).type == "cuda" else ReferenceBackend()
