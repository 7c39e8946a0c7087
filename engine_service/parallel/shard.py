"""How a model is split over N tensor-parallel ranks, and each rank's runner.

A rank's shard is an ordinary ``CausalLM`` built from ``shard_args``: the query / KV heads, the
Gated DeltaNet key / value heads and the MLP (and MoE expert) intermediate sizes divided by N,
so the layers, pools and kernels run unchanged per rank (its KV pool holds its KV heads, its
state pool its value heads). Cut of each checkpoint tensor (``shard_tensor``, by HF name):

- column parallel (rank r keeps its r-th block of output rows): ``q_proj``, ``k_proj``,
  ``v_proj`` (heads are contiguous, so GQA's ``h // (Hq / Hkv)`` still pairs a rank's query
  heads with its KV heads), ``gate_proj`` / ``up_proj`` (dense, shared expert, per expert),
  ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``dt_bias``, ``A_log``; ``in_proj_qkv`` and the
  ``conv1d`` channels per part (q, k, v each its block: value head j still reads key head
  ``j // (Hv / Hk)``); the fused ``experts.gate_up_proj`` per half;
- row parallel (rank r keeps its r-th block of input columns; its bias on rank 0 only):
  ``o_proj``, ``down_proj`` (also the fused experts'), ``out_proj``; the output of every token
  mixer and every MLP / MoE is then summed over the ranks (a forward hook: ``group.all_reduce``);
- vocab parallel: ``embed_tokens`` / ``lm_head`` rows ``[r * Vr, (r + 1) * Vr)`` with
  ``Vr = ceil(V / N)`` (the last rank's missing rows zero): the embedding looks up its own ids
  and sums over the ranks (``VocabParallelEmbedding``), the LM head gathers its logit columns
  (``VocabParallelHead``), so every rank holds the whole residual stream and all logits;
- everything else (norms, q/k norms, the GDN output norm, the MoE router and shared-expert gate,
  the MTP ``fc``) is replicated.

Weights: each rank streams the whole checkpoint and keeps its cut (``load_shard_weights``); a
per-rank streaming loader that reads only its byte ranges belongs in ``loading/`` (not done).
Random weights draw every full tensor in the single-process order and keep the cut, so a TP
engine and a single-process one with the same seed hold the same model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.logs import get_logger
from deepwell.engine_service.kv.settings import KVSettings
from deepwell.engine_service.layers.backend import ReferenceBackend, get_backend
from deepwell.engine_service.layers.cuda_backend import default_backend
from deepwell.engine_service.layers.fp8_linear import quantize_linears
from deepwell.engine_service.loading.source import ModelSource
from deepwell.engine_service.models.decoder import CausalLM
from deepwell.engine_service.models.loader import load_weights, model_defaults
from deepwell.engine_service.models.registry import Family, resolve
from deepwell.engine_service.models.spec import FULL, ModelArgs
from deepwell.engine_service.parallel.group import TPGroup
from deepwell.engine_service.runner import TorchModelRunner, finish_linears

log = get_logger(__name__)

COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_z", "in_proj_b", "in_proj_a"})
ROW = frozenset({"o_proj", "down_proj", "out_proj"})
HEAD_VECTORS = frozenset({"dt_bias", "A_log"})  # per GDN value head, on the layer itself
QKV_CHANNELS = frozenset({"in_proj_qkv", "conv1d"})
VOCAB = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


# -- model arguments ---------------------------------------------------------------------------
class TPConfigError(ValueError):
    """A tensor-parallel size this model (or machine) cannot use; the message names the numbers."""


def check_tensor_parallel(args: ModelArgs, world: int) -> None:
    """``TPConfigError`` (a ValueError) naming every head count / size of this model that ``world``
    ranks cannot split."""
    if world < 1:
        raise TPConfigError(f"tensor_parallel must be >= 1, got {world}")
    sizes: list[tuple[str, int]] = []
    if args.attention_layers or args.mtp_layers:
        sizes += [("num_attention_heads", args.attention.num_heads),
                  ("num_key_value_heads", args.attention.num_kv_heads)]
    if args.gdn is not None and args.recurrent_layers:
        sizes += [("linear_num_key_heads", args.gdn.num_k_heads), ("linear_num_value_heads", args.gdn.num_v_heads)]
    dense = any(i not in args.moe_layers for i in range(args.num_layers)) or (args.mtp_layers and args.moe is None)
    if dense:
        sizes.append(("intermediate_size", args.intermediate))
    if args.moe is not None:
        sizes.append(("moe_intermediate_size", args.moe.intermediate))
        if args.moe.shared_intermediate:
            sizes.append(("shared_expert_intermediate_size", args.moe.shared_intermediate))
    bad = [f"{name} ({n})" for name, n in sizes if n % world]
    if bad:
        raise TPConfigError(f"tensor_parallel={world} does not divide this model's {', '.join(bad)}: every rank "
                         f"holds an equal share of the heads and intermediate sizes (KV heads are not replicated); "
                         f"use a tensor_parallel that divides them")


def shard_args(args: ModelArgs, world: int) -> ModelArgs:
    """One rank's ``ModelArgs``: heads and intermediate sizes divided by ``world`` (vocab unchanged)."""
    check_tensor_parallel(args, world)
    if world == 1:
        return args
    a = args.attention
    gdn = args.gdn
    moe = args.moe
    return replace(
        args,
        attention=replace(a, num_heads=a.num_heads // world, num_kv_heads=a.num_kv_heads // world),
        gdn=replace(gdn, num_k_heads=gdn.num_k_heads // world, num_v_heads=gdn.num_v_heads // world)
        if gdn is not None and args.recurrent_layers else gdn,
        intermediate=args.intermediate // world,
        moe=replace(moe, intermediate=moe.intermediate // world, shared_intermediate=moe.shared_intermediate // world)
        if moe is not None else None,
    )


def vocab_rows(vocab: int, world: int) -> int:
    """Embedding / LM-head rows each rank holds (``ceil(vocab / world)``; the last rank's tail is padding)."""
    return -(-vocab // world)


# -- tensor cuts --------------------------------------------------------------------------------
def _block(t: torch.Tensor, dim: int, rank: int, world: int, name: str) -> torch.Tensor:
    size = t.shape[dim]
    if size % world:
        raise ValueError(f"tensor {name!r}: dimension {dim} of size {size} does not split into {world} ranks")
    n = size // world
    return t.narrow(dim, rank * n, n)


def shard_tensor(name: str, t: torch.Tensor, args: ModelArgs, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of the (normalized, adapted) checkpoint tensor ``name`` of a model with
    the full ``args`` (the rules in the module docstring; unknown names are replicated)."""
    if world == 1:
        return t
    if name in VOCAB:
        rows = vocab_rows(args.vocab_size, world)
        lo = rank * rows
        n = max(0, min(rows, args.vocab_size - lo))
        out = t.new_zeros((rows, *t.shape[1:]))
        out[:n].copy_(t[lo:lo + n])
        return out
    parts = name.split(".")
    if len(parts) < 2:
        return t
    module, param = parts[-2], parts[-1]
    if module in COLUMN or (param in HEAD_VECTORS and module == "linear_attn"):
        return _block(t, 0, rank, world, name)
    if module in ROW:
        if param == "bias":
            return t if rank == 0 else torch.zeros_like(t)
        return _block(t, -1, rank, world, name)
    if module in QKV_CHANNELS and args.gdn is not None:
        g = args.gdn
        q, k, v = torch.split(t, [g.key_dim, g.key_dim, g.value_dim], dim=0)
        return torch.cat([_block(x, 0, rank, world, name) for x in (q, k, v)], dim=0)
    if module == "experts" and param == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
        gate, up = t.chunk(2, dim=1)
        return torch.cat([_block(gate, 1, rank, world, name), _block(up, 1, rank, world, name)], dim=1)
    return t


# -- the parallel embedding and LM head ---------------------------------------------------------
class VocabParallelEmbedding(nn.Module):
    """``embed_tokens`` over this rank's vocabulary rows: ids outside them give zeros, then the
    rows are summed over the ranks (exact: one rank adds its row to zeros)."""

    def __init__(self, weight: nn.Parameter, start: int, rows: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # [vocab_rows, hidden]
        self.start = start
        self.rows = rows  # real rows of this rank (the tail of the last rank is padding)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class VocabParallelHead(nn.Module):
    """``lm_head`` over this rank's vocabulary rows; returns every rank's logits side by side."""

    def __init__(self, weight: nn.Parameter, vocab: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.vocab = vocab
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(F.linear(x, self.weight), self.vocab)


def _reduce_hook(group: TPGroup) -> Any:
    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output)

    return hook


def build_shard_model(args: ModelArgs, group: TPGroup, dtype: torch.dtype, backend: ReferenceBackend) -> CausalLM:
    """Rank ``group.rank``'s uninitialised model for a model of full ``args``, on ``group.device``:
    the sharded layers, the vocab-parallel embedding and LM head, the all-reduce hooks."""
    world = group.world
    sargs = shard_args(args, world)
    if world == 1:
        with model_defaults(group.device, dtype):
            return CausalLM(args, backend).eval()
    rows = vocab_rows(args.vocab_size, world)
    with model_defaults(group.device, dtype):
        model = CausalLM(replace(sargs, vocab_size=rows), backend)  # embedding / head: this rank's rows
    model.args = sargs  # the runner checks token ids against the whole vocabulary
    start = group.rank * rows
    emb = VocabParallelEmbedding(model.model.embed_tokens.weight, start,
                                 max(0, min(rows, args.vocab_size - start)), group)
    model.model.embed_tokens = emb
    model.lm_head = VocabParallelHead(emb.weight if args.tie_embeddings else model.lm_head.weight,
                                      args.vocab_size, group)
    hook = _reduce_hook(group)
    layers = [*model.model.layers, *(model.mtp.layers if model.mtp is not None else [])]
    for layer in layers:
        (layer.self_attn if layer.kind == FULL else layer.linear_attn).register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)
    return model.eval()


# -- weights ------------------------------------------------------------------------------------
def load_shard_weights(model: CausalLM, family: Family, text_cfg: dict[str, Any],
                       tensors: Iterable[tuple[str, torch.Tensor]], args: ModelArgs, group: TPGroup) -> None:
    """``models.load_weights`` with every tensor cut to this rank's share after the family's adapter."""
    rank, world = group.rank, group.world

    def adapter_for(cfg: dict[str, Any]) -> Any:
        adapt = family.adapter_for(cfg)

        def sharded(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
            for n, t in adapt(name, tensor):
                yield n, shard_tensor(n, t, args, rank, world)

        return sharded

    load_weights(model, dataclasses.replace(family, adapter_for=adapter_for), text_cfg, tensors)


def random_shard_weights(model: CausalLM, args: ModelArgs, group: TPGroup, backend: ReferenceBackend,
                         seed: int = 0) -> None:
    """``models.random_weights`` of the full model (same generator, same order, same values), each
    tensor cut to this rank's share: a TP engine equals a single-process one with the same seed."""
    param = next(model.parameters())
    gen = torch.Generator(device=param.device).manual_seed(seed)
    with torch.device("meta"):
        full = CausalLM(args, backend)  # names and shapes in the single-process order
    mine = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in full.named_parameters():
            t = torch.empty(p.shape, dtype=param.dtype, device=param.device)
            if t.dim() >= 2:
                t.normal_(0.0, 0.02, generator=gen)
            else:
                t.fill_(1.0)
            mine[name].copy_(shard_tensor(name, t, args, group.rank, group.world))
    log.warning("random_weights", architecture=args.architecture, rank=group.rank,
                detail="weights are random: for speed measurements only")


# -- a rank's runner ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunnerOptions:
    """``runner.build_runner``'s settings, as plain values (sent to the workers as JSON)."""

    dtype: str = "float32"  # float32 | bfloat16 | float16
    kv_dtype: str = "auto"
    page_size: int = 64
    backend: str = "auto"
    kv_hadamard: str = "auto"
    kv_center_k: str = "auto"
    kv_k_rounding: str = "auto"
    kv_paged: str = "auto"
    random: bool = False
    mtp: bool = False
    weight_dtype: str = "auto"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


def build_rank_runner(source: ModelSource, group: TPGroup, opts: RunnerOptions) -> TorchModelRunner:
    """This rank's ``TorchModelRunner`` over its shard (``runner.build_runner``'s steps: backend,
    model, KV settings checked before the weights, weights, FP8, MTP)."""
    dev, dtype = group.device, opts.torch_dtype
    name, why = default_backend(dev) if opts.backend == "auto" else (opts.backend, "named")
    ops = get_backend(name)
    family, text_cfg = resolve(source.config)
    args = family.build_args(text_cfg)
    model = build_shard_model(args, group, dtype, ops)
    runner = TorchModelRunner(model, dev, dtype, KVSettings(opts.kv_dtype, opts.kv_hadamard, opts.kv_center_k,
                                                            opts.kv_k_rounding, opts.kv_paged), opts.page_size, ops)
    if opts.random:
        random_shard_weights(model, args, group, ops)
    else:
        load_shard_weights(model, family, text_cfg, source.iter_tensors(), args, group)
    if opts.weight_dtype == "fp8":
        quantize_linears(model)
    elif opts.weight_dtype != "auto":
        raise ValueError(f"weight_dtype must be auto or fp8, got {opts.weight_dtype!r}")
    finish_linears(model, dev, dtype, rank=group.rank)  # stacked projections, the FP8 kernels timed here
    if opts.mtp and model.mtp is not None:
        runner.enable_mtp()
    log.info("tp_rank_built", rank=group.rank, world=group.world, architecture=args.architecture,
             device=str(dev), dtype=opts.dtype, layer_backend=ops.name, backend_reason=why,
             kv_heads=model.args.attention.num_kv_heads, kv_dtype=runner.kv_dtype_name, mtp=runner.mtp_layers > 0)
    return runner
