"""The one decoder every registered family builds: embeddings, a stack of
(token mixer + MLP) blocks with pre-norm residuals, final norm, LM head, optional MTP.

Parameter names equal HF's ``*ForCausalLM`` names (``model.layers.{i}.self_attn...``,
``model.layers.{i}.linear_attn...``, ``lm_head.weight``), so checkpoints load by name.
Attention layer ``i`` uses KV pool layer ``attn_index[i]``; GDN layer ``i`` uses state
pool layer ``state_index[i]``. ``forward`` returns final hidden states *before* the
final norm; ``logits(h)`` applies norm + LM head to the rows that need logits only.
"""

from __future__ import annotations

import torch
from torch import nn

from deepwell.engine_service.layers.attention import Attention
from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.context import StepContext
from deepwell.engine_service.layers.fp8_linear import serves_draft_rows
from deepwell.engine_service.layers.gdn import GatedDeltaNet
from deepwell.engine_service.layers.mlp import SwiGLU, linear
from deepwell.engine_service.layers.moe import SparseMoE
from deepwell.engine_service.layers.norm import RMSNorm
from deepwell.engine_service.layers.rope import RotaryEmbedding
from deepwell.engine_service.kv.pool import PagePool
from deepwell.engine_service.kv.state import StatePool
from deepwell.engine_service.models.spec import FULL, ModelArgs


def make_mlp(args: ModelArgs, use_moe: bool, backend: ReferenceBackend) -> nn.Module:
    if use_moe and args.moe is not None:
        m = args.moe
        return SparseMoE(
            args.hidden, m.num_experts, m.top_k, m.intermediate, m.shared_intermediate,
            m.norm_topk_prob, backend,
        )
    return SwiGLU(args.hidden, args.intermediate, args.mlp_bias, backend)


class DecoderLayer(nn.Module):
    def __init__(
        self, args: ModelArgs, use_moe: bool, backend: ReferenceBackend, kind: str
    ) -> None:
        super().__init__()
        self.kind = kind
        if kind == FULL:
            self.self_attn = Attention(args.attention, backend)
        else:
            assert args.gdn is not None
            self.linear_attn = GatedDeltaNet(args.gdn, backend)
        self.mlp = make_mlp(args, use_moe, backend)
        zc = args.zero_centered_norm
        self.input_layernorm = RMSNorm(args.hidden, args.rms_eps, zc, backend)
        self.post_attention_layernorm = RMSNorm(args.hidden, args.rms_eps, zc, backend)


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs, backend: ReferenceBackend) -> None:
        super().__init__()
        # given its (empty) weight, nn.Embedding skips the random init, which on a meta
        # tensor would import torch._dynamo (~3 s of every engine start on CPU)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden,
                                         _weight=torch.empty(args.vocab_size, args.hidden), _freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(args, i in args.moe_layers, backend, kind)
            for i, kind in enumerate(args.layer_types)
        )
        self.norm = RMSNorm(args.hidden, args.rms_eps, args.zero_centered_norm, backend)


class MTPModule(nn.Module):
    """Multi-token prediction (``mtp.*``): the draft model of speculative decoding.

    Layout as in Qwen3.5/Qwen3-Next checkpoints: ``fc`` [H, 2H], ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``layers.{i}`` (full-attention decoder layers) and ``norm``; the
    embedding and LM head are the main model's. Row ``i`` of a step pairs the embedding of a
    token ``t[p+1]`` with the (final-normed) hidden state ``h[p]`` that predicted it, at
    position ``p``: ``x = fc([norm_e(embed(t)) | norm_h(h)])``, then the layers (their own KV in
    the pool, one page-pool layer each after the main model's), then ``norm``. The result both
    predicts ``t[p+2]`` (through the LM head) and is the ``h`` of the next draft step
    (as in vLLM's Qwen3-Next MTP).
    """

    def __init__(self, args: ModelArgs, backend: ReferenceBackend) -> None:
        super().__init__()
        zc = args.zero_centered_norm
        self.fc = linear(2 * args.hidden, args.hidden)
        self.pre_fc_norm_embedding = RMSNorm(args.hidden, args.rms_eps, zc, backend)
        self.pre_fc_norm_hidden = RMSNorm(args.hidden, args.rms_eps, zc, backend)
        self.layers = nn.ModuleList(
            DecoderLayer(args, args.moe is not None, backend, FULL) for _ in range(args.mtp_layers)
        )
        self.norm = RMSNorm(args.hidden, args.rms_eps, zc, backend)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: StepContext, kv: PagePool, first_layer: int) -> torch.Tensor:
        """``embeds``/``hidden`` ``[T, H]`` -> normed output ``[T, H]``; layer ``i`` uses pool layer
        ``first_layer + i``."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        h = self.fc(x)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn(layer.input_layernorm(h), cos_sin, ctx, kv.layer(first_layer + i))
            x, h = layer.post_attention_layernorm.add(a, h)
            h = h + layer.mlp(x)
        return self.norm(h)


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs, backend: ReferenceBackend) -> None:
        super().__init__()
        self.args = args
        self.model = TextModel(args, backend)
        if args.tie_embeddings:
            self.lm_head = nn.Linear(args.hidden, args.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = linear(args.hidden, args.vocab_size)
        self.rotary = RotaryEmbedding(args.rope)
        self.mtp: MTPModule | None = MTPModule(args, backend) if args.mtp_layers > 0 else None
        # an FP8 copy of the LM head that drafting reads (layers.fp8_linear.attach_draft_head)
        self.draft_head: nn.Module | None = None
        self.attn_index = {layer: j for j, layer in enumerate(args.attention_layers)}
        self.state_index = {layer: j for j, layer in enumerate(args.recurrent_layers)}

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv: PagePool | None,
        state: StatePool | None,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos_sin = None
        if self.attn_index:
            cos_sin = self.rotary.cos_sin(ctx.positions, h.dtype)
        pending: torch.Tensor | None = None  # the last MLP's output, added into h with the next norm
        for i, layer in enumerate(self.model.layers):
            if pending is None:
                x = layer.input_layernorm(h)
            else:
                x, h = layer.input_layernorm.add(pending, h)
            if layer.kind == FULL:
                assert kv is not None and cos_sin is not None
                x = layer.self_attn(x, cos_sin, ctx, kv.layer(self.attn_index[i]))
            else:
                assert state is not None
                j = self.state_index[i]
                x = layer.linear_attn(x, ctx, state.conv[j], state.recurrent[j])
            x, h = layer.post_attention_layernorm.add(x, h)
            pending = layer.mlp(x)
        return h if pending is None else h + pending

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of a draft step from the MTP module's (normed) output: through the FP8 draft
        head where there is one and it serves this many rows, else the LM head."""
        head = self.draft_head
        if head is None or not serves_draft_rows(hidden.shape[0]):
            head = self.lm_head
        return head(hidden).float()

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: StepContext, kv: PagePool
                    ) -> torch.Tensor:
        """The MTP module over one step (``MTPModule.forward``): ``input_ids`` ``[T]`` the tokens
        that follow each row's position, ``hidden`` ``[T, H]`` their predictors' normed hidden
        states. Its pool layers come after the main model's attention layers."""
        assert self.mtp is not None
        embeds = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(ctx.positions, embeds.dtype)
        return self.mtp(embeds, hidden.to(embeds.dtype), cos_sin, ctx, kv, len(self.attn_index))
