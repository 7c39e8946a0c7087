"""The contract between the scheduler side of the engine and the model side.

The scheduler (``engine_service.scheduler`` and friends) decides *which* tokens run in a
step and *where* their KV and recurrent state live; the model runner
(``engine_service.models`` / ``engine_service.runner``) does the maths. They meet only
through the types below, so each side is testable alone (the scheduler against a fake
runner, the runner against HF transformers with a trivial page allocator).

Memory model
------------
- Attention layers keep K/V in a paged pool: page ``p`` holds positions
  ``[i * page_size, (i + 1) * page_size)`` of a sequence whose block table has ``p`` at
  index ``i``. The scheduler owns page allocation and refcounts (``BlockManager``); the
  runner owns the page tensors and writes/reads them through the block tables it is
  given.
- Recurrent (Gated DeltaNet) layers keep conv + recurrent state per *state slot*; the
  scheduler assigns one slot per running sequence. A sequence's state in its slot always
  corresponds to exactly ``start`` tokens (its computed tokens).
- State images: ``copy_state(src, dst)`` makes slot ``dst`` a bit-exact copy of ``src``. After
  a step whose slice ended exactly at a position ``p`` the engine copies the sequence's slot
  into an image slot; copying the image back into a slot later resumes at ``p`` exactly as
  if the sequence had stopped there (attention KV for positions ``< p`` is never rewritten).
- ``copy_pages(src, dst)`` copies whole KV pages (every attention layer): a sequence resuming
  from a cut inside a shared page gets its own copy of that page before it writes there.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


def page_tensor(table: Sequence[int], n: int) -> torch.Tensor:
    """``table[:n]`` as an int32 CPU tensor. A block table that is an ``array('i')`` (what the
    engine passes: ``BlockManager.table_array``) becomes one by a memory copy; any other
    sequence is converted element by element (~20 ns a page: 40 us for a 128k-token
    context, which a step would otherwise pay several times per sequence)."""
    if isinstance(table, array) and table.typecode == "i":
        part = table[:n]
        return torch.frombuffer(part, dtype=torch.int32) if len(part) else torch.empty(0, dtype=torch.int32)
    return torch.tensor([int(p) for p in table[:n]], dtype=torch.int32)


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a forward step."""

    state_slot: int  # row in the recurrent-state pool (-1 for attention-only models)
    block_table: Sequence[int]  # page ids covering positions [0, start + num_tokens)
    start: int  # tokens already computed (the first position of this slice)
    num_tokens: int  # new tokens in this step, >= 1
    need_logits: bool = True  # return logits for the slice's last token
    all_logits: bool = False  # return logits for every token of the slice, in order (scoring: perplexity)
    # speculative verify slice (implies all_logits): recurrent state stays at ``start`` until
    # ``accept(slot, n)`` commits its first n tokens; attention KV beyond them is ignored later
    verify: bool = False


@dataclass(frozen=True)
class DraftInput:
    """One sequence's part of MTP drafting after a forward (``TorchModelRunner.propose``)."""

    block_table: Sequence[int]  # pages covering start + len(tokens) + num_drafts - 1 positions
    start: int  # position of the slice the last forward computed for it
    hidden_row: int  # that slice's first row in the forward's batch
    tokens: Sequence[int]  # the tokens that follow positions start .. start + len - 1 (len: rows computed)
    num_drafts: int  # tokens to draft after them (0: only fill the MTP layers' KV)


@dataclass
class ForwardBatch:
    """A step: the slices' new tokens concatenated in slice order."""

    input_ids: torch.Tensor  # [sum(num_tokens)] int64, on the host (the engine's) or the runner's device
    seqs: list[SeqSlice]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class MemorySpec:
    """What one KV page and one state slot cost, so the scheduler can size its pools."""

    page_size: int  # tokens per page
    bytes_per_page: int  # all attention layers together
    bytes_per_state_slot: int  # all recurrent layers together (0 for attention-only)
    num_attention_layers: int
    num_recurrent_layers: int
    # what one page would cost in each KV dtype this model can use (sizing logs and errors)
    page_bytes_by_kv_dtype: tuple[tuple[str, int], ...] = ()

    @property
    def hybrid(self) -> bool:
        return self.num_recurrent_layers > 0


class ModelRunner(Protocol):
    """What the scheduler needs from the model side."""

    @property
    def device(self) -> torch.device: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def memory_spec(self) -> MemorySpec: ...

    def allocate(self, num_pages: int, num_state_slots: int) -> None:
        """Create the KV page pool and the state pool (called once, before forward)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; return fp32 logits [rows, vocab]: per slice in order, one row per token
        where ``all_logits``, else one for the last token where ``need_logits``."""

    def reset_state(self, slot: int) -> None:
        """Zero a state slot before a new sequence starts in it."""

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Slot ``dst_slot`` becomes a bit-exact copy of ``src_slot`` (no-op without state)."""

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """KV pages ``dst[i]`` become byte copies of ``src[i]`` in every attention layer."""


