"""Programmatic dependent launch (PDL) for the chains of short kernels in a decode step.

A decode step is chains of short kernels: in an attention layer the KV append, Q's Hadamard
rotation, the attention and, with split-K, the merge; between GEMMs the norms, SwiGLU and the
GEMMs' split-K sums. Launched the ordinary way, each starts
only once the one before has drained and its own launch has been processed — a gap of about a
microsecond per edge, which is a sizable part of a 3 us append or a 50 us batch-1 decode.
Launched with PDL (Hopper and later: ``launch_pdl=True``), a kernel's programs may be scheduled
while the previous kernel in the stream still runs. The contract every such kernel keeps:

- ``enter(PDL)`` is its first statement: ``griddepcontrol.wait`` (blocks until the previous
  kernel has completed and its writes are visible — whatever that kernel is: one launched
  without PDL simply counts as signalling at its end), then ``griddepcontrol.launch_dependents``
  (the next kernel's programs may now be scheduled; they wait in turn). No global memory is
  read or written before the wait (L2 prefetches aside, below), so reads and writes keep stream
  order exactly as without PDL;
- a CUDA graph captured from such launches keeps the programmatic edges (CUDA 12.3+).

So at most two kernels overlap, and only the second one's launch and prologue overlap the first
one's tail. A weight-streaming kernel also issues L2 prefetches of its weight before the wait
(``enter_streaming``): a prefetch fills L2, the GPU's point of coherence, and moves no value into
the program, so what the program reads after the wait is unchanged. Which kernel families are
launched so: ``DEFAULT`` (append, Q rotation, merge, the fused small ops and the few-row GEMMs; the
attention kernels measured no gain), or ``DEEPWELL_PDL`` = ``0`` (none: ablation, a driver that
misbehaves), ``all``, or a comma-separated list of ``KERNELS``. The Triton interpreter and CPUs
never use it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepwell.kernels.cuda_arch import capability

ENV = "DEEPWELL_PDL"


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch_kwargs``: wait for the previous
    kernel, then let the next one be scheduled (module doc). A no-op when ``PDL`` is false."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# the kernel families ``DEEPWELL_PDL`` may name: "fused" (``kernels.fused``: norms, SwiGLU, RoPE, GDN
# gating) and "linear" (the few-row GEMMs: ``kernels.gemv``, ``kernels.fp8_gemm``, and their split-K
# sums) are the chains between a decode step's GEMMs
KERNELS = ("append", "rotate", "attention", "merge", "fused", "linear")
# measured (docs/kernels.md, "Programmatic dependent launch"): the small kernels gain, the attention
# kernels do not (their early-resident dependents cost up to 3% at 4k x 64, H200); "fused" + "linear"
# with the weight prefetch took an FP8 27B decode step (H100, 4k x 1) from 14.2 to 13.8 ms with the
# FMA kernel at one row, from 16.9 to 15.0 with the tensor-core kernels
DEFAULT = ("append", "rotate", "merge", "fused", "linear")


# A kernel that streams a weight can start fetching it before its wait (no kernel writes a weight
# while the engine serves; and a prefetch only warms L2, so even then no value would change: module
# doc). ``enter_streaming`` issues
# L2 prefetches of the first ``PREFETCH_ENV`` (default ``PREFETCH_LINES``) 128-byte lines of each
# of the program's weight rows, then waits: the weight starts to stream while the previous kernel
# drains (only where the previous kernel let this one be scheduled early, i.e. was itself
# launched with PDL). ``DEEPWELL_PDL_PREFETCH=0`` waits first (ablation).
PREFETCH_ENV = "DEEPWELL_PDL_PREFETCH"
PREFETCH_LINES = 4


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def enter_streaming(PDL: tl.constexpr, rows, k_lo, k_hi, LINES: tl.constexpr):
    """``enter`` for a kernel streaming a weight (see ``PREFETCH_ENV``): ``rows [R]`` pointers to
    element ``k_lo`` of each of the program's weight rows (rows past the matrix clamped into it),
    ``[k_lo, k_hi)`` the program's K slice. With ``PDL`` and ``LINES`` > 0, each row's first
    ``LINES`` 128-byte lines of the slice are prefetched into L2 before the wait; nothing is
    loaded into the program before it."""
    if PDL:
        if LINES > 0:
            if k_hi > k_lo:
                step: tl.constexpr = 128 // (rows.dtype.element_ty.primitive_bitwidth // 8)
                off = tl.minimum(tl.arange(0, LINES) * step, k_hi - k_lo - 1)
                _prefetch_l2(rows[:, None] + off[None, :])
        gdc_wait()
        gdc_launch_dependents()


def selected() -> frozenset[str]:
    """Kernel families launched with PDL: ``DEEPWELL_PDL`` unset = ``DEFAULT``, ``0`` = none,
    ``all`` = every one of ``KERNELS``, else a comma-separated subset (ValueError for an unknown
    name)."""
    value = os.environ.get(ENV, "").strip()
    if value == "":
        return frozenset(DEFAULT)
    if value == "0":
        return frozenset()
    if value == "all":
        return frozenset(KERNELS)
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(names - set(KERNELS))
    if unknown:
        raise ValueError(f"{ENV}={value!r}: unknown kernel families {unknown}; use 0, all or a comma-separated "
                         f"subset of {', '.join(KERNELS)}")
    return names


def enabled(device: torch.device, kernel: str) -> bool:
    """PDL for a launch of ``kernel`` (one of ``KERNELS``) on ``device``: a CUDA device of compute
    capability 9.0 or later, not the interpreter, and selected by ``DEEPWELL_PDL``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel family {kernel!r}; one of {KERNELS}")
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1" or kernel not in selected():
        return False
    return capability(device) >= (9, 0)


def launch_kwargs(device: torch.device, kernel: str) -> dict:
    """Keyword arguments of a Triton / Gluon launch of ``kernel``: its ``PDL`` constexpr and,
    where enabled, ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device, kernel) else {"PDL": False}


def prefetch_lines() -> int:
    """``PREFETCH_ENV``'s lines per weight row (unset: ``PREFETCH_LINES``; ValueError unless 0 or
    a power of two up to 64)."""
    value = os.environ.get(PREFETCH_ENV, "").strip()
    if value == "":
        return PREFETCH_LINES
    if not value.isdigit() or int(value) > 64 or int(value) & (int(value) - 1):
        raise ValueError(f"{PREFETCH_ENV}={value!r}: lines per weight row must be 0 or a power of two up to 64")
    return int(value)


def check_env() -> None:
    """ValueError naming the variable if ``ENV``, ``PREFETCH_ENV`` or the split-K sum's switch
    (``gemv.triton_kernel.FIXUP_ENV``) holds a value the kernels would refuse at their first
    launch: the engine asks before it loads weights."""
    from deepwell.kernels.gemv.triton_kernel import fixup_enabled

    selected()
    prefetch_lines()
    fixup_enabled()


def streaming_kwargs(device: torch.device) -> dict:
    """``launch_kwargs`` of a weight-streaming ("linear") kernel, with its ``PREFETCH`` lines
    (``enter_streaming``): 0 where PDL is off."""
    kw = launch_kwargs(device, "linear")
    return {**kw, "PREFETCH": prefetch_lines() if kw["PDL"] else 0}
