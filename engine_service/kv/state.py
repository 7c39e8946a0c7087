"""The recurrent-state pool of Gated DeltaNet layers: per layer conv ``[slots, conv_dim, K - 1]``
in the model dtype and recurrent ``[slots, Hv, Dk, Dv]`` in fp32 (always: the recurrence
accumulates).

A slot holds either a running sequence's state or a *state image*: a copy of a sequence's
state at one position, kept by a prefix-cache entry (``copy``: every layer's rows, bit-exact).
Which slot is which is the block manager's business; this module only holds the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepwell.engine_service.kv.pool import copy_rows, export_rows, import_rows, row_nbytes


@dataclass(frozen=True)
class StateLayout:
    num_layers: int
    conv_dim: int
    conv_width: int  # K - 1
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        conv_elem = torch.empty((), dtype=self.conv_dtype).element_size()
        conv = self.conv_dim * self.conv_width * conv_elem
        rec = self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
        return self.num_layers * (conv + rec)


class StatePool:
    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1 for a hybrid model, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        lay = layout
        self.conv = [torch.zeros(num_slots, lay.conv_dim, lay.conv_width, dtype=lay.conv_dtype, device=device)
                     for _ in range(lay.num_layers)]
        self.recurrent = [torch.zeros(num_slots, lay.num_v_heads, lay.head_k_dim, lay.head_v_dim,
                                      dtype=torch.float32, device=device)
                          for _ in range(lay.num_layers)]

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every state tensor, dim 0 = slot (``kv.pool``'s byte movers use these)."""
        return [*self.conv, *self.recurrent]

    @property
    def slot_nbytes(self) -> int:
        return row_nbytes(self.slot_tensors())

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} out of range [0, {self.num_slots})")

    def reset(self, slot: int) -> None:
        self.check_slot(slot)
        for t in self.slot_tensors():
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a bit-exact copy of slot ``src`` (every layer)."""
        self.check_slot(src)
        self.check_slot(dst)
        if src != dst:
            copy_rows(self.slot_tensors(), [src], [dst])

    def export(self, slots: Sequence[int], out: torch.Tensor) -> None:
        for s in slots:
            self.check_slot(s)
        export_rows(self.slot_tensors(), slots, out)

    def load(self, slots: Sequence[int], src: torch.Tensor) -> None:
        for s in slots:
            self.check_slot(s)
        import_rows(self.slot_tensors(), slots, src)
