"""Per-step batch metadata shared by every layer of one forward.

``StepContext`` is built once per ``ForwardBatch`` by the runner: flat ``positions`` and
KV ``slots`` (page * page_size + offset) for every new token, and per sequence the token
range in the batch, its start position, the gather index of its cached tokens (float KV
pool) and its state slot (for recurrent layers). Layers never see block tables; only the
KV store of an attention layer reads the page tables below.

A *verify* slice (speculative decoding: the last sampled token and the drafts after it) runs
like any multi-token slice, except that recurrent layers leave its state slot at ``start``:
each records what it needs in ``StepContext.verify`` (``VerifyRecord``), and the runner's
``accept`` replays the first L tokens into the slot once L is known.

When every slice of a step is a verify slice of the same length T (a speculative decode step
over a quantized KV store), they form one ``VerifyGroup`` instead: attention runs the decode
kernels with T tokens per sequence, the recurrent layers run the B sequences' T tokens as one
batched op from gathered states, and each records one *group commit* that replays the first
L_b tokens of every sequence at once (``lengths`` on the device: the step can be a CUDA graph).

Single-token slices (decode) are also gathered into a ``DecodeGroup`` so layers can run
them as one batched op: their batch rows, state slots, and the KV gather index padded to
the longest context (``lengths`` masks the padding).

With a quantized KV store (``engine_service.kv.quant_pool``) the runner fills ``PageTables``
instead of gather indices: int32 block tables ``[B, max_pages]`` (padded with page 0) and
int32 context lengths ``[B]`` (cached tokens *including* the new ones), for the
multi-token slices (``StepContext.prefill``, one varlen kernel call) and the decode group
(``DecodeGroup.pages``). Exactly one of the two forms is present for a step with KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqInfo:
    offset: int  # first row of this sequence in the batch's token dimension
    num_tokens: int
    start: int  # position of the first new token
    state_slot: int
    token_index: torch.Tensor | None  # [start + num_tokens] flat KV rows; None: no float KV pool
    verify: bool = False  # speculative verify slice: recurrent state committed later (VerifyRecord)


@dataclass(frozen=True)
class PageTables:
    """Some slices in paged-kernel form (quantized KV store)."""

    rows: torch.Tensor  # [sum(q_lens)] int64 batch rows of the slices' tokens, back to back
    block_tables: torch.Tensor  # [B, max_pages] int32, padded with 0
    context_lens: torch.Tensor  # [B] int32: start + num_tokens
    q_lens: tuple[int, ...]  # new tokens of each slice


@dataclass(frozen=True)
class DecodeGroup:
    rows: torch.Tensor  # [B] batch rows of the single-token slices
    state_slots: torch.Tensor  # [B] their state slots (hybrid models)
    token_index: torch.Tensor | None  # [B, Lmax] flat KV rows, padded with row 0 (float pool)
    lengths: torch.Tensor | None  # [B] context length (start + 1) of each (float pool)
    pages: PageTables | None = None  # quantized KV store


@dataclass(frozen=True)
class VerifyGroup:
    """B verify slices of T tokens each, rows ``b * T + t`` of the batch (sequence-major)."""

    tokens_per_seq: int  # T
    slots: tuple[int, ...]  # host state slots, in batch order
    state_slots: torch.Tensor  # [B] int64 on the device
    pages: PageTables  # block tables and context lengths (start + T) of the B slices


Commit = Callable[[int], None]  # replay the first L tokens of a verify slice into its slot
GroupCommit = Callable[[torch.Tensor], None]  # [B] int64 lengths (device): replay each slice's first L_b


@dataclass
class VerifyRecord:
    """Per verify slice (by state slot), one commit per recurrent layer, filled during the forward;
    for a ``VerifyGroup``, one group commit per recurrent layer instead."""

    commits: dict[int, list[Commit]] = field(default_factory=dict)
    group: list[GroupCommit] = field(default_factory=list)

    def add(self, slot: int, commit: Commit) -> None:
        self.commits.setdefault(slot, []).append(commit)

    def add_group(self, commit: GroupCommit) -> None:
        self.group.append(commit)


@dataclass(frozen=True)
class StepContext:
    positions: torch.Tensor  # [T] int64
    kv_slots: torch.Tensor | None  # [T] int64 flat KV rows for the new tokens
    seqs: tuple[SeqInfo, ...]  # every slice
    multi: tuple[SeqInfo, ...] = ()  # slices with num_tokens > 1 (run one by one)
    decode: DecodeGroup | None = None  # slices with num_tokens == 1 (run batched)
    prefill: PageTables | None = None  # the ``multi`` slices, quantized KV store only
    verify: VerifyRecord | None = None  # present when a slice is a verify slice
    verify_group: VerifyGroup | None = None  # every slice a verify slice of one length (then no multi)
