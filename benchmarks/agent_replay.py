"""Replay scripted coding-agent sessions through the real gateway and engine; report prefix reuse.

    python benchmarks/agent_replay.py [--sessions 4] [--turns 8] [--seed 0]
        [--model DIR_or_gguf | --tiny-hybrid] [--engine-arg="--num-pages 512" ...]
        [--context-tokens N] [--system-chars 12000] [--tools 16] [--tool-output-chars 300-3000]
        [--loop-len 2-5] [--max-tokens 8] [--stream] [--start lead|together] [--json PATH]
        [--gateway URL --engine ADDR --request-log PATH [--metrics URL]]

What it does. ``benchmarks/agent_sessions.py`` scripts ``--sessions`` coding-agent sessions
(one shared system prompt and tool set; a user task, tool loops of assistant ``thinking`` +
``tool_use`` answered by ``tool_result`` file contents / command output, now and then an
answer and a new user message; the assistant turns are the script's, the model's outputs
are ignored but for timing, as in recorded traffic). Each request sends the whole
conversation so far to ``POST /v1/messages`` (Anthropic Messages; ``temperature`` 0, small
``max_tokens``; system blocks led by a per-request ``x-anthropic-billing-header`` block as
Claude Code sends, which the gateway strips) with ``x-claude-code-session-id`` (the
gateway's session key) and a unique ``x-request-id``. Sessions run concurrently (asyncio +
httpx), turns in order within a session. ``--start lead`` (default) lets session 0's first
turn finish before the others start, as when one agent is already running; ``together``
starts all at once. By default the script starts ``python -m deepwell.engine_service`` (``--model``,
the embedded SmolLM2 when absent, or ``--tiny-hybrid``: a tiny random Qwen3.5-style hybrid
with a small byte-level BPE tokenizer and the Qwen3.5 XML-tools chat template, written on the
spot; ``--engine-arg='--num-pages 512 --cpu-threads 1'`` passes flags through, note the
``=``) and ``python -m deepwell.gateway --request-log`` on loopback, and stops both at the end; with
``--gateway`` it uses a running stack (``--engine``: its gRPC address, for the model's
tokenizer and template; ``--request-log``: the log that gateway writes; ``--metrics``: the
engine's /metrics). Sizes: ``--system-chars``, ``--tools``, ``--tool-output-chars MIN-MAX``,
``--loop-len MIN-MAX``; ``--context-tokens N`` scales the tool outputs (rendering the script
with the real tokenizer) so that the sessions' last prompts average about N tokens.

Definitions.

- *Prompt*: every request is rendered here exactly as the gateway renders it: the model's
  tokenizer and chat template come from the engine over gRPC (``GetModelInfo`` +
  ``ReadModelFile``, ``gateway.engine_client.build_bundle``), the body goes through
  ``gateway.http.anthropic_api.to_chat_request`` and ``gateway.prompting.build_prompt``,
  giving the token ids, ``turn_boundary`` and ``prefix_boundary`` the gateway sends to the
  engine. The gateway log's ``prompt_tokens`` must equal the rendered length ("prompt
  mismatches" counts those that do not).
- *Cached tokens*: from the gateway's JSONL request log (matched by ``x-request-id``), per
  reuse level (resident_frontier, resident_checkpoint, host_entry, session_lookup,
  shared_prefix); the response's ``usage.cache_read_input_tokens`` must equal the log's
  total ("usage mismatches" counts those that do not).
- *Earlier request*: request j is earlier than request k when j's response was complete
  before k was sent (all earlier turns of the same session, and whatever other sessions had
  finished by then); only successful requests count.
- *Reusable point* R(k): the largest b among earlier requests j with b in {turn_boundary_j,
  prefix_boundary_j} when j is of k's session, b = prefix_boundary_j when j is of another
  session, such that prompt_k and prompt_j agree on their first b tokens and b <
  len(prompt_k) (reuse always leaves one token to compute). The engine was given a state it
  can resume at every such b (a turn checkpoint / a shared-prefix checkpoint, or for
  attention-only models any cut of the ledger).
- *Re-prefill of a cached turn*: a request of turn >= 2 served fewer cached tokens than
  R(k): the cache lost something it had been given and the engine computed it again.
  Target 0. On turn 1, R(k) > 0 only through another session's shared prefix; a turn-1
  request below it is a *shared-prefix miss*, counted separately.
- *Cached fraction* (turns >= 2): sum of cached tokens / sum of prompt tokens over all
  successful requests of turn >= 2. Target >= 0.95. For context the totals also give the
  *reusable fraction* (sum of R(k) / prompt tokens: what the boundaries promise) and the
  *shared-prefix-only fraction* (sum of prefix_boundary / prompt tokens: what serving only
  the shared system-and-tools block would give; a cached fraction above it shows that the
  sessions' own history was served).

Figures. Per turn: session, turn, prompt tokens, cached tokens per level and in total,
R(k), new (= prompt - cached), the gateway's ``ttft_ms``, the engine's ``prefill_ms`` and a
flag (RE-PREFILL, SHARED-MISS, USAGE!=LOG, PROMPT!=LOG, or the HTTP error). Totals: the
counts and fractions above, TTFT percentiles for turn 1 and turns >= 2, and from the
engine's Prometheus ``/metrics`` (counters as the change over the replay, gauges at the end):
``deepwell_engine_cache_hit_tokens_total{level}``, lookups, entries created,
``deepwell_engine_cache_evictions_total{cause}``, ``deepwell_engine_cache_entries{tier}``,
``deepwell_engine_cache_bytes{tier}`` and, where the engine exports them (the host tier),
``deepwell_engine_cache_spills_total{result}``, ``deepwell_engine_cache_restores_total{result}``,
``deepwell_engine_cache_copy_bytes_total{direction}``, the mean of
``deepwell_engine_cache_restore_seconds`` over the replay and
``deepwell_engine_cache_bytes{tier="host"}``; "n/a (...)" where a figure does not exist, never
a made-up number. "engine hits == log" says whether the engine's per-level hit counters moved
by exactly the gateway log's cached tokens (expected when nothing else uses the engine).

``--json PATH`` writes ``{"config", "rows", "totals"}``. ``main(argv)`` returns the totals
dict, so tests call it in-process (``tests/gateway/test_agent_replay.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from benchmarks.agent_sessions import (  # noqa: E402
    MAX_TOOLS,
    ScriptConfig,
    session_requests,
    shared_system_prompt,
    tool_definitions,
)

LEVELS = ("resident_frontier", "resident_checkpoint", "host_entry", "session_lookup", "shared_prefix")
LEVEL_ABBREV = {"resident_frontier": "front", "resident_checkpoint": "ckpt", "host_entry": "host",
                "session_lookup": "sess", "shared_prefix": "shared"}
TARGET_CACHED_FRACTION = 0.95
RESTORE_SECONDS = "deepwell_engine_cache_restore_seconds"
QWEN35_TEMPLATE = ROOT / "tests" / "gateway" / "templates" / "qwen3_5_xml.jinja"


# ----------------------------------------------------------------------------- options
def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN-MAX with 0 < MIN <= MAX")
    return a, b


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="agent_replay", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    p.add_argument("--turns", type=int, default=8, help="requests per session")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="", help="HF directory or .gguf for the engine ('' = embedded SmolLM2)")
    p.add_argument("--qwen35-27b", action="store_true",
                   help="the Qwen3.5-27B shape (64 layers, hidden 5120, ...) with random weights generated by the "
                        "engine on its device (--random-weights; GPU), tokenizer and template as --tiny-hybrid")
    p.add_argument("--tiny-hybrid", action="store_true",
                   help="serve a tiny random Qwen3.5-style hybrid with the Qwen3.5 XML-tools template")
    p.add_argument("--kv-daemon", action="store_true",
                   help="also start a KV-cache daemon and give the engine its host tier (--kv-daemon)")
    p.add_argument("--daemon-arena-mib", type=int, default=1024, help="with --kv-daemon: the daemon's arena size")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra engine flags, shell-split, e.g. --engine-arg='--num-pages 64' (repeatable)")
    p.add_argument("--gateway", default="", help="use this running gateway (http://host:port) instead of starting one")
    p.add_argument("--engine", default="", help="with --gateway: the engine's gRPC address (tokenizer + template)")
    p.add_argument("--request-log", default="", help="with --gateway: the JSONL request log that gateway writes")
    p.add_argument("--metrics", default="", help="with --gateway: the engine's /metrics URL (optional)")
    p.add_argument("--context-tokens", type=int, default=0,
                   help="scale tool outputs so a session's last prompt is about this many tokens (0 = off)")
    p.add_argument("--system-chars", type=int, default=12000, help="shared system prompt length in characters")
    p.add_argument("--tools", type=int, default=16, help=f"tool definitions (1..{MAX_TOOLS})")
    p.add_argument("--tool-output-chars", type=_range, default=(300, 3000), help="one tool result's size: MIN-MAX")
    p.add_argument("--loop-len", type=_range, default=(2, 5), help="tool-loop steps between user messages: MIN-MAX")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--stream", action="store_true", help="stream the responses (SSE); measures the client's TTFT")
    p.add_argument("--start", choices=("lead", "together"), default="lead",
                   help="lead: session 0's first turn runs alone first; together: all sessions start at once")
    p.add_argument("--json", default="", help="write config, per-turn rows and totals here")
    p.add_argument("--workdir", default="", help="run directory for logs and the tiny model (default: a temp dir)")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=900.0)
    p.add_argument("--quiet", action="store_true", help="print the totals only")
    args = p.parse_args(argv)
    if args.gateway and not (args.engine and args.request_log):
        p.error("--gateway needs --engine (gRPC address) and --request-log (the log that gateway writes)")
    if sum(map(bool, (args.tiny_hybrid, args.model, args.qwen35_27b))) > 1:
        p.error("--tiny-hybrid, --qwen35-27b and --model exclude each other")
    if args.sessions < 1 or args.turns < 1 or args.max_tokens < 1:
        p.error("--sessions, --turns and --max-tokens must be >= 1")
    return args


# ----------------------------------------------------------------------------- tiny hybrid
HYBRID_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                   "</tool_call>", "<tool_response>", "</tool_response>")


def hybrid_tokenizer_json(vocab_size: int = 2048) -> str:
    """A byte-level BPE (every byte has a token, so it covers any text) with the Qwen3.5 special
    tokens, its merges trained on the session script's own text (system prompt, every tool
    definition, a few sessions with a fixed seed) and the chat template: about 3.7 characters a
    token on the replayed prompts, and merges across turn boundaries happen as with real
    tokenizers. Training is deterministic for the same corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cfg = ScriptConfig(seed=12345, turns=12, system_chars=4000)
    corpus = [shared_system_prompt(cfg), json.dumps(tool_definitions(ScriptConfig(tools=MAX_TOOLS))),
              *(json.dumps(session_requests(cfg, s)[-1]) for s in range(4)), QWEN35_TEMPLATE.read_text("utf-8")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(HYBRID_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def write_tiny_hybrid(directory: Path, seed: int = 0) -> Path:
    """A tiny random ``qwen3_5`` (4 layers, linear/full attention alternating, hidden 64,
    head_dim 64: ``tests/engine/helpers_models.py``'s ``_HYBRID``; vocabulary 2048) saved with
    transformers, plus ``tokenizer.json`` (``hybrid_tokenizer_json``), ``tokenizer_config.json``,
    ``chat_template.jinja`` (the Qwen3.5 XML-tools template of ``tests/gateway/templates``) and
    ``generation_config.json`` (eos = ``<|im_end|>``)."""
    import torch
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    directory.mkdir(parents=True, exist_ok=True)
    tok_json = hybrid_tokenizer_json(vocab_size=2048)
    ids = {t["content"]: t["id"] for t in json.loads(tok_json)["added_tokens"]}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen3_5TextConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, max_position_embeddings=65536, rms_norm_eps=1e-6,
        initializer_range=0.08, bos_token_id=None, eos_token_id=eos, pad_token_id=pad, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(seed)
    Qwen3_5ForCausalLM(config).float().save_pretrained(directory)
    _write_chat_files(directory, tok_json, eos, pad, 65536)
    return directory


def _write_chat_files(directory: Path, tok_json: str, eos: int, pad: int, max_length: int) -> None:
    """The tokenizer, its config, the generation config and the Qwen3.5 XML-tools chat template."""
    (directory / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": max_length}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}))
    (directory / "chat_template.jinja").write_text(QWEN35_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")


QWEN35_27B = {  # the text model of Qwen3.5-27B's config (shared/DESIGN.md "Target model facts")
    "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 5120,
    "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}


def write_qwen35_27b(directory: Path) -> Path:
    """``config.json`` of the Qwen3.5-27B text model and the tiny hybrid's tokenizer files (its
    ids fit the vocabulary): served with ``--random-weights`` (no weight files)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok_json = hybrid_tokenizer_json(vocab_size=2048)
    ids = {t["content"]: t["id"] for t in json.loads(tok_json)["added_tokens"]}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    (directory / "config.json").write_text(json.dumps({**QWEN35_27B, "eos_token_id": eos, "pad_token_id": pad}))
    _write_chat_files(directory, tok_json, eos, pad, 262144)
    return directory


# ----------------------------------------------------------------------------- processes
def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies (Linux), so no server outlives the run."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Stack:
    gateway_url: str
    engine_address: str
    request_log: Path
    metrics_url: str  # '' = none
    run_dir: Path


def start_engine(run_dir: Path, model: str, extra: list[str],
                 timeout_s: float) -> tuple[subprocess.Popen[Any], str, str]:
    """``python -m deepwell.engine_service`` on loopback; returns (process, gRPC address, metrics URL)."""
    port_file = run_dir / "engine.port"
    stderr = open(run_dir / "engine.stderr.log", "w")
    cmd = [sys.executable, "-m", "deepwell.engine_service", "--model", model, "--listen", "127.0.0.1:0",
           "--port-file", str(port_file), "--metrics-port", "0", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
                            preexec_fn=_die_with_parent)
    stderr.close()
    lines: list[str] = []

    def drain() -> None:  # the engine prints one line; keep reading so stdout can never block it
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not any(line.startswith("engine listening on ") for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            err = (run_dir / "engine.stderr.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"engine did not start ({' '.join(cmd)}):\n{''.join(lines)}{err}")
        time.sleep(0.05)
    line = next(line for line in lines if line.startswith("engine listening on "))
    address = line.split()[3]
    metrics = line.split("metrics on ")[1].strip() if "metrics on http" in line else ""
    return proc, address, metrics


def start_gateway(run_dir: Path, engine: str, request_log: Path, timeout_s: float) -> tuple[subprocess.Popen[Any], str]:
    """``python -m deepwell.gateway`` on loopback (HTTP only) writing ``request_log``; waits for /health."""
    port_file = run_dir / "gateway.port"
    log = open(run_dir / "gateway.log", "w")
    cmd = [sys.executable, "-m", "deepwell.gateway", "--port", "0", "--port-file", str(port_file), "--engines", engine,
           "--grpc-listen", "", "--request-log", str(request_log), "--health-interval-s", "0.5",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=_die_with_parent)
    log.close()
    deadline = time.monotonic() + timeout_s
    url = ""
    while time.monotonic() < deadline and proc.poll() is None:
        if not url and port_file.exists() and port_file.read_text().strip():
            url = f"http://127.0.0.1:{int(port_file.read_text())}"
        if url:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return proc, url
            except OSError:
                pass
        time.sleep(0.1)
    stop_process(proc)
    log_tail = (run_dir / "gateway.log").read_text(errors="replace")[-4000:]
    raise RuntimeError(f"gateway did not become healthy:\n{log_tail}")


def start_daemon(run_dir: Path, arena_mib: int, timeout_s: float) -> tuple[subprocess.Popen[Any], str, Path]:
    """``python -m deepwell.kvcache_daemon`` on a unix socket with its arena in /dev/shm; (process, address,
    the arena's directory: remove it after the daemon stopped)."""
    import asyncio
    import tempfile

    from deepwell import grpcx

    shm = Path(tempfile.mkdtemp(prefix="dw-replay-", dir="/dev/shm"))
    address = f"unix://{run_dir / 'kvcache.sock'}"
    log = open(run_dir / "kvcache.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([sys.executable, "-m", "deepwell.kvcache_daemon", "--address", address, "--arena-path",
                             str(shm / "arena"), "--arena-bytes", str(arena_mib << 20), "--granule-bytes",
                             str(1 << 20), "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, preexec_fn=_die_with_parent)
    if not asyncio.run(grpcx.wait_healthy(address, "deepwell.kvcache.v1.KVCache", timeout_s)):
        stop_process(proc)
        shutil.rmtree(shm, ignore_errors=True)
        raise RuntimeError("kvcache daemon did not become healthy:\n" + (run_dir / "kvcache.log").read_text()[-4000:])
    return proc, address, shm


@contextmanager
def local_stack(args: argparse.Namespace, run_dir: Path) -> Iterator[Stack]:
    """The engine (``--model`` / ``--tiny-hybrid`` / embedded), with ``--kv-daemon`` a KV-cache
    daemon for its host tier, and a gateway; all stopped on exit."""
    model = str(Path(args.model).resolve()) if args.model else ""  # the servers run in the repository root
    if args.tiny_hybrid:
        model = str(write_tiny_hybrid(run_dir / "tiny-hybrid", seed=args.seed))
    extra = [part for a in args.engine_arg for part in shlex.split(a)]
    if args.qwen35_27b:
        model = str(write_qwen35_27b(run_dir / "qwen35-27b"))
        extra.append("--random-weights")
    daemon = None
    if args.kv_daemon:
        daemon, kv_address, shm = start_daemon(run_dir, args.daemon_arena_mib, args.start_timeout_s)
        extra += ["--kv-daemon", kv_address]
    try:
        with _engine_and_gateway(args, run_dir, model, extra) as stack:
            yield stack
    finally:
        if daemon is not None:
            stop_process(daemon)
            shutil.rmtree(shm, ignore_errors=True)


@contextmanager
def _engine_and_gateway(args: argparse.Namespace, run_dir: Path, model: str, extra: list[str]) -> Iterator[Stack]:
    engine, address, metrics = start_engine(run_dir, model, extra, args.start_timeout_s)
    try:
        request_log = run_dir / "requests.jsonl"
        gateway, url = start_gateway(run_dir, address, request_log, args.start_timeout_s)
        try:
            yield Stack(url, address, request_log, metrics, run_dir)
        finally:
            stop_process(gateway)
    finally:
        stop_process(engine)


# ----------------------------------------------------------------------------- prompts
async def fetch_bundle(address: str) -> Any:
    """The gateway's ``ModelBundle`` of the engine at ``address`` (as its health loop builds it)."""
    from deepwell import grpcx
    from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
    from deepwell.gateway.engine_client import GATEWAY_FILES, build_bundle

    async with grpcx.aio_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
        files: dict[str, bytes] = {}
        for f in info.files:
            if f.name in GATEWAY_FILES:
                chunks = [c.data async for c in stub.ReadModelFile(engine_pb2.ReadModelFileRequest(name=f.name),
                                                                   timeout=120)]
                files[f.name] = b"".join(chunks)
    return build_bundle(info, files)


@dataclass
class Prompt:
    ids: bytes  # token ids as uint32 bytes (prefix comparison at memcmp speed)
    length: int
    turn_boundary: int | None
    prefix_boundary: int | None


def render(bundle: Any, body: dict[str, Any], headers: dict[str, str]) -> Prompt:
    """The token ids and boundaries the gateway sends to the engine for this request."""
    from deepwell.gateway.http import schemas_anthropic
    from deepwell.gateway.http.anthropic_api import to_chat_request
    from deepwell.gateway.http.common import RequestContext
    from deepwell.gateway.prompting import build_prompt
    from deepwell.gateway.tool_format import tool_format

    ctx = RequestContext(request_id=headers["x-request-id"], tenant="default", headers=headers)
    req, _ = to_chat_request(schemas_anthropic.MessagesRequest.model_validate(body), ctx)
    fmt = tool_format(req, bundle)  # a template that ignores tools gets the generic tool prompt
    p = build_prompt(req, bundle.template, bundle.tokenizer, generic_tools=fmt is not None and fmt.generic)
    return Prompt(array("I", p.token_ids).tobytes(), len(p.token_ids), p.turn_boundary, p.prefix_boundary)


# ----------------------------------------------------------------------------- the replay
@dataclass
class Turn:
    session: int
    turn: int  # 1-based
    request_id: str
    session_id: str
    body: dict[str, Any]
    prompt: Prompt
    sent: float = 0.0
    done: float = 0.0
    status: int = 0
    error: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    client_ms: float = 0.0
    client_ttft_ms: float | None = None
    record: dict[str, Any] | None = None  # the gateway's request-log line
    reusable: int = 0
    reusable_from: str = ""  # "turn", "prefix" or "prefix (other session)"

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.record is not None

    @property
    def cached(self) -> dict[str, int]:
        return dict((self.record or {}).get("cached_tokens") or {})

    @property
    def cached_total(self) -> int:
        return int(self.cached.get("total", 0))


def headers_for(session_id: str, request_id: str) -> dict[str, str]:
    return {"x-claude-code-session-id": session_id, "x-request-id": request_id, "anthropic-version": "2023-06-01",
            "content-type": "application/json"}


def request_body(system: str, tools: list[dict[str, Any]], messages: list[dict[str, Any]], request_id: str,
                 max_tokens: int, stream: bool) -> dict[str, Any]:
    billing = f"x-anthropic-billing-header: cc_version=2.0.0; cc_entrypoint=cli; cch={request_id[-5:]};"
    return {"model": "agent-replay", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "system": [{"type": "text", "text": billing},
                       {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "tools": tools, "messages": messages}


def script_config(args: argparse.Namespace, scale: float = 1.0) -> ScriptConfig:
    return ScriptConfig(seed=args.seed, turns=args.turns, tools=args.tools, system_chars=args.system_chars,
                        tool_output_chars=args.tool_output_chars, loop_len=args.loop_len, size_scale=scale)


def plan_sessions(args: argparse.Namespace, bundle: Any, scale: float, run_id: str) -> list[list[Turn]]:
    """Every session's turns with their bodies and rendered prompts."""
    cfg = script_config(args, scale)
    system, tools = shared_system_prompt(cfg), tool_definitions(cfg)
    plans: list[list[Turn]] = []
    for s in range(args.sessions):
        sid = f"agent-replay-{run_id}-{s}"
        turns = []
        for k, messages in enumerate(session_requests(cfg, s), start=1):
            rid = f"ar-{run_id}-s{s}-t{k}"
            body = request_body(system, tools, messages, rid, args.max_tokens, args.stream)
            turns.append(Turn(s, k, rid, sid, body, render(bundle, body, headers_for(sid, rid))))
        plans.append(turns)
    return plans


def calibrate_scale(args: argparse.Namespace, bundle: Any) -> float:
    """The tool-output scale that makes the sessions' last prompts average ``--context-tokens``."""
    cfg0 = script_config(args)
    first = render(bundle, request_body(shared_system_prompt(cfg0), tool_definitions(cfg0),
                                        session_requests(cfg0, 0)[0], "calib", 1, False),
                   headers_for("calib", "calib")).length
    if args.context_tokens <= first:
        raise SystemExit(f"--context-tokens {args.context_tokens} is not above the first prompt ({first} tokens)")
    scale = 1.0
    for _ in range(4):
        cfg = script_config(args, scale)
        system, tools = shared_system_prompt(cfg), tool_definitions(cfg)
        lasts = [render(bundle, request_body(system, tools, session_requests(cfg, s)[-1], "calib", 1, False),
                        headers_for("calib", "calib")).length for s in range(args.sessions)]
        last = statistics.mean(lasts)
        if last <= first or abs(last - args.context_tokens) < 0.02 * args.context_tokens:
            break
        scale = max(0.01, scale * (args.context_tokens - first) / (last - first))
    return scale


async def send(client: Any, url: str, t: Turn, stream: bool) -> None:
    headers = headers_for(t.session_id, t.request_id)
    t.sent = time.monotonic()
    try:
        if not stream:
            r = await client.post(url + "/v1/messages", json=t.body, headers=headers)
            t.status = r.status_code
            data = r.json()
            if r.status_code == 200:
                t.usage = dict(data.get("usage") or {})
            else:
                t.error = json.dumps(data.get("error", data))[:300]
        else:
            async with client.stream("POST", url + "/v1/messages", json=t.body, headers=headers) as r:
                t.status = r.status_code
                if r.status_code != 200:
                    t.error = (await r.aread()).decode(errors="replace")[:300]
                else:
                    await _read_stream(r, t)
    except Exception as exc:  # a transport failure is a result too
        t.status, t.error = -1, f"{type(exc).__name__}: {exc}"
    t.done = time.monotonic()
    t.client_ms = (t.done - t.sent) * 1000


async def _read_stream(r: Any, t: Turn) -> None:
    event = ""
    async for line in r.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = json.loads(line[5:])
            if event == "message_start":
                t.usage = dict(data["message"].get("usage") or {})
            elif event == "content_block_delta" and t.client_ttft_ms is None:
                t.client_ttft_ms = (time.monotonic() - t.sent) * 1000
            elif event == "message_delta":
                t.usage["output_tokens"] = (data.get("usage") or {}).get("output_tokens")
            elif event == "error":
                t.status, t.error = 500, json.dumps(data)[:300]


async def replay(plans: list[list[Turn]], url: str, stream: bool, start: str, timeout_s: float) -> None:
    import httpx

    lead_done = asyncio.Event()
    limits = httpx.Limits(max_connections=len(plans) + 4, max_keepalive_connections=len(plans) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def session(turns: list[Turn]) -> None:
            for t in turns:
                if start == "lead" and t.session != 0 and not lead_done.is_set():
                    await lead_done.wait()
                await send(client, url, t, stream)
                if t.session == 0 and t.turn == 1:
                    lead_done.set()
            lead_done.set()

        await asyncio.gather(*(session(turns) for turns in plans))


def attach_records(turns: list[Turn], log_path: Path, wait_s: float = 15.0) -> None:
    """Match each turn with its request-log line (by x-request-id); the log is written as
    requests finish, so wait a little for the last lines."""
    want = {t.request_id: t for t in turns if t.status > 0}
    deadline = time.monotonic() + wait_s
    while True:
        found: dict[str, dict[str, Any]] = {}
        if log_path.exists():
            for line in log_path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("request_id") in want:
                    found[rec["request_id"]] = rec
        if len(found) == len(want) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for rid, t in want.items():
        t.record = found.get(rid)
        if t.record is None and not t.error:
            t.error = "no request-log line"


# ----------------------------------------------------------------------------- analysis
def reusable_points(turns: list[Turn]) -> None:
    """Set ``reusable`` / ``reusable_from`` of every turn (R(k) of the module docstring).

    Own session: every earlier turn's turn and prefix boundaries. Other sessions: their
    distinct shared prefixes (boundary and tokens), each from when its first request finished."""
    shared: dict[tuple[int, bytes], float] = {}
    sessions: dict[int, list[Turn]] = {}
    for j in turns:
        sessions.setdefault(j.session, []).append(j)
        b = j.prompt.prefix_boundary
        if j.ok and b:
            key = (b, j.prompt.ids[: 4 * b])
            shared[key] = min(shared.get(key, j.done), j.done)
    for k in turns:
        best, source, n = 0, "", k.prompt.length
        for j in sessions[k.session]:
            if j is k or not j.ok or j.done > k.sent:
                continue
            for b, what in ((j.prompt.prefix_boundary or 0, "prefix"), (j.prompt.turn_boundary or 0, "turn")):
                if best < b < n and k.prompt.ids[: 4 * b] == j.prompt.ids[: 4 * b]:
                    best, source = b, what
        for (b, head), done in shared.items():
            if done <= k.sent and best < b < n and k.prompt.ids[: 4 * b] == head:
                best, source = b, "prefix (other session)"
        k.reusable, k.reusable_from = best, source


def row(t: Turn) -> dict[str, Any]:
    timings = (t.record or {}).get("timings") or {}
    cached = t.cached
    log_prompt = (t.record or {}).get("prompt_tokens")
    usage_read = t.usage.get("cache_read_input_tokens")
    return {
        "session": t.session, "turn": t.turn, "request_id": t.request_id, "status": t.status, "error": t.error,
        "prompt_tokens": t.prompt.length, "log_prompt_tokens": log_prompt,
        "cached": {lvl: int(cached.get(lvl, 0)) for lvl in LEVELS}, "cached_total": t.cached_total,
        "usage_cache_read": usage_read, "usage_input": t.usage.get("input_tokens"),
        "turn_boundary": t.prompt.turn_boundary, "prefix_boundary": t.prompt.prefix_boundary,
        "reusable": t.reusable, "reusable_from": t.reusable_from,
        "re_prefill": t.ok and t.turn >= 2 and t.cached_total < t.reusable,
        "shared_prefix_miss": t.ok and t.turn == 1 and t.cached_total < t.reusable,
        "usage_mismatch": t.ok and usage_read != t.cached_total,
        "prompt_mismatch": t.ok and log_prompt != t.prompt.length,
        "ttft_ms": timings.get("ttft_ms"), "prefill_ms": timings.get("prefill_ms"),
        "queue_ms": timings.get("queue_ms"), "total_ms": timings.get("total_ms"),
        "client_ms": round(t.client_ms, 3), "client_ttft_ms": t.client_ttft_ms,
    }


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # noqa: E731
    return {"p50": round(pick(0.5), 1), "p95": round(pick(0.95), 1), "max": round(v[-1], 1), "n": len(v)}


def totals_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == 200 and r["log_prompt_tokens"] is not None]
    later = [r for r in ok if r["turn"] >= 2]
    prompt = sum(r["prompt_tokens"] for r in later)
    frac = lambda n: round(n / prompt, 4) if prompt else None  # noqa: E731
    return {
        "requests": len(rows), "ok": len(ok), "errors": len(rows) - len(ok),
        "prompt_tokens_turn2plus": prompt,
        "cached_tokens_turn2plus": sum(r["cached_total"] for r in later),
        "cached_fraction_turn2plus": frac(sum(r["cached_total"] for r in later)),
        "reusable_fraction_turn2plus": frac(sum(r["reusable"] for r in later)),
        "shared_prefix_only_fraction_turn2plus": frac(sum(r["prefix_boundary"] or 0 for r in later)),
        "target_cached_fraction": TARGET_CACHED_FRACTION,
        "re_prefills": sum(r["re_prefill"] for r in rows),
        "re_prefill_tokens": sum(r["reusable"] - r["cached_total"] for r in rows if r["re_prefill"]),
        "shared_prefix_misses": sum(r["shared_prefix_miss"] for r in rows),
        "usage_mismatches": sum(r["usage_mismatch"] for r in rows),
        "prompt_mismatches": sum(r["prompt_mismatch"] for r in rows),
        "no_turn_boundary": sum(r["turn_boundary"] is None for r in rows),
        "cached_by_level": {lvl: sum(r["cached"][lvl] for r in ok) for lvl in LEVELS},
        "ttft_ms_turn1": _percentiles([r["ttft_ms"] for r in ok if r["turn"] == 1 and r["ttft_ms"] is not None]),
        "ttft_ms_turn2plus": _percentiles([r["ttft_ms"] for r in later if r["ttft_ms"] is not None]),
        "prefill_ms_turn2plus_mean": round(statistics.mean(r["prefill_ms"] for r in later), 1)
        if later and all(r["prefill_ms"] is not None for r in later) else None,
    }


# ----------------------------------------------------------------------------- engine metrics
@dataclass
class Scrape:
    families: set[str]  # metric family names present (counters without _total)
    samples: list[tuple[str, dict[str, str], float]]

    def has(self, name: str) -> bool:
        return name.removesuffix("_total") in self.families

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, labels, v in self.samples:
            if n == name and label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out

    def total(self, name: str) -> float:
        return sum(v for n, _l, v in self.samples if n == name)


def scrape(url: str) -> Scrape | None:
    if not url:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode("utf-8")
    fams = list(text_string_to_metric_families(text))
    return Scrape({f.name for f in fams}, [(s.name, dict(s.labels), float(s.value)) for f in fams for s in f.samples])


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items())}


def engine_figures(before: Scrape | None, after: Scrape | None) -> dict[str, Any] | None:
    """The cache figures of the engine's /metrics: counters as the change over the replay,
    gauges at the end; a metric the engine does not export is None."""
    if before is None or after is None:
        return None

    def counter(name: str, label: str) -> dict[str, float] | None:
        return _delta(before.by(name, label), after.by(name, label)) if after.has(name) else None

    def gauge(name: str, label: str) -> dict[str, float] | None:
        return after.by(name, label) if after.has(name) else None

    out: dict[str, Any] = {
        "hit_tokens": counter("deepwell_engine_cache_hit_tokens_total", "level"),
        "lookups": counter("deepwell_engine_cache_lookups_total", "result"),
        "created": counter("deepwell_engine_cache_entries_created_total", "kind"),
        "evictions": counter("deepwell_engine_cache_evictions_total", "cause"),
        "checkpoints_skipped": round(after.total("deepwell_engine_cache_checkpoints_skipped_total")
                                     - before.total("deepwell_engine_cache_checkpoints_skipped_total"), 3)
        if after.has("deepwell_engine_cache_checkpoints_skipped_total") else None,
        "entries": gauge("deepwell_engine_cache_entries", "tier"),
        "bytes": gauge("deepwell_engine_cache_bytes", "tier"),
    }
    out["host"] = {
        "spills": counter("deepwell_engine_cache_spills_total", "result"),
        "restores": counter("deepwell_engine_cache_restores_total", "result"),
        "copy_bytes": counter("deepwell_engine_cache_copy_bytes_total", "direction"),
        "restore_seconds_exported": after.has(RESTORE_SECONDS),
        "restore_seconds_mean": _hist_mean(before, after, RESTORE_SECONDS),
        "bytes": (out["bytes"] or {}).get("host"),
    }
    return out


def _hist_mean(before: Scrape, after: Scrape, name: str) -> float | None:
    """Mean of the histogram's observations over the replay; None when there were none."""
    n = after.total(name + "_count") - before.total(name + "_count")
    s = after.total(name + "_sum") - before.total(name + "_sum")
    return round(s / n, 6) if n > 0 else None


# ----------------------------------------------------------------------------- printing
def _num(v: Any, width: int) -> str:
    return f"{'-' if v is None else (f'{v:.0f}' if isinstance(v, float) else v):>{width}}"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'sess':>4} {'turn':>4} {'prompt':>7} {'cached':>7} "
            + " ".join(f"{LEVEL_ABBREV[lvl]:>6}" for lvl in LEVELS)
            + f" {'R(k)':>7} {'new':>6} {'ttft_ms':>8} {'prefill_ms':>10}  flag")
    print(head)
    print("-" * len(head))
    for r in sorted(rows, key=lambda r: (r["session"], r["turn"])):
        flags = [f for f, on in (("RE-PREFILL", r["re_prefill"]), ("SHARED-MISS", r["shared_prefix_miss"]),
                                 ("USAGE!=LOG", r["usage_mismatch"]), ("PROMPT!=LOG", r["prompt_mismatch"])) if on]
        if r["status"] != 200 or r["error"]:
            flags.append(f"ERROR {r['status']}: {r['error'][:60]}")
        served = r["status"] == 200 and r["log_prompt_tokens"] is not None
        new = r["prompt_tokens"] - r["cached_total"] if served else None
        cached = r["cached_total"] if served else None
        print(f"{r['session']:>4} {r['turn']:>4} {r['prompt_tokens']:>7} {_num(cached, 7)} "
              + " ".join(_num(r["cached"][lvl] if served else None, 6) for lvl in LEVELS)
              + f" {r['reusable']:>7} {_num(new, 6)} {_num(r['ttft_ms'], 8)} {_num(r['prefill_ms'], 10)}  "
              + " ".join(flags))


def _fmt_map(m: dict[str, float] | None, missing: str) -> str:
    if m is None:
        return missing
    if not m:
        return "0 (no samples)"
    return ", ".join(f"{k}={v:.0f}" for k, v in m.items())


def print_totals(totals: dict[str, Any]) -> None:
    pct = lambda v: "n/a" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    print(f"\nrequests {totals['requests']}  ok {totals['ok']}  errors {totals['errors']}  "
          f"wall {totals['wall_s']:.1f} s  (model {totals['model']}, {totals['sessions']} sessions x "
          f"{totals['turns']} turns)")
    print(f"cached fraction, turns >= 2 : {pct(totals['cached_fraction_turn2plus'])} "
          f"({totals['cached_tokens_turn2plus']} / {totals['prompt_tokens_turn2plus']} tokens; target >= "
          f"{pct(TARGET_CACHED_FRACTION)})")
    print(f"reusable fraction (R(k))    : {pct(totals['reusable_fraction_turn2plus'])}   shared-prefix-only "
          f"fraction: {pct(totals['shared_prefix_only_fraction_turn2plus'])}")
    print(f"re-prefills of a cached turn: {totals['re_prefills']} ({totals['re_prefill_tokens']} tokens; target 0)"
          f"   shared-prefix misses (turn 1): {totals['shared_prefix_misses']}")
    print(f"usage != log: {totals['usage_mismatches']}   prompt != log: {totals['prompt_mismatches']}   "
          f"requests without a turn boundary: {totals['no_turn_boundary']}")
    print("cached tokens by level      : " + ", ".join(f"{k}={v}" for k, v in totals["cached_by_level"].items()))
    for key in ("ttft_ms_turn1", "ttft_ms_turn2plus"):
        v = totals[key]
        text = "n/a" if v is None else f"p50 {v['p50']}  p95 {v['p95']}  max {v['max']}  (n={v['n']})"
        print(f"{key:<28}: {text}")
    prefill = totals["prefill_ms_turn2plus_mean"]
    print(f"{'prefill_ms mean, turns >= 2':<28}: {'n/a' if prefill is None else prefill}")
    eng = totals["engine"]
    if eng is None:
        print("engine metrics              : n/a (no metrics URL)")
        return
    na = "n/a (not exported)"
    print("engine cache hit tokens     : " + _fmt_map(eng["hit_tokens"], na)
          + f"   (engine hits == log: {totals['engine_hits_match_log']})")
    print("engine cache lookups        : " + _fmt_map(eng["lookups"], na))
    print("engine entries created      : " + _fmt_map(eng["created"], na))
    print("engine evictions            : " + _fmt_map(eng["evictions"], na))
    skipped = eng["checkpoints_skipped"]
    print(f"engine checkpoints skipped  : {na if skipped is None else int(skipped)}")
    print("engine entries (gauge)      : " + _fmt_map(eng["entries"], na))
    print("engine bytes (gauge)        : " + _fmt_map(eng["bytes"], na))
    host, nh = eng["host"], "n/a (no host tier)"
    mean = host["restore_seconds_mean"]
    mean_text = nh if not host["restore_seconds_exported"] else "n/a (no restores)" if mean is None else f"{mean} s"
    print("host tier spills            : " + _fmt_map(host["spills"], nh))
    print("host tier restores          : " + _fmt_map(host["restores"], nh) + f"; mean restore {mean_text}")
    print("host tier copy bytes        : " + _fmt_map(host["copy_bytes"], nh))
    print(f"host tier bytes (gauge)     : {nh if host['bytes'] is None else int(host['bytes'])}")


# ----------------------------------------------------------------------------- main
def run(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    bundle = asyncio.run(fetch_bundle(stack.engine_address))
    if bundle.template is None:
        raise SystemExit(f"model {bundle.model_id!r} has no chat template")
    scale = calibrate_scale(args, bundle) if args.context_tokens else 1.0
    run_id = uuid.uuid4().hex[:8]
    t_render = time.monotonic()
    plans = plan_sessions(args, bundle, scale, run_id)
    print(f"rendered {args.sessions * args.turns} prompts of model {bundle.model_id} in "
          f"{time.monotonic() - t_render:.1f} s; replaying ({args.sessions} sessions, start={args.start})", flush=True)
    before = scrape(stack.metrics_url)
    t0 = time.monotonic()
    asyncio.run(replay(plans, stack.gateway_url, args.stream, args.start, args.request_timeout_s))
    wall = time.monotonic() - t0
    turns = [t for p in plans for t in p]
    attach_records(turns, stack.request_log)
    after = scrape(stack.metrics_url)
    reusable_points(turns)
    rows = [row(t) for t in turns]
    totals = {"model": bundle.model_id, "sessions": args.sessions, "turns": args.turns, "wall_s": round(wall, 2),
              "tool_output_scale": round(scale, 4), **totals_of(rows), "engine": engine_figures(before, after)}
    hits = (totals["engine"] or {}).get("hit_tokens")
    totals["engine_hits_match_log"] = None if hits is None else all(
        round(hits.get(lvl, 0.0)) == n for lvl, n in totals["cached_by_level"].items())
    if not args.quiet:
        print_table(rows)
    print_totals(totals)
    if args.json:
        config = dict(vars(args))
        config["script"] = asdict(script_config(args, scale))
        Path(args.json).write_text(json.dumps({"config": config, "rows": rows, "totals": totals}, indent=1))
    return totals


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the totals dict."""
    args = parse_args(argv)
    run_dir = Path(args.workdir or tempfile.mkdtemp(prefix="agent-replay-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.gateway:
        stack = Stack(args.gateway.rstrip("/"), args.engine, Path(args.request_log), args.metrics, run_dir)
        return run(args, stack)
    with local_stack(args, run_dir) as stack:
        print(f"engine {stack.engine_address} (metrics {stack.metrics_url or 'off'}), gateway {stack.gateway_url}, "
              f"logs in {run_dir}", flush=True)
        return run(args, stack)


if __name__ == "__main__":
    from deepwell.logs import setup_logging

    setup_logging("agent_replay", os.environ.get("DEEPWELL_LOG_LEVEL", "warning"))
    main()
