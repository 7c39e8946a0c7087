"""``TorchModelRunner``: the ``runner_api.ModelRunner`` over the torch decoder.

``build_runner(open_model(path), device, dtype, kv_dtype)`` builds the model from the
source's config (registry), streams its weights in (``models.loader``), and returns a
runner whose pools are created by ``allocate``. One ``forward`` runs a whole
``ForwardBatch``: per-token work (projections, MLPs) is batched over every slice; per
sequence, attention reads the pool through the slice's block table and GDN layers advance
the slice's state slot.

Everything about KV memory lives in ``engine_service.kv``: the runner resolves its
``KVSettings`` against the model (``kv.settings.resolve``: ``KVSettingsError`` at
construction for settings the model cannot use) and owns one ``kv.store.KVStore`` (the page
pool, float or quantized, the state pool, the quantized cache's calibration and kernel
check, the page / slot byte movers). With a quantized pool the step context carries int32
block tables instead of gather indices, and ``calibrate_kv`` (called once after
``allocate``) runs the calibration's scratch forward.

Checked per step (``ValueError`` with the reason, nothing written): token count matches
the slices, ``num_tokens >= 1``, block tables cover ``start + num_tokens`` with page ids
in the pool, token ids in the vocabulary, and for hybrid models distinct state slots in
range whose state is at exactly ``start`` tokens (the runner tracks each slot's position:
``forward`` advances it, ``reset_state`` zeroes it, ``copy_state`` / ``import_state`` set it).
Same code on CPU and CUDA; nothing here assumes a device.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepwell.logs import get_logger
from deepwell.engine_service.draft_graphs import DraftGraphs
from deepwell.engine_service.graphs import DecodeGraphs, Scratch
from deepwell.engine_service.kv.calibration import KVCalibration
from deepwell.engine_service.kv.float_pool import QUANT_KV_DTYPES, KVPool
from deepwell.engine_service.kv.pool import Region
from deepwell.engine_service.kv.quant_pool import QuantKVPool
from deepwell.engine_service.kv.selfcheck import KVKernelCheck
from deepwell.engine_service.kv.settings import KVSettings, KVSpec, page_bytes_by_kv_dtype, resolve
from deepwell.engine_service.kv.state import StateLayout, StatePool
from deepwell.engine_service.kv.store import KVStore
from deepwell.engine_service.layers.backend import ReferenceBackend, get_backend
from deepwell.engine_service.layers.context import (DecodeGroup, PageTables, SeqInfo, StepContext, VerifyGroup,
                                                    VerifyRecord)
from deepwell.engine_service.layers import gemv_linear
from deepwell.engine_service.layers.cuda_backend import default_backend  # also registers "cuda"
from deepwell.engine_service.layers.fp8_linear import BLOCK as FP8_BLOCK
from deepwell.engine_service.layers.fp8_linear import attach_draft_head, prepare_linears, quantize_linears
from deepwell.engine_service.layers.moe import prepare_experts, quantize_experts
from deepwell.engine_service.layers.fp8_linear import wants_draft_head
from deepwell.engine_service.layers.fp8_linear import tune as tune_fp8
from deepwell.engine_service.loading.fp8 import block_size as fp8_block_size
from deepwell.engine_service.layers.projections import fuse_projections
from deepwell.engine_service.layers.rope import inv_freq_and_scale
from deepwell.engine_service.loading.source import ModelSource
from deepwell.engine_service.models import build_model, load_weights, random_weights
from deepwell.engine_service.models.decoder import CausalLM
from deepwell.engine_service.runner_api import DraftInput, ForwardBatch, MemorySpec, SeqSlice, page_tensor
from deepwell.kernels.calibration import ScaleCounts

log = get_logger(__name__)

DEFAULT_PAGE_SIZE = 64


class TorchModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        kv: KVSettings | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        ops: ReferenceBackend | None = None,
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
        self.kv_spec: KVSpec = resolve(kv or KVSettings(), model_dtype=dtype, num_layers=len(a.attention_layers),
                                       num_kv_heads=a.attention.num_kv_heads, head_dim=a.attention.head_dim,
                                       page_size=page_size, device_type=torch.device(device).type)
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
        inv_freq, _ = inv_freq_and_scale(a.rope)
        self.kv_store = KVStore(self.kv_spec, self.state_layout, device, self.ops, inv_freq=inv_freq,
                                max_context=a.max_context, num_q_heads=a.attention.num_heads, model_dtype=dtype)
        self._slot_pos: list[int] = []  # tokens each state slot's contents correspond to
        self.mtp_layers = 0  # > 0 once enable_mtp(): the MTP module's KV layers follow the model's
        self._last_hidden: torch.Tensor | None = None  # the last forward's hidden states (MTP drafting)
        self._last_verify_t = 0  # T when the last forward was a verify group of T rows per slice, else 0
        self._verify: VerifyRecord | None = None  # the last forward's verify slices, until accepted
        self._verify_start: dict[int, int] = {}
        self._verify_tokens: dict[int, int] = {}  # slot -> tokens its verify slice ran
        self._group_slots: tuple[int, ...] = ()  # the last step's VerifyGroup slots, in its order
        self._graph_batch = 0  # > 0 once plan_graphs(): allocate() adds the scratch page and slot
        self._graph_verify = 0  # tokens per sequence of the verify steps to capture (0: none)
        self._scratch = Scratch(-1, -1)
        self.graphs: DecodeGraphs | None = None  # decode steps as CUDA graphs (capture_graphs)
        self.draft_graphs: DraftGraphs | None = None  # MTP drafting chains as CUDA graphs (with verify graphs)
        # a step of verify slices all of one length runs batched (``context.VerifyGroup``); off:
        # each slice alone, as a prefill chunk (tests compare the two)
        self.verify_groups = True

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
    def kv(self) -> KVPool | QuantKVPool | None:
        return self.kv_store.kv

    @property
    def state(self) -> StatePool | None:
        return self.kv_store.state

    @property
    def kv_dtype_name(self) -> str:
        """The KV format as reported in ModelInfo: ``nvfp4``/``fp8``/``int8`` or the float dtype."""
        return self.kv_spec.name

    @property
    def kv_calibration(self) -> KVCalibration | None:
        return self.kv_store.calibration

    @property
    def kv_kernel_check(self) -> KVKernelCheck | None:
        return self.kv_store.kernel_check

    def memory_spec(self) -> MemorySpec:
        return MemorySpec(
            page_size=self.page_size,
            bytes_per_page=self.kv_spec.bytes_per_page,
            bytes_per_state_slot=self.state_layout.bytes_per_slot if self.state_layout else 0,
            num_attention_layers=self.kv_spec.float_layout.num_layers,
            num_recurrent_layers=self.state_layout.num_layers if self.state_layout else 0,
            page_bytes_by_kv_dtype=page_bytes_by_kv_dtype(self.kv_spec.float_layout),
        )

    def allocate(self, num_pages: int, num_state_slots: int) -> None:
        """The pools: ``num_pages`` pages and ``num_state_slots`` slots for the scheduler, plus,
        after ``plan_graphs``, one scratch page and slot of its own (the graphs' padded rows)."""
        extra = 1 if self._graph_batch else 0
        has_kv = bool(self.kv_spec.float_layout.num_layers)
        slots = num_state_slots + (extra if self.state_layout is not None else 0)
        self.kv_store.allocate(num_pages + (extra if has_kv else 0), slots)
        if self.state_layout is not None:
            self._slot_pos = [0] * slots
        if extra:
            self._scratch = Scratch(num_pages if has_kv else -1,
                                    num_state_slots if self.state_layout is not None else -1)

    # -- CUDA graphs -------------------------------------------------------------------
    def graphs_unsupported(self) -> str | None:
        """Why this runner's decode steps cannot be captured, or None."""
        if self.kv_spec.float_layout.num_layers and self.kv_spec.quant_layout is None:
            return ("the KV cache is a gathered float pool (decode gathers each context to the longest): "
                    "use a paged KV format (--kv-paged on, or a quantized --kv-dtype)")
        if self.args.moe is not None and self._device.type == "cuda" and not self.ops.moe_on_device(self.dtype):
            return (f"the {self.ops.name} layer backend routes MoE tokens on the host (data-dependent shapes) in "
                    f"{self.dtype}: use the cuda backend with bf16 / fp16 / fp32")
        return None

    def plan_graphs(self, max_batch: int, verify_tokens: int = 0) -> None:
        """Reserve the scratch page and slot for decode graphs of up to ``max_batch`` sequences
        and, with ``verify_tokens`` > 1, speculative verify steps of that many tokens per sequence
        (before ``allocate``; ``capture_graphs`` after calibration). ValueError if unsupported."""
        why = self.graphs_unsupported()
        if why is not None:
            raise ValueError(f"CUDA graphs are not available for this model: {why}")
        if self.kv_store.kv is not None or self.kv_store.state is not None:
            raise RuntimeError("plan_graphs() must be called before allocate()")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not 0 <= verify_tokens <= self.page_size:
            raise ValueError(f"verify_tokens must be in [0, {self.page_size}] (padding fits one scratch page), "
                             f"got {verify_tokens}")
        self._graph_batch = max_batch
        self._graph_verify = verify_tokens

    def capture_graphs(self, capture: bool | None = None) -> DecodeGraphs:
        """Build the decode graphs (after ``allocate`` and the KV calibration: the pools and scales
        they read must not move). ``capture`` (default: on a CUDA device) records them; without,
        the same static-buffer steps run eagerly (tests on CPU)."""
        if not self._graph_batch or (self.kv_spec.float_layout.num_layers and self.kv_store.kv is None):
            raise RuntimeError("capture_graphs() needs plan_graphs() and allocate() first")
        capture = self._device.type == "cuda" if capture is None else capture
        graphs = DecodeGraphs(self, self._graph_batch, self._scratch, capture, self._graph_verify)
        drafts = None
        if self.mtp_layers and graphs.verify_tokens and self._scratch.page >= 0:
            drafts = DraftGraphs(self, graphs.verify_batch, graphs.verify_tokens - 1, self._scratch.page, capture)
        if capture:
            graphs.capture()
            if drafts is not None:
                drafts.capture()
        self.graphs, self.draft_graphs = graphs, drafts
        return graphs

    # -- quantized KV ------------------------------------------------------------------
    def kv_scale_counts(self) -> tuple[ScaleCounts, ScaleCounts] | None:
        """(K, V) block-scale counts of everything the serving pool has stored (fp8 / nvfp4)."""
        return self.kv_store.scale_counts()

    def calibrate_kv(self, token_ids: Sequence[int], source: str = "token_ids",
                     max_position: int | None = None, sink: bool = True) -> KVCalibration | None:
        """Calibrate the quantized pool on one scratch forward of ``token_ids``
        (``KVStore.calibrate``: temporary pools only; None for float pools and int8)."""
        return self.kv_store.calibrate(self._scratch_forward, token_ids, self.vocab_size, source=source,
                                       max_position=max_position, sink=sink)

    def _scratch_forward(self, ids: list[int], scratch: KVPool | None, state: StatePool | None,
                         logits: bool = False) -> None:
        """One sequence of ``ids`` from position 0 through ``scratch`` (a float pool, or a
        ``RecordingPool`` over one) and ``state``'s slot 0, the MTP layers included; ``logits``:
        the last row's logits too (as a serving step computes them)."""
        n = len(ids)
        pages = -(-n // self.page_size)
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long),
                             [SeqSlice(0 if state else -1, list(range(pages)) if scratch is not None else [], 0, n,
                                       need_logits=False)])
        ctx = self._context(batch, scratch, state, [0])
        with torch.inference_mode():
            ids_dev = batch.input_ids.to(self._device)
            hidden = self.model(ids_dev, ctx, scratch, state)  # type: ignore[arg-type]
            if self.mtp_layers:  # the MTP layers' K/V too: each row pairs with the token after it
                nxt = torch.cat([ids_dev[1:], ids_dev[-1:]])
                ctx = self._context(batch, scratch, None, [])
                self.model.mtp_forward(nxt, self.model.model.norm(hidden), ctx, scratch)  # type: ignore[arg-type]
            if logits:
                self.model.logits(hidden[-1:])

    def step_activation_bytes(self, num_tokens: int) -> int:
        """Peak bytes one prefill step of ``num_tokens`` tokens allocates beyond the weights and
        the pools: its activations, an FP8 layer's weight dequantized for many rows, the MTP
        pass, the last row's logits. Measured on CUDA with one scratch forward through a float
        pool and a scratch state slot (both freed after; a short forward first keeps one-time
        allocations out of the count), before ``allocate``: ``build_core``
        takes it off the KV pool's budget, so a full step still fits once the pool is sized.
        0 off CUDA (host memory is not budgeted this way)."""
        if self._device.type != "cuda" or num_tokens < 1:
            return 0
        n = min(num_tokens, self.max_context)
        pages = -(-n // self.page_size)
        scratch = KVPool(self.kv_spec.float_layout, pages, self._device, self.ops) \
            if self.kv_spec.float_layout.num_layers else None
        state = StatePool(self.state_layout, 1, self._device) if self.state_layout is not None else None
        ids = [i % self.vocab_size for i in range(n)]
        # a short forward first: what the first forward allocates once and keeps (cuBLAS's
        # workspace, 32 MiB on Hopper; lazily built kernel tables) is gone from the free memory
        # the pools are sized from, so it must not count as a step's activations as well
        self._scratch_forward(ids[:min(n, self.page_size)], scratch, state, logits=True)
        if state is not None:
            state.reset(0)  # the measured forward starts a sequence: its slot holds no state
        torch.cuda.synchronize(self._device)
        base = torch.cuda.memory_allocated(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        self._scratch_forward(ids, scratch, state, logits=True)
        torch.cuda.synchronize(self._device)
        peak = torch.cuda.max_memory_allocated(self._device) - base
        del scratch, state
        torch.cuda.empty_cache()
        log.info("step_activations_measured", tokens=n, mib=round(peak / 2**20, 1))
        return max(0, int(peak))

    def check_kv_kernels(self) -> KVKernelCheck | None:
        """Before serving: the device's KV kernels against the reference (``KVStore.check_kernels``)."""
        return self.kv_store.check_kernels()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.kv is None and self.kv_spec.float_layout.num_layers:
            raise RuntimeError("allocate() must be called before forward()")
        ids = batch.input_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):  # (host ids: no sync)
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if self.graphs is not None and self.graphs.accepts(batch):
            return self._graph_forward(batch)
        ctx = self._context(batch, self.kv, self.state, self._slot_pos)
        self.kv_store.written = self.kv is not None
        ids = ids.to(self._device, torch.long, non_blocking=True)
        with torch.inference_mode():
            hidden = self.model(ids, ctx, self.kv, self.state)
            self._last_hidden = hidden if self.mtp_layers else None
            self._verify = ctx.verify
            self._verify_start = {s.state_slot: s.start for s in ctx.seqs if s.verify}
            self._verify_tokens = {s.state_slot: s.num_tokens for s in ctx.seqs if s.verify}
            self._group_slots = ctx.verify_group.slots if ctx.verify_group is not None else ()
            self._last_verify_t = ctx.verify_group.tokens_per_seq if ctx.verify_group is not None else 0
            if self.state is not None:
                for s in ctx.seqs:
                    if not s.verify:
                        self._slot_pos[s.state_slot] = s.start + s.num_tokens
            rows = []
            for s, q in zip(ctx.seqs, batch.seqs, strict=True):
                if q.all_logits or q.verify:
                    rows.extend(range(s.offset, s.offset + s.num_tokens))
                elif q.need_logits:
                    rows.append(s.offset + s.num_tokens - 1)
            if not rows:
                return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self._device)
            index = torch.tensor(rows, dtype=torch.long, device=self._device)
            return self.model.logits(hidden.index_select(0, index))

    def _graph_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode step through the graphs (``graphs.DecodeGraphs``): the eager path's checks,
        the same bookkeeping."""
        assert self.graphs is not None
        kv, state = self.kv, self.state
        self._check_slices(batch, kv, state, self._slot_pos)
        self.kv_store.written = kv is not None
        t = batch.seqs[0].num_tokens
        if isinstance(kv, QuantKVPool):
            kv.count_stored(self.graphs.bucket(len(batch.seqs), t) * t)  # padded rows are appended too
        hidden, logits, commit = self.graphs.run(batch)
        self._last_hidden = hidden.clone() if self.mtp_layers else None
        self._verify, self._verify_start, self._verify_tokens, self._group_slots = None, {}, {}, ()
        self._last_verify_t = t if commit is not None else 0
        if commit is not None:  # a verify step: the slots stay at their starts until accept_many
            self._verify = VerifyRecord(group=[commit])
            self._verify_start = {s.state_slot: s.start for s in batch.seqs}
            self._verify_tokens = {s.state_slot: t for s in batch.seqs}
            self._group_slots = tuple(s.state_slot for s in batch.seqs)
            return logits.clone()  # every row (a copy: the next replay rewrites the buffer)
        if state is not None:
            for s in batch.seqs:
                self._slot_pos[s.state_slot] = s.start + 1
        rows = [i for i, s in enumerate(batch.seqs) if s.need_logits]
        if len(rows) == logits.shape[0]:  # a copy: the graph's output buffer is rewritten by the next replay
            return logits.clone()
        return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=self._device))

    # -- speculative decoding ----------------------------------------------------------
    def enable_mtp(self) -> None:
        """Give the model's MTP module its KV layers in the pool (after the main model's), so
        ``propose`` can draft; before ``allocate``. ValueError when the model has no MTP weights."""
        if self.model.mtp is None:
            raise ValueError(f"{self.args.architecture} has no MTP module loaded: nothing to draft with "
                             "(speculative decoding needs a checkpoint with mtp.* weights)")
        if self.kv_store.kv is not None:
            raise RuntimeError("enable_mtp() must be called before allocate()")
        a, n = self.args, len(self.model.mtp.layers)
        self.kv_spec = resolve(self.kv_spec.settings, model_dtype=self.dtype, num_layers=len(a.attention_layers) + n,
                               num_kv_heads=a.attention.num_kv_heads, head_dim=a.attention.head_dim,
                               page_size=self.page_size, device_type=self._device.type)
        inv_freq, _ = inv_freq_and_scale(a.rope)
        self.kv_store = KVStore(self.kv_spec, self.state_layout, self._device, self.ops, inv_freq=inv_freq,
                                max_context=a.max_context, num_q_heads=a.attention.num_heads, model_dtype=self.dtype)
        self.mtp_layers = n

    def accept(self, slot: int, num_tokens: int) -> None:
        """Commit the first ``num_tokens`` tokens of the last forward's verify slice in ``slot``:
        its recurrent state then holds ``start + num_tokens`` tokens (no-op without state)."""
        self.accept_many({slot: num_tokens})

    def accept_many(self, accepted: Mapping[int, int]) -> None:
        """``accept`` for several slots at once: a ``VerifyGroup`` step commits them in one replay
        per recurrent layer (a slot not named yet keeps its state: replayed over 0 tokens)."""
        if self.state is None:
            return
        record = self._verify
        for slot, n in accepted.items():
            if record is None or slot not in self._verify_start:
                raise ValueError(f"state slot {slot} had no verify slice in the last forward")
            if not 0 <= n <= self._verify_tokens[slot]:
                raise ValueError(f"cannot accept {n} of the {self._verify_tokens[slot]} tokens verified in slot {slot}")
        if not accepted:
            return
        assert record is not None
        with torch.inference_mode():
            if record.group:
                lengths = torch.tensor([accepted.get(s, 0) for s in self._group_slots], dtype=torch.long)
                lengths = lengths.to(self._device, non_blocking=True)
                for group_commit in record.group:
                    group_commit(lengths)
            for slot, n in accepted.items():
                for commit in record.commits.get(slot, []):
                    commit(n)
        for slot, n in accepted.items():
            self._slot_pos[slot] = self._verify_start.pop(slot) + n

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        """MTP drafting after a forward: per input, the MTP layers run over its computed rows
        (filling their KV), then ``num_drafts`` tokens are drafted greedily one at a time."""
        if not self.mtp_layers or self._last_hidden is None:
            raise RuntimeError("propose() needs enable_mtp() and a forward first")
        if not inputs:
            return []
        dev, model, hid = self._device, self.model, self._last_hidden
        after_verify = self._draft_after_verify(inputs, hid)
        if after_verify is not None:
            return after_verify
        drafts: list[list[int]] = [[] for _ in inputs]
        with torch.inference_mode():
            rows = torch.cat([torch.arange(d.hidden_row, d.hidden_row + len(d.tokens)) for d in inputs]).to(dev)
            h = model.model.norm(hid.index_select(0, rows))
            seqs = [SeqSlice(-1, d.block_table, d.start, len(d.tokens), need_logits=False) for d in inputs]
            ids = [t for d in inputs for t in d.tokens]
            live = [i for i, d in enumerate(inputs) if d.num_drafts > 0]
            out = self._mtp_step(ids, seqs, h)
            last_rows = list(itertools.accumulate(len(d.tokens) for d in inputs))  # each input's last row + 1
            ends = torch.tensor([last_rows[i] - 1 for i in live], dtype=torch.long, device=dev)
            wanted = [inputs[i].num_drafts for i in live]
            chain = self.draft_graphs
            if chain is not None and live and self.graphs is not None and chain.accepts(len(live), wanted):
                got = chain.run(out.index_select(0, ends), [inputs[i].start + len(inputs[i].tokens) for i in live],
                                wanted, [inputs[i].block_table for i in live])
                for i, d in zip(live, got, strict=True):
                    drafts[i] = d
                return drafts
            for step in range(max((inputs[i].num_drafts for i in live), default=0)):
                if not live:
                    break
                last = out.index_select(0, ends)
                picked = model.draft_logits(last).argmax(dim=-1).tolist()
                for i, t in zip(live, picked):
                    drafts[i].append(int(t))
                live_next = [j for j, i in enumerate(live) if len(drafts[i]) < inputs[i].num_drafts]
                if not live_next:
                    break
                live = [live[j] for j in live_next]
                seqs = [SeqSlice(-1, inputs[i].block_table, inputs[i].start + len(inputs[i].tokens) + step, 1,
                                 need_logits=False) for i in live]
                out = self._mtp_step([drafts[i][-1] for i in live], seqs, last.index_select(
                    0, torch.tensor(live_next, dtype=torch.long, device=dev)))
                ends = torch.arange(len(live), dtype=torch.long, device=dev)
        return drafts

    def _draft_after_verify(self, inputs: Sequence[DraftInput], hid: torch.Tensor) -> list[list[int]] | None:
        """After a verify group of ``T`` rows per slice, the MTP pass over all ``T`` rows and the
        draft chain as one graph (``DraftGraphs.run_after_verify``); None where it does not apply
        (another step, more sequences than its buckets)."""
        chain, t = self.draft_graphs, self._last_verify_t
        if chain is None or self.graphs is None or t != chain.verify_tokens:
            return None
        if any(d.hidden_row % t or d.hidden_row + t > hid.shape[0] for d in inputs) or not chain.accepts_verify(
                len(inputs), [len(d.tokens) for d in inputs], [d.num_drafts for d in inputs]):
            return None
        firsts = [d.hidden_row for d in inputs]
        if firsts == list(range(0, len(inputs) * t, t)):  # every slice of the step, in order
            rows = hid[: len(inputs) * t]
        else:
            index = torch.cat([torch.arange(f, f + t) for f in firsts]).to(self._device)
            rows = hid.index_select(0, index)
        return chain.run_after_verify(rows, [d.start for d in inputs], [d.tokens for d in inputs],
                                      [d.num_drafts for d in inputs], [d.block_table for d in inputs])

    def _mtp_step(self, ids: list[int], seqs: list[SeqSlice], hidden: torch.Tensor) -> torch.Tensor:
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long), seqs)
        ctx = self._context(batch, self.kv, None, [])
        return self.model.mtp_forward(batch.input_ids.to(self._device), hidden, ctx, self.kv)  # type: ignore[arg-type]

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

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Slot ``dst_slot`` becomes a bit-exact copy of ``src_slot`` (a state image, or a sequence
        resuming from one), at the same position."""
        if self.state is not None:
            self.state.copy(src_slot, dst_slot)
            self._slot_pos[dst_slot] = self._slot_pos[src_slot]

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """KV pages ``dst[i]`` become byte copies of ``src[i]`` in every attention layer."""
        self.kv_store.copy_pages(src, dst)

    def entry_nbytes(self, num_pages: int, with_state: bool) -> int:
        """Bytes of a host cache entry of ``num_pages`` pages (and a state image)."""
        return num_pages * self.kv_store.page_nbytes + (self.kv_store.slot_nbytes if with_state else 0)

    def export_kv(self, pages: Sequence[int], slot: int, out: Region) -> None:
        """Write ``pages`` and (``slot >= 0``) the state slot into ``out`` (a host entry's bytes)."""
        self.kv_store.export_entry(pages, slot, out)

    def import_kv(self, pages: Sequence[int], slot: int, position: int, src: Region, entry_pages: int) -> None:
        """Fill ``pages`` (a prefix of an entry of ``entry_pages`` pages) and (``slot >= 0``) the slot,
        whose state is then at ``position`` tokens."""
        self.kv_store.import_entry(pages, slot, src, entry_pages)
        if slot >= 0 and self.state is not None:
            self._slot_pos[slot] = position

    # -- step metadata --------------------------------------------------------------
    def _context(self, batch: ForwardBatch, kv: Any, state: StatePool | None,
                 slot_pos: list[int]) -> StepContext:
        """Validate ``batch`` against ``kv``/``state`` (whose slots are at ``slot_pos``) and
        build the step metadata: gather indices for a float pool, page tables for a
        quantized one."""
        ps = self.page_size
        quant = isinstance(kv, QuantKVPool)
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        seqs: list[SeqInfo] = []
        tables: list[torch.Tensor] = []  # per slice, quantized pool only
        offset = 0
        for s, pages in zip(batch.seqs, self._check_slices(batch, kv, state, slot_pos), strict=True):
            end = s.start + s.num_tokens
            token_index = None
            if pages is not None:
                table = pages.long()
                if quant:
                    tables.append(pages)
                    pos = torch.arange(s.start, end)
                    slots.append((table[pos // ps] * ps + pos % ps).to(self._device))
                else:
                    pos = torch.arange(end)
                    token_index = (table[pos // ps] * ps + pos % ps).to(self._device)
                    slots.append(token_index[s.start :])
            positions.append(torch.arange(s.start, end))
            verify = s.verify and s.num_tokens > 1 and state is not None
            seqs.append(SeqInfo(offset, s.num_tokens, s.start, s.state_slot, token_index, verify))
            offset += s.num_tokens
        if quant and self.verify_groups and all(s.verify for s in seqs) and len({s.num_tokens for s in seqs}) == 1:
            pages_t = self._page_tables(seqs, tables)
            assert pages_t is not None
            return StepContext(
                positions=torch.cat(positions).to(self._device),
                kv_slots=torch.cat(slots),
                seqs=tuple(seqs),
                verify=VerifyRecord(),
                verify_group=VerifyGroup(seqs[0].num_tokens, tuple(s.state_slot for s in seqs),
                                         torch.tensor([s.state_slot for s in seqs], dtype=torch.long,
                                                      device=self._device), pages_t),
            )
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
            verify=VerifyRecord() if any(s.verify for s in seqs) else None,
        )

    def _check_slices(self, batch: ForwardBatch, kv: Any, state: StatePool | None,
                      slot_pos: Sequence[int]) -> list[torch.Tensor | None]:
        """The checks of every step, eager or graphed (``ValueError`` with the reason, nothing run):
        slices cover the tokens, positions within the context, distinct state slots at exactly
        ``start``, block tables covering ``start + num_tokens`` with page ids in the pool (the
        graphs' scratch page and slot are not the scheduler's). Returns each slice's pages
        (int32 CPU tensors, ``runner_api.page_tensor``)."""
        if not batch.seqs:
            raise ValueError("empty batch")
        total = sum(s.num_tokens for s in batch.seqs)
        if total != batch.num_tokens:
            raise ValueError(f"slices cover {total} tokens but input_ids has {batch.num_tokens}")
        own = kv is not None and kv is self.kv_store.kv  # the serving pools hold the scratch rows
        num_pages = kv.num_pages - int(own and self._scratch.page >= 0) if kv is not None else 0
        num_slots = (state.num_slots - int(state is self.kv_store.state and self._scratch.slot >= 0)
                     if state is not None else 0)
        used_slots: set[int] = set()
        out: list[list[int] | None] = []
        for s in batch.seqs:
            if s.num_tokens < 1 or s.start < 0:
                raise ValueError(f"bad slice: start={s.start}, num_tokens={s.num_tokens}")
            end = s.start + s.num_tokens
            if end > self.max_context:
                raise ValueError(f"position {end} exceeds the model's context {self.max_context}")
            if state is not None:
                if not 0 <= s.state_slot < num_slots:
                    raise ValueError(f"state slot {s.state_slot} out of range [0, {num_slots})")
                if s.state_slot in used_slots:
                    raise ValueError(f"state slot {s.state_slot} used twice in one batch")
                if slot_pos[s.state_slot] != s.start:
                    raise ValueError(
                        f"state slot {s.state_slot} holds position {slot_pos[s.state_slot]} "
                        f"but the slice starts at {s.start} (reset or restore the slot first)"
                    )
                used_slots.add(s.state_slot)
            pages = None
            if kv is not None:
                need = -(-end // self.page_size)
                if len(s.block_table) < need:
                    raise ValueError(f"block table has {len(s.block_table)} pages, {need} needed for {end} tokens")
                pages = page_tensor(s.block_table, need)
                if int(pages.min()) < 0 or int(pages.max()) >= num_pages:
                    raise ValueError(f"page ids must be in [0, {num_pages})")
            out.append(pages)
        return out

    def _page_tables(self, seqs: list[SeqInfo], tables: list[torch.Tensor]) -> PageTables | None:
        if not seqs:
            return None
        dev = self._device
        width = max(len(t) for t in tables)
        padded = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            padded[i, : len(t)] = t
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


def finish_linears(model: CausalLM, dev: torch.device, dtype: torch.dtype, **log_fields: Any) -> None:
    """The linear layers' last steps before serving, after the weights and FP8 (which layers stay
    16-bit is its choice): the Gated DeltaNet's input projections stacked (``fuse_projections``),
    then on CUDA the FP8 few-row kernels timed at the model's shapes (``fp8_linear.tune``). Every
    builder of a serving model runs it (a TP rank on its shard: ``parallel.shard``)."""
    saved = fuse_projections(model)
    if saved:
        log.info("projections_fused", launches_saved_per_forward=saved, **log_fields)
    tuned = tune_fp8(model, dev, dtype)
    if tuned is not None:
        log.info("fp8_gemm_tuned", **tuned, **log_fields)


def build_runner(
    source: ModelSource,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_dtype: str = "auto",
    page_size: int = DEFAULT_PAGE_SIZE,
    backend: str = "auto",
    kv_hadamard: str = "auto",
    kv_center_k: str = "auto",
    kv_k_rounding: str = "auto",
    kv_paged: str = "auto",
    random: bool = False,
    mtp: bool = False,
    weight_dtype: str = "auto",
    batch_invariant: bool = False,
    linear_kernel: str = "auto",
) -> TorchModelRunner:
    """Build the model for ``source`` on ``device`` and stream its weights in (``random``: fill
    them with random values instead, ``models.random_weights``).

    ``backend`` names the layer ops (``layers.backend.get_backend``); "auto": "cuda" (the GDN
    ops on fla-core's kernels, ``layers.cuda_backend``) on a CUDA device where fla-core
    imports, else "reference".

    ``weight_dtype`` "fp8": the decoder's linear layers are block-scaled FP8 (``layers.fp8_linear``):
    an FP8 checkpoint's own codes and scales (native), any other checkpoint quantized after
    loading; "auto": native FP8 for an FP8 checkpoint on CUDA, else the model dtype (an FP8
    checkpoint on CPU is dequantized: the FP8 matmul's reference dequantizes every call).

    ``mtp``: give the checkpoint's MTP module its KV layers (``enable_mtp``) for speculative
    decoding; a model without (complete) MTP weights logs ``mtp_unavailable`` and has none.

    ``batch_invariant``: the CPU reference made independent of the step's make-up
    (``layers.invariant``: row-padded linear layers, per-row attention); CPU, a float KV cache
    and 16-bit / fp32 weights only.

    ``linear_kernel`` "gemv": the 16-bit linear layers run decode steps' few rows through the
    split-K GEMV (``layers.gemv_linear``; CUDA); "auto": torch's GEMM.

    The runner (and so every KV setting) is checked before the weights load."""
    dev = torch.device(device)
    linear_kernel = gemv_linear.resolve(linear_kernel, dev)
    if batch_invariant:
        from deepwell.engine_service.layers import invariant

        if dev.type != "cpu" or backend not in ("auto", "reference", invariant.BatchInvariantBackend.name):
            raise ValueError(f"batch_invariant needs the CPU reference backend, not device {dev} / backend {backend}")
        if kv_dtype in QUANT_KV_DTYPES or weight_dtype == "fp8":
            raise ValueError("batch_invariant needs a float KV cache and 16-bit or fp32 weights, not "
                             f"kv_dtype={kv_dtype} / weight_dtype={weight_dtype}")
        backend = invariant.BatchInvariantBackend.name
    if backend == "auto":
        backend, why = default_backend(dev)
    else:
        why = "named"
    ops = get_backend(backend)
    log.info("layer_backend", backend=ops.name, device=str(dev), reason=why)
    model, family, text_cfg = build_model(source.config, dev, dtype, ops)
    runner = TorchModelRunner(model, dev, dtype, KVSettings(kv_dtype, kv_hadamard, kv_center_k, kv_k_rounding, kv_paged),
                              page_size, ops)
    native_fp8 = source.iter_fp8 is not None and (weight_dtype == "fp8" or (weight_dtype == "auto"
                                                                            and dev.type == "cuda"))
    if weight_dtype not in ("auto", "fp8"):
        raise ValueError(f"weight_dtype must be auto or fp8, got {weight_dtype!r}")
    if random:
        random_weights(model)
    elif native_fp8:  # the checkpoint's own codes and scales, loaded into FP8 layers
        block = fp8_block_size(source.config) or FP8_BLOCK
        names = prepare_linears(model, block)
        experts = prepare_experts(model, block)
        load_weights(model, family, text_cfg, source.iter_fp8(), fp8_layers=names | experts, fp8_block=block)
        log.info("weights_fp8", layers=len(names), expert_tensors=len(experts), block=list(block),
                 source="checkpoint (native)")
    else:
        load_weights(model, family, text_cfg, source.iter_tensors())
    if batch_invariant:
        from deepwell.engine_service.layers.invariant import check_row_invariance, pad_linear_rows

        log.info("batch_invariant", linear_layers=pad_linear_rows(model))
        check_row_invariance(model)  # RowInvarianceError where this BLAS breaks the mode's premise
    if weight_dtype == "fp8" and not native_fp8:
        count, saved = quantize_linears(model)
        moes, saved_moe = quantize_experts(model, FP8_BLOCK)
        log.info("weights_fp8", layers=count, moe_layers=moes, bytes_saved=saved + saved_moe, block=list(FP8_BLOCK),
                 source="quantized at load")
    if mtp and model.mtp is not None and (native_fp8 or weight_dtype == "fp8") and wants_draft_head():
        log.info("draft_head_fp8", bytes=attach_draft_head(model),
                 detail="drafts read an FP8 copy of the LM head; verification keeps the 16-bit one")
    finish_linears(model, dev, dtype)
    if linear_kernel == "gemv":
        log.info("linear_kernel", kernel="gemv", layers=gemv_linear.use_gemv(model))
    if mtp:
        if model.mtp is not None:
            runner.enable_mtp()
        else:
            log.info("mtp_unavailable", model_id=source.model_id,
                        reason="the checkpoint has no (complete) MTP weights: decoding without speculation")
    log.info(
        "runner_built",
        model_id=source.model_id,
        architecture=model.args.architecture,
        device=str(dev),
        dtype=str(dtype),
        kv_dtype=runner.kv_dtype_name,
    )
    return runner
