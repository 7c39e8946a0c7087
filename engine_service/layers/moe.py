"""Top-k softmax-routed mixture of experts with an optional sigmoid-gated shared expert.

Parameters follow HF's fused layout: ``experts.gate_up_proj [E, 2I, H]`` (gate rows then
up rows) and ``experts.down_proj [E, H, I]``; checkpoints with per-expert tensors are
written into slices of these by the loader. Routing: softmax over all experts in fp32,
top-k, renormalised when ``norm_topk_prob``.
"""

from __future__ import annotations

import torch
from torch import nn

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.mlp import SwiGLU, linear


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate), requires_grad=False
        )


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
        out = self.backend.moe_experts(
            x, self.experts.gate_up_proj, self.experts.down_proj, top_i, top_w.to(x.dtype)
        )
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + self.backend.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
