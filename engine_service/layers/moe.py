"""Top-k softmax-routed mixture of experts with an optional sigmoid-gated shared expert.

Parameters follow HF's fused layout: ``experts.gate_up_proj [E, 2I, H]`` (gate rows then
up rows) and ``experts.down_proj [E, H, I]``; checkpoints with per-expert tensors are
written into slices of these by the loader. Routing: softmax over all experts in fp32,
top-k, renormalised when ``norm_topk_prob``.

FP8 experts (``FP8Experts``: an FP8 checkpoint's per-expert codes and scales loaded natively
after ``prepare_experts``, or 16-bit experts quantized after loading by ``quantize_experts``)
hold half the bytes; the backend's ``moe_experts`` reads them with their ``Scales``.
"""

from __future__ import annotations

import torch
from torch import nn

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.mlp import SwiGLU, linear
from deepwell.kernels import fp8_gemm
from deepwell.kernels.moe.reference import Scales
from deepwell.kernels.moe.triton_kernel import BLOCK_K


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate), requires_grad=False
        )


class FP8Experts(nn.Module):
    """``Experts`` as block-scaled FP8: E4M3 codes ``gate_up_proj [E, 2I, H]`` / ``down_proj
    [E, H, I]`` and fp32 scales ``*_scale_inv [E, ceil(rows / bn), ceil(cols / bk)]`` (the Qwen
    FP8 checkpoint layout per expert, stacked). ``I`` must be a multiple of ``bn``, so the gate
    and up halves of ``gate_up_proj`` own whole scale blocks (a checkpoint stores them apart)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, block: tuple[int, int],
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        bn, bk = block
        if intermediate % bn:
            raise ValueError(f"FP8 experts need the intermediate size ({intermediate}) a multiple of the scale "
                             f"block's {bn} rows")
        self.block = block

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            make = torch.empty if dtype != torch.float32 else torch.ones
            return nn.Parameter(make(*shape, dtype=dtype, device=device), requires_grad=False)

        fp8 = torch.float8_e4m3fn
        self.gate_up_proj = param(num_experts, 2 * intermediate, hidden, dtype=fp8)
        self.gate_up_proj_scale_inv = param(num_experts, 2 * intermediate // bn, -(-hidden // bk),
                                            dtype=torch.float32)
        self.down_proj = param(num_experts, hidden, intermediate, dtype=fp8)
        self.down_proj_scale_inv = param(num_experts, -(-hidden // bn), -(-intermediate // bk), dtype=torch.float32)

    @classmethod
    def from_experts(cls, experts: Experts, block: tuple[int, int]) -> FP8Experts:
        """``experts`` quantized (each expert's blocks: scale = amax / 448, codes round to nearest)."""
        num, two_i, hidden = experts.gate_up_proj.shape
        out = cls(num, hidden, two_i // 2, block, experts.gate_up_proj.device)
        with torch.no_grad():
            for src, codes, scales in ((experts.gate_up_proj, out.gate_up_proj, out.gate_up_proj_scale_inv),
                                       (experts.down_proj, out.down_proj, out.down_proj_scale_inv)):
                for e in range(num):
                    codes[e], scales[e] = fp8_gemm.quantize(src[e].detach(), block)
        return out

    def scales(self) -> Scales:
        return Scales(self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.block)

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"experts={e}, hidden={h}, intermediate={two_i // 2}, fp8 blocks={self.block}"


def fp8_experts_fit(experts: Experts, block: tuple[int, int]) -> bool:
    """Whether ``FP8Experts`` can hold these experts and the kernels read them: the intermediate
    size a multiple of ``bn``, ``bk`` a multiple of the kernels' K step."""
    return (experts.gate_up_proj.shape[1] // 2) % block[0] == 0 and block[1] % BLOCK_K == 0


def prepare_experts(model: nn.Module, block: tuple[int, int]) -> set[str]:
    """Before loading: every ``Experts`` that fits becomes ``FP8Experts`` (empty codes, unit
    scales; the 16-bit tensors freed as it goes). Returns the weight names a checkpoint's FP8
    pairs load into: the fused ``<m>.gate_up_proj`` / ``<m>.down_proj`` and the per-expert
    ``<m>.{e}.{gate,up,down}_proj.weight``."""
    names: set[str] = set()
    for full, parent, child_name, child in _experts(model):
        if not fp8_experts_fit(child, block):
            continue
        num, two_i, hidden = child.gate_up_proj.shape
        setattr(parent, child_name, FP8Experts(num, hidden, two_i // 2, block, child.gate_up_proj.device))
        names |= {f"{full}.gate_up_proj", f"{full}.down_proj"}
        names |= {f"{full}.{e}.{proj}.weight" for e in range(num) for proj in ("gate_proj", "up_proj", "down_proj")}
    return names


def quantize_experts(model: nn.Module, block: tuple[int, int]) -> tuple[int, int]:
    """After loading: every ``Experts`` that fits replaced by its quantized ``FP8Experts``, one
    at a time; returns (modules replaced, bytes saved)."""
    count, saved = 0, 0
    for _full, parent, child_name, child in _experts(model):
        if not fp8_experts_fit(child, block):
            continue
        before = sum(p.numel() * p.element_size() for p in child.parameters())
        q = FP8Experts.from_experts(child, block)
        setattr(parent, child_name, q)
        saved += before - sum(p.numel() * p.element_size() for p in q.parameters())
        count += 1
    return count, saved


def _experts(model: nn.Module):  # type: ignore[no-untyped-def]
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Experts):
                yield (f"{name}.{child_name}" if name else child_name), parent, child_name, child


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        norm_topk_prob: bool,
        backend: ReferenceBackend,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.backend = backend
        self.gate = Router(num_experts, hidden)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate > 0:
            self.shared_expert = SwiGLU(hidden, shared_intermediate, backend=backend)
            self.shared_expert_gate = linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.backend.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        ex = self.experts
        scales = ex.scales() if isinstance(ex, FP8Experts) else None
        out = self.backend.moe_experts(x, ex.gate_up_proj, ex.down_proj, top_i, top_w.to(x.dtype), scales)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + self.backend.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
