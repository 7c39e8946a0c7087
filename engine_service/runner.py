"""``TorchModelRunner``: the ``runner_api.ModelRunner`` over the torch decoder.

``build_runner(open_model(path), device, dtype, kv_dtype)`` builds the model from the
source's config (registry), streams its weights in (``models.loader``), and returns a
runner whose pools are created by ``allocate``. One ``forward`` runs a whole
``ForwardBatch``: per-token work (projections, MLPs) is batched over every slice; per
sequence, attention reads the pool through the slice's block table and GDN layers advance
the slice's state slot.

Checked per step (``ValueError`` with the reason, nothing written): token count matches
the slices, ``num_tokens >= 1``, block tables cover ``start + num_tokens`` with page ids
in the pool, token ids in the vocabulary, and for hybrid models distinct state slots in
range whose state is at exactly ``start`` tokens (the runner tracks each slot's position:
``forward`` advances it, ``reset_state`` zeroes it, ``restore_state``/``copy_state`` set
it; ``snapshot_state(slot, p)`` refuses unless the slot is at ``p``).
Same code on CPU and CUDA; nothing here assumes a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepwell.logs import get_logger
from engine_service.layers.backend import get_backend
from engine_service.layers.context import DecodeGroup, SeqInfo, StepContext
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
from engine_service.runner_api import ForwardBatch, MemorySpec

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
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.model = model
        self.args = model.args
        self._device = device
        self.dtype = dtype
        self.kv_dtype = resolve_kv_dtype(kv_dtype, dtype)
        self.page_size = page_size
        a = self.args
        self.kv_layout = KVLayout(
            num_layers=len(a.attention_layers),
            num_kv_heads=a.attention.num_kv_heads,
            head_dim=a.attention.head_dim,
            page_size=page_size,
            dtype=self.kv_dtype,
        )
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
        self.kv: KVPool | None = None
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

    def memory_spec(self) -> MemorySpec:
        return MemorySpec(
            page_size=self.page_size,
            bytes_per_page=self.kv_layout.bytes_per_page,
            bytes_per_state_slot=self.state_layout.bytes_per_slot if self.state_layout else 0,
            num_attention_layers=self.kv_layout.num_layers,
            num_recurrent_layers=self.state_layout.num_layers if self.state_layout else 0,
        )

    def allocate(self, num_pages: int, num_state_slots: int) -> None:
        if self.kv is not None or self.state is not None:
            raise RuntimeError("pools are already allocated")
        if self.kv_layout.num_layers:
            self.kv = KVPool(self.kv_layout, num_pages, self._device)
        if self.state_layout is not None:
            self.state = StatePool(self.state_layout, num_state_slots, self._device)
            self._slot_pos = [0] * num_state_slots
        log.info(
            "pools_allocated",
            num_pages=num_pages,
            num_state_slots=num_state_slots if self.state_layout else 0,
            kv_bytes=num_pages * self.kv_layout.bytes_per_page,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        ctx = self._context(batch)
        ids = batch.input_ids.to(self._device, torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        with torch.inference_mode():
            hidden = self.model(ids, ctx, self.kv, self.state)
            if self.state is not None:
                for s in ctx.seqs:
                    self._slot_pos[s.state_slot] = s.start + s.num_tokens
            rows = [
                s.offset + s.num_tokens - 1
                for s, q in zip(ctx.seqs, batch.seqs, strict=True)
                if q.need_logits
            ]
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
    def _context(self, batch: ForwardBatch) -> StepContext:
        if self.kv is None and self.kv_layout.num_layers:
            raise RuntimeError("allocate() must be called before forward()")
        if not batch.seqs:
            raise ValueError("empty batch")
        total = sum(s.num_tokens for s in batch.seqs)
        if total != batch.num_tokens:
            raise ValueError(f"slices cover {total} tokens but input_ids has {batch.num_tokens}")
        ps = self.page_size
        num_pages = self.kv.num_pages if self.kv is not None else 0
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        seqs: list[SeqInfo] = []
        used_slots: set[int] = set()
        offset = 0
        for s in batch.seqs:
            if s.num_tokens < 1 or s.start < 0:
                raise ValueError(f"bad slice: start={s.start}, num_tokens={s.num_tokens}")
            end = s.start + s.num_tokens
            if end > self.max_context:
                raise ValueError(f"position {end} exceeds the model's context {self.max_context}")
            if self.state is not None:
                self.state.check_slot(s.state_slot)
                if s.state_slot in used_slots:
                    raise ValueError(f"state slot {s.state_slot} used twice in one batch")
                if self._slot_pos[s.state_slot] != s.start:
                    raise ValueError(
                        f"state slot {s.state_slot} holds position {self._slot_pos[s.state_slot]} "
                        f"but the slice starts at {s.start} (reset or restore the slot first)"
                    )
                used_slots.add(s.state_slot)
            token_index = None
            if self.kv is not None:
                need = -(-end // ps)
                if len(s.block_table) < need:
                    raise ValueError(
                        f"block table has {len(s.block_table)} pages, "
                        f"{need} needed for {end} tokens"
                    )
                table = torch.as_tensor(list(s.block_table[:need]), dtype=torch.long)
                if int(table.min()) < 0 or int(table.max()) >= num_pages:
                    raise ValueError(f"page ids must be in [0, {num_pages})")
                pos = torch.arange(end)
                token_index = (table[pos // ps] * ps + pos % ps).to(self._device)
                slots.append(token_index[s.start :])
            positions.append(torch.arange(s.start, end))
            seqs.append(SeqInfo(offset, s.num_tokens, s.start, s.state_slot, token_index))
            offset += s.num_tokens
        multi = tuple(s for s in seqs if s.num_tokens > 1)
        single = [s for s in seqs if s.num_tokens == 1]
        return StepContext(
            positions=torch.cat(positions).to(self._device),
            kv_slots=torch.cat(slots) if slots else None,
            seqs=tuple(seqs),
            multi=multi,
            decode=self._decode_group(single) if single else None,
        )

    def _decode_group(self, single: list[SeqInfo]) -> DecodeGroup:
        dev = self._device
        index = lengths = None
        if self.kv is not None:
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
        )


def build_runner(
    source: ModelSource,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_dtype: str = "auto",
    page_size: int = DEFAULT_PAGE_SIZE,
    backend: str = "reference",
) -> TorchModelRunner:
    """Build the model for ``source`` on ``device`` and stream its weights in."""
    dev = torch.device(device)
    model, family, text_cfg = build_model(source.config, dev, dtype, get_backend(backend))
    load_weights(model, family, text_cfg, source.iter_tensors())
    log.info(
        "runner_built",
        model_id=source.model_id,
        architecture=model.args.architecture,
        device=str(dev),
        dtype=str(dtype),
    )
    return TorchModelRunner(model, dev, dtype, kv_dtype, page_size)
