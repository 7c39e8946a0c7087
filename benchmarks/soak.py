"""Soak and fault suite for ``deepwell up``: concurrent streaming sessions while the KV-cache
daemon and the engine are SIGKILLed, then checks that nothing was lost, corrupted or leaked.

    python benchmarks/soak.py --sessions 16 --duration-s 600 --kill daemon@150 --kill engine@350

What it does:

1. starts ``python -m deepwell.cli up`` on free ports (CPU by default), with an API-keys file of
   two tenants: ``soak`` (the load) and ``replay`` (the reference replay; the prefix cache is
   scoped by tenant on the device and in the host tier, so the replay never reuses KV that was
   computed while faults were injected);
2. records the engine's resources at idle (the baseline);
3. runs ``--sessions`` concurrent sessions for ``--duration-s``: multi-turn chat conversations
   (OpenAI ``/v1/chat/completions``, streaming) that resend the growing history each turn, a
   share with a tool offered (``--tools-fraction``; a tool call is answered with a tool result),
   a share of requests cancelled mid-stream by closing the connection (``--cancel-fraction``).
   Every request is greedy (``temperature`` 0) with a fixed ``max_tokens``. A failed turn
   (503, connection error, mid-stream error) is retried after the Retry-After (at most 3 s);
4. meanwhile SIGKILLs the daemon and / or the engine (``--kill daemon@150``, ``--kill-every S``:
   daemon and engine in turn; ``--term engine@S`` sends SIGTERM instead, a graceful stop), found
   among ``deepwell up``'s children in /proc; ``deepwell up`` restarts them (backoff 1, 2, 4 ... s).
   A kill's *downtime* lasts until the restarted process answers (daemon: its Stats; engine: the
   gateway's /health is 200 again);
5. when the time is up and the in-flight requests ended, waits (``--settle-s``) for the stack to
   be idle and compares its resources with the baseline;
6. replays every completed generation (same messages, tools, ``max_tokens``) as the ``replay``
   tenant, fault-free, and compares the text, the tool calls and the finish reason;
7. prints the figures and a verdict line (exit status 0 when every criterion passes).

Definitions:

* *completed*: the client received a normal finish reason (``stop``, ``length``,
  ``tool_calls``) and ``[DONE]``;
* *errors by kind*: ``http_<status>`` (non-200 answer), ``connect_error`` (no HTTP answer:
  refused, reset before the headers), ``midstream_error:event`` (an error event in a 200 stream),
  ``midstream_error:disconnect`` (the stream broke), ``midstream_error:no_finish`` (``[DONE]``
  without a finish reason), ``timeout`` (no end within ``--request-timeout-s``: a hang);
* *lost*: the gateway's request log (``--request-log``) records the generation as completed
  (status 200, finish reason stop / stop_sequence / length / tool_calls) but the client did not
  receive it (excluding requests the client itself cancelled); *misreported*: the client
  received a normal finish but the request log says the generation did not complete (or has no
  record of it);
* *wrong output*: a completed generation whose text / tool calls / finish reason differ from the
  fault-free replay of the same request;
* *back to baseline*, once idle: the engine's ``deepwell_engine_requests_running`` and
  ``..._waiting`` are 0; ``deepwell_engine_kv_pages_used`` minus the pages only prefix-cache
  entries hold (the engine's Stats RPC ``cache_pages``: the cache keeps entries by design) equals
  the baseline's, and the same for ``deepwell_engine_state_slots_used`` (minus
  ``cache_state_slots``); the /metrics gauges agree with the Stats RPC; the daemon (its Stats RPC)
  holds no leases, reservations or takes, and no detached client holds anything (a dead
  engine's holdings are reclaimed after the daemon's grace period, 30 s by default:
  ``--daemon-grace-s``). Committed daemon entries are its cache, kept by design (reported);
* *downtime answers*: every request started during an engine downtime ended with a 503, a
  connection error, a mid-stream error (in flight at the kill) or a completion, never a hang or
  another status.

The engine's and daemon's Stats RPCs need the internal token: it is read from the file that
``deepwell up`` generated in its run directory (named by the children's ``--internal-token-file``).

The prefix cache's host tier (spills to the daemon, restores from it) is busy only under KV
pressure: ``--engine-args "--cache-fraction 0.05"`` keeps few entries on the device so that most
are spilled and restored, across the kills too.
"""

from __future__ import annotations

import os

# the script forks `deepwell up` after grpc may be loaded (tests/conftest.py says why this matters)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import secrets  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

TARGETS = ("daemon", "engine")
MODULES = {"daemon": "deepwell.kvcache_daemon", "engine": "deepwell.engine_service", "gateway": "deepwell.gateway"}
COMPLETED = ("stop", "length", "tool_calls")
SERVER_COMPLETED = ("stop", "stop_sequence", "length", "tool_calls")

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = (
    "Name a color.", "What is 2 plus 3?", "Say hello.", "Name a fruit.", "What day comes after Monday?",
    "Name an animal.", "What is the capital of France?", "Give me a word that rhymes with cat.",
    "Name a planet.", "What is water made of?", "Count to three.", "Name a musical instrument.",
    "What color is the sky?", "Name a sport.", "What is 10 minus 4?", "Name a country in Asia.",
)
FOLLOWUPS = ("Why?", "Say it differently.", "Give one more.", "Shorter, please.", "And another one?",
             "Are you sure?", "Explain briefly.", "Thanks. Next one?")
TOOL_QUESTIONS = ("What is the weather in Paris?", "Is it raining in Tokyo?", "How warm is it in Rome?",
                  "Weather in Berlin, please.")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


# ----------------------------------------------------------------------------- processes
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def children(pid: int) -> list[int]:
    """Live direct children of ``pid`` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and int(st[1]) == pid and st[0] != "Z":
                kids.append(int(entry.name))
    return kids


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else ""


class Stack:
    """``deepwell up`` as a subprocess, its children found through /proc."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.port, self.grpc_port, self.engine_port, self.metrics_port = free_ports(4)
        self.log_path = workdir / "up.log"
        self.request_log = Path(args.request_log) if args.request_log else workdir / "requests.jsonl"
        self.keys = {"soak": secrets.token_urlsafe(24), "replay": secrets.token_urlsafe(24)}
        keys_file = workdir / "api-keys"
        keys_file.write_text("".join(f"{k}:{v}\n" for k, v in self.keys.items()))
        keys_file.chmod(0o600)
        self.argv = [sys.executable, "-m", "deepwell.cli", "up", "--port", str(self.port),
                     "--grpc-port", str(self.grpc_port), "--engine-port", str(self.engine_port),
                     "--engine-metrics-port", str(self.metrics_port), "--device", args.device,
                     "--log-level", args.log_level, "--request-log", str(self.request_log),
                     "--api-keys-file", str(keys_file), "--kvcache-arena-bytes", str(args.arena_mib << 20),
                     "--startup-timeout-s", str(args.startup_timeout_s)]
        if args.model:
            self.argv += ["--model", args.model]
        if args.cpu_kv_gib:
            self.argv += ["--cpu-kv-gib", str(args.cpu_kv_gib)]
        if args.engine_args:
            self.argv += ["--engine-args", args.engine_args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: set[int] = set()  # every child pid ever seen (killed at the end if still alive)
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        env = dict(os.environ)
        if self.args.daemon_grace_s:
            env["DEEPWELL_KVCACHE_GRACE_S"] = str(self.args.daemon_grace_s)
        t0 = time.monotonic()
        out = open(self.workdir / "up.out", "wb")  # noqa: SIM115  (not a pipe: the children inherit it)
        with open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=err, env=env, cwd=ROOT)
        out.close()
        deadline = t0 + self.args.startup_timeout_s + 60
        while time.monotonic() < deadline:
            if "Press Ctrl-C to stop." in (self.workdir / "up.out").read_text(errors="replace"):
                self.pids()
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError("deepwell up did not come up:\n" + self.log_tail())

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def pids(self) -> dict[str, int]:
        """{daemon|engine|gateway: pid} of the live children."""
        found: dict[str, int] = {}
        if self.proc is None:
            return found
        for kid in children(self.proc.pid):
            argv = cmdline(kid)
            for name, module in MODULES.items():
                if len(argv) > 2 and argv[1] == "-m" and argv[2] == module:
                    found[name] = kid
                    self.seen.add(kid)
        return found

    def token(self) -> str:
        from deepwell.auth import read_token_file

        for pid in self.pids().values():
            path = flag(cmdline(pid), "--internal-token-file")
            if path:
                return read_token_file(path)
        raise RuntimeError("no child names its --internal-token-file")

    def daemon_address(self) -> str:
        pid = self.pids().get("daemon")
        argv = cmdline(pid) if pid else []
        if not argv:  # restarting: the engine was given the same address
            argv = cmdline(self.pids().get("engine", 0))
            return flag(argv, "--kv-daemon")
        return flag(argv, "--address")

    def up_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 20
        while any(alive(p) for p in self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in self.seen:
            if alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        return self.proc.returncode


# ----------------------------------------------------------------------------- resources
METRICS = ("deepwell_engine_requests_running", "deepwell_engine_requests_waiting", "deepwell_engine_kv_pages_used",
           "deepwell_engine_kv_pages_total", "deepwell_engine_state_slots_used", "deepwell_engine_state_slots_total",
           "deepwell_engine_cache_entries", "deepwell_engine_cache_bytes")


def engine_metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in METRICS:
                out[s.name.removeprefix("deepwell_engine_")] = out.get(s.name.removeprefix("deepwell_engine_"),
                                                                        0.0) + s.value
    return out


def _rpc_dict(reply: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    return json_format.MessageToDict(reply, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def engine_stats(address: str, token: str) -> dict[str, Any]:
    from deepwell import grpcx
    from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc

    with grpcx.sync_channel(address, token) as ch:
        return _rpc_dict(engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest(), timeout=5))


def daemon_stats(address: str, token: str) -> dict[str, Any]:
    from deepwell import grpcx
    from deepwell.kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc

    with grpcx.sync_channel(address, token) as ch:
        return _rpc_dict(kvcache_pb2_grpc.KVCacheStub(ch).Stats(kvcache_pb2.StatsRequest(), timeout=5))


def resources(stack: Stack) -> dict[str, Any]:
    """The engine's /metrics and Stats and the daemon's Stats, with the derived figures."""
    snap: dict[str, Any] = {"t": time.monotonic()}
    try:
        token = stack.token()
    except Exception as exc:  # a child restarting
        return {**snap, "error": f"token: {exc}"}
    try:
        m = engine_metrics(stack.metrics_port)
        st = engine_stats(f"127.0.0.1:{stack.engine_port}", token)
        st = {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in st.items()}
        snap["engine"] = {
            "requests_running": int(m.get("requests_running", -1)),
            "requests_waiting": int(m.get("requests_waiting", -1)),
            "kv_pages_used": int(m.get("kv_pages_used", -1)), "kv_pages_total": int(m.get("kv_pages_total", -1)),
            "state_slots_used": int(m.get("state_slots_used", -1)),
            "cache_entries": int(m.get("cache_entries", 0)), "cache_bytes": int(m.get("cache_bytes", 0)),
            "cache_pages": int(st.get("cache_pages", 0)), "cache_state_slots": int(st.get("cache_state_slots", 0)),
            "stats_requests_running": int(st.get("requests_running", 0)),
            "stats_requests_waiting": int(st.get("requests_waiting", 0)),
            "stats_kv_pages_used": int(st.get("kv_pages_used", 0)),
            "stats_state_slots_used": int(st.get("state_slots_used", 0)),
        }
        e = snap["engine"]
        e["pages_in_requests"] = e["kv_pages_used"] - e["cache_pages"]
        e["slots_in_requests"] = e["state_slots_used"] - e["cache_state_slots"]
    except Exception as exc:
        snap["engine_error"] = f"{type(exc).__name__}: {exc}"
    try:
        d = daemon_stats(stack.daemon_address(), token)
        clients = d.pop("clients", [])
        snap["daemon"] = {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in d.items()
                          if k in ("arena_bytes", "budget_bytes", "committed_bytes", "reserved_bytes",
                                   "taken_bytes", "free_bytes", "entries", "leases", "evictions")}
        snap["daemon"]["clients"] = len(clients)
        snap["daemon"]["detached_holdings"] = sum(
            1 for c in clients if not c.get("attached") and (int(c.get("leases", 0)) or int(c.get(
                "reservations", 0)) or int(c.get("takes", 0)) or int(c.get("pinned_bytes", 0))))
    except Exception as exc:
        snap["daemon_error"] = f"{type(exc).__name__}: {exc}"
    return snap


def baseline_problems(base: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Why ``now`` is not back to ``base`` (empty when it is)."""
    problems = [now[k] for k in ("error", "engine_error", "daemon_error") if k in now]
    e, b = now.get("engine"), base.get("engine")
    if e and b:
        for k in ("requests_running", "requests_waiting"):
            if e[k] != 0:
                problems.append(f"engine {k}={e[k]}")
        for k in ("pages_in_requests", "slots_in_requests"):
            if e[k] != b[k]:
                problems.append(f"engine {k}={e[k]} (baseline {b[k]})")
        for k in ("requests_running", "requests_waiting", "kv_pages_used", "state_slots_used"):
            if e[k] != e["stats_" + k]:
                problems.append(f"engine /metrics {k}={e[k]} but Stats says {e['stats_' + k]}")
    d, bd = now.get("daemon"), base.get("daemon")
    if d and bd:
        for k in ("leases", "reserved_bytes", "taken_bytes", "detached_holdings"):
            if d.get(k, 0) != bd.get(k, 0):
                problems.append(f"daemon {k}={d.get(k)} (baseline {bd.get(k)})")
    return problems


# ----------------------------------------------------------------------------- requests
@dataclass
class Attempt:
    rid: str
    session: int
    tenant: str
    t0: float
    t1: float = 0.0
    outcome: str = ""  # ok | cancelled | http_<status> | connect_error | midstream_error:<why> | timeout
    detail: str = ""
    ttft_s: float | None = None
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    retry_after_s: float | None = None
    body: dict[str, Any] | None = None  # the request (kept for completed ones, to replay)


async def stream_chat(client: httpx.AsyncClient, base: str, key: str, rid: str, body: dict[str, Any],
                      cancel_after: int, timeout_s: float, session: int, tenant: str) -> Attempt:
    """One streaming chat request; ``cancel_after`` > 0 closes the connection after that many
    token chunks."""
    a = Attempt(rid=rid, session=session, tenant=tenant, t0=time.monotonic())
    headers = {"authorization": f"Bearer {key}", "x-request-id": rid}
    got_headers = done = False
    chunks = 0
    calls: dict[int, dict[str, Any]] = {}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as resp:
                got_headers = True
                if resp.status_code != 200:
                    await resp.aread()
                    a.outcome, a.detail = f"http_{resp.status_code}", resp.text[:200]
                    ra = resp.headers.get("retry-after")
                    a.retry_after_s = float(ra) if ra and ra.replace(".", "", 1).isdigit() else None
                    return a
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        a.outcome, a.detail = "midstream_error:event", json.dumps(obj["error"])[:200]
                        return a
                    if not obj.get("choices"):
                        continue
                    choice = obj["choices"][0]
                    delta = choice.get("delta") or {}
                    token = False
                    if delta.get("content"):
                        a.text += delta["content"]
                        token = True
                    for tc in delta.get("tool_calls") or []:
                        c = calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                        fn = tc.get("function") or {}
                        c["name"] += fn.get("name") or ""
                        c["arguments"] += fn.get("arguments") or ""
                        if tc.get("id"):
                            c["id"] = tc["id"]
                        token = True
                    if token:
                        chunks += 1
                        if a.ttft_s is None:
                            a.ttft_s = time.monotonic() - a.t0
                    if choice.get("finish_reason"):
                        a.finish = choice["finish_reason"]
                    if cancel_after and chunks >= cancel_after and a.finish is None:
                        a.outcome = "cancelled"  # leaving the block closes the connection mid-stream
                        return a
        a.tool_calls = [calls[i] for i in sorted(calls)]
        if not done:
            a.outcome = "midstream_error:disconnect"
        elif a.finish in COMPLETED:
            a.outcome = "ok"
        else:
            a.outcome, a.detail = "midstream_error:no_finish", f"finish_reason={a.finish!r}"
    except TimeoutError:
        a.outcome, a.detail = "timeout", f"no end within {timeout_s:.0f} s"
    except httpx.TransportError as exc:
        a.outcome = "midstream_error:disconnect" if got_headers else "connect_error"
        a.detail = f"{type(exc).__name__}: {exc}"[:200]
    except json.JSONDecodeError as exc:
        a.outcome, a.detail = "midstream_error:event", f"bad SSE data: {exc}"
    finally:
        a.t1 = time.monotonic()
        a.tool_calls = a.tool_calls or [calls[i] for i in sorted(calls)]
    return a


def assistant_turn(a: Attempt) -> list[dict[str, Any]]:
    """The messages a client appends after reply ``a`` (a tool call gets a tool result)."""
    if a.tool_calls and a.outcome == "ok":
        calls = [{"id": c.get("id") or f"call_{i}", "type": "function",
                  "function": {"name": c["name"], "arguments": c["arguments"] or "{}"}}
                 for i, c in enumerate(a.tool_calls)]
        msgs: list[dict[str, Any]] = [{"role": "assistant", "content": a.text or None, "tool_calls": calls}]
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": '{"temperature_c": 21, "sky": "clear"}'}
                 for c in calls]
        return msgs
    return [{"role": "assistant", "content": a.text or "(no answer)"}]


class Load:
    def __init__(self, args: argparse.Namespace, stack: Stack) -> None:
        self.args = args
        self.stack = stack
        self.attempts: list[Attempt] = []
        self.deadline = 0.0

    async def session(self, i: int) -> None:
        args, rng = self.args, random.Random(f"{self.args.seed}:{i}")
        tools = rng.random() < args.tools_fraction
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s, connect=10.0),
                                     limits=limits) as client:
            conv = 0
            while time.monotonic() < self.deadline:
                conv += 1
                first = rng.choice(TOOL_QUESTIONS if tools and rng.random() < 0.6 else QUESTIONS)
                messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": first}]
                for turn in range(args.turns):
                    reply = None
                    tries = 0
                    while time.monotonic() < self.deadline:
                        tries += 1
                        body: dict[str, Any] = {"model": "default", "messages": [dict(m) for m in messages],
                                                "stream": True, "temperature": 0, "max_tokens": args.max_tokens}
                        if tools:
                            body["tools"] = TOOLS
                        cancel_after = (rng.randint(1, max(1, args.max_tokens // 2))
                                        if rng.random() < args.cancel_fraction else 0)
                        rid = f"soak-{i}-{conv}-{turn}-{tries}-{secrets.token_hex(3)}"
                        a = await stream_chat(client, self.stack.base, self.stack.keys["soak"], rid, body,
                                              cancel_after, args.request_timeout_s, i, "soak")
                        if a.outcome == "ok":
                            a.body = body
                        self.attempts.append(a)
                        if a.outcome in ("ok", "cancelled"):
                            reply = a
                            break
                        pause = min(a.retry_after_s or 1.0, 3.0) * (0.5 + rng.random())
                        await asyncio.sleep(pause)
                    if reply is None:
                        break
                    messages += assistant_turn(reply)
                    if turn + 1 < args.turns:
                        if reply.tool_calls and reply.outcome == "ok":
                            continue  # the tool result is the next request's last message
                        messages.append({"role": "user", "content": rng.choice(FOLLOWUPS + QUESTIONS)})


# ----------------------------------------------------------------------------- faults
Fault = tuple[float, str, str]  # (seconds into the load, daemon | engine, KILL | TERM)


def _parse_fault(spec: str, sig: str) -> Fault:
    opt = "--kill" if sig == "KILL" else "--term"
    target, sep, at = spec.partition("@")
    if not sep or target not in TARGETS:
        raise argparse.ArgumentTypeError(f"{opt} {spec!r}: expected daemon@SECONDS or engine@SECONDS")
    try:
        t = float(at)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{opt} {spec!r}: {at!r} is not a number of seconds") from None
    if t < 0:
        raise argparse.ArgumentTypeError(f"{opt} {spec!r}: the time must be >= 0")
    return t, target, sig


def parse_kill(spec: str) -> Fault:
    return _parse_fault(spec, "KILL")


def parse_term(spec: str) -> Fault:
    return _parse_fault(spec, "TERM")


def kill_plan(args: argparse.Namespace) -> list[Fault]:
    plan = list(args.kill or []) + list(args.term or [])
    if args.kill_every:
        t, n = args.kill_every, 0
        while t < args.duration_s:
            plan.append((t, TARGETS[n % 2], "KILL"))
            t += args.kill_every
            n += 1
    return sorted(plan)


class Faults:
    def __init__(self, stack: Stack, plan: list[Fault]) -> None:
        self.stack = stack
        self.plan = plan
        self.kills: list[dict[str, Any]] = []
        self.t_start = 0.0
        self._watchers: list[asyncio.Task[None]] = []

    def _ready(self, target: str) -> bool:
        """The target (and for the engine: the gateway's routing to it) serves."""
        try:
            token = self.stack.token()
            if target == "daemon":
                daemon_stats(self.stack.daemon_address(), token)
                return True
            return httpx.get(f"{self.stack.base}/health", timeout=2).status_code == 200
        except Exception:
            return False

    async def run(self, t_start: float, deadline: float) -> None:
        self.t_start = t_start
        for at, target, sig in self.plan:
            await asyncio.sleep(max(0.0, t_start + at - time.monotonic()))
            rec: dict[str, Any] = {"target": target, "planned_s": at, "signal": "SIG" + sig}
            self.kills.append(rec)
            if time.monotonic() >= deadline:
                rec["skipped"] = "after the end of the soak"
                continue
            pid = None
            wait_until = time.monotonic() + 60
            while time.monotonic() < wait_until:
                pid = self.stack.pids().get(target)
                if pid and await asyncio.to_thread(self._ready, target):
                    break
                pid = None
                await asyncio.sleep(0.5)
            if pid is None:
                rec["skipped"] = f"no serving {target} within 60 s"
                continue
            os.kill(pid, signal.SIGKILL if sig == "KILL" else signal.SIGTERM)
            rec.update(pid=pid, at_s=round(time.monotonic() - t_start, 2), t_kill=time.monotonic())
            self._watchers.append(asyncio.create_task(self._watch(rec, target, pid)))

    async def _watch(self, rec: dict[str, Any], target: str, old: int) -> None:
        limit = time.monotonic() + 300
        while time.monotonic() < limit:
            pid = self.stack.pids().get(target)
            if pid and pid != old and await asyncio.to_thread(self._ready, target):
                rec["new_pid"] = pid
                rec["t_back"] = time.monotonic()
                rec["downtime_s"] = round(rec["t_back"] - rec["t_kill"], 2)
                return
            await asyncio.sleep(0.25)
        rec["downtime_s"] = None  # never came back

    async def wait(self, timeout_s: float) -> None:
        if self._watchers:
            await asyncio.wait(self._watchers, timeout=timeout_s)

    def windows(self, target: str) -> list[tuple[float, float]]:
        return [(k["t_kill"], k.get("t_back", float("inf"))) for k in self.kills
                if k["target"] == target and "t_kill" in k]


# ----------------------------------------------------------------------------- checks
def read_request_log(path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[rec.get("request_id", "")] = rec
    return out


def request_key(body: dict[str, Any]) -> str:
    return json.dumps({k: body.get(k) for k in ("messages", "tools", "max_tokens")}, sort_keys=True)


def output_of(a: Attempt) -> dict[str, Any]:
    return {"text": a.text, "tool_calls": [(c["name"], c["arguments"]) for c in a.tool_calls], "finish": a.finish}


async def replay(args: argparse.Namespace, stack: Stack, completed: list[Attempt]) -> dict[str, Any]:
    """Replay each distinct completed request as the ``replay`` tenant and compare."""
    keys: dict[str, dict[str, Any]] = {}
    for a in completed:
        assert a.body is not None
        keys.setdefault(request_key(a.body), a.body)
    reference: dict[str, Attempt] = {}
    errors: list[Attempt] = []  # fault-free: every failed attempt is a finding
    sem = asyncio.Semaphore(args.replay_concurrency)
    limits = httpx.Limits(max_connections=args.replay_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s, connect=10.0),
                                 limits=limits) as client:
        async def one(n: int, key: str, body: dict[str, Any]) -> None:
            async with sem:
                for attempt in range(3):
                    r = await stream_chat(client, stack.base, stack.keys["replay"], f"replay-{n}-{attempt}", body,
                                          0, args.request_timeout_s, -1, "replay")
                    if r.outcome == "ok":
                        reference[key] = r
                        return
                    errors.append(r)
                    await asyncio.sleep(1.0)
                reference[key] = r

        await asyncio.gather(*(one(n, k, b) for n, (k, b) in enumerate(keys.items())))
    diffs, examples, failed = 0, [], 0
    for a in completed:
        ref = reference[request_key(a.body or {})]
        if ref.outcome != "ok":
            failed += 1
            continue
        if output_of(a) != output_of(ref):
            diffs += 1
            if len(examples) < 5:
                examples.append({"request_id": a.rid, "soak": output_of(a), "replay": output_of(ref),
                                 "last_message": (a.body or {}).get("messages", [{}])[-1]})
    return {"distinct_requests": len(keys), "compared": len(completed) - failed, "differences": diffs,
            "replay_failures": sum(1 for r in reference.values() if r.outcome != "ok"),
            "unreplayed": failed, "examples": examples,
            "errors": len(errors), "error_examples": [{"request_id": r.rid, "outcome": r.outcome,
                                                        "detail": r.detail} for r in errors[:5]]}


def error_details(attempts: list[Attempt]) -> dict[str, dict[str, int]]:
    """{kind: {message (its first 120 characters): count}} of the failed attempts."""
    out: dict[str, dict[str, int]] = {}
    for a in attempts:
        if a.outcome not in ("ok", "cancelled"):
            d = out.setdefault(a.outcome, {})
            d[a.detail[:120]] = d.get(a.detail[:120], 0) + 1
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def in_windows(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(lo <= t <= hi for lo, hi in windows)


async def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    stack = Stack(args, workdir)
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "kill"},
                              "kills_planned": [f"{t}@{s:g}" + ("" if g == "KILL" else " (SIGTERM)")
                                                for s, t, g in kill_plan(args)], "workdir": str(workdir)}
    try:
        result["startup_s"] = round(await asyncio.to_thread(stack.start), 1)
        # one small request warms the path, then the idle baseline
        async with httpx.AsyncClient(timeout=args.request_timeout_s) as client:
            warm = await stream_chat(client, stack.base, stack.keys["replay"], "warmup",
                                     {"model": "default", "stream": True, "temperature": 0, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "Hi"}]},
                                     0, args.request_timeout_s, -1, "replay")
        if warm.outcome != "ok":
            raise RuntimeError(f"the warm-up request failed: {warm.outcome} {warm.detail}")
        await asyncio.sleep(0.5)
        before = await asyncio.to_thread(resources, stack)
        result["resources_before"] = before
        if baseline_problems(before, before) or "engine" not in before:
            raise RuntimeError(f"cannot read the baseline: {before}")

        load = Load(args, stack)
        faults = Faults(stack, kill_plan(args))
        t_start = time.monotonic()
        load.deadline = t_start + args.duration_s
        injector = asyncio.create_task(faults.run(t_start, load.deadline))
        await asyncio.gather(*(load.session(i) for i in range(args.sessions)))
        t_load_end = time.monotonic()
        injector.cancel()
        await faults.wait(args.settle_s)
        attempts = load.attempts

        # idle: resources back to the baseline?
        settle_deadline = time.monotonic() + args.settle_s
        while True:
            after = await asyncio.to_thread(resources, stack)
            problems = baseline_problems(before, after)
            if not problems or time.monotonic() >= settle_deadline:
                break
            await asyncio.sleep(1.0)
        after["settle_s"] = round(after["t"] - t_load_end, 1)
        result["resources_after"] = after
        result["baseline_problems"] = problems
        result["stack_survived"] = stack.up_alive() and set(stack.pids()) == {"daemon", "engine", "gateway"}

        # lost / misreported generations (the gateway's request log)
        await asyncio.sleep(0.5)
        log = read_request_log(stack.request_log)
        ok_ids = {a.rid for a in attempts if a.outcome == "ok"}
        client_cancelled = {a.rid for a in attempts if a.outcome == "cancelled"}
        server_done = {rid for rid, r in log.items() if r.get("tenant") == "soak" and r.get("status") == 200
                       and r.get("finish_reason") in SERVER_COMPLETED}
        lost = sorted(server_done - ok_ids - client_cancelled)
        misreported = sorted(ok_ids - server_done)
        result["lost"] = {"count": len(lost), "request_ids": lost[:20],
                          "outcomes": [next((a.outcome for a in attempts if a.rid == r), "?") for r in lost[:20]]}
        result["misreported"] = {"count": len(misreported), "request_ids": misreported[:20],
                                 "server_says": [{k: log.get(r, {}).get(k) for k in ("status", "finish_reason")}
                                                 for r in misreported[:20]]}

        # the figures of the load
        kinds: dict[str, int] = {}
        for a in attempts:
            if a.outcome not in ("ok", "cancelled"):
                kinds[a.outcome] = kinds.get(a.outcome, 0) + 1
        ttfts = [a.ttft_s for a in attempts if a.outcome == "ok" and a.ttft_s is not None]
        completed = [a for a in attempts if a.outcome == "ok"]
        engine_down = faults.windows("engine")
        during = [a for a in attempts if in_windows(a.t0, engine_down)]
        # errors of requests that overlapped no engine downtime (a daemon kill must cost no request)
        slack = 1.0  # the gateway may still answer 503 just after its /health turned 200
        unexplained = [a for a in attempts if a.outcome not in ("ok", "cancelled")
                       and not any(a.t0 <= hi + slack and a.t1 >= lo for lo, hi in engine_down)]
        during_kinds: dict[str, int] = {}
        for a in during:
            during_kinds[a.outcome] = during_kinds.get(a.outcome, 0) + 1
        bad_during = {k: v for k, v in during_kinds.items()
                      if k not in ("ok", "cancelled", "http_503", "connect_error") and not k.startswith("midstream")}
        result.update({
            "load_s": round(t_load_end - t_start, 1),
            "requests": len(attempts), "completed": len(completed),
            "cancelled": sum(a.outcome == "cancelled" for a in attempts),
            "with_tools": sum(1 for a in completed if a.body and a.body.get("tools")),
            "tool_call_replies": sum(1 for a in completed if a.tool_calls),
            "errors": dict(sorted(kinds.items())), "error_details": error_details(attempts),
            "ttft_s": {"p50": pct(ttfts, 50), "p99": pct(ttfts, 99), "n": len(ttfts),
                       "mean": statistics.fmean(ttfts) if ttfts else None},
            "kills": [{k: v for k, v in kill.items() if k not in ("t_kill", "t_back")} for kill in faults.kills],
            "engine_downtime_requests": dict(sorted(during_kinds.items())),
            "engine_downtime_bad": bad_during,
            "hangs": kinds.get("timeout", 0),
            "unexplained_errors": {"count": len(unexplained), "examples": [
                {"request_id": a.rid, "outcome": a.outcome, "detail": a.detail, "at_s": round(a.t0 - t_start, 1)}
                for a in unexplained[:10]]},
            "attempts": [{"rid": a.rid, "t0": round(a.t0 - t_start, 2), "t1": round(a.t1 - t_start, 2),
                          "outcome": a.outcome, "ttft_s": None if a.ttft_s is None else round(a.ttft_s, 3)}
                         for a in attempts],
        })

        # the fault-free replay
        t0 = time.monotonic()
        result["replay"] = await replay(args, stack, completed)
        result["replay"]["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        result["up_exit"] = await asyncio.to_thread(stack.stop)
        result["up_log_tail"] = stack.log_tail(2000)
    return result


def verdict(result: dict[str, Any], plan: list[Fault]) -> dict[str, bool]:
    rp = result.get("replay", {})
    kills = result.get("kills", [])
    planned_in_time = [k for k in kills if "skipped" not in k]
    crit = {
        "completed_generations": result.get("completed", 0) > 0,
        "wrong_outputs_0": rp.get("differences", 1) == 0 and rp.get("replay_failures", 1) == 0,
        "lost_0": result.get("lost", {}).get("count", 1) == 0,
        "misreported_0": result.get("misreported", {}).get("count", 1) == 0,
        "resources_back_to_baseline": result.get("baseline_problems", ["not measured"]) == [],
        "no_hangs": result.get("hangs", 1) == 0,
        "no_errors_outside_engine_downtime": result.get("unexplained_errors", {}).get("count", 1) == 0,
        "replay_error_free": rp.get("errors", 1) == 0,
        "downtime_answers": not result.get("engine_downtime_bad", {"?": 1}),
        "stack_survived": bool(result.get("stack_survived")),
        "faults_recovered": all(k.get("downtime_s") is not None for k in planned_in_time)
        and len(planned_in_time) == len([1 for at, _, _ in plan if at < result["config"]["duration_s"]]),
    }
    return crit


def report(result: dict[str, Any], crit: dict[str, bool]) -> str:
    lines = ["", "== deepwell soak =="]
    c = result["config"]
    lines.append(f"sessions {c['sessions']}, {c['duration_s']:g} s (load ran {result.get('load_s')} s), turns "
                 f"{c['turns']}, max_tokens {c['max_tokens']}, seed {c['seed']}, kills {result['kills_planned']}")
    lines.append(f"start-up of deepwell up: {result.get('startup_s')} s")
    lines.append(f"requests: {result.get('requests')}  completed: {result.get('completed')}  cancelled by the "
                 f"client: {result.get('cancelled')}  completed with tools offered: {result.get('with_tools')} "
                 f"(tool-call replies {result.get('tool_call_replies')})")
    lines.append(f"errors by kind: {json.dumps(result.get('errors', {}))}")
    for kind, details in result.get("error_details", {}).items():
        for detail, n in sorted(details.items(), key=lambda x: -x[1])[:4]:
            lines.append(f"  {kind} x{n}: {detail}")
    t = result.get("ttft_s", {})
    f = (lambda x: "n/a" if x is None else f"{x:.3f} s")  # noqa: E731
    lines.append(f"TTFT (completed, client-side): p50 {f(t.get('p50'))}  p99 {f(t.get('p99'))}  (n={t.get('n')})")
    for k in result.get("kills", []):
        if "skipped" in k:
            lines.append(f"kill {k['target']}@{k['planned_s']:g}: skipped ({k['skipped']})")
        else:
            lines.append(f"kill {k['target']}@{k['planned_s']:g}: pid {k['pid']} {k['signal']} at {k['at_s']} s, back "
                         f"(pid {k.get('new_pid')}) after {k.get('downtime_s')} s")
    lines.append(f"requests started during engine downtime: {json.dumps(result.get('engine_downtime_requests', {}))}")
    ux = result.get("unexplained_errors", {})
    lines.append(f"errors of requests that overlapped no engine downtime: {ux.get('count')}")
    for ex in ux.get("examples", [])[:5]:
        lines.append(f"  {ex['request_id']} at {ex['at_s']} s: {ex['outcome']} {ex['detail'][:160]}")
    for name in ("resources_before", "resources_after"):
        r = result.get(name, {})
        e, d = r.get("engine", {}), r.get("daemon", {})
        lines.append(f"{name.split('_')[1]:>6}: engine running {e.get('requests_running')} waiting "
                     f"{e.get('requests_waiting')} kv_pages_used {e.get('kv_pages_used')}/{e.get('kv_pages_total')} "
                     f"(cache-held {e.get('cache_pages')}, in requests {e.get('pages_in_requests')}) state_slots_used "
                     f"{e.get('state_slots_used')} (cache-held {e.get('cache_state_slots')}) cache entries "
                     f"{e.get('cache_entries')} ({e.get('cache_bytes')} B)")
        if d:
            lines.append(f"        daemon arena {d.get('arena_bytes')} B: committed {d.get('committed_bytes')} B "
                         f"({d.get('entries')} entries) reserved {d.get('reserved_bytes')} taken "
                         f"{d.get('taken_bytes')} leases {d.get('leases')} clients {d.get('clients')} detached with "
                         f"holdings {d.get('detached_holdings')}")
        for k in ("error", "engine_error", "daemon_error"):
            if k in r:
                lines.append(f"        {k}: {r[k]}")
    if "settle_s" in result.get("resources_after", {}):
        lines.append(f"idle {result['resources_after']['settle_s']} s after the load; not at baseline: "
                     f"{result.get('baseline_problems')}")
    lost, mis = result.get("lost", {}), result.get("misreported", {})
    lines.append(f"lost completed generations: {lost.get('count')} {lost.get('request_ids') or ''}")
    lines.append(f"misreported completions (client saw a finish the server log does not): {mis.get('count')} "
                 f"{mis.get('server_says') or ''}")
    rp = result.get("replay", {})
    lines.append(f"replay: {rp.get('compared')} completed generations compared ({rp.get('distinct_requests')} "
                 f"distinct requests, {rp.get('seconds')} s): {rp.get('differences')} differ from the fault-free "
                 f"replay; replay failures {rp.get('replay_failures')}")
    lines.append(f"replay errors (fault-free, each retried up to 3 times): {rp.get('errors')}")
    for ex in rp.get("error_examples", []):
        lines.append(f"  {ex['request_id']}: {ex['outcome']} {ex['detail'][:160]}")
    for ex in rp.get("examples", []):
        lines.append(f"  differs {ex['request_id']}: soak {json.dumps(ex['soak'])[:300]} | replay "
                     f"{json.dumps(ex['replay'])[:300]}")
    lines.append(f"deepwell up exit status: {result.get('up_exit')}")
    verdict_line = "VERDICT: " + ("PASS" if all(crit.values()) else "FAIL") + "  " + "  ".join(
        f"{k}={'PASS' if v else 'FAIL'}" for k, v in crit.items())
    lines.append(verdict_line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/soak.py", description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring for the definitions of each figure.")
    p.add_argument("--sessions", type=int, default=16, help="concurrent sessions (default 16)")
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation before a new one (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sessions' choices (default 0)")
    p.add_argument("--kill", action="append", type=parse_kill, metavar="TARGET@S",
                   help="SIGKILL daemon or engine S seconds into the load (repeatable)")
    p.add_argument("--kill-every", type=float, default=0.0, metavar="S",
                   help="SIGKILL the daemon and the engine in turn every S seconds (0 = off)")
    p.add_argument("--term", action="append", type=parse_term, metavar="TARGET@S",
                   help="SIGTERM (graceful stop; deepwell up restarts it too) daemon or engine S seconds into the "
                        "load (repeatable)")
    p.add_argument("--cancel-fraction", type=float, default=0.15,
                   help="share of requests cancelled mid-stream by closing the connection (default 0.15)")
    p.add_argument("--tools-fraction", type=float, default=0.33,
                   help="share of sessions that offer a tool (default 0.33)")
    p.add_argument("--request-timeout-s", type=float, default=120.0,
                   help="a request not ended after this long is a hang (default 120)")
    p.add_argument("--settle-s", type=float, default=90.0,
                   help="seconds to wait for the idle stack to return to the baseline (default 90)")
    p.add_argument("--replay-concurrency", type=int, default=0,
                   help="concurrent replay requests (default 0: as many as --sessions, at least 4)")
    p.add_argument("--json", default="", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--model", default="", help="model directory or .gguf ('' = the embedded default model)")
    p.add_argument("--engine-args", default="", help="more engine flags, one string (deepwell up --engine-args)")
    p.add_argument("--device", default="cpu", help="engine device (default cpu)")
    p.add_argument("--cpu-kv-gib", type=float, default=0.5, help="CPU KV pool GiB (default 0.5; 0 = the engine's)")
    p.add_argument("--arena-mib", type=int, default=256, help="the daemon's host arena, MiB (default 256)")
    p.add_argument("--daemon-grace-s", type=float, default=0.0,
                   help="the daemon's reclaim grace for a dead client's holdings (0 = the daemon's default, 30 s)")
    p.add_argument("--request-log", default="", help="the gateway's request log (default: in the work dir)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="deepwell up's per-service start timeout")
    p.add_argument("--log-level", default="warning", help="the services' log level (default warning)")
    p.add_argument("--workdir", default="", help="keep logs here (default: a temporary directory, kept on FAIL)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.sessions < 1 or args.duration_s <= 0 or args.turns < 1 or args.max_tokens < 1:
        build_parser().error("--sessions, --duration-s, --turns and --max-tokens must be positive")
    args.replay_concurrency = args.replay_concurrency or max(4, args.sessions)
    plan = kill_plan(args)
    keep = bool(args.workdir)
    workdir = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="deepwell-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"config": vars(args)}
    try:
        result = asyncio.run(soak(args, workdir))
        crit = verdict(result, plan)
    except Exception as exc:
        result["exception"] = f"{type(exc).__name__}: {exc}"
        result.setdefault("config", {k: v for k, v in vars(args).items() if k != "kill"})
        result.setdefault("kills_planned", [])
        crit = {"ran": False}
        print(f"soak: {result['exception']}", file=sys.stderr)
    result["criteria"] = crit
    result["passed"] = all(crit.values())
    print(report(result, crit), flush=True)
    if not result["passed"]:
        print(f"(logs kept in {workdir})", flush=True)
    elif not keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
