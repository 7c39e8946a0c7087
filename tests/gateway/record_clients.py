"""Record what real agent CLIs send to the gateway (a script, not a test).

A logging HTTP proxy sits in front of a running gateway (``deepwell up``): every request is
forwarded unchanged and the response streamed back unchanged, and each request is written as
one JSON fixture (method, path, scrubbed headers, JSON body, plus a ``recorded`` block with the
client, its version, the command, the gateway's status and, for errors, its error text).
``tests/gateway/test_client_replay.py`` replays the fixtures against a gateway in CI.

Scrubbing: ``authorization``, ``x-api-key``, ``cookie`` (and other credential headers),
``host`` and ``content-length`` are dropped; in headers and body strings the client's working
directory, its ``$HOME``, the user name and the host name are replaced by placeholders, and the
device id inside Claude Code's ``metadata.user_id`` is zeroed.

Usage::

    deepwell up --port 8000 ...            # in another terminal
    # one proxy, by hand (fixtures named <prefix>-NN-<method>-<path>.json):
    python tests/gateway/record_clients.py proxy --upstream http://127.0.0.1:8000 --port 8100 \\
        --out /tmp/fixtures --prefix manual
    # every built-in scenario (the CLIs installed with npm under --clients):
    python tests/gateway/record_clients.py record --upstream http://127.0.0.1:8000 \\
        --clients /tmp/clients --out tests/gateway/clients
    python tests/gateway/record_clients.py record ... --only claude-code-say-hi,codex-exec-responses

The ``record`` scenarios (``SCENARIOS`` below) run each CLI non-interactively in a scratch
working directory with a scratch ``$HOME`` / ``CODEX_HOME`` / ``XDG_*`` folders (no personal
configuration is read), a dummy API key, telemetry and auto-update off, and small output caps.
"""

from __future__ import annotations

import argparse
import getpass
import gzip
import http.client
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- scrubbing
DROP_HEADERS = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
    "chatgpt-account-id", "openai-organization", "openai-project", "x-goog-api-key",
    "host", "content-length", "connection", "keep-alive", "transfer-encoding",
})
PLACEHOLDER_CWD = "/work/project"
PLACEHOLDER_HOME = "/home/user"
INSTALLATION_ID = re.compile(r'(installation[_-]id\\*"\s*:\s*\\*")([0-9a-fA-F-]{36})')
GENERIC_NAMES = frozenset({"root", "user", "admin", "ubuntu", "debian", "runner", "localhost", "host"})


@dataclass
class Scrubber:
    replacements: list[tuple[str, str]] = field(default_factory=list)
    words: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def for_run(cls, cwd: str | None, home: str | None) -> Scrubber:
        """Replace the run's directories, the real home directory, the user and host names.
        Paths are replaced only where a path starts (not inside ``</root>``-like tags), and the
        user / host names only when they are not common words (``root``, short names)."""
        pairs: list[tuple[str, str]] = []
        for path, placeholder in ((cwd, PLACEHOLDER_CWD), (home, PLACEHOLDER_HOME),
                                  (os.path.expanduser("~"), PLACEHOLDER_HOME)):
            if path and len(path) > 1:
                pairs.append((path, placeholder))
                # the path as a slug (Claude Code's / Qwen Code's per-project memory folders)
                pairs.append((path.replace("/", "-"), placeholder.replace("/", "-")))
                real = os.path.realpath(path)
                if real != path:
                    pairs.append((real, placeholder))
        pairs.sort(key=lambda p: -len(p[0]))  # longest paths first (a cwd under $HOME)
        words = [(w, r) for w, r in ((getpass.getuser(), "user"), (socket.gethostname(), "host"))
                 if len(w) >= 4 and w.lower() not in GENERIC_NAMES]
        return cls(pairs, words)

    def text(self, s: str) -> str:
        for old, new in self.replacements:
            s = re.sub(rf"(?<![\w<.-]){re.escape(old)}(?![\w.-])", new, s)
        for old, new in self.words:
            s = re.sub(rf"\b{re.escape(old)}\b", new, s)
        # Codex's installation id (x-codex-turn-metadata, client_metadata): a device identifier
        return INSTALLATION_ID.sub(lambda m: m.group(1) + re.sub(r"[0-9a-fA-F]", "0", m.group(2)), s)

    def value(self, v: Any) -> Any:
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {k: _zero(x) if isinstance(x, str) and re.search(r"installation[_-]id", k) else self.value(x)
                    for k, x in v.items()}
        return v

    def headers(self, headers: list[tuple[str, str]]) -> dict[str, str]:
        out: dict[str, str] = {}
        for k, v in headers:
            k = k.lower()
            if k in DROP_HEADERS:
                continue
            out[k] = self.text(v) if k not in out else out[k] + ", " + self.text(v)
        return out

    def body(self, body: Any) -> Any:
        body = self.value(body)
        meta = body.get("metadata") if isinstance(body, dict) else None
        if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
            meta["user_id"] = scrub_user_id(meta["user_id"])
        return body


def _zero(s: str) -> str:
    return re.sub(r"[0-9a-zA-Z]", "0", s)


def scrub_user_id(user_id: str) -> str:
    """Claude Code's ``metadata.user_id``: a JSON object (``device_id``, ``account_uuid``,
    ``session_id``) in current versions, ``user_<hex>_account_<uuid>_session_<uuid>`` in older
    ones. The device / account parts identify a machine or a person: zeroed; the session id
    (random per conversation) is kept."""
    try:
        obj = json.loads(user_id)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        for k in ("device_id", "account_uuid", "organization_uuid", "email"):
            if isinstance(obj.get(k), str) and obj[k]:
                obj[k] = re.sub(r"[0-9a-zA-Z]", "0", obj[k])
        return json.dumps(obj, separators=(",", ":"))
    return re.sub(r"^user_[0-9a-f]+", lambda m: "user_" + "0" * (len(m.group(0)) - 5), user_id)


def decode_body(raw: bytes, encoding: str) -> bytes:
    encoding = (encoding or "").lower().strip()
    if encoding in ("", "identity"):
        return raw
    if encoding in ("gzip", "x-gzip"):
        return gzip.decompress(raw)
    if encoding == "deflate":
        return zlib.decompress(raw)
    if encoding == "zstd":
        import zstandard  # type: ignore[import-not-found]

        return zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    if encoding == "br":
        import brotli  # type: ignore[import-not-found]

        return brotli.decompress(raw)
    raise ValueError(f"unknown content-encoding {encoding!r}")


def sse_event_names(data: bytes) -> list[str]:
    """The ``event:`` names (or the ``type`` of data-only events, ``[DONE]``) of an SSE body."""
    names: list[str] = []
    event = None
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            payload = line[5:].strip()
            if event is None:
                if payload == "[DONE]":
                    event = "[DONE]"
                else:
                    try:
                        obj = json.loads(payload)
                        event = obj.get("type") or obj.get("object") or ("error" if "error" in obj else "data")
                    except ValueError:
                        event = "data"
            names.append(event)
            event = None
        elif line.startswith(":"):
            names.append(":")
    # collapse runs of the same name (deltas)
    out: list[str] = []
    for n in names:
        if out and out[-1].split(" x")[0] == n:
            base, _, count = out[-1].partition(" x")
            out[-1] = f"{base} x{int(count or 1) + 1}"
        else:
            out.append(n)
    return out


# --------------------------------------------------------------------------- the proxy
@dataclass
class Recorder:
    out_dir: Path
    prefix: str
    scrubber: Scrubber
    meta: dict[str, Any]
    seq: int = 0
    written: list[Path] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, method: str, path: str, headers: list[tuple[str, str]], raw: bytes,
              status: int, resp_headers: dict[str, str], resp_body: bytes) -> Path:
        with self.lock:
            n = self.seq
            self.seq += 1
        body: Any = None
        body_text: str | None = None
        if raw:
            try:
                decoded = decode_body(raw, dict((k.lower(), v) for k, v in headers).get("content-encoding", ""))
                body = json.loads(decoded)
            except (ValueError, ImportError, OSError):
                body_text = raw.decode("utf-8", "replace")
        ctype = resp_headers.get("content-type", "")
        recorded: dict[str, Any] = {**self.meta, "seq": n, "status": status, "response_content_type": ctype}
        if status >= 400:
            recorded["error"] = resp_body.decode("utf-8", "replace")[:4000]
        elif "text/event-stream" in ctype:
            recorded["sse_events"] = sse_event_names(resp_body)
        fixture = {
            "method": method,
            "path": self.scrubber.text(path),
            "headers": self.scrubber.headers(headers),
            "body": self.scrubber.body(body) if body is not None else None,
            "recorded": recorded,
        }
        if body_text is not None:
            fixture["body_text"] = self.scrubber.text(body_text)
        slug = re.sub(r"[^a-z0-9]+", "-", urllib.parse.urlsplit(path).path.lower()).strip("-") or "root"
        target = self.out_dir / f"{self.prefix}-{n:02d}-{method.lower()}-{slug}.json"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        self.written.append(target)
        return target


HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection",
                 "upgrade", "te", "trailer"})


def make_handler(upstream: str, recorder: Recorder) -> type[http.server.BaseHTTPRequestHandler]:
    up = urllib.parse.urlsplit(upstream)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet
            sys.stderr.write(f"[proxy {recorder.prefix}] {fmt % args}\n")

        def _read_body(self) -> bytes:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
            n = int(self.headers.get("content-length") or 0)
            return self.rfile.read(n) if n else b""

        def _forward(self) -> None:
            raw = self._read_body()
            headers = list(self.headers.items())
            fwd = {k: v for k, v in headers if k.lower() not in HOP}
            fwd["Host"] = up.netloc
            if raw or self.command in ("POST", "PUT", "PATCH"):
                fwd["Content-Length"] = str(len(raw))
            conn = http.client.HTTPConnection(up.hostname, up.port or 80, timeout=1800)
            resp_body = bytearray()
            status, resp_headers = 502, {}
            try:
                try:
                    conn.request(self.command, self.path, body=raw or None, headers=fwd)
                    resp = conn.getresponse()
                except OSError as exc:
                    msg = json.dumps({"error": {"message": f"recording proxy: upstream unreachable: {exc}"}}).encode()
                    self.send_response(502)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    resp_body += msg
                    return
                status = resp.status
                resp_headers = {k.lower(): v for k, v in resp.getheaders()}
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                if self.command == "HEAD" or resp.status in (204, 304):
                    self.send_header("content-length", resp_headers.get("content-length", "0"))
                    self.end_headers()
                    return
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    if len(resp_body) < 4 << 20:
                        resp_body += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            finally:
                conn.close()
                path = recorder.write(self.command, self.path, headers, raw, status, resp_headers, bytes(resp_body))
                sys.stderr.write(f"[proxy {recorder.prefix}] {self.command} {self.path} -> {status}: {path.name}\n")

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _forward

    return Handler


class Proxy:
    def __init__(self, upstream: str, recorder: Recorder, port: int = 0) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), make_handler(upstream, recorder))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Proxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------- scenarios
CLAUDE_VERSION = "2.1.332"
CODEX_VERSION = "0.171.0"
QWEN_VERSION = "0.24.4"
OPENCODE_VERSION = "1.18.33"  # opencode-ai: a launcher; the binary comes from opencode-linux-x64 (optional dep)
NPM_PACKAGES = {"claude-code": f"@anthropic-ai/claude-code@{CLAUDE_VERSION}",
                "codex": f"@openai/codex@{CODEX_VERSION}",
                "qwen-code": f"@qwen-code/qwen-code@{QWEN_VERSION}",
                "opencode": f"opencode-ai@{OPENCODE_VERSION}"}
VERSIONS = {"claude-code": CLAUDE_VERSION, "codex": CODEX_VERSION, "qwen-code": QWEN_VERSION,
            "opencode": OPENCODE_VERSION}

# Documented switches that turn off telemetry, error reporting and auto-update.
CLAUDE_ENV = {
    "ANTHROPIC_API_KEY": "dummy",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
    "CLAUDE_CODE_MAX_RETRIES": "0",
    "API_TIMEOUT_MS": "600000",
}
QWEN_SETTINGS = {
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    "security": {"auth": {"selectedType": "openai"}},
    "model": {"name": "smollm2", "generationConfig": {"samplingParams": {"max_tokens": 64}}},
}

# OpenCode: no auto-update, no models.dev catalogue (the custom provider below needs none), no
# LSP downloads, no share links; its config / data / cache / state under the scratch $HOME.
# (It still runs `npm install @opencode-ai/plugin` in its config folder at startup: the npm
# registry must be reachable, nothing else is.)
OPENCODE_ENV = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "XDG_CONFIG_HOME": "{home}/.config",
    "XDG_DATA_HOME": "{home}/.local/share",
    "XDG_CACHE_HOME": "{home}/.cache",
    "XDG_STATE_HOME": "{home}/.local/state",
}


def opencode_config(base_url: str, max_output: int = 64) -> dict[str, Any]:
    """``~/.config/opencode/opencode.json``: the gateway as a custom OpenAI-compatible provider
    (``@ai-sdk/openai-compatible``, bundled in the binary: chat completions). ``limit.output``
    is the ``max_tokens`` OpenCode sends; the timeouts (default 300 s to the response headers
    and between chunks) leave room for minutes of CPU prefill."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "model": "deepwell/smollm2",
        "provider": {
            "deepwell": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "deepwell",
                "options": {"baseURL": f"{base_url}/v1", "apiKey": "dummy",
                            "timeout": 1_800_000, "headerTimeout": 1_800_000, "chunkTimeout": 1_800_000},
                "models": {"smollm2": {"name": "SmolLM2", "limit": {"context": 32768, "output": max_output}}},
            },
        },
    }


def codex_config(base_url: str) -> str:
    """A provider block for the gateway (``wire_api = "chat"`` is refused by Codex >= 0.1xx:
    "`wire_api = \"chat\"` is no longer supported")."""
    return f"""# written by tests/gateway/record_clients.py
model = "smollm2"
model_provider = "deepwell"
check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "read-only"

[model_providers.deepwell]
name = "deepwell"
base_url = "{base_url}/v1"
env_key = "DEEPWELL_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[otel]
exporter = "none"

[feedback]
enabled = false
"""


@dataclass
class Scenario:
    name: str
    client: str
    argv: list[str]  # {bin} = the client's node_modules/.bin directory
    env: dict[str, str] = field(default_factory=dict)  # {proxy} = the proxy's URL, {home}, {cwd}
    setup: str = ""  # "codex" | "qwen" | "opencode" | ""
    timeout_s: float = 900.0
    note: str = ""
    then: list[list[str]] = field(default_factory=list)  # later turns, same home / project / proxy


SCENARIOS = [
    Scenario("claude-code-say-hi", "claude-code", ["{bin}/claude", "-p", "say hi"],
             {**CLAUDE_ENV, "ANTHROPIC_BASE_URL": "{proxy}"},
             note="the default: every built-in tool (Agent included), the default model"),
    Scenario("claude-code-model-haiku", "claude-code", ["{bin}/claude", "-p", "--model", "haiku", "say hi"],
             {**CLAUDE_ENV, "ANTHROPIC_BASE_URL": "{proxy}"}, note="--model haiku"),
    Scenario("claude-code-model-custom", "claude-code", ["{bin}/claude", "-p", "--model", "smollm2", "say hi"],
             {**CLAUDE_ENV, "ANTHROPIC_BASE_URL": "{proxy}"}, note="--model with a non-Anthropic name"),
    Scenario("claude-code-bare-no-tools", "claude-code",
             ["{bin}/claude", "-p", "--bare", "--tools", "", "--system-prompt", "You are a terse assistant.",
              "--session-id", "3f0c9a52-7d1e-4b8a-9c61-2e5f4d8b7a10", "say hi"],
             {**CLAUDE_ENV, "ANTHROPIC_BASE_URL": "{proxy}"},
             then=[["{bin}/claude", "-p", "--bare", "--tools", "", "--system-prompt", "You are a terse assistant.",
                    "--resume", "3f0c9a52-7d1e-4b8a-9c61-2e5f4d8b7a10", "and now say bye"]],
             note="a prompt small enough for SmolLM2 (no tools, a one-line system prompt), then a second turn "
                  "of the same conversation (--resume)"),
    Scenario("claude-code-bare-read-tool", "claude-code",
             ["{bin}/claude", "-p", "--bare", "--tools", "Read", "--system-prompt", "You are a terse assistant.",
              "say hi"],
             {**CLAUDE_ENV, "ANTHROPIC_BASE_URL": "{proxy}"}, note="one tool (Read): the tool shape"),
    Scenario("codex-exec-responses", "codex",
             ["{bin}/codex", "exec", "--skip-git-repo-check", "say hi"],
             {"DEEPWELL_API_KEY": "dummy", "CODEX_HOME": "{home}/.codex"}, setup="codex",
             then=[["{bin}/codex", "exec", "--skip-git-repo-check", "resume", "--last", "and now say bye"]],
             note='wire_api = "responses" (Codex sends no output cap), then a second turn (exec resume --last)'),
    Scenario("qwen-code-say-hi", "qwen-code", ["{bin}/qwen", "--auth-type", "openai", "say hi"],
             {"OPENAI_BASE_URL": "{proxy}/v1", "OPENAI_API_KEY": "dummy", "OPENAI_MODEL": "smollm2"},
             setup="qwen", then=[["{bin}/qwen", "--auth-type", "openai", "--continue", "and now say bye"]],
             note="OpenAI chat completions, then a second turn (--continue)"),
    Scenario("opencode-run-say-hi", "opencode", ["{bin}/opencode", "run", "say hi"], dict(OPENCODE_ENV),
             setup="opencode", then=[["{bin}/opencode", "run", "--continue", "and now say bye"]],
             note="OpenAI chat completions through a custom @ai-sdk/openai-compatible provider, then a second "
                  "turn (--continue)"),
]


def setup_scenario(sc: Scenario, home: Path, proxy_url: str) -> None:
    if sc.setup.startswith("codex"):
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text(codex_config(proxy_url))
    elif sc.setup == "qwen":
        (home / ".qwen").mkdir(parents=True, exist_ok=True)
        (home / ".qwen" / "settings.json").write_text(json.dumps(QWEN_SETTINGS, indent=1))
    elif sc.setup == "opencode":
        (home / ".config" / "opencode").mkdir(parents=True, exist_ok=True)
        (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(opencode_config(proxy_url), indent=1))


def run_scenario(sc: Scenario, upstream: str, bin_dir: Path, out_dir: Path, keep: bool = False) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"rec-{sc.name}-"))
    home, cwd = root / "home", root / "project"
    home.mkdir()
    cwd.mkdir()
    (cwd / "README.md").write_text("# demo\n\nA scratch project for recording client traffic.\n")
    scrubber = Scrubber.for_run(str(cwd), str(home))
    scrubber.replacements[:0] = [(str(root), "/work"), (str(root).replace("/", "-"), "-work")]
    scrubber.replacements.sort(key=lambda p: -len(p[0]))
    command = " && ".join(_command(a) for a in [sc.argv, *sc.then])
    meta = {"client": sc.client, "client_version": VERSIONS[sc.client], "scenario": sc.name, "command": command,
            "note": sc.note}
    for old in out_dir.glob(f"{sc.name}-[0-9][0-9]-*.json"):
        old.unlink()
    recorder = Recorder(out_dir, sc.name, scrubber, meta)
    with Proxy(upstream, recorder) as proxy:
        setup_scenario(sc, home, proxy.url)
        subst = {"{proxy}": proxy.url, "{home}": str(home), "{cwd}": str(cwd), "{bin}": str(bin_dir)}

        def fill(s: str) -> str:
            for k, v in subst.items():
                s = s.replace(k, v)
            return s

        env = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "HOME": str(home), "USER": "user",
               "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1", "CI": "1",
               **{k: fill(v) for k, v in sc.env.items()}}
        steps = []
        for argv in [sc.argv, *sc.then]:
            t0 = time.monotonic()
            try:
                p = subprocess.run([fill(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                                   timeout=sc.timeout_s, stdin=subprocess.DEVNULL)
                code, stdout, stderr = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as exc:
                code, stdout, stderr = "timeout", _text(exc.stdout), _text(exc.stderr)
            steps.append({"command": _command(argv), "exit_code": code, "seconds": round(time.monotonic() - t0, 1),
                          "stdout": scrubber.text(stdout)[-2000:], "stderr": scrubber.text(stderr)[-3000:]})
            time.sleep(0.5)  # let in-flight recordings finish
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    statuses = []
    for path in recorder.written:
        rec = json.loads(path.read_text())
        statuses.append(f"{rec['method']} {rec['path']} -> {rec['recorded']['status']}")
    return {"scenario": sc.name, "client": sc.client, "version": VERSIONS[sc.client], "command": command,
            "steps": steps, "requests": statuses, "fixtures": [p.name for p in recorder.written]}


def _command(argv: list[str]) -> str:
    return " ".join(a if a and " " not in a else json.dumps(a) for a in argv).replace("{bin}/", "")


def _text(out: str | bytes | None) -> str:
    return out.decode("utf-8", "replace") if isinstance(out, bytes) else (out or "")


# --------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p1 = sub.add_parser("proxy", help="run one recording proxy until Ctrl-C")
    p1.add_argument("--upstream", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    p1.add_argument("--port", type=int, default=8100)
    p1.add_argument("--out", required=True, type=Path)
    p1.add_argument("--prefix", default="manual")
    p1.add_argument("--client", default="unknown")
    p1.add_argument("--client-version", default="unknown")
    p1.add_argument("--command", default="")
    p2 = sub.add_parser("record", help="run the built-in client scenarios through fresh proxies")
    p2.add_argument("--upstream", required=True)
    p2.add_argument("--clients", required=True, type=Path, help="npm --prefix directory holding the CLIs")
    p2.add_argument("--out", required=True, type=Path)
    p2.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p2.add_argument("--summary", type=Path, default=Path(tempfile.gettempdir()) / "record_clients_summary.json")
    p2.add_argument("--keep", action="store_true", help="keep the scratch home/project directories")
    sub.add_parser("install", help="print the npm command that installs the pinned CLIs")
    args = ap.parse_args(argv)

    if args.cmd == "install":
        print("npm install --no-audit --no-fund --prefix /tmp/clients " + " ".join(NPM_PACKAGES.values()))
        return 0
    if args.cmd == "proxy":
        meta = {"client": args.client, "client_version": args.client_version, "scenario": args.prefix,
                "command": args.command}
        rec = Recorder(args.out, args.prefix, Scrubber.for_run(os.getcwd(), os.path.expanduser("~")), meta)
        with Proxy(args.upstream, rec, args.port) as proxy:
            print(f"recording proxy on {proxy.url} -> {args.upstream}; fixtures in {args.out}", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 0
    only = {s for s in args.only.split(",") if s}
    unknown = only - {s.name for s in SCENARIOS}
    if unknown:
        ap.error(f"unknown scenarios: {sorted(unknown)}")
    bin_dir = (args.clients / "node_modules" / ".bin").resolve()
    results = []
    for sc in SCENARIOS:
        if only and sc.name not in only:
            continue
        print(f"== {sc.name}", flush=True)
        r = run_scenario(sc, args.upstream, bin_dir, args.out, keep=args.keep)
        results.append(r)
        print("\n".join(r["requests"]), flush=True)
        for st in r["steps"]:
            print(f"exit {st['exit_code']} after {st['seconds']} s: {st['command']}\nstdout: {st['stdout'][-600:]}"
                  f"\nstderr: {st['stderr'][-1200:]}", flush=True)
    previous = json.loads(args.summary.read_text()) if args.summary.exists() else []
    names = {r["scenario"] for r in results}
    args.summary.write_text(json.dumps([p for p in previous if p["scenario"] not in names] + results, indent=1))
    print(f"summary: {args.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
