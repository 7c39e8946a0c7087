"""`deepwell up` end to end: starts daemon + engine + gateway, serves a chat completion,
restarts the KV-cache daemon when it dies (serving on), shuts everything down on SIGINT, and
stops everything when the engine dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from benchmarks.soak import free_ports
from deepwell import grpcx
from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc

from tests.engine.fixtures_smollm2 import smollm2_gguf_path


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_up(tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
             timeout_s: float = 300) -> tuple[subprocess.Popen[str], list[int]]:
    """``deepwell up --device cpu`` on free ports (gateway, gRPC Chat, engine, engine metrics,
    returned in that order) with ``extra`` flags and its stderr in ``tmp_path/up.log``; returns
    once it printed its banner (or fails with what it printed)."""
    ports = free_ports(4)
    argv = [sys.executable, "-m", "deepwell.cli", "up", "--port", str(ports[0]), "--grpc-port", str(ports[1]),
            "--engine-port", str(ports[2]), "--engine-metrics-port", str(ports[3]), "--device", "cpu",
            "--log-level", "warning", *extra]
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        seen.append(line)
        if "Press Ctrl-C to stop." in line:
            return proc, ports
    proc.kill()
    proc.wait()
    raise AssertionError("deepwell up did not come up:\n" + "".join(seen) + (tmp_path / "up.log").read_text()[-4000:])


def _start_up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    # a 0.25 GiB KV pool (5.8k tokens): zeroing the default 2 GiB took ~23 of the engine's ~30 s start
    proc, ports = start_up(tmp_path, "--model", str(smollm2_gguf_path()), "--kvcache-arena-bytes", str(64 << 20),
                           "--startup-timeout-s", "240", *extra, env={"DEEPWELL_ENGINE_CPU_KV_GIB": "0.25"})
    return proc, ports[0]


def _daemon(kids: list[int]) -> list[int]:
    return [k for k in kids if _alive(k) and "kvcache_daemon" in Path(f"/proc/{k}/cmdline").read_text()]


def test_up_serves_and_shuts_down_on_sigint(tmp_path: Path) -> None:
    proc, port = _start_up(tmp_path)
    kids = _children(proc.pid)
    try:
        assert len(kids) == 3, kids  # daemon, engine, gateway
        engine = [k for k in kids if "engine_service" in Path(f"/proc/{k}/cmdline").read_text()]
        assert "--kv-daemon" in Path(f"/proc/{engine[0]}/cmdline").read_text()
        body = {"model": "default", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        # the engine's port is internal: a caller without up's token is refused
        argv = Path(f"/proc/{engine[0]}/cmdline").read_text().split("\0")
        assert "--internal-token-file" in argv
        with pytest.raises(grpc.RpcError) as err, grpcx.sync_channel(argv[argv.index("--listen") + 1]) as ch:
            engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the daemon dies: up restarts it, the engine serves on (and reconnects)
        old = _daemon(kids)
        os.kill(old[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not [k for k in _daemon(_children(proc.pid)) if k not in old]:
            time.sleep(0.2)
        assert proc.poll() is None and [k for k in _daemon(_children(proc.pid)) if k not in old]
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        kids = _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 30
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(k) for k in kids), "children outlived deepwell up"
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)


def test_up_restarts_dead_children_and_serves_on(tmp_path: Path) -> None:
    """nvfp4 KV on the default model; SIGKILL the daemon, then the engine: the gateway answers
    503 with a retry hint while the engine is down, both come back by themselves, and requests
    succeed again; then SIGKILL the gateway: it comes back and serves."""
    proc, port = _start_up(tmp_path, "--kv-dtype", "nvfp4")
    kids = _children(proc.pid)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "default", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    try:
        engine = [k for k in kids if "engine_service" in Path(f"/proc/{k}/cmdline").read_text()]
        assert "nvfp4" in Path(f"/proc/{engine[0]}/cmdline").read_text().split("\0")
        assert httpx.post(url, json=body, timeout=120).status_code == 200
        os.kill(_daemon(kids)[0], signal.SIGKILL)
        os.kill(engine[0], signal.SIGKILL)
        statuses: list[int] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            reply = httpx.post(url, json=body, timeout=120)
            statuses.append(reply.status_code)
            if reply.status_code == 200:
                break
            assert reply.status_code == 503 and reply.headers.get("retry-after"), (reply.status_code, reply.text)
            time.sleep(0.5)
        assert statuses[-1] == 200 and 503 in statuses, statuses
        assert proc.poll() is None
        now = _children(proc.pid)
        assert len(now) == 3 and _daemon(now) and not set(now) & {engine[0], *_daemon(kids)}
        # the gateway dies: up restarts it, and it finds the engine again by itself
        gateway = [k for k in now if "gateway" in Path(f"/proc/{k}/cmdline").read_text()]
        os.kill(gateway[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        ok = False
        while time.monotonic() < deadline and not ok:
            try:
                ok = httpx.post(url, json=body, timeout=60).status_code == 200
            except httpx.TransportError:  # nothing listens until it is back
                pass
            time.sleep(0.5)
        assert ok and proc.poll() is None
        log = (tmp_path / "up.log").read_text()
        assert "engine exited with status -9; restarting it" in log and "restarting kvcache" in log
        assert "gateway exited with status -9; restarting it" in log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for k in _children(proc.pid) + kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)


def test_up_passes_engine_and_gateway_options_through(tmp_path: Path) -> None:
    from deepwell.up import UpConfig, plan

    keys = tmp_path / "keys"
    keys.write_text("k:secret\n")
    cfg = UpConfig(kv_dtype="nvfp4", max_context=16384, cpu_kv_gib=0.5, api_keys_file=str(keys),
                   request_log=str(tmp_path / "r.jsonl"), engine_args="--max-concurrency 2 --chunk-tokens 512",
                   gateway_args="--default-max-tokens 256")
    daemon, engine, gateway = plan(cfg, tmp_path)
    e, g = engine.argv, gateway.argv
    for flag, value in (("--kv-dtype", "nvfp4"), ("--max-context", "16384"), ("--cpu-kv-gib", "0.5"),
                        ("--max-concurrency", "2"), ("--chunk-tokens", "512")):
        assert e[e.index(flag) + 1] == value
    for flag, value in (("--api-keys-file", str(keys)), ("--request-log", str(tmp_path / "r.jsonl")),
                        ("--default-max-tokens", "256")):
        assert g[g.index(flag) + 1] == value
    token = str(tmp_path / "internal-token")
    for child in (daemon, engine, gateway):
        assert child.argv[child.argv.index("--internal-token-file") + 1] == token
    # every flag the engine and gateway get is one they accept
    from deepwell import cli

    for argv, name in ((e, "engine"), (g, "gateway")):
        parser = cli.build_parser()
        args = parser.parse_args([name, *argv[3:]])
        assert args.command == name


@pytest.mark.parametrize(("flag", "value", "needle"), [("--port", "0", "invalid port=0"),
                                                        ("--model", "/no/such/model", "no such file"),
                                                        ("--engine-args", "'unclosed", "not a valid flag string"),
                                                        ("--memory-fraction", "1.5", "must be in (0, 1]")])
def test_up_rejects_bad_flags(flag: str, value: str, needle: str) -> None:
    result = subprocess.run([sys.executable, "-m", "deepwell.cli", "up", flag, value],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert needle in result.stderr
