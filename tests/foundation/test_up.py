"""`deepwell up` end to end: starts daemon + engine + gateway, serves a chat completion,
restarts the KV-cache daemon when it dies (serving on), shuts everything down on SIGINT, and
stops everything when the engine dies; its console (banner, status lines, relayed progress and
problems) and the children's log files."""

from __future__ import annotations

import io
import json
import os
import shutil
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
    once it printed its banner (stdout up to it in ``tmp_path/up.out``; or fails with what it
    printed)."""
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
        if "Press Ctrl-C to stop." in line:  # the banner's last line: everything is ready
            (tmp_path / "up.out").write_text("".join(seen))
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
        # the banner: where to point a client, the status page, the log files (--logs files, the default)
        out = (tmp_path / "up.out").read_text()
        for needle in (f"http://127.0.0.1:{port}/v1", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL",
                       f"http://127.0.0.1:{port}/deepwell/status", f"http://127.0.0.1:{port}/metrics"):
            assert needle in out, (needle, out)
        logs_line = next(line for line in out.splitlines() if "logs (JSON lines):" in line)
        logs = Path(logs_line.split(":", 1)[1].strip().split("/{")[0])
        run_dir = logs.parent
        assert logs.name == "logs" and run_dir.name.startswith("deepwell-up-")
        # the console: short status lines, no JSON; the children's JSON lines are in their files
        console = (tmp_path / "up.log").read_text()
        assert "deepwell up: starting engine" in console and "deepwell up: engine is ready" in console
        assert not [line for line in console.splitlines() if line.lstrip().startswith("{")], console
        for name in ("kvcache", "engine", "gateway"):
            records = [json.loads(line) for line in (logs / f"{name}.jsonl").read_text().splitlines()
                       if line.startswith("{")]
            assert records[0]["event"] == "deepwell_up_start" and records[0]["child"] == name
        assert (run_dir / "internal-token").exists()
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
        deadline = time.monotonic() + 30
        while "kvcache is ready again" not in (tmp_path / "up.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        console = (tmp_path / "up.log").read_text()
        assert "kvcache exited with status -9; restarting it in 1 s" in console and "kvcache is ready again" in console
        assert (logs / "kvcache.jsonl").read_text().count('"event": "deepwell_up_start"') == 2  # appended
        kids = _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 30
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(k) for k in kids), "children outlived deepwell up"
        # the logs stay; the token, the socket and the arena go
        assert sorted(p.name for p in run_dir.iterdir()) == ["logs"]
        assert f"stopped; the logs are in {logs}" in (tmp_path / "up.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)
        if "run_dir" in locals() and proc.poll() is not None:  # the kept logs of this test's run
            shutil.rmtree(run_dir, ignore_errors=True)


def test_up_restarts_dead_children_and_serves_on(tmp_path: Path) -> None:
    """nvfp4 KV on the default model; SIGKILL the daemon, then the engine: the gateway answers
    503 with a retry hint while the engine is down, both come back by themselves, and requests
    succeed again; then SIGKILL the gateway: it comes back and serves. With ``--logs console``
    the children's own log lines are on up's stderr, as before the log files."""
    proc, port = _start_up(tmp_path, "--kv-dtype", "nvfp4", "--logs", "console", "--log-level", "info")
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
        assert '"event": "engine_serving"' in log  # the engine's own JSON lines, on up's stderr
        assert "on this terminal (--logs console)" in (tmp_path / "up.out").read_text()
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


def test_up_plans_log_files_and_a_banner_that_names_them(tmp_path: Path) -> None:
    from deepwell.up import ARENA_BYTES_CPU, ARENA_BYTES_GPU, UpConfig, banner, plan

    children = plan(UpConfig(device="cpu"), tmp_path)
    assert [c.log_path for c in children] == [tmp_path / "logs" / f"{n}.jsonl" for n in ("kvcache", "engine",
                                                                                          "gateway")]
    text = banner(UpConfig(port=8123, grpc_port=50099, engine_metrics_port=9199), children)
    lines = text.strip().splitlines()
    assert lines[-1] == "Press Ctrl-C to stop." and lines[0] == "deepwell is up."
    for needle in ("OpenAI base URL:      http://127.0.0.1:8123/v1", "Anthropic base URL:   http://127.0.0.1:8123 ",
                   "gRPC Chat:            127.0.0.1:50099", "status page:          http://127.0.0.1:8123/deepwell/status",
                   "http://127.0.0.1:8123/metrics (gateway), http://127.0.0.1:9199/metrics (engine)",
                   f"logs (JSON lines):    {tmp_path / 'logs'}/{{kvcache,engine,gateway}}.jsonl"):
        assert needle in text, (needle, text)
    serving = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "device": "cpu", "max_context": 32768}
    assert banner(UpConfig(), children, serving).splitlines()[1] == (
        "deepwell is up: HuggingFaceTB/SmolLM2-135M-Instruct on cpu, context 32768 tokens.")
    console = plan(UpConfig(logs="console", log_dir=str(tmp_path / "elsewhere")), tmp_path)
    assert all(c.log_path is None for c in console) and "on this terminal" in banner(UpConfig(), console)
    assert plan(UpConfig(log_dir=str(tmp_path / "x")), tmp_path)[1].log_path == tmp_path / "x" / "engine.jsonl"
    # the daemon's arena: proportionate on CPU (the engine's KV pool is host RAM already), 1 GiB on a GPU
    for cfg, arena in ((UpConfig(device="cpu"), ARENA_BYTES_CPU), (UpConfig(device="cuda"), ARENA_BYTES_GPU),
                       (UpConfig(device="cpu", kvcache_arena_bytes=64 << 20), 64 << 20)):
        argv = plan(cfg, tmp_path)[0].argv
        assert argv[argv.index("--arena-bytes") + 1] == str(arena)
    assert ARENA_BYTES_CPU == 256 << 20


def test_up_console_relays_progress_and_problems(tmp_path: Path) -> None:
    from deepwell.up_console import Console, LogTail, humanize

    def line(**record: object) -> str:
        return json.dumps({"timestamp": "t", "level": "info", **record})

    out, now = io.StringIO(), [0.0]
    con = Console(out, tty=False, clock=lambda: now[0])
    con.status("starting engine")
    con.relay("engine", line(event="progress", task="loading weights", done=270e6, total=540e6, unit="B",
                             elapsed_s=1.0), starting=True)
    con.relay("engine", "engine listening on 127.0.0.1:1", starting=True)  # a plain line: not shown
    con.relay("engine", line(event="kv_pool_sized", pages=512), starting=True)  # info: not shown
    con.relay("engine", line(level="warning", event="mtp_unavailable", reason="no MTP weights"), starting=True)
    con.relay("engine", line(level="warning", event="later", reason="x"), starting=False)  # serving: not shown
    for _ in range(3):  # the same error thrice within REPEAT_S: once, then a count
        con.relay("gateway", line(level="error", event="generation_failed", error="boom"), starting=False)
    now[0] = 11.0
    con.relay("gateway", line(level="error", event="generation_failed", error="boom"), starting=False)
    con.relay("engine", line(event="engine_serving", model="m", device="cpu"), starting=False)
    assert out.getvalue().splitlines() == [
        "deepwell up: starting engine",
        "deepwell up: engine: loading weights  50%  270/540 MB  1.0 s",
        "deepwell up: engine warning mtp_unavailable: no MTP weights",
        "deepwell up: gateway error generation_failed: boom",
        "deepwell up: gateway error generation_failed: boom (2 more like it before)",
    ]
    assert con.serving["model"] == "m"
    # on a TTY: one bar redrawn in place, ended by the next status line
    tty = io.StringIO()
    con = Console(tty, tty=True)
    con.relay("engine", line(event="progress", task="w", done=1, total=4, elapsed_s=0.5), starting=True)
    con.relay("engine", line(event="progress", task="w", done=2, total=4, elapsed_s=1.5), starting=True)
    con.status("engine is ready")
    assert tty.getvalue() == ("\rengine: w  [######------------------]  25%  1/4  0.5 s\x1b[K"
                              "\rengine: w  [############------------]  50%  2/4  1.5 s\x1b[K\n"
                              "deepwell up: engine is ready\n")
    # a log file read as it grows; a partial last line waits for its end
    path = tmp_path / "c.jsonl"
    path.write_text("old\n")
    tail = LogTail(path)
    with open(path, "a") as fh:
        fh.write('{"a": 1}\npart')
    assert tail.lines() == ['{"a": 1}']
    with open(path, "a") as fh:
        fh.write("ial\n")
    assert tail.lines() == ["partial"]
    text = humanize(line(level="error", event="engine step failed", request_ids=["r1"], exception="Traceback\n  x"))
    assert text == 'ERROR   engine step failed  request_ids=["r1"]\nTraceback\n  x'
    assert humanize("plain text\n") == "plain text"
