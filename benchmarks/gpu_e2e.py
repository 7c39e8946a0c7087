"""GPU forward at the memory roofline: the real engine on a random-weight Qwen3.5-27B-shaped model.

    python3 benchmarks/gpu_e2e.py --json $OUT/e2e.json                       # everything but 414k / HF / profile
    python3 benchmarks/gpu_e2e.py --skip-prefill --kv-dtypes nvfp4 --contexts 131072 409600 --json X
    python3 benchmarks/gpu_e2e.py --skip-decode --skip-prefill --prefill-414k --kv-dtypes nvfp4 --json X
    python3 benchmarks/gpu_e2e.py --skip-decode --skip-prefill --hf --json X  # HF transformers on a slice
    python3 benchmarks/gpu_e2e.py --skip-prefill --profile --batches 1 --contexts 4096 --json X
    python3 benchmarks/gpu_e2e.py --shape qwen3.6-35b-a3b --weight-dtypes fp8 --kv-dtypes nvfp4 --json X
    python3 benchmarks/gpu_e2e.py --tiny --device cpu --contexts 256 --batches 1 2 --kv-dtypes bf16 --json X
    python3 benchmarks/gpu_e2e.py --skip-decode --skip-prefill --kv-dtypes nvfp4 --speculative 2 4 \
        --contexts 4096 131072 --batches 1 8 --json X                        # MTP speculative rounds only
    python3 benchmarks/gpu_e2e.py --tiny --device cpu --contexts 256 --batches 1 2 --kv-dtypes nvfp4 \
        --skip-prefill --speculative 2 4 --json X

Not a test: one line per figure as it is measured (stdout, flushed), every figure also in
``--json PATH`` (rewritten after each figure, so a run stopped at its time limit keeps what it
measured). Run subsets with the flags so each command fits a 10-minute device call.

What runs. ``config.json`` of the Qwen3.5-27B text model (``benchmarks/agent_replay.py``
``QWEN35_27B``, written with its small tokenizer by ``write_qwen35_27b``; ``--tiny``: the same
hybrid structure at hidden 128 / 4 layers, for testing the plumbing on a CPU) is built by
``engine_service.runner.build_runner(..., random=True)`` (the engine's ``--random-weights``: the
weights are generated on the device, nothing large travels), and every figure runs through the
real ``EngineCore`` in this process (scheduler + runner + sampler, no gRPC, as
``benchmarks/engine_bench.py``), built by ``engine_service.cli.build_core`` from an
``EngineConfig`` (pool sized from ``--memory-fraction`` of the memory free after the weights,
the quantized KV's start-up calibration and kernel check included). The prefix cache is off
(random prompts never hit; its state images would only take memory). One model is built per
weight dtype; each KV dtype gets a fresh runner over the same weights and a fresh pool.
Contexts beyond the model's 262,144 positions are served with YaRN factor 4 (Qwen3.5's
documented extension, ``--rope-scaling``), as ``deepwell engine --rope-scaling yarn:4`` does.
``--shape qwen3.6-35b-a3b``: the MoE half of the family instead (40 layers, hidden 2048, every
layer 256 routed experts of 512, top-8, plus a shared expert; 34.7B parameters, ~3B per token):
its roofline counts the experts a step reads, ``weights_read`` (every other weight, and of each
MoE layer's experts the ``E (1 - (1 - k/E)^B)`` that ``B`` tokens pick in expectation under
uniform routing, which the random-weight router approximates), and its FLOPs a token's top-k;
``--hf`` is for the dense shape only.

Denominators (measured first, in the same run): HBM bandwidth = bytes read + written by a
``--bw-gib`` device-to-device copy / its time; bf16 GEMM peak = 2 x 8192^3 / the time of one
8192^3 matmul on random data (each: 10 calls after 3 warm-ups, the best of 3 rounds).

Decode (``--batches`` x ``--contexts`` per weight dtype x ``--kv-dtypes``): ``B`` requests of
``ctx`` prompt tokens, greedy, ``ignore_eos``; after every request has its first token and
``--warmup-steps`` steps, ``--decode-steps`` engine steps are timed; figure = tokens generated /
time (aggregate over the batch). Roofline: per step the GPU must stream the weights once
(every parameter but the embedding table, which is only gathered), read every sequence's KV
(its context x KV bytes per token, scales included) and read and write back its recurrent state
(the Gated DeltaNet and conv state, in place); roofline tok/s = B x bandwidth / those bytes.
Contexts above ``--fill-above`` (default 8192) are not prefilled (a 400k prefill alone takes
minutes): the requests are submitted and admitted by the scheduler as usual (it allocates their
pages), then their first ``ctx - 1`` positions are written directly: random K/V appended through
each attention layer's own pool write (so quantized pages are validly encoded, scales and all),
random recurrent/conv state imported into the request's slot at position ``ctx - 1`` through the
runner's ``import_kv`` (the host-tier restore path), and the request's ``num_computed`` set to
``ctx - 1``; the first engine step then computes the last prompt token as a decode. The line
says ``[fill: direct]``. Combinations whose KV does not fit the pool are skipped with the numbers.

Prefill (``--prefill-tokens``, default 8k and 64k, one request, chunks of ``--token-budget``):
tok/s = prompt tokens / time to the first token; FLOPs = 2 x P_layers x T + 2 x P_head +
4 x L_attn x H x D x T^2 / 2 (P_layers: the decoder layers' parameters; P_head: the LM head, one
logits row; L_attn, H, D: full-attention layers, query heads, head dim; causal attention
QK^T + PV; the GDN recurrence's FLOPs are not counted); MFU = FLOP/s / the measured GEMM peak.
``--prefill-414k``: the cold (nothing cached) time to first token of one ``--cold-tokens``-token
prompt. The maximum resident context per KV dtype: the pages ``--memory-fraction`` of the
memory free after the weights holds (less one state slot) x the page size.

``--hf``: a ``--layers``-layer slice of the same shape (default 16, 3 GDN : 1 attention kept)
with random weights, first through deepwell (bf16 KV), then through HF transformers'
``Qwen3_5ForCausalLM`` (its GDN kernels from fla-core when it imports, sdpa attention, its own
cache); batch-1 decode at ``--hf-context`` (prefilled) and prefill at ``--hf-prefill``; ratios
deepwell / HF. ``--profile``: one decode step (batch ``--profile-batch``, the first context)
under torch.profiler: kernel launches, GPU busy = union of kernel time / the step's wall time
(unprofiled wall: the mean timed step; profiled wall also given), the top 10 kernels.

Speculative decoding (``--speculative K [K ...]``: MTP drafts per round; default: not measured).
Per weight dtype a second model of the same shape with one MTP layer (the written config gets
``mtp_num_hidden_layers: 1``; ``build_runner(..., random=True, mtp=True)``: ``random_weights``
fills the MTP module too, which ``mtp_weights`` checks, filling any tensor it finds unset), built
after the plain model is dropped (the two do not fit one GPU together at the 27B shape); the
other figures' model is unchanged. Per KV dtype x ``--cuda-graphs`` mode x context x batch, as
the decode figures (same warm-up, ``--decode-steps`` timed steps, direct fill above
``--fill-above``): first the plain step on this model (``speculative_tokens=0``, no MTP KV
layer), then per K an engine with ``speculative_tokens=K`` (honoured with CUDA graphs on: verify
graphs of K+1 tokens per sequence; they need a paged KV, e.g. nvfp4) timed over as many rounds.
A round is one engine step: a verify forward of K+1 tokens per sequence, the commit of the kept
prefix of each sequence's recurrent state (``accept_many``), the MTP drafting (``propose``: K
MTP forwards, one per draft token, the first over the step's kept rows) and the host's
scheduling, sampling and acceptance. Figure: ms/round and its ratio to the plain step. A
separate profiled pass of as many rounds splits one: the runner's ``forward`` (the verify
forward), ``accept_many`` (commit) and ``propose`` (drafting) timed with the device synchronized
before and after each (those syncs slow that pass: its parts, not its total, are the figures);
the verify forward's ratio to the plain step (and to the plain forward) is printed. Random
weights mean the drafts are (almost) never accepted (the measured acceptance is printed and
means nothing), so the rate is projected at an ASSUMED per-token acceptance p (``--accept-rate``,
default 0.92): expected tokens per round and sequence = (1 - p^(K+1)) / (1 - p) (the accepted
drafts plus the model's own token), projected tok/s = batch x that / the round's time, printed
beside the plain decode tok/s (batch / plain step) with their ratio. Targets: at K = 4 the
verify forward <= 1.3x the plain step (the whole round's ratio beside it), and at 128k, batch 1,
FP8 weights the projected rate >= 3x plain decode (printed for every K and KV dtype). JSON:
``speculative_plain`` (the plain steps), ``speculative`` (the rounds, with the ratios and the
projection), ``model["<w>+mtp"]``.

Each target of the issue is printed under its figure with PASS/MISS (on ``--tiny`` they are
printed but mean nothing). ``main(argv)`` returns the JSON dict (the CPU test calls it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import torch  # noqa: E402

from benchmarks.agent_replay import QWEN35_27B, write_qwen35_27b  # noqa: E402
from deepwell.engine_service import rope_scaling  # noqa: E402
from deepwell.engine_service.block_manager import pages_for  # noqa: E402
from deepwell.engine_service.cli import build_core  # noqa: E402
from deepwell.engine_service.config import MAX_SPECULATIVE_TOKENS, EngineConfig  # noqa: E402
from deepwell.engine_service.engine import EngineCore, FinishedEvent, TokensEvent  # noqa: E402
from deepwell.engine_service.kv.pool import Region  # noqa: E402
from deepwell.engine_service.kv.quant_pool import KVSettingsError  # noqa: E402
from deepwell.engine_service.kv.settings import KVSettings  # noqa: E402
from deepwell.engine_service.layers.moe import SparseMoE  # noqa: E402
from deepwell.engine_service.layers.context import SeqInfo, StepContext  # noqa: E402
from deepwell.engine_service.loading import open_model  # noqa: E402
from deepwell.engine_service.runner import TorchModelRunner, build_runner  # noqa: E402
from deepwell.engine_service.sampling import SamplingParams  # noqa: E402
from deepwell.engine_service.scheduler import Finish, Status  # noqa: E402

GiB = 1 << 30
PAGE_SIZE = 64
FILL_CHUNK = 16384  # K/V rows appended per call when filling pages directly
YARN_FACTOR = 4.0  # Qwen3.5: 262,144 native positions, ~1M with YaRN factor 4
QUEUE = 256

TINY = {  # the Qwen3.5 hybrid structure (3 GDN : 1 full attention, gated attention, partial RoPE) at toy size
    **QWEN35_27B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 65536,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(4)],
}

# Qwen3.6-35B-A3B's text model (= Qwen3.5-35B-A3B's): the MoE half of the target family; every
# layer a sparse MoE block (256 routed experts, top-8, and one shared expert, all 512 wide)
QWEN36_35B_A3B = {  # MoE layers only: no dense MLP width (``intermediate_size``)
    **{k: v for k, v in QWEN35_27B.items() if k != "intermediate_size"}, "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], "hidden_size": 2048,
    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_value_heads": 32,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
}
TINY_MOE = {**TINY, "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 16,
            "num_experts_per_tok": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
SHAPES = {"qwen3.5-27b": ("Qwen3.5-27B", QWEN35_27B, TINY), "qwen3.6-35b-a3b": ("Qwen3.6-35B-A3B", QWEN36_35B_A3B, TINY_MOE)}

# the targets
T_DECODE_B1_4K = 0.80  # batch 1 at 4k: fraction of the weights-read roofline
T_DECODE_128K = 0.70  # 128k, nvfp4 KV, FP8 weights: fraction of the weights + KV roofline
T_BATCH_SCALING = 15.0  # batch 32 aggregate / batch 1
T_PREFILL_MFU = 0.50  # at 8k
T_COLD_S = 110.0  # 414k-token cold prefill
T_HF_DECODE = 5.0
T_HF_PREFILL = 1.2
T_GPU_BUSY = 0.90
T_VERIFY_COST = 1.3  # a verify forward of K+1 tokens per sequence / a plain decode step, at K = T_VERIFY_K
T_VERIFY_K = 4
T_SPEC_SPEEDUP = 3.0  # projected speculative tok/s / plain decode tok/s at 128k, batch 1, FP8 weights
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


# ----------------------------------------------------------------------------- report
def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


class Report:
    """Printed lines and the JSON of every figure (rewritten after each one)."""

    def __init__(self, path: str | None, tiny: bool) -> None:
        self.path = Path(path) if path else None
        self.tiny = tiny
        self.data: dict[str, Any] = {"config": {}, "denominators": {}, "model": {}, "resident": [], "decode": [],
                                     "prefill": [], "cold_prefill": [], "hf": {}, "profile": [],
                                     "speculative_plain": [], "speculative": [], "targets": [], "notes": [],
                                     "errors": []}

    def line(self, text: str) -> None:
        print(text, flush=True)

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.line(f"note: {text}")

    def add(self, section: str, item: dict[str, Any]) -> None:
        self.data[section].append(item)
        self.save()

    def error(self, what: str, exc: BaseException) -> None:
        tb = traceback.format_exc()
        self.data["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
        self.line(f"ERROR {what}: {type(exc).__name__}: {exc}")
        print(tb, file=sys.stderr, flush=True)
        self.save()

    def target(self, name: str, value: float | None, threshold: float, unit: str = "",
               higher: bool = True, note: str = "") -> None:
        ok = value is not None and math.isfinite(value) and (value >= threshold if higher else value <= threshold)
        if self.tiny:
            note = (note + "; " if note else "") + "tiny shape: not meaningful"
        cmp = ">=" if higher else "<="
        shown = "n/a" if value is None else (f"{value:.1%}" if unit == "%" else f"{value:.3g}{unit}")
        want = f"{threshold:.0%}" if unit == "%" else f"{threshold:g}{unit}"
        self.line(f"    target {name}: {shown} (want {cmp} {want}) {'PASS' if ok else 'MISS'}"
                  + (f" ({note})" if note else ""))
        self.add("targets", {"name": name, "value": value, "threshold": threshold, "higher_is_better": higher,
                             "pass": ok, "note": note})

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(_clean(self.data), indent=1))
        os.replace(tmp, self.path)


# ----------------------------------------------------------------------------- helpers
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free_memory(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def free_bytes(dev: torch.device) -> int:
    return int(torch.cuda.mem_get_info(dev)[0]) if dev.type == "cuda" else 0


def fmt_tokens(n: float) -> str:
    return f"{n / 1024:.0f}k" if n >= 1024 and n % 1024 == 0 else f"{n:.0f}"


def tb_s(b: float) -> str:
    return f"{b / 1e12:.2f} TB/s" if b >= 1e11 else f"{b / 1e9:.2f} GB/s"


def gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.3g} MB"


def flops_s(f: float) -> str:
    return f"{f / 1e12:.1f} TFLOP/s" if f >= 1e11 else f"{f / 1e9:.3g} GFLOP/s"


def short_dtype(dt: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dt, str(dt))


# ----------------------------------------------------------------------------- denominators
def _best_round(dev: torch.device, op: Any, iters: int, rounds: int) -> float:
    """The shortest of ``rounds`` timings of ``iters`` calls of ``op`` (after 3 warm-up calls)."""
    for _ in range(3):
        op()
    best = math.inf
    for _ in range(rounds):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(dev: torch.device, nbytes: int, iters: int = 10, rounds: int = 3) -> dict[str, Any]:
    """Bytes read + written per second by a device-to-device copy of ``nbytes`` (best round)."""
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1) for _ in range(2)]
    dt = _best_round(dev, lambda: bufs[1].copy_(bufs[0]), iters, rounds)
    bufs.clear()
    free_memory(dev)
    return {"bytes_per_s": 2 * nbytes * iters / dt, "copy_bytes": nbytes, "iters": iters, "rounds": rounds,
            "seconds": dt}


def measure_gemm(dev: torch.device, n: int, dtype: torch.dtype, iters: int = 10, rounds: int = 3) -> dict[str, Any]:
    """FLOP/s of an ``n``^3 matmul in ``dtype`` on random data (best round)."""
    g = torch.Generator(device=dev).manual_seed(0)
    m = [torch.randn(n, n, device=dev, dtype=dtype, generator=g) for _ in range(2)]
    m.append(torch.empty(n, n, device=dev, dtype=dtype))
    dt = _best_round(dev, lambda: torch.matmul(m[0], m[1], out=m[2]), iters, rounds)
    m.clear()
    free_memory(dev)
    return {"flops_per_s": 2 * n ** 3 * iters / dt, "n": n, "dtype": short_dtype(dtype), "iters": iters,
            "rounds": rounds}


# ----------------------------------------------------------------------------- model
def slice_config(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    if not layers or layers >= cfg["num_hidden_layers"]:
        return dict(cfg)
    return {**cfg, "num_hidden_layers": layers, "layer_types": list(cfg["layer_types"][:layers])}


def write_model(directory: Path, cfg: dict[str, Any]) -> Path:
    """``write_qwen35_27b``'s files (config + small tokenizer + template) with ``cfg`` as the config."""
    write_qwen35_27b(directory)
    written = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "eos_token_id": written["eos_token_id"],
                                                       "pad_token_id": written["pad_token_id"]}))
    return directory


def fp8_weight_option() -> str | None:
    """The engine option for FP8 weights, if the engine has one (an EngineConfig field that
    ``build_runner`` also takes)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    params = inspect.signature(build_runner).parameters
    for name in ("weight_dtype", "weights_dtype", "weight_format"):
        if name in fields and name in params:
            return name
    return None


def model_stats(model: Any) -> dict[str, Any]:
    """Bytes streamed per decode step and the parameter counts the FLOP formula uses."""
    m, a = model, model.args

    def size(mod: Any) -> tuple[int, int]:
        ps = list(mod.parameters()) + [b for b in mod.buffers()]
        return sum(p.numel() for p in mod.parameters()), sum(p.numel() * p.element_size() for p in ps)

    layer_params, layer_bytes = size(m.model.layers)
    norm_params, norm_bytes = size(m.model.norm)
    head_params, head_bytes = size(m.lm_head) if not a.tie_embeddings else size(m.model.embed_tokens)
    embed_params, embed_bytes = size(m.model.embed_tokens)
    blocks = [mod for mod in m.model.layers.modules() if isinstance(mod, SparseMoE)]
    expert_sizes = [size(b.experts) for b in blocks]
    expert_params, expert_bytes = sum(p for p, _ in expert_sizes), sum(b for _, b in expert_sizes)
    num_experts = blocks[0].experts.gate_up_proj.shape[0] if blocks else 0
    top_k = blocks[0].top_k if blocks else 0
    return {
        # every weight; the embedding table is only gathered (a MoE step reads its picked experts:
        # ``weights_read``)
        "weight_bytes_streamed": layer_bytes + norm_bytes + head_bytes,
        "moe_layers": len(blocks), "num_experts": num_experts, "top_k": top_k, "expert_bytes": expert_bytes,
        "expert_params": expert_params,
        # what one token computes with: the routed experts' share is top_k / num_experts
        "active_layer_params": layer_params + norm_params - expert_params * (1 - top_k / num_experts if blocks else 1),
        "layer_params": layer_params + norm_params, "head_params": head_params, "embed_params": embed_params,
        "total_params": layer_params + norm_params + embed_params + (0 if a.tie_embeddings else head_params),
        "attention_layers": len(a.attention_layers), "recurrent_layers": len(a.recurrent_layers),
        "heads": a.attention.num_heads, "kv_heads": a.attention.num_kv_heads, "head_dim": a.attention.head_dim,
        "hidden": a.hidden, "vocab": a.vocab_size, "layers": a.num_layers,
    }


def weights_read(stats: dict[str, Any], tokens: int) -> float:
    """Weight bytes a step of ``tokens`` tokens reads: every weight, except that a MoE layer reads
    only the experts its tokens pick, ``E (1 - (1 - k / E)^tokens)`` of ``E`` in expectation when
    each token picks ``k`` distinct experts uniformly (the random-weight router is close to it)."""
    if not stats["moe_layers"]:
        return stats["weight_bytes_streamed"]
    e, k = stats["num_experts"], stats["top_k"]
    picked = 1.0 - (1.0 - k / e) ** tokens
    return stats["weight_bytes_streamed"] - stats["expert_bytes"] * (1.0 - picked)


def with_mtp(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with one MTP layer (Qwen3.5's ``mtp_num_hidden_layers``; ``QWEN35_27B`` has none)."""
    return {**cfg, "mtp_num_hidden_layers": 1}


def mtp_weights(model: Any) -> dict[str, Any]:
    """The MTP module's size, and a check that ``random_weights`` filled it: it fills every
    parameter of the model, the MTP module (a registered submodule) included, so every floating
    parameter must be finite and every weight matrix spread out. A matrix or vector that is not
    gets N(0, 0.02) or ones here, on its device, and is named under ``refilled``. FP8 codes
    (1-byte) are skipped and FP8 scales (``*_scale_inv``, quantized from filled weights after
    ``random_weights``) only checked finite: neither can be refilled meaningfully."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        raise RuntimeError("the model has no MTP module (mtp_num_hidden_layers missing from its config?)")
    refilled: list[str] = []
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if p.device.type == "meta":
                raise RuntimeError(f"MTP parameter {name} was never materialized (meta device)")
            if not p.is_floating_point() or p.element_size() < 2:
                continue
            finite = bool(torch.isfinite(p).all())
            if name.endswith("scale_inv"):
                if not finite:
                    raise RuntimeError(f"MTP FP8 scales {name} are not finite")
                continue
            if finite and (p.dim() < 2 or p.numel() < 2 or float(p.float().std()) > 0.0):
                continue
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
            refilled.append(name)
    tensors = list(mtp.parameters()) + list(mtp.buffers())
    return {"mtp_layers": len(mtp.layers), "mtp_params": sum(p.numel() for p in mtp.parameters()),
            "mtp_bytes": sum(t.numel() * t.element_size() for t in tensors), "refilled": refilled}


def prefill_flops(stats: dict[str, Any], tokens: int) -> float:
    attn = 4 * stats["attention_layers"] * stats["heads"] * stats["head_dim"] * tokens * tokens / 2
    return 2 * stats["active_layer_params"] * tokens + 2 * stats["head_params"] + attn


FLOPS_FORMULA = ("FLOPs = 2 x P_layers x T + 2 x P_head + 4 x L_attn x H x D x T^2/2 "
                 "(P_layers {P:.3g} decoder-layer params a token computes with (MoE: its top-k experts), P_head {Ph:.3g} LM head, one logits row; "
                 "L_attn {L}, H {H}, D {D}; causal QK^T + PV; GDN recurrence FLOPs not counted); "
                 "MFU = FLOP/s / measured GEMM peak")


# ----------------------------------------------------------------------------- engine
@dataclasses.dataclass(eq=False)
class Job:
    kind: str  # decode | profile | prefill | cold | spec_plain | spec
    seqs: int  # sequences (and state slots) at once
    length: int  # positions each sequence reaches
    size: int  # the figure's context (decode, spec) or prompt tokens (prefill)
    drafts: int = 0  # spec: MTP tokens drafted per round (the engine's speculative_tokens)


def decode_tokens(args: argparse.Namespace, batch: int, ctx: int, profile: bool) -> int:
    """``max_tokens`` of a decode figure's requests: warm-up + timed steps, the steps the later
    requests of a prefilled batch lag behind the first, and the profiled step."""
    stagger = 0 if ctx > args.fill_above else -(-batch * ctx // args.token_budget) + batch + 2
    return args.warmup_steps + args.decode_steps + stagger + (2 if profile else 0)


def spec_tokens(args: argparse.Namespace, batch: int, ctx: int, drafts: int) -> int:
    """``max_tokens`` of a speculative figure's requests (``drafts`` 0: its plain baseline): the
    decode figure's rounds plus the profiled pass's, each emitting up to ``drafts + 1`` tokens,
    with room for the last round to draft all ``drafts`` (``Scheduler.draft_room`` drafts fewer
    near ``max_tokens``, and a verify slice of another length would leave the verify graph)."""
    rounds = decode_tokens(args, batch, ctx, False) + args.decode_steps + 1
    return rounds * (drafts + 1) + 1


class Engine:
    """One weight dtype's model; a fresh runner + pool (``EngineCore``) per KV dtype (and, with
    ``mtp``, per speculative K: the model's MTP module gets KV layers only in runners asked for it)."""

    def __init__(self, args: argparse.Namespace, source: Any, dev: torch.device, dtype: torch.dtype,
                 weight_kw: dict[str, Any], mtp: bool = False) -> None:
        self.args, self.source, self.dev, self.dtype = args, source, dev, dtype
        base = build_runner(source, device=dev, dtype=dtype, kv_dtype="auto", page_size=PAGE_SIZE, random=True,
                            mtp=mtp, **weight_kw)
        self.model, self.ops = base.model, base.ops
        del base
        self.stats = model_stats(self.model)
        self.mtp = mtp_weights(self.model) if mtp else None
        self.core: EngineCore | None = None

    def runner(self, kv: str, mtp: bool = False) -> TorchModelRunner:
        runner = TorchModelRunner(self.model, self.dev, self.dtype, KVSettings(kv), PAGE_SIZE, self.ops)
        if mtp:
            runner.enable_mtp()  # as build_runner(mtp=True): the MTP layer's KV follows the model's
        return runner

    def pool_budget(self, runner: TorchModelRunner, slots: int) -> tuple[int, str]:
        """Bytes the pool gets (``engine_service.cli.size_pools``' rule) and how they were found."""
        spec = runner.memory_spec()
        a = self.args
        if self.dev.type == "cuda":
            free = free_bytes(self.dev)
            budget = int(free * a.memory_fraction) - slots * spec.bytes_per_state_slot
            return budget, (f"{a.memory_fraction} x {free / GiB:.1f} GiB free after the weights, less {slots} "
                            f"state slots of {spec.bytes_per_state_slot / 2**20:.0f} MiB")
        return int(a.cpu_kv_gib * GiB), f"--cpu-kv-gib {a.cpu_kv_gib}"

    def open(self, kv: str, max_context: int, max_conc: int, graphs: str = "auto", drafts: int = 0) -> EngineCore:
        """``drafts`` > 0: speculative decoding with that many MTP drafts per round (honoured with
        CUDA graphs on: ``build_core`` then plans verify graphs of ``drafts + 1`` tokens)."""
        self.close()
        a = self.args
        cfg = EngineConfig(kv_dtype=kv, page_size=PAGE_SIZE, memory_fraction=a.memory_fraction,
                           cpu_kv_gib=a.cpu_kv_gib, max_concurrency=max_conc, token_budget=a.token_budget,
                           queue_size=QUEUE, max_context=max_context, prefix_cache="off", cuda_graphs=graphs,
                           speculative_tokens=drafts)
        self.core = build_core(cfg, self.source, self.runner(kv, mtp=drafts > 0))
        return self.core

    def close(self) -> None:
        if self.core is not None:
            self.core = None
        free_memory(self.dev)

    def drop(self) -> None:
        self.close()
        self.model = None
        free_memory(self.dev)


class Sink:
    def __init__(self) -> None:
        self.tokens = 0
        self.finished: FinishedEvent | None = None

    def __call__(self, ev: Any) -> None:
        if isinstance(ev, TokensEvent):
            self.tokens += len(ev.token_ids)
        elif isinstance(ev, FinishedEvent):
            self.finished = ev


def _check(sinks: list[Sink]) -> None:
    for s in sinks:
        if s.finished is not None and s.finished.reason is Finish.ERROR:
            raise RuntimeError(f"request failed in the engine: {s.finished.error}")


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def fill_direct(core: EngineCore, reqs: list[Any], n: int, seed: int) -> None:
    """Admit the waiting ``reqs`` (the scheduler allocates their pages and state slots; the
    plans of these scheduling passes are not run) and make each hold ``n - 1`` computed
    positions: random K/V appended through every attention layer's pool write, random state
    imported into its slot at position ``n - 1``, ``num_computed = n - 1``."""
    if core.cache is not None:
        raise RuntimeError("direct fill needs the prefix cache off")
    sched, runner = core.scheduler, core.runner
    with core.lock:
        for _ in range(len(reqs) + 2):
            if all(r.status is Status.RUNNING for r in reqs):
                break
            sched.schedule()  # admits waiting requests as budget and slots allow; the plan is dropped
            for r in reqs:
                if r.status is Status.RUNNING and r.num_computed == 0:
                    r.num_computed = n - 1  # the next schedule() gives it a 1-token slice, not a prefill
        if not all(r.status is Status.RUNNING for r in reqs):
            raise RuntimeError("the scheduler did not admit every request (pool or slots too small)")
        tables = [list(core.blocks.block_table(r.request_id)) for r in reqs]
        slots = [core.blocks.state_slot(r.request_id) for r in reqs]
    dev, ps, m = runner.device, runner.page_size, n - 1
    g = torch.Generator(device=dev).manual_seed(seed)
    kv = runner.kv
    if kv is not None and m > 0:
        lay = runner.kv_spec.float_layout
        chunk = min(FILL_CHUNK, m)
        k = torch.randn(chunk, lay.num_kv_heads, lay.head_dim, device=dev, generator=g).to(runner.dtype)
        v = torch.randn(chunk, lay.num_kv_heads, lay.head_dim, device=dev, generator=g).to(runner.dtype)
        for table, slot in zip(tables, slots, strict=True):
            t = torch.tensor(table, dtype=torch.long)
            for start in range(0, m, chunk):
                c = min(chunk, m - start)
                pos = torch.arange(start, start + c)
                rows = (t[pos // ps] * ps + pos % ps).to(dev)
                ctx = StepContext(positions=pos.to(dev), kv_slots=rows, seqs=(SeqInfo(0, c, start, slot, None),))
                for i in range(lay.num_layers):
                    kv.layer(i).write(k[:c], v[:c], ctx)
        del k, v
    if runner.state is not None:
        s0 = slots[0]
        for t in runner.state.slot_tensors():
            t[s0].normal_(0.0, 0.02, generator=g)
        buf = torch.empty(runner.entry_nbytes(0, True), dtype=torch.uint8, pin_memory=dev.type == "cuda")
        runner.export_kv([], s0, Region([buf]))
        for s in slots:
            runner.import_kv([], s, m, Region([buf]), 0)  # sets the slot's position to n - 1
    sync(dev)


def decode_room(core: EngineCore, batch: int, ctx: int, max_tokens: int) -> str | None:
    """Why ``batch`` requests of ``ctx`` prompt tokens and ``max_tokens`` more do not fit ``core``, or None."""
    need = batch * pages_for(ctx + max_tokens, PAGE_SIZE)
    if ctx + max_tokens > core.max_context:
        return f"context {ctx} + {max_tokens} tokens exceeds the served context {core.max_context}"
    if need > core.blocks.num_pages:
        return (f"needs {batch} x {pages_for(ctx + max_tokens, PAGE_SIZE)} = {need} KV pages, the pool holds "
                f"{core.blocks.num_pages}")
    return None


def start_decode(core: EngineCore, batch: int, ctx: int, args: argparse.Namespace, max_tokens: int,
                 seed: int) -> tuple[list[Any], list[Sink], float]:
    """Submit ``batch`` greedy requests of one random ``ctx``-token prompt and step until every
    one has its first token (prefilled, or above ``--fill-above`` filled directly); returns the
    requests, their sinks and the seconds that took. The caller cancels the requests (here: if
    this fails)."""
    prompt = random_prompt(ctx, core.runner.vocab_size, seed)
    sinks = [Sink() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [core.make_request(prompt, params, sink=s) for s in sinks]
    for r in reqs:
        core.submit(r)
    t_fill = time.perf_counter()
    try:
        if ctx > args.fill_above:
            fill_direct(core, reqs, ctx, seed)
        while min(s.tokens for s in sinks) == 0:
            _check(sinks)
            if core.step() == 0 and not core.has_work():
                break
        _check(sinks)
    except BaseException:
        for r in reqs:
            core.cancel(r.request_id)
        raise
    return reqs, sinks, time.perf_counter() - t_fill


def run_decode(core: EngineCore, batch: int, ctx: int, args: argparse.Namespace, profile: bool = False,
               seed: int = 0) -> dict[str, Any]:
    """Decode tok/s (aggregate) of ``batch`` requests at context ``ctx``; see the module doc."""
    dev = core.runner.device
    direct = ctx > args.fill_above
    max_tokens = decode_tokens(args, batch, ctx, profile)
    why = decode_room(core, batch, ctx, max_tokens)
    if why is not None:
        return {"skipped": why}
    reqs: list[Any] = []
    try:
        reqs, sinks, fill_s = start_decode(core, batch, ctx, args, max_tokens, seed)
        for _ in range(args.warmup_steps - 1):
            core.step()
        sync(dev)
        ctx0 = sum(r.num_computed for r in reqs) / batch
        start = sum(s.tokens for s in sinks)
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            core.step()
        sync(dev)
        dt = time.perf_counter() - t0
        _check(sinks)
        tokens = sum(s.tokens for s in sinks) - start
        ctx1 = sum(r.num_computed for r in reqs) / batch
        out: dict[str, Any] = {"tok_s": tokens / dt, "tokens": tokens, "seconds": dt, "steps": args.decode_steps,
                               "step_s": dt / args.decode_steps, "mean_context": (ctx0 + ctx1) / 2 + 1,
                               "fill": "direct" if direct else "prefill", "fill_s": fill_s}
        if tokens != batch * args.decode_steps:
            out["warning"] = f"{tokens} tokens in {args.decode_steps} steps of {batch} requests"
        if profile:
            out["profile"] = profile_step(core, dt / args.decode_steps)
        return out
    finally:
        for r in reqs:
            core.cancel(r.request_id)


class PhaseTimer:
    """While active, the runner's ``forward``, ``accept_many`` and ``propose`` are timed call by
    call, the device synchronized before and after each (instance attributes shadowing the
    methods, removed on exit; ``EngineCore`` calls them through ``core.runner``). The syncs
    cost time of their own: for a separate profiled pass, never the timed one."""

    PHASES = ("forward", "accept_many", "propose")

    def __init__(self, runner: Any, tokens_per_seq: int) -> None:
        self.runner = runner
        self.tokens_per_seq = tokens_per_seq  # a full round's slice: 1 (plain decode) or K + 1 (verify)
        self.seconds: dict[str, list[float]] = {name: [] for name in self.PHASES}
        self.full_forwards = 0  # forwards whose every slice is a full round's (verify slices of K + 1 / decodes of 1)
        self.graphed_forwards = 0  # forwards the runner's CUDA graphs accepted
        self._wrapped: list[str] = []

    def __enter__(self) -> PhaseTimer:
        for name in self.PHASES:
            fn = getattr(self.runner, name, None)
            if fn is not None:
                setattr(self.runner, name, self._timed(name, fn))
                self._wrapped.append(name)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self._wrapped:
            delattr(self.runner, name)
        self._wrapped.clear()

    def _timed(self, name: str, fn: Any) -> Any:
        dev = self.runner.device

        def timed(*args: Any, **kw: Any) -> Any:
            if name == "forward":
                self._classify(args[0] if args else kw["batch"])
            sync(dev)
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            sync(dev)
            self.seconds[name].append(time.perf_counter() - t0)
            return out

        return timed

    def _classify(self, batch: Any) -> None:
        t, seqs = self.tokens_per_seq, batch.seqs
        if seqs and all(s.num_tokens == t and s.verify == (t > 1) for s in seqs):
            self.full_forwards += 1
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None and graphs.accepts(batch):
            self.graphed_forwards += 1

    def per_step(self, name: str, steps: int) -> float:
        return sum(self.seconds[name]) / steps


def run_rounds(core: EngineCore, batch: int, ctx: int, args: argparse.Namespace, drafts: int,
               seed: int = 0) -> dict[str, Any]:
    """Engine steps of ``batch`` requests at context ``ctx`` on a core drafting ``drafts`` tokens
    per round (0: speculation off, the plain step); see the module doc. Timed as ``run_decode``
    (``--decode-steps`` steps after the warm-up), then a separate profiled pass of as many steps
    under ``PhaseTimer`` splits a step into the forward (a verify forward of ``drafts + 1``
    tokens per sequence), the commit (``accept_many``), the MTP drafting (``propose``) and the
    rest (scheduling, sampling and acceptance on the host)."""
    dev = core.runner.device
    max_tokens = spec_tokens(args, batch, ctx, drafts)
    why = decode_room(core, batch, ctx, max_tokens)
    if why is not None:
        return {"skipped": why}
    steps, c = args.decode_steps, core.counters
    reqs: list[Any] = []
    try:
        reqs, sinks, fill_s = start_decode(core, batch, ctx, args, max_tokens, seed)
        for _ in range(args.warmup_steps - 1):
            core.step()
        sync(dev)
        ctx0 = sum(r.num_computed for r in reqs) / batch
        start = sum(s.tokens for s in sinks)
        before = (c.spec_rounds, c.spec_drafted, c.spec_accepted)
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        sync(dev)
        dt = time.perf_counter() - t0
        _check(sinks)
        tokens = sum(s.tokens for s in sinks) - start
        ctx1 = sum(r.num_computed for r in reqs) / batch
        rounds, drafted, accepted = (a - b for a, b in zip((c.spec_rounds, c.spec_drafted, c.spec_accepted), before))
        out: dict[str, Any] = {"drafts": drafts, "step_s": dt / steps, "tok_s": tokens / dt, "tokens": tokens,
                               "seconds": dt, "steps": steps, "tokens_per_round": tokens / (batch * steps),
                               "mean_context": (ctx0 + ctx1) / 2 + 1,
                               "fill": "direct" if ctx > args.fill_above else "prefill", "fill_s": fill_s}
        if drafts:
            out.update(verify_slices=rounds, drafted=drafted, accepted=accepted,
                       measured_acceptance=accepted / drafted if drafted else None)
            if rounds != batch * steps or drafted != batch * steps * drafts:
                out["warning"] = (f"{rounds} verify slices drafting {drafted} tokens in {steps} steps of {batch} "
                                  f"requests (a full round each: {batch * steps} drafting {batch * steps * drafts})")
        elif tokens != batch * steps:
            out["warning"] = f"{tokens} tokens in {steps} steps of {batch} requests"
        walls: list[float] = []
        dg = getattr(core.runner, "draft_graphs", None)
        mtp_graphed = dg.verify_replays if dg is not None else 0
        with PhaseTimer(core.runner, drafts + 1) as pt:
            for _ in range(steps):
                sync(dev)
                t0 = time.perf_counter()
                core.step()
                sync(dev)
                walls.append(time.perf_counter() - t0)
        _check(sinks)
        step_p = sum(walls) / steps
        phases = {name: pt.per_step(name, steps) for name in PhaseTimer.PHASES}
        out["profiled"] = {"steps": steps, "step_s": step_p, "forward_s": phases["forward"],
                           "accept_s": phases["accept_many"], "propose_s": phases["propose"],
                           "other_s": step_p - sum(phases.values()), "full_forwards": pt.full_forwards,
                           "graphed_forwards": pt.graphed_forwards,
                           "graphed_mtp": (dg.verify_replays if dg is not None else 0) - mtp_graphed,
                           "calls": {name: len(v) for name, v in pt.seconds.items()}}
        return out
    finally:
        for r in reqs:
            core.cancel(r.request_id)


def fp8_kernels(weights: str) -> str:
    """The FP8 weights' few-token kernel per shape and row count (the engine times them at load on
    CUDA, ``layers.fp8_linear.tune``; log ``fp8_gemm_tuned``)."""
    if weights != "fp8":
        return ""
    from deepwell.kernels.fp8_gemm import triton_kernel, tune

    if triton_kernel.KERNEL_BY_SHAPE:
        return "; FP8 few-row kernels: " + "; ".join(f"{s}: {k}" for s, k in tune.summary(triton_kernel.KERNEL_BY_SHAPE).items())
    n = triton_kernel.FMA_MAX_TOKENS
    return f"; FP8 GEMV: FMA kernel up to {n} rows" if n else "; FP8 GEMV: tensor-core kernel at every row count"


def fp8_gemm_times(model: torch.nn.Module, dev: torch.device, dtype: torch.dtype, bw: float,
                   rows: tuple[int, ...] = (1, 5), timer: Any = None) -> list[dict[str, Any]]:
    """Where an FP8 decode step's GEMM time goes: per weight shape of ``model``'s FP8 layers (the
    draft head aside) and row count, the kernel the engine serves (``triton_kernel.few_row_kernel``)
    timed alone (``tune.graph_timer``: replayed in a CUDA graph, weights cold in L2), its bytes
    (codes + block scales) over that time, the fraction of the copy bandwidth ``bw``, and the
    layers of that shape (so layers x time is the step's share). Empty without FP8 layers, or off CUDA unless a ``timer``
    ``(kernel, rows, N, K) -> seconds`` is given."""
    from collections import Counter

    from deepwell.engine_service.layers.fp8_linear import DRAFT_HEAD, FP8Linear
    from deepwell.kernels.fp8_gemm import triton_kernel, tune

    layers = [m for name, m in model.named_modules() if isinstance(m, FP8Linear) and not name.endswith(DRAFT_HEAD)]
    if not layers or (timer is None and dev.type != "cuda"):
        return []
    timer = timer or tune.graph_timer(dev, dtype, layers[0].block)
    out = []
    for (n, k), count in sorted(Counter((m.out_features, m.in_features) for m in layers).items()):
        bn, bk = layers[0].block
        nbytes = n * k + (-(-n // bn)) * (-(-k // bk)) * 4
        for m in rows:
            kind = triton_kernel.few_row_kernel((n, k), m)
            t = timer(kind, m, n, k)
            out.append({"shape": f"{n}x{k}", "rows": m, "kernel": kind, "layers": count, "us": t * 1e6,
                        "gb_s": nbytes / t / 1e9, "fraction": nbytes / t / bw if bw else None,
                        "step_ms": count * t * 1e3})
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_prefill(core: EngineCore, tokens: int, args: argparse.Namespace, warm: bool = True,
                seed: int = 1) -> dict[str, Any]:
    """Time to the first token of one ``tokens``-token prompt (chunks of the token budget)."""
    if tokens + 1 > core.max_context:
        return {"skipped": f"{tokens} tokens + 1 exceeds the served context {core.max_context}"}
    if pages_for(tokens + 1, PAGE_SIZE) > core.blocks.num_pages:
        return {"skipped": f"needs {pages_for(tokens + 1, PAGE_SIZE)} KV pages, the pool holds "
                           f"{core.blocks.num_pages}"}
    dev, vocab = core.runner.device, core.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if warm:  # kernels compiled / tuned for the chunk shape first
        s = Sink()
        core.submit(core.make_request(random_prompt(min(tokens, args.token_budget), vocab, seed + 7), params, sink=s))
        while core.has_work():
            core.step()
        _check([s])
    s = Sink()
    req = core.make_request(random_prompt(tokens, vocab, seed), params, sink=s)
    sync(dev)
    t0 = time.perf_counter()
    core.submit(req)
    while core.has_work():
        core.step()
    sync(dev)
    dt = time.perf_counter() - t0
    _check([s])
    if s.tokens != 1:
        raise RuntimeError(f"prefill of {tokens} tokens produced {s.tokens} tokens")
    return {"tokens": tokens, "seconds": dt, "tok_s": tokens / dt}


# ----------------------------------------------------------------------------- profiler
def _kineto(prof: Any) -> list[tuple[str, str, float, float]]:
    """(device type, name, start_us, duration_us) of every profiler event."""
    try:
        return [(str(e.device_type()).split(".")[-1], e.name(), e.start_ns() / 1e3, e.duration_ns() / 1e3)
                for e in prof.profiler.kineto_results.events()]
    except AttributeError:  # a torch without these accessors: the FunctionEvents
        return [(str(e.device_type).split(".")[-1], e.name, float(e.time_range.start),
                 float(e.time_range.elapsed_us())) for e in prof.events()]


def profile_step(core: EngineCore, unprofiled_step_s: float) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    dev = core.runner.device
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(dev)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        core.step()
        sync(dev)
        wall = time.perf_counter() - t0
    events = _kineto(prof)
    if cuda:
        kernels = [e for e in events if e[0] == "CUDA" and not e[1].startswith(("Memcpy", "Memset"))]
        launches = sum(1 for e in events if e[0] == "CPU" and e[1] in LAUNCH_APIS)
    else:  # no kernels on a CPU: the ops stand in
        kernels = [e for e in events if e[0] == "CPU" and e[1].startswith("aten::")]
        launches = None
    spans = sorted((s, s + d) for _, _, s, d in kernels)
    busy, end = 0.0, -math.inf
    for s, e in spans:  # union of the kernels' intervals
        if e > end:
            busy += e - max(s, end)
            end = e
    by_name: dict[str, list[float]] = {}
    for _, name, _, d in kernels:
        agg = by_name.setdefault(name, [0.0, 0])
        agg[0] += d
        agg[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:20]
    busy_s = busy / 1e6
    return {
        "kernels": len(kernels) if cuda else None, "launch_calls": launches, "kernel_time_s": busy_s if cuda else None,
        "wall_profiled_s": wall, "wall_unprofiled_s": unprofiled_step_s,
        "gpu_busy": min(1.0, busy_s / unprofiled_step_s) if cuda and unprofiled_step_s > 0 else None,
        "gpu_busy_profiled_wall": busy_s / wall if cuda and wall > 0 else None,
        "top": [{"name": n, "total_us": t, "count": c} for n, (t, c) in top],
    }


# ----------------------------------------------------------------------------- HF comparison
def hf_model(cfg: dict[str, Any], dev: torch.device, dtype: torch.dtype) -> Any:
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    hcfg = Qwen3_5TextConfig(**fields)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = Qwen3_5ForCausalLM(hcfg)
    finally:
        torch.set_default_dtype(prev)
    return model.to(dev, dtype).eval()


def _hf_forward(model: Any, ids: torch.Tensor, cache: Any = None) -> Any:
    import warnings

    kw = {"input_ids": ids, "use_cache": True}
    if cache is not None:
        kw["past_key_values"] = cache  # 5.17 and 5.24 both take it (5.24 warns: renamed `cache`)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return model(**kw, logits_to_keep=1)
        except TypeError:  # a transformers without logits_to_keep
            return model(**kw)


def hf_prefill(model: Any, tokens: int, dev: torch.device, vocab: int) -> dict[str, Any]:
    ids = torch.tensor([random_prompt(tokens, vocab, 1)], device=dev)
    with torch.inference_mode():
        # warm-up at the timed length: fla's kernels autotune per sequence length on their first
        # call (an H200 run warmed at 512 tokens timed ~8 s of tuning into 4k and 8k alike)
        _hf_forward(model, ids)
        sync(dev)
        t0 = time.perf_counter()
        out = _hf_forward(model, ids)
        out.logits[:, -1].argmax(-1).tolist()
        dt = time.perf_counter() - t0
    del out
    free_memory(dev)
    return {"tokens": tokens, "seconds": dt, "tok_s": tokens / dt}


def hf_decode(model: Any, ctx: int, steps: int, warm: int, dev: torch.device, vocab: int) -> dict[str, Any]:
    ids = torch.tensor([random_prompt(ctx, vocab, 0)], device=dev)
    with torch.inference_mode():
        out = _hf_forward(model, ids)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for i in range(warm + steps):
            if i == warm:
                sync(dev)
                t0 = time.perf_counter()
            out = _hf_forward(model, nxt, cache)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.tolist()  # a host sync per token, as the engine's sampler has
        dt = time.perf_counter() - t0
    del out, cache
    free_memory(dev)
    return {"tok_s": steps / dt, "steps": steps, "seconds": dt, "context": ctx}


# ----------------------------------------------------------------------------- the benchmark
class Bench:
    def __init__(self, args: argparse.Namespace, rep: Report) -> None:
        self.args, self.rep = args, rep
        self.dev = torch.device(args.device)
        self.dtype = {"auto": torch.bfloat16 if self.dev.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
                      "float32": torch.float32, "float16": torch.float16}[args.dtype]
        self.bw = self.peak = 0.0
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_e2e-"))
        self.decode_figs: dict[tuple[str, str, int, int], float] = {}
        self.spec_plain: dict[tuple[str, str, int, int], dict[str, Any]] = {}  # the plain steps on the MTP model
        # where the targets are read: its shapes, or on --tiny their stand-ins
        t = args.tiny
        self.at_4k = args.contexts[0] if t else 4096
        self.at_128k = args.contexts[-1] if t else 131072
        self.big_batch = max(args.batches) if t else 32
        self.at_8k = args.prefill_tokens[0] if t else 8192
        self.cold_min = 0 if t else 414_000
        self.graphs = args.cuda_graphs[0]  # the engine's --cuda-graphs for the figures being run

    # -- denominators ------------------------------------------------------------------
    def denominators(self) -> None:
        a, rep = self.args, self.rep
        bw = measure_bandwidth(self.dev, int(a.bw_gib * GiB))
        gemm_dtype = torch.bfloat16 if self.dev.type == "cuda" else self.dtype
        gm = measure_gemm(self.dev, a.gemm_n, gemm_dtype)
        self.bw, self.peak = bw["bytes_per_s"], gm["flops_per_s"]
        rep.data["denominators"] = {"hbm": bw, "gemm": gm}
        rep.line(f"HBM bandwidth: {tb_s(self.bw)} (device-to-device copy of {a.bw_gib:g} GiB, bytes read + written)")
        rep.line(f"GEMM peak: {flops_s(self.peak)} ({gm['dtype']} {a.gemm_n}^3 matmul)")
        rep.save()

    # -- the model -----------------------------------------------------------------------
    def source(self, cfg: dict[str, Any], name: str, context_needed: int) -> Any:
        src = open_model(write_model(self.tmp / name, cfg), weights=False)
        trained = int(src.text_config().get("max_position_embeddings") or 0)
        rs = self.args.rope_scaling
        yarn = None
        if rs.startswith("yarn"):
            yarn = rope_scaling.parse(rs)
        elif rs == "auto" and context_needed > trained:
            yarn = rope_scaling.Yarn(YARN_FACTOR)
        if yarn is not None:
            src.config = rope_scaling.with_yarn(src.config, yarn)
            self.rep.note(f"rope: YaRN factor {yarn.factor:g} over {trained} trained positions -> "
                          f"{src.text_config()['max_position_embeddings']} served (contexts up to {context_needed})")
        return src

    def main_contexts(self, speculative: bool = False) -> int:
        """The longest sequence of the main figures (``speculative``: of the speculative ones)."""
        jobs = [j for k in [0, *self.args.speculative] for j in self.spec_jobs(k)] if speculative else self.jobs()
        return max([j.length for j in jobs] or [1])

    def run_main(self) -> None:
        a, rep = self.args, self.rep
        _, full, tiny = SHAPES[a.shape]
        cfg = slice_config(tiny if a.tiny else full, a.model_layers)
        src = self.source(cfg, "main", self.main_contexts()) if self.jobs() else None
        src_mtp = self.source(with_mtp(cfg), "main-mtp", self.main_contexts(True)) if a.speculative else None
        opt = fp8_weight_option()
        weights = list(a.weight_dtypes)
        if "fp8" in weights and opt is None:
            rep.note("fp8 weights: not implemented (no weight-dtype option in engine_service/config.py "
                     "EngineConfig / build_runner); skipped")
            weights.remove("fp8")
        for w in weights:
            for lk in a.linear_kernels:
                kw: dict[str, Any] = {opt: "fp8"} if w == "fp8" and opt is not None else {}
                wl = w if w == "fp8" else short_dtype(self.dtype)
                if lk != "auto":
                    kw["linear_kernel"] = lk
                    wl = f"{wl}+{lk}"
                if src is not None:
                    self.run_weights(src, w, wl, kw)
                if src_mtp is not None:
                    self.run_speculative(src_mtp, w, wl, kw)

    def run_weights(self, src: Any, w: str, wl: str, kw: dict[str, Any]) -> None:
        """The decode / profile / prefill figures of one weight dtype's model (no MTP module)."""
        a, rep = self.args, self.rep
        t0 = time.perf_counter()
        try:
            eng = Engine(a, src, self.dev, self.dtype, kw)
        except Exception as exc:  # noqa: BLE001 - report and go on
            rep.error(f"building the {w} model", exc)
            return
        st = eng.stats
        rep.data["model"][wl] = st
        rep.line(f"model {wl}-w: {st['layers']} layers ({st['attention_layers']} attention, "
                 f"{st['recurrent_layers']} GDN), {st['total_params'] / 1e9:.2f}B params, "
                 f"{gb(st['weight_bytes_streamed'])} of weights" + (
                     f" ({st['moe_layers']} MoE layers of {st['num_experts']} experts, top-{st['top_k']}: "
                     f"{gb(weights_read(st, 1))} read per token at batch 1)" if st["moe_layers"] else
                     " streamed per decode step") + f", random weights on "
                 f"{self.dev} in {time.perf_counter() - t0:.1f} s" + fp8_kernels(w))
        if w == "fp8":
            self.fp8_gemm_report(eng, wl)
        if wl == "fp32":
            rep.note("weights and activations in float32 (CPU run: float32 is the fast path there); the "
                     "'bf16' KV pool is still bf16")
        try:
            self.resident(eng, wl)
            for kv in a.kv_dtypes:
                for g in a.cuda_graphs:  # one label per mode when several are compared
                    self.graphs = g
                    self.per_kv(eng, wl if len(a.cuda_graphs) == 1 else f"{wl}/graphs-{g}", kv)
        finally:
            eng.drop()
            del eng
            free_memory(self.dev)

    def run_speculative(self, src: Any, w: str, wl: str, kw: dict[str, Any]) -> None:
        """The speculative figures of one weight dtype: a model of its own with one MTP layer,
        built after the plain model is dropped (both would not fit one GPU at the 27B shape). Per
        KV dtype and graphs mode: the plain step on it (speculation off, no MTP KV layer), then
        one engine per ``--speculative`` K."""
        a, rep = self.args, self.rep
        t0 = time.perf_counter()
        try:
            eng = Engine(a, src, self.dev, self.dtype, kw, mtp=True)
        except Exception as exc:  # noqa: BLE001 - report and go on
            rep.error(f"building the {w} model with its MTP layer", exc)
            return
        st, m = eng.stats, eng.mtp
        assert m is not None
        rep.data["model"][f"{wl}+mtp"] = {**st, **m}
        rep.line(f"model {wl}-w + MTP (speculative figures): the same {st['layers']} layers plus {m['mtp_layers']} MTP "
                 f"layer of {m['mtp_params'] / 1e6:.1f}M params ({gb(m['mtp_bytes'])}), random weights on {self.dev} "
                 f"in {time.perf_counter() - t0:.1f} s ("
                 + ("random_weights filled the MTP module" if not m["refilled"] else
                    f"filled here, random_weights left {len(m['refilled'])} MTP tensors unset: {m['refilled'][:3]}")
                 + ")")
        try:
            for kv in a.kv_dtypes:
                for g in a.cuda_graphs:
                    self.graphs = g
                    label = wl if len(a.cuda_graphs) == 1 else f"{wl}/graphs-{g}"
                    for k in [0, *a.speculative]:
                        self.per_kv(eng, label, kv, self.spec_jobs(k), k)
        finally:
            eng.drop()
            del eng
            free_memory(self.dev)

    def fp8_gemm_report(self, eng: Engine, wl: str) -> None:
        """Per FP8 weight shape at 1 and 5 rows, the served kernel's time alone against the copy
        bandwidth, and the sum over a decode step's layers (``fp8_gemm_times``)."""
        try:
            figs = fp8_gemm_times(eng.model, self.dev, self.dtype, self.bw)
        except Exception as exc:  # noqa: BLE001 - report and go on
            self.rep.error(f"timing the {wl} GEMMs", exc)
            return
        if not figs:
            return
        self.rep.data.setdefault("fp8_gemm", {})[wl] = figs
        for m in sorted({f["rows"] for f in figs}):
            row = [f for f in figs if f["rows"] == m]
            total = sum(f["step_ms"] for f in row)
            self.rep.line(f"FP8 GEMMs alone at {m} row{'s' if m > 1 else ''} ({wl}-w): {total:.2f} ms per decode step "
                          "over the layers; " + "; ".join(
                              f"{f['shape']} x{f['layers']} {f['kernel']} {f['us']:.1f} us = {f['gb_s']:.0f} GB/s"
                              + (f" ({f['fraction']:.0%})" if f["fraction"] else "") for f in row))

    def resident(self, eng: Engine, wl: str) -> None:
        rep = self.rep
        eng.close()
        runner = eng.runner("auto")
        spec = runner.memory_spec()
        budget, where = eng.pool_budget(runner, 1)
        served = runner.max_context
        for name, page_bytes in spec.page_bytes_by_kv_dtype:
            pages = max(0, budget) // page_bytes
            tokens = pages * spec.page_size
            rep.add("resident", {"weights": wl, "kv": name, "tokens": tokens, "pages": pages, "page_bytes": page_bytes,
                                 "budget_bytes": budget, "served_limit": served, "where": where})
            rep.line(f"max resident context {wl}-w {name}-kv: {tokens:,} tokens ({pages:,} pages x {spec.page_size}, "
                     f"{page_bytes / 1024:.0f} KiB/page, {budget / GiB:.2f} GiB = {where}); model serves up to "
                     f"{served:,}")

    def jobs(self) -> list[Job]:
        """Every figure of one (weights, kv) pair, with the sequences and length it needs."""
        a = self.args
        out: list[Job] = []
        if not a.skip_decode:
            out += [Job("decode", b, ctx + decode_tokens(a, b, ctx, False), ctx)
                    for ctx in a.contexts for b in a.batches]
        if a.profile:
            ctx = a.contexts[0]
            out.append(Job("profile", a.profile_batch, ctx + decode_tokens(a, a.profile_batch, ctx, True), ctx))
        if not a.skip_prefill:
            out += [Job("prefill", 1, t + 1, t) for t in a.prefill_tokens]
        if a.prefill_414k:
            out.append(Job("cold", 1, a.cold_tokens + 1, a.cold_tokens))
        return out

    def spec_jobs(self, drafts: int) -> list[Job]:
        """The speculative figures of one K (``drafts`` 0: their plain steps), on the MTP model."""
        a = self.args
        kind = "spec" if drafts else "spec_plain"
        return [Job(kind, b, ctx + spec_tokens(a, b, ctx, drafts), ctx, drafts) for ctx in a.contexts
                for b in a.batches]

    def per_kv(self, eng: Engine, wl: str, kv: str, jobs: list[Job] | None = None, drafts: int = 0) -> None:
        """Run ``jobs`` (default ``jobs()``) for ``kv`` on engines drafting ``drafts`` tokens per
        round. A pool is sized for the largest batch still to run (its state slots come out of the
        same memory); what does not fit waits for a pool with fewer slots (one per distinct batch
        at most), and is skipped, with the numbers, once even that cannot hold it."""
        rep = self.rep
        eng.close()
        try:
            runner = eng.runner(kv, mtp=drafts > 0)
        except KVSettingsError as exc:
            rep.note(f"kv {kv}: not usable with this model ({exc}); skipped")
            return
        spec = runner.memory_spec()
        model_ctx = runner.max_context
        pending = self.jobs() if jobs is None else list(jobs)
        while pending:
            slots = max(j.seqs for j in pending)
            budget, where = eng.pool_budget(runner, slots if spec.hybrid else 0)
            pool_pages = max(0, budget) // spec.bytes_per_page

            def fits(j: Job) -> bool:
                return j.length <= model_ctx and j.seqs * pages_for(j.length, PAGE_SIZE) <= pool_pages

            runnable = [j for j in pending if fits(j)]
            for j in pending:
                if j.seqs == slots and not fits(j):  # fewer slots cannot help it: skipped
                    why = (f"context {j.length} exceeds the model's {model_ctx} positions" if j.length > model_ctx
                           else f"needs {j.seqs} x {pages_for(j.length, PAGE_SIZE):,} KV pages of "
                                f"{spec.bytes_per_page / 1024:.0f} KiB; the pool holds {pool_pages:,} "
                                f"({budget / GiB:.2f} GiB = {where})")
                    self.skip(wl, kv, j, why)
            pending = [j for j in pending if j not in runnable and j.seqs != slots]
            if runnable:
                self.run_jobs(eng, wl, kv, spec, runnable, slots, max(j.length for j in runnable), drafts)
        del runner
        if jobs is None:
            self.scaling_targets(wl, kv)

    def skip(self, wl: str, kv: str, j: Job, why: str) -> None:
        rep = self.rep
        if j.kind in ("spec", "spec_plain"):
            what = f"speculative K={j.drafts}" if j.drafts else "speculative baseline (plain step)"
            rep.line(f"{what} {wl}-w {kv}-kv batch={j.seqs} ctx={j.size}: skipped ({why})")
            rep.add("speculative" if j.drafts else "speculative_plain",
                    {"weights": wl, "kv": kv, "batch": j.seqs, "context": j.size, "drafts": j.drafts, "skipped": why})
        elif j.kind in ("decode", "profile"):
            rep.line(f"decode {wl}-w {kv}-kv batch={j.seqs} ctx={j.size}: skipped ({why})")
            rep.add("decode", {"weights": wl, "kv": kv, "batch": j.seqs, "context": j.size, "skipped": why})
        else:
            section = "prefill" if j.kind == "prefill" else "cold_prefill"
            rep.line(f"{'cold ' if j.kind == 'cold' else ''}prefill {wl}-w {kv}-kv tokens={j.size}: skipped ({why})")
            rep.add(section, {"weights": wl, "kv": kv, "tokens": j.size, "skipped": why})

    def run_jobs(self, eng: Engine, wl: str, kv: str, spec: Any, jobs: list[Job], slots: int,
                 max_context: int, drafts: int = 0) -> None:
        a, rep = self.args, self.rep
        t0 = time.perf_counter()
        mtp = "" if eng.mtp is None else (f" (MTP model, speculative K={drafts})" if drafts
                                          else " (MTP model, speculation off)")
        try:
            core = eng.open(kv, max_context, slots, self.graphs, drafts)
        except Exception as exc:  # noqa: BLE001
            rep.error(f"building the engine for {wl}-w {kv}-kv{mtp}", exc)
            return
        if core.spec_tokens != drafts:
            rep.error(f"the engine for {wl}-w {kv}-kv{mtp}",
                      RuntimeError(f"drafts {core.spec_tokens} tokens per round, {drafts} asked for"))
            del core
            eng.close()
            return
        kv_bpt = spec.bytes_per_page / spec.page_size
        rep.line(f"engine {wl}-w {kv}-kv{mtp}: {core.blocks.num_pages:,} pages x {PAGE_SIZE} ({kv_bpt / 1024:.2f} "
                 f"KiB/token over {spec.num_attention_layers} attention layers), {core.blocks.num_state_slots} state "
                 f"slots of {spec.bytes_per_state_slot / 2**20:.1f} MiB, served context {core.max_context:,}, token "
                 f"budget {a.token_budget}; built (calibration, kernel check and graph capture included) in "
                 f"{time.perf_counter() - t0:.1f} s; cuda graphs "
                 + (str(core.runner.graphs.describe()) if getattr(core.runner, "graphs", None) is not None else "off"))
        try:
            for j in jobs:
                if j.kind == "spec_plain":
                    self.spec_plain_one(core, wl, kv, j.seqs, j.size)
                elif j.kind == "spec":
                    self.spec_one(core, wl, kv, j.seqs, j.size, j.drafts)
                elif j.kind == "decode":
                    self.decode_one(core, eng, wl, kv, j.seqs, j.size, spec)
                elif j.kind == "profile":
                    self.profile_one(core, eng, wl, kv, spec, j.seqs, j.size)
                elif j.kind == "prefill":
                    self.prefill_one(core, eng, wl, kv, j.size)
                else:
                    self.cold_one(core, wl, kv)
        finally:
            del core  # the pool goes before the next one is sized
            eng.close()

    def scaling_targets(self, wl: str, kv: str) -> None:
        b = self.big_batch
        for ctx in self.args.contexts:
            one, many = self.decode_figs.get((wl, kv, 1, ctx)), self.decode_figs.get((wl, kv, b, ctx))
            if b > 1 and one and many:
                self.rep.target(f"{wl}-w {kv}-kv batch {b} / batch 1 aggregate at ctx {ctx}", many / one,
                                T_BATCH_SCALING, "x")

    def roofline(self, st: dict[str, Any], spec: Any, batch: int, ctx: float) -> dict[str, float]:
        w = weights_read(st, batch)
        kvb = batch * ctx * spec.bytes_per_page / spec.page_size
        state = batch * 2 * spec.bytes_per_state_slot  # read and written back in place
        total = w + kvb + state
        return {"bytes_per_step": total, "weight_bytes": w, "kv_bytes": kvb, "state_bytes": state,
                "roofline_tok_s": batch * self.bw / total, "weights_only_tok_s": batch * self.bw / w,
                "weights_kv_tok_s": batch * self.bw / (w + kvb)}

    def decode_one(self, core: EngineCore, eng: Engine, wl: str, kv: str, b: int, ctx: int, spec: Any,
                   profile: bool = False) -> dict[str, Any] | None:
        """One decode figure, printed and recorded with its targets (``profile``: the profiled
        run, printed only: its figure is the unprofiled one's twin)."""
        rep, a = self.rep, self.args
        label = f"decode {wl}-w {kv}-kv batch={b} ctx={ctx}"
        base = {"weights": wl, "kv": kv, "batch": b, "context": ctx}
        try:
            r = run_decode(core, b, ctx, a, profile=profile)
        except Exception as exc:  # noqa: BLE001
            rep.error(label, exc)
            return None
        if "skipped" in r:
            rep.line(f"{label}: skipped ({r['skipped']})")
            rep.add("decode", {**base, **r})
            return None
        if profile:
            rep.line(f"{label} (profiled run): {r['tok_s']:.1f} tok/s, {r['step_s'] * 1e3:.1f} ms/step "
                     f"[fill: {r['fill']}]")
            return r
        rf = self.roofline(eng.stats, spec, b, r["mean_context"])
        frac = r["tok_s"] / rf["roofline_tok_s"]
        fig = {**base, **r, **rf, "fraction": frac, "fraction_weights_only": r["tok_s"] / rf["weights_only_tok_s"],
               "fraction_weights_kv": r["tok_s"] / rf["weights_kv_tok_s"], "bandwidth": self.bw}
        fig.pop("profile", None)
        rep.add("decode", fig)
        rep.line(f"{label}: {r['tok_s']:.1f} tok/s = {frac:.0%} of roofline ({rf['roofline_tok_s']:.1f} tok/s at "
                 f"{tb_s(self.bw)}; {gb(rf['bytes_per_step'])}/step = {gb(rf['weight_bytes'])} weights "
                 f"+ {gb(rf['kv_bytes'])} KV + {gb(rf['state_bytes'])} state r+w) [fill: {r['fill']}, "
                 f"{r['fill_s']:.1f} s; {r['step_s'] * 1e3:.1f} ms/step]"
                 + (f" WARNING {r['warning']}" if "warning" in r else ""))
        self.decode_figs[(wl, kv, b, ctx)] = r["tok_s"]
        if b == 1 and ctx == self.at_4k:
            rep.target(f"{wl}-w {kv}-kv decode batch 1 at 4k, fraction of the weights-read roofline",
                       fig["fraction_weights_only"], T_DECODE_B1_4K, "%")
        if ctx == self.at_128k and kv == "nvfp4":
            rep.target(f"{wl}-w {kv}-kv decode batch {b} at 128k, fraction of the weights + KV roofline",
                       fig["fraction_weights_kv"], T_DECODE_128K, "%",
                       note="" if wl.startswith("fp8") else f"the target is for FP8 weights; measured with {wl} weights")
        return r

    def profile_one(self, core: EngineCore, eng: Engine, wl: str, kv: str, spec: Any, b: int, ctx: int) -> None:
        rep = self.rep
        graphed = core.runner.graphs is not None
        rep.line(f"profile: one decode step, {wl}-w {kv}-kv batch={b} ctx={ctx} (cuda graphs: "
                 f"{'on: ' + str(core.runner.graphs.describe()) if graphed else 'off, eager step'})")
        r = self.decode_one(core, eng, wl, kv, b, ctx, spec, profile=True)
        if r is None or "profile" not in r:
            return
        p = r["profile"]
        rep.add("profile", {"weights": wl, "kv": kv, "batch": b, "context": ctx, **p})
        if p["gpu_busy"] is not None:
            rep.line(f"profile {wl}-w {kv}-kv batch={b} ctx={ctx}: {p['kernels']} kernels, {p['launch_calls']} launch "
                     f"calls; kernel time {p['kernel_time_s'] * 1e3:.2f} ms; GPU busy {p['gpu_busy']:.0%} of the "
                     f"unprofiled step ({p['wall_unprofiled_s'] * 1e3:.2f} ms), {p['gpu_busy_profiled_wall']:.0%} of "
                     f"the profiled one ({p['wall_profiled_s'] * 1e3:.2f} ms)")
        else:
            rep.line(f"profile {wl}-w {kv}-kv batch={b} ctx={ctx}: no GPU (kernel launches and busy n/a); "
                     f"step {p['wall_profiled_s'] * 1e3:.2f} ms profiled; top ops by CPU time:")
        for i, k in enumerate(p["top"], 1):
            rep.line(f"    {i:2d}. {k['total_us'] / 1e3:8.3f} ms  x{k['count']:<4d} {k['name'][:110]}")
        rep.line(f"    kernel launches in the step: {p['launch_calls']}")
        rep.target(f"{wl}-w {kv}-kv GPU busy in a decode step (torch profiler)", p["gpu_busy"], T_GPU_BUSY, "%",
                   note="" if graphed else "the target is with CUDA graphs on; this step ran eagerly")

    # -- speculative decoding (MTP) ------------------------------------------------------
    def spec_plain_one(self, core: EngineCore, wl: str, kv: str, b: int, ctx: int) -> None:
        """The plain decode step the speculative rounds are compared with: the MTP model's
        weights, speculation off, this batch, context, KV dtype and graphs mode."""
        rep = self.rep
        label = f"speculative baseline {wl}-w {kv}-kv batch={b} ctx={ctx}"
        base = {"weights": wl, "kv": kv, "batch": b, "context": ctx, "drafts": 0}
        try:
            r = run_rounds(core, b, ctx, self.args, 0)
        except Exception as exc:  # noqa: BLE001
            rep.error(label, exc)
            return
        rep.add("speculative_plain", {**base, **r})
        if "skipped" in r:
            rep.line(f"{label}: skipped ({r['skipped']})")
            return
        self.spec_plain[(wl, kv, b, ctx)] = r
        p = r["profiled"]
        rep.line(f"{label} (MTP model, speculation off): plain step {r['step_s'] * 1e3:.2f} ms = {r['tok_s']:.1f} "
                 f"tok/s; profiled: forward {p['forward_s'] * 1e3:.2f} ms of a {p['step_s'] * 1e3:.2f} ms step, "
                 f"{p['graphed_forwards']}/{p['steps']} graphed [fill: {r['fill']}, {r['fill_s']:.1f} s]"
                 + (f" WARNING {r['warning']}" if "warning" in r else ""))

    def spec_one(self, core: EngineCore, wl: str, kv: str, b: int, ctx: int, k: int) -> None:
        """One speculative figure: a round of ``k`` drafts (verify forward of ``k + 1`` tokens per
        sequence + commit + ``k`` MTP drafting forwards) against the plain step, its parts, and
        the projection at the assumed acceptance (``--accept-rate``); printed with its targets."""
        rep, a = self.rep, self.args
        label = f"speculative K={k} {wl}-w {kv}-kv batch={b} ctx={ctx}"
        base = {"weights": wl, "kv": kv, "batch": b, "context": ctx, "drafts": k}
        try:
            r = run_rounds(core, b, ctx, a, k)
        except Exception as exc:  # noqa: BLE001
            rep.error(label, exc)
            return
        if "skipped" in r:
            rep.line(f"{label}: skipped ({r['skipped']})")
            rep.add("speculative", {**base, **r})
            return
        p, plain = r["profiled"], self.spec_plain.get((wl, kv, b, ctx))
        acc = a.accept_rate
        per_round = (1.0 - acc ** (k + 1)) / (1.0 - acc)  # expected tokens per round and sequence
        round_s, verify_s = r["step_s"], p["forward_s"]
        projected = b * per_round / round_s
        fig: dict[str, Any] = {**base, **r, "round_s": round_s, "verify_s": verify_s, "propose_s": p["propose_s"],
                               "commit_s": p["accept_s"], "accept_rate_assumed": acc,
                               "tokens_per_round_assumed": per_round, "projected_tok_s": projected}
        if plain is not None:
            plain_s, plain_fwd = plain["step_s"], plain["profiled"]["forward_s"]
            fig.update(plain_step_s=plain_s, plain_tok_s=plain["tok_s"], plain_forward_s=plain_fwd,
                       round_ratio=round_s / plain_s, verify_ratio=verify_s / plain_s,
                       verify_forward_ratio=verify_s / plain_fwd, projected_speedup=projected / plain["tok_s"])
            vs_round = (f" = {fig['round_ratio']:.2f}x the plain step ({plain_s * 1e3:.2f} ms/step, same model, KV, "
                        "batch, context, graphs; speculation off)")
            vs_verify = (f" = {fig['verify_ratio']:.2f}x the plain step, {fig['verify_forward_ratio']:.2f}x its "
                         f"forward ({plain_fwd * 1e3:.2f} ms)")
            vs_plain = f" vs {plain['tok_s']:.1f} tok/s plain decode = {fig['projected_speedup']:.2f}x"
        else:
            vs_round, vs_verify, vs_plain = " (no plain step to compare with)", "", ""
        rep.add("speculative", fig)
        measured = r.get("measured_acceptance")
        rep.line(f"{label}: {round_s * 1e3:.2f} ms/round{vs_round} [fill: {r['fill']}; measured acceptance "
                 + ("n/a" if measured is None else f"{measured:.1%}")
                 + f", {r['tokens_per_round']:.2f} tokens/round/seq: random weights, meaningless]"
                 + (f" WARNING {r['warning']}" if "warning" in r else ""))
        partial = "" if p["full_forwards"] == p["steps"] else (
            f"; only {p['full_forwards']}/{p['steps']} were full rounds of {k + 1} tokens/seq")
        rep.line(f"    round parts (profiled pass, device synced around each; {p['step_s'] * 1e3:.2f} ms/round there): "
                 f"verify forward ({k + 1} tokens/seq) {verify_s * 1e3:.2f} ms{vs_verify}; commit (accept_many) "
                 f"{p['accept_s'] * 1e3:.2f} ms; propose ({k} MTP drafting forwards) {p['propose_s'] * 1e3:.2f} ms; "
                 f"rest (scheduler, sampler, acceptance) {p['other_s'] * 1e3:.2f} ms; verify forwards graphed "
                 f"{p['graphed_forwards']}/{p['steps']}, MTP pass + chain graphed {p.get('graphed_mtp', 0)}/{p['steps']}"
                 f"{partial}")
        rep.line(f"    projection (acceptance ASSUMED, p = {acc:g} per draft token; random weights cannot measure it): "
                 f"(1 - p^{k + 1}) / (1 - p) = {per_round:.2f} tokens/round/seq -> {b} x {per_round:.2f} / "
                 f"{round_s * 1e3:.2f} ms = {projected:.1f} tok/s{vs_plain}")
        if k == T_VERIFY_K:
            rep.target(f"{wl}-w {kv}-kv batch {b} ctx {ctx}: verify round of K+1={k + 1} tokens (verify forward) / "
                       "plain step", fig.get("verify_ratio"), T_VERIFY_COST, "x", higher=False,
                       note=f"whole round {fig['round_ratio']:.2f}x the plain step" if plain else "no plain step")
        if b == 1 and ctx == self.at_128k:
            rep.target(f"{wl}-w {kv}-kv K={k} projected rate at 128k, batch 1 / plain decode (acceptance assumed "
                       f"p={acc:g})", fig.get("projected_speedup"), T_SPEC_SPEEDUP, "x",
                       note="" if wl.startswith("fp8") else f"the target is for FP8 weights; measured with {wl}")

    def prefill_one(self, core: EngineCore, eng: Engine, wl: str, kv: str, t: int) -> None:
        rep, st = self.rep, eng.stats
        label = f"prefill {wl}-w {kv}-kv tokens={t}"
        try:
            r = run_prefill(core, t, self.args)
        except Exception as exc:  # noqa: BLE001
            rep.error(label, exc)
            return
        base = {"weights": wl, "kv": kv, "tokens": t}
        if "skipped" in r:
            rep.line(f"{label}: skipped ({r['skipped']})")
            rep.add("prefill", {**base, **r})
            return
        flops = prefill_flops(st, t)
        fps = flops / r["seconds"]
        mfu = fps / self.peak
        rep.add("prefill", {**base, **r, "flops": flops, "flops_per_s": fps, "mfu": mfu})
        if not any("FLOPs =" in n for n in rep.data["notes"]):
            rep.note(FLOPS_FORMULA.format(P=st["active_layer_params"], Ph=st["head_params"], L=st["attention_layers"],
                                          H=st["heads"], D=st["head_dim"]))
        rep.line(f"{label}: {r['tok_s']:.0f} tok/s = {flops_s(fps)} = {mfu:.0%} MFU "
                 f"({r['seconds']:.2f} s, GEMM peak {flops_s(self.peak)})")
        if t == self.at_8k:
            rep.target(f"{wl}-w {kv}-kv prefill MFU at 8k", mfu, T_PREFILL_MFU, "%")

    def cold_one(self, core: EngineCore, wl: str, kv: str) -> None:
        rep, n = self.rep, self.args.cold_tokens
        label = f"cold prefill {wl}-w {kv}-kv tokens={n}"
        try:
            r = run_prefill(core, n, self.args, warm=True)
        except Exception as exc:  # noqa: BLE001
            rep.error(label, exc)
            return
        base = {"weights": wl, "kv": kv, "tokens": n}
        rep.add("cold_prefill", {**base, **r})
        if "skipped" in r:
            rep.line(f"{label}: skipped ({r['skipped']})")
            return
        rep.line(f"{label}: {r['seconds']:.1f} s to the first token ({r['tok_s']:.0f} tok/s; nothing cached, "
                 f"chunks of {self.args.token_budget})")
        if n >= self.cold_min:
            rep.target(f"{wl}-w {kv}-kv cold 414k-token prefill", r["seconds"], T_COLD_S, " s", higher=False)

    # -- HF ------------------------------------------------------------------------------
    def hf_deepwell(self, eng: Engine, layers: int, need: int, dw: dict[str, Any]) -> None:
        a, rep = self.args, self.rep
        core = eng.open("bf16", need + PAGE_SIZE, 1)
        try:
            for t in a.hf_prefill:
                dw[f"prefill_{t}"] = r = run_prefill(core, t, a)
                rep.line(f"deepwell {layers}-layer prefill {t}: "
                         + (f"{r['tok_s']:.0f} tok/s" if "tok_s" in r else f"skipped ({r['skipped']})"))
            dw["decode"] = r = run_decode(core, 1, a.hf_context, a)
            rep.line(f"deepwell {layers}-layer decode batch=1 ctx={a.hf_context}: "
                     + (f"{r['tok_s']:.1f} tok/s [fill: {r['fill']}]" if "tok_s" in r else f"skipped ({r['skipped']})"))
        finally:
            del core
            eng.close()

    def run_hf(self) -> None:
        import importlib.util

        a, rep = self.args, self.rep
        cfg = slice_config(TINY if a.tiny else QWEN35_27B, a.layers)
        L = cfg["num_hidden_layers"]
        fla = importlib.util.find_spec("fla") is not None
        conv = importlib.util.find_spec("causal_conv1d") is not None
        import transformers

        info = {"layers": L, "transformers": transformers.__version__, "fla": fla, "causal_conv1d": conv,
                "context": a.hf_context, "prefill_tokens": a.hf_prefill}
        rep.data["hf"] = info
        full = (TINY if a.tiny else QWEN35_27B)["num_hidden_layers"]
        rep.line(f"HF comparison: a {L}-layer slice of the shape (of {full}), random weights, "
                 f"{short_dtype(self.dtype)}, bf16 KV; transformers {transformers.__version__}, "
                 f"fla-core {'imports' if fla else 'absent (torch fallback)'}, causal-conv1d "
                 f"{'imports' if conv else 'absent (torch conv)'}")
        need = max([*a.hf_prefill, a.hf_context + a.warmup_steps + a.decode_steps + 2]) + 1
        src = self.source(cfg, f"slice{L}", need)
        dw: dict[str, Any] = {}
        try:
            eng = Engine(a, src, self.dev, self.dtype, {})
            try:
                self.hf_deepwell(eng, L, need, dw)
            finally:
                eng.drop()
                del eng
                free_memory(self.dev)
        except Exception as exc:  # noqa: BLE001
            rep.error("deepwell on the HF slice", exc)
            return
        info["deepwell"] = dw
        rep.save()
        hf: dict[str, Any] = {}
        try:
            model = hf_model(cfg, self.dev, self.dtype)
            info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
            try:
                for t in a.hf_prefill:
                    hf[f"prefill_{t}"] = hf_prefill(model, t, self.dev, cfg["vocab_size"])
                    rep.line(f"HF {L}-layer prefill {t}: {hf[f'prefill_{t}']['tok_s']:.0f} tok/s")
                hf["decode"] = hf_decode(model, a.hf_context, a.decode_steps, a.warmup_steps, self.dev,
                                         cfg["vocab_size"])
                rep.line(f"HF {L}-layer decode batch=1 ctx={a.hf_context}: {hf['decode']['tok_s']:.1f} tok/s")
            finally:
                del model
                free_memory(self.dev)
        except Exception as exc:  # noqa: BLE001
            rep.error("HF transformers on the slice", exc)
        info["hf"] = hf
        ratios = {}
        for key in dw:
            if key in hf and "tok_s" in dw[key] and "tok_s" in hf[key]:
                ratios[key] = dw[key]["tok_s"] / hf[key]["tok_s"]
        info["ratios"] = ratios
        rep.save()
        for key, r in ratios.items():
            rep.line(f"deepwell / HF {key.replace('_', ' ')} ({L}-layer slice): {r:.2f}x")
            if key == "decode":
                rep.target("decode vs HF (batch 1 at 4k)", r, T_HF_DECODE, "x")
            else:
                rep.target(f"{key.replace('_', ' ')} vs HF", r, T_HF_PREFILL, "x")


# ----------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-27b", choices=sorted(SHAPES),
                    help="the model's shape: the dense Qwen3.5-27B (the issue's) or the MoE Qwen3.6-35B-A3B")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3.5-style hybrid (4 layers, hidden 128): plumbing")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: cuda if available)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                    help="weights / activations (auto: bf16 on CUDA, float32 on CPU)")
    ap.add_argument("--weight-dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                    help="weight formats (fp8 only where the engine has the option)")
    ap.add_argument("--kv-dtypes", nargs="+", default=["bf16", "nvfp4"], help="KV formats (as --kv-dtype)")
    ap.add_argument("--linear-kernels", nargs="+", default=["auto"], choices=["auto", "torch", "gemv"],
                    help="the engine's --linear-kernel per model built (several: one model each, labelled "
                         "<weights>+<kernel>; gemv: decode steps' 16-bit linears through kernels.gemv)")
    ap.add_argument("--contexts", nargs="+", type=int, default=None,
                    help="decode contexts (default 4096 131072 409600)")
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="decode batches (default 1 8 32)")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 32; tiny 4)")
    ap.add_argument("--warmup-steps", type=int, default=3, help="decode steps before timing (first token included)")
    ap.add_argument("--fill-above", type=int, default=None,
                    help="contexts above this are filled directly, not prefilled (default 8192; tiny 128)")
    ap.add_argument("--prefill-tokens", nargs="+", type=int, default=None, help="default 8192 65536 (tiny 256 512)")
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per engine step (default 8192; tiny 256)")
    ap.add_argument("--cuda-graphs", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                    help="the engine's --cuda-graphs; several (e.g. on off) run every figure once per mode")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--prefill-414k", action="store_true", help="cold prefill of --cold-tokens (long)")
    ap.add_argument("--cold-tokens", type=int, default=None, help="default 414000 (tiny 1024)")
    ap.add_argument("--hf", action="store_true", help="HF transformers comparison on a --layers slice")
    ap.add_argument("--layers", type=int, default=None, help="layers of the HF comparison's slice (default 16; tiny 4)")
    ap.add_argument("--hf-context", type=int, default=None,
                    help="HF comparison decode context (default 4096; tiny 128)")
    ap.add_argument("--hf-prefill", nargs="+", type=int, default=None, help="default 4096 8192 (tiny 128 256)")
    ap.add_argument("--profile", action="store_true", help="one decode step under torch.profiler")
    ap.add_argument("--profile-batch", type=int, default=1)
    ap.add_argument("--speculative", nargs="+", type=int, default=[], metavar="K",
                    help="MTP speculative rounds of K drafted tokens each (on a model with one MTP layer); "
                         "default: not measured")
    ap.add_argument("--accept-rate", type=float, default=0.92,
                    help="per-token draft acceptance ASSUMED for the speculative projection (random weights "
                         "cannot measure it)")
    ap.add_argument("--model-layers", type=int, default=0, help="run the main figures on a slice (0 = every layer)")
    ap.add_argument("--memory-fraction", type=float, default=0.9, help="CUDA: KV pool share of the free memory")
    ap.add_argument("--cpu-kv-gib", type=float, default=0.25, help="CPU: KV pool GiB")
    ap.add_argument("--rope-scaling", default="auto",
                    help="auto (YaRN x4 when a context exceeds the model's), model, or yarn:<factor>")
    ap.add_argument("--bw-gib", type=float, default=None, help="copy size for the bandwidth (default 4; tiny 1/16)")
    ap.add_argument("--gemm-n", type=int, default=None, help="GEMM size for the peak (default 8192; tiny 256)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    t = args.tiny
    defaults = {"contexts": [256] if t else [4096, 131072, 409600], "batches": [1, 2] if t else [1, 8, 32],
                "decode_steps": 4 if t else 32, "fill_above": 128 if t else 8192,
                "prefill_tokens": [256, 512] if t else [8192, 65536], "token_budget": 256 if t else 8192,
                "cold_tokens": 1024 if t else 414_000, "layers": 4 if t else 16, "hf_context": 128 if t else 4096,
                "hf_prefill": [128, 256] if t else [4096, 8192], "bw_gib": 1 / 16 if t else 4.0,
                "gemm_n": 256 if t else 8192}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.warmup_steps < 1 or args.decode_steps < 1:
        ap.error("--warmup-steps and --decode-steps must be >= 1")
    if any(not 1 <= k <= min(MAX_SPECULATIVE_TOKENS, PAGE_SIZE - 1) for k in args.speculative):
        ap.error(f"--speculative K must be in 1..{min(MAX_SPECULATIVE_TOKENS, PAGE_SIZE - 1)}")
    args.speculative = sorted(set(args.speculative))
    if not 0.0 <= args.accept_rate < 1.0:
        ap.error("--accept-rate must be in [0, 1)")
    if args.rope_scaling not in ("auto", "model"):
        rope_scaling.parse(args.rope_scaling)
    if args.hf and args.shape != "qwen3.5-27b":
        ap.error("--hf compares the dense Qwen3.5-27B shape only")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rep = Report(args.json, args.tiny)
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    shape = SHAPES[args.shape][0]
    rep.data["config"] = {**{k: v for k, v in vars(args).items()}, "device_name": name,
                          "torch": torch.__version__, "shape": f"tiny {shape}" if args.tiny else shape}
    rep.line(f"gpu_e2e: {f'tiny {shape}-style' if args.tiny else f'{shape}-shaped'} random-weight model on {name} "
             f"(torch {torch.__version__}); page {PAGE_SIZE}, token budget {args.token_budget}, prefix cache off")
    bench = Bench(args, rep)
    t0 = time.perf_counter()
    try:
        bench.denominators()
        if bench.jobs() or args.speculative:
            bench.run_main()
        if args.hf:
            bench.run_hf()
    finally:
        rep.data["elapsed_s"] = time.perf_counter() - t0
        rep.save()
    passed = sum(1 for t in rep.data["targets"] if t["pass"])
    rep.line(f"done in {rep.data['elapsed_s']:.0f} s: {passed}/{len(rep.data['targets'])} targets PASS, "
             f"{len(rep.data['errors'])} errors" + (f"; JSON {args.json}" if args.json else ""))
    return rep.data


if __name__ == "__main__":
    from deepwell.logs import setup_logging

    setup_logging("gpu_e2e", os.environ.get("GPU_E2E_LOG_LEVEL", "warning"))
    data = main()
    sys.exit(1 if data["errors"] else 0)
