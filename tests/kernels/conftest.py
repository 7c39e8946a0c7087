"""Kernel tests: without CUDA the Triton kernels run in the interpreter (set before triton loads)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
