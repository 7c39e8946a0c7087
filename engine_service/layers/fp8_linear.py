"""Linear layers with block-scaled FP8 weights (``--weight-dtype fp8``).

``FP8Linear`` holds a weight as E4M3 codes ``weight [N, K]`` and fp32 block scales
``weight_scale_inv [ceil(N / bn), ceil(K / bk)]`` (the DeepSeek-V3 / Qwen FP8 checkpoint
layout: the scale multiplies) and computes ``x @ w.T (+ bias)`` through
``kernels.fp8_gemm.matmul``: the W8A16 Triton kernel on CUDA (one byte per weight read), the
reference (dequantize, then matmul) on CPU. Activations stay in the model dtype.

``prepare_linears(model, block)`` does the same replacement *before* loading, with empty codes and
scales: an FP8 checkpoint's own codes and scales then load into them unchanged (native serving,
``models.loader``), and a layer the checkpoint has in 16 bits is quantized as it loads.

``quantize_linears(model)`` replaces, after the weights are loaded, every ``nn.Linear`` of the
decoder layers (and the MTP module) whose sides are both at least ``min_features`` by its FP8
form (scale = block amax / 448); the embedding, the LM head, MoE routers (``mlp.gate``) and
small projections (the Gated DeltaNet's per-head ``in_proj_a`` / ``in_proj_b``) stay in the
model dtype, as in Qwen's own FP8 checkpoints. MoE experts (fused tensors) have their own FP8
form, ``layers.moe.FP8Experts`` (``prepare_experts`` / ``quantize_experts``).

``attach_draft_head(model)`` gives a model that drafts with its MTP layer an FP8 copy of its LM
head, ``model.draft_head``: a draft step reads half the bytes of the 16-bit head (at the 27B shape
1.27 GB instead of 2.54, four times per round of four drafts), for as much memory taken from the
KV pool (``DEEPWELL_FP8_DRAFT_HEAD=0`` keeps it there). Only drafting uses it, and only for
calls of fewer than ``fp8_gemm.DEQUANT_MIN_TOKENS`` rows (``serves_draft_rows``; more would
dequantize the whole head); the main model's logits, which verification compares the drafts
with, stay those of the 16-bit head, so outputs do not change.

``tune(model)`` (CUDA, after loading) picks, per weight shape and row count, the fastest
few-token kernel timed there (``kernels.fp8_gemm.tune``: the tensor-core one, its form with
swapped operands, or the FMA one); ``DEEPWELL_FP8_FMA_MAX_TOKENS`` pins instead: the FMA kernel up
to that many rows, the tensor-core one above (0: always).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from deepwell.kernels import fp8_gemm

BLOCK = (128, 128)


class FP8Linear(nn.Module):
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 block: tuple[int, int] = BLOCK) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.block = block
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, layer: nn.Linear, block: tuple[int, int] = BLOCK) -> FP8Linear:
        codes, scales = fp8_gemm.quantize(layer.weight.detach(), block)
        bias = layer.bias.detach() if layer.bias is not None else None
        return cls(codes, scales, bias, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = fp8_gemm.matmul(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv, self.block,
                              self.bias)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks={self.block}"


def _eligible(model: nn.Module, min_features: int, skip: tuple[str, ...]):  # type: ignore[no-untyped-def]
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, nn.Linear) or any(full == s or full.endswith("." + s) for s in skip):
                continue
            if min(child.in_features, child.out_features) < min_features:
                continue
            yield full, parent, child_name, child


def prepare_linears(model: nn.Module, block: tuple[int, int] = BLOCK, min_features: int = 128,
                    skip: tuple[str, ...] = ("lm_head", "gate")) -> set[str]:
    """Before loading: the layers ``quantize_linears`` would replace become ``FP8Linear`` with
    empty codes and scales (each layer's 16-bit weight is freed as it goes). Returns their
    weight parameter names (``<module>.weight``)."""
    names: set[str] = set()
    for full, parent, child_name, child in _eligible(model, min_features, skip):
        n, k = child.out_features, child.in_features
        dev = child.weight.device
        codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.ones(-(-n // block[0]), -(-k // block[1]), dtype=torch.float32, device=dev)
        bias = child.bias.detach() if child.bias is not None else None
        setattr(parent, child_name, FP8Linear(codes, scales, bias, block))
        names.add(f"{full}.weight")
    return names


def quantize_linears(model: nn.Module, min_features: int = 128, block: tuple[int, int] = BLOCK,
                     skip: tuple[str, ...] = ("lm_head", "gate")) -> tuple[int, int]:
    """Replace eligible ``nn.Linear`` modules of ``model`` in place; returns (layers replaced,
    weight bytes saved). One layer at a time, so the peak is one layer's extra copy."""
    count, saved = 0, 0
    for _full, parent, child_name, child in _eligible(model, min_features, skip):
        before = child.weight.numel() * child.weight.element_size()
        q = FP8Linear.from_linear(child, block)
        setattr(parent, child_name, q)
        saved += before - q.weight.numel() - q.weight_scale_inv.numel() * 4
        count += 1
    return count, saved


class FP8EnvError(ValueError):
    """An FP8 environment setting (``DEEPWELL_FP8_*``) out of range; the engine refuses to start."""


DRAFT_HEAD = "draft_head"
DRAFT_HEAD_ENV = "DEEPWELL_FP8_DRAFT_HEAD"  # "0": draft through the 16-bit head (its memory goes to the KV pool)


def wants_draft_head() -> bool:
    """Whether FP8 models that draft get the FP8 draft head (``DRAFT_HEAD_ENV`` unset or "1";
    ``FP8EnvError`` for anything else)."""
    value = os.environ.get(DRAFT_HEAD_ENV, "1")
    if value not in ("0", "1"):
        raise FP8EnvError(f"{DRAFT_HEAD_ENV}={value!r}: use 1 (drafts read an FP8 copy of the LM head, the default) "
                         "or 0 (they read the 16-bit head; the copy's memory goes to the KV pool)")
    return value == "1"


def attach_draft_head(model: nn.Module, block: tuple[int, int] = BLOCK) -> int:
    """``model.draft_head`` = ``model.lm_head`` quantized to FP8 (the head itself is kept);
    returns the copy's bytes (codes and scales)."""
    head = FP8Linear.from_linear(model.lm_head, block)  # type: ignore[arg-type]
    setattr(model, DRAFT_HEAD, head)
    return head.weight.numel() + head.weight_scale_inv.numel() * head.weight_scale_inv.element_size()


def serves_draft_rows(rows: int) -> bool:
    """Whether a draft call of ``rows`` rows goes through the FP8 draft head: fewer than the FP8
    matmul dequantizes a whole weight for (``fp8_gemm.DEQUANT_MIN_TOKENS``)."""
    from deepwell.kernels.fp8_gemm.triton_kernel import DEQUANT_MIN_TOKENS

    return rows < DEQUANT_MIN_TOKENS


def dequant_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The largest ``FP8Linear`` weight of ``model`` dequantized into ``dtype`` (what one call with
    ``fp8_gemm.DEQUANT_MIN_TOKENS`` rows or more allocates for a moment); 0 without FP8 layers.
    The draft head is never called with that many rows (``serves_draft_rows``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return max((m.out_features * m.in_features * elem for name, m in model.named_modules()
                if isinstance(m, FP8Linear) and name != DRAFT_HEAD), default=0)


FMA_ENV = "DEEPWELL_FP8_FMA_MAX_TOKENS"


def tune(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, Any] | None:
    """Set ``fp8_gemm``'s few-token kernels for ``model``'s FP8 layers on ``device`` (``FMA_ENV``
    if set, else timed per shape and row count); returns what was chosen and why (for the log),
    None without FP8 layers or off CUDA."""
    from deepwell.kernels.fp8_gemm import tune as fp8_tune

    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    if not layers or device.type != "cuda":
        return None
    pinned = os.environ.get(FMA_ENV)
    if pinned is not None:
        try:
            rows = int(pinned)
            fp8_tune.apply(rows)
        except ValueError as exc:
            raise FP8EnvError(f"{FMA_ENV}={pinned!r}: {exc}") from None
        return {"fma_max_tokens": rows, "source": FMA_ENV}
    shapes = {(m.out_features, m.in_features) for m in layers}
    try:
        choice, times, rejected = fp8_tune.tune_kernels(shapes, device, dtype, layers[0].block)
    finally:  # the timing's random weights go back to the device before the KV pool is sized
        torch.cuda.empty_cache()
    fp8_tune.apply(0, choice)
    out: dict[str, Any] = {"source": "timed", "kernels": fp8_tune.summary(choice),
                           "us": {f"{n}x{k}": {m: {kind: round(s * 1e6, 1) for kind, s in row.items()}
                                               for m, row in t.items()} for (n, k), t in times.items()}}
    if rejected:  # a kernel that failed its check against "w8a16" is not served
        out["rejected"] = {kind: f"relative error {err:.3g}" for kind, err in rejected.items()}
    return out
