"""The compute capability of a CUDA device, asked of the driver once per device: launchers
ask it every step (Gluon kernels: Hopper only; PDL: 9.0 on; Triton's fp8 type: 8.9 on,
``kernels.e4m3_unpack``; the unpacking PTX blocks: ``paged_attention.triton_kernel.unpack_asm_for``)."""

from __future__ import annotations

import functools

import torch


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of CUDA ``device`` (its index, or the current device)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)
