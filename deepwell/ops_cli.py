"""Operator views on a running stack: ``deepwell sessions`` and ``deepwell stats``.

- ``deepwell sessions`` reads the gateway's ``GET /v1/deepwell/sessions`` (every engine's
  ``Sessions`` RPC, merged) and prints one row per session: its key, tenant, where its cache
  lives (GPU resident / host / both), the tokens cached, the last turn's cached share and
  engine-side TTFT, its age, idle time and the bytes it holds. ``--watch`` refreshes it (the
  screen is cleared on a terminal; elsewhere tables follow one another), ``--json`` prints the
  endpoint's JSON (one document per refresh).
- ``deepwell stats`` puts the counters of each process on one screen: the gateway's and the
  engine's Prometheus ``/metrics`` (scraped over HTTP) and the KV-cache daemon's ``Stats`` RPC
  (``--daemon-address``, with ``--internal-token-file`` when the daemon requires the token);
  whatever is not given is skipped.

The ``deepwell`` package imports no service: HTTP goes through ``urllib``, the daemon through
the generated ``deepwell.kvcache.v1`` stubs. ``sessions_cli`` / ``stats_cli`` are the two
subcommands' modules (``deepwell.cli.COMMANDS``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:8000"
SESSIONS_PATH = "/v1/deepwell/sessions"
CLEAR = "\x1b[H\x1b[2J"


class OpsError(Exception):
    """A view could not be fetched; the message says why (printed as is)."""


# -- formatting ------------------------------------------------------------------------------
def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def human_duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def table(header: list[str], rows: list[list[str]], right: Iterable[int] = ()) -> str:
    """Columns padded to their widest cell; columns in ``right`` are right-aligned."""
    right = set(right)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = []
    for row in [header, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# -- HTTP ------------------------------------------------------------------------------------
def http_get(url: str, api_key: str = "", timeout: float = 10.0) -> bytes:
    """The body of a 200 answer; ``OpsError`` naming the status and the server's message else."""
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body.decode(errors="replace")[:300] or exc.reason
        raise OpsError(f"{url}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OpsError(f"cannot reach {url}: {reason}") from None


# -- deepwell sessions -----------------------------------------------------------------------
WHERE = {"resident": "GPU", "host": "host", "both": "GPU+host", "none": "-"}


def fetch_sessions(url: str, api_key: str = "", timeout: float = 10.0, tenant: str = "") -> dict[str, Any]:
    target = url.rstrip("/") + SESSIONS_PATH
    if tenant:
        target += "?" + urllib.parse.urlencode({"tenant": tenant})
    try:
        data = json.loads(http_get(target, api_key, timeout))
    except ValueError as exc:
        raise OpsError(f"{target}: not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise OpsError(f"{target}: unexpected answer (not a sessions list)")
    return data


def sessions_table(data: dict[str, Any]) -> str:
    rows = data.get("data", [])
    engines = data.get("engines", [])
    several = len({r.get("engine") for r in rows}) > 1 or len(engines) > 1
    header = ["SESSION", "TENANT", "WHERE", "CACHED", "LAST %", "TTFT ms", "AGE", "IDLE", "BYTES"]
    if several:
        header.append("ENGINE")
    out = []
    for r in rows:
        turn = r.get("last_turn") or {}
        last = f"{100 * turn['cached_fraction']:.1f}" if turn else "-"
        ttft = f"{turn['ttft_ms']:.1f}" if turn and turn.get("ttft_ms") else "-"
        session = r.get("session") or r.get("session_key", "")
        if r.get("requests_running"):
            session += " *"  # a request runs now
        row = [session, r.get("tenant", ""), WHERE.get(r.get("placement", "none"), "-"),
               str(r.get("cached_tokens", 0)), last, ttft, human_duration(r.get("age_s")),
               human_duration(r.get("idle_s")), human_bytes(r.get("bytes", 0))]
        if several:
            row.append(str(r.get("engine", "")))
        out.append(row)
    text = table(header, out, right=(3, 4, 5, 6, 7, 8)) if out else "no sessions"
    notes = [f"engine {e['address']}: {e.get('error')}" for e in engines if not e.get("ok", True)]
    return "\n".join([text, *notes])


def _sessions_configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("DEEPWELL_URL", DEFAULT_URL),
                        help=f"gateway URL [env DEEPWELL_URL; default: {DEFAULT_URL}]")
    parser.add_argument("--api-key", default=os.environ.get("DEEPWELL_API_KEY", ""),
                        help="an admin API key, when the gateway has API keys (--admin-keys) [env DEEPWELL_API_KEY]")
    parser.add_argument("--tenant", default="", help="only this tenant's sessions (default: every tenant)")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--count", type=int, default=0, metavar="N",
                        help="with --watch: stop after N refreshes (0 = until Ctrl-C)")
    parser.add_argument("--json", action="store_true", help="print the endpoint's JSON (one line per refresh "
                                                            "with --watch)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the gateway")


def _sessions_run(args: argparse.Namespace, out: TextIO | None = None,
                  sleep: Callable[[float], None] = time.sleep) -> int:
    out = out or sys.stdout
    if args.watch is not None and not args.watch > 0:
        print("deepwell sessions: --watch takes a number of seconds > 0", file=sys.stderr)
        return 2
    tty = out.isatty()
    shown = 0
    try:
        while True:
            try:
                data = fetch_sessions(args.url, args.api_key, args.timeout, args.tenant)
                error = None
            except OpsError as exc:
                data, error = None, str(exc)
            if args.watch is None:
                if error is not None:
                    print(f"deepwell sessions: {error}", file=sys.stderr)
                    return 1
                print(json.dumps(data, indent=2) if args.json else sessions_table(data), file=out)
                return 0
            if args.json:
                print(json.dumps(data if error is None else {"error": error}), file=out, flush=True)
            else:
                stamp = time.strftime("%H:%M:%S")
                head = f"deepwell sessions  {args.url}  {stamp}  (every {args.watch:g}s, Ctrl-C to stop)"
                body = f"error: {error}" if error is not None else sessions_table(data)  # type: ignore[arg-type]
                print((CLEAR if tty else "") + head + "\n" + body + ("" if tty else "\n"), file=out, flush=True)
            shown += 1
            if args.count and shown >= args.count:
                return 0
            sleep(args.watch)
    except KeyboardInterrupt:
        return 0


# -- deepwell stats --------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict[str, str], float]


def parse_metrics(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition: (name, labels, value)."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(3) or "")}
        out.append((m.group(1), labels, value))
    return out


class Metrics:
    """Sums over a scrape's samples."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def total(self, name: str, **match: str) -> float:
        return sum(v for n, labels, v in self.samples
                   if n == name and all(labels.get(k) == w for k, w in match.items()))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, labels, v in self.samples:
            if n == name and label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out

    def mean_ms(self, histogram: str) -> float | None:
        count = self.total(histogram + "_count")
        return 1000 * self.total(histogram + "_sum") / count if count else None

    def has(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n, _, _ in self.samples)


def _num(v: float) -> int | float:
    return int(v) if math.isfinite(v) and v == int(v) else round(v, 4)


def _nums(d: dict[str, float]) -> dict[str, int | float]:
    return {k: _num(v) for k, v in sorted(d.items())}


def gateway_figures(m: Metrics) -> dict[str, Any]:
    by_status = m.by("deepwell_gateway_requests_total", "status")
    classes = {"2xx": 0.0, "4xx": 0.0, "5xx": 0.0}
    for status, n in by_status.items():
        key = f"{status[:1]}xx"
        classes[key] = classes.get(key, 0.0) + n
    tokens = m.by("deepwell_gateway_tokens_total", "kind")
    return {
        "requests": _nums(classes), "requests_by_status": _nums(by_status), "tokens": _nums(tokens),
        "ttft_mean_ms": m.mean_ms("deepwell_gateway_ttft_seconds"),
        "ttft_count": _num(m.total("deepwell_gateway_ttft_seconds_count")),
        "streams_open": _num(m.total("deepwell_gateway_active_streams")),
        "engines_healthy": _num(m.total("deepwell_gateway_engines_healthy")),
        "tool_parse": _nums(m.by("deepwell_gateway_tool_parse_total", "outcome")),
    }


def engine_figures(m: Metrics) -> dict[str, Any]:
    e = "deepwell_engine_"
    return {
        "requests": {"running": _num(m.total(e + "requests_running")), "waiting": _num(m.total(e + "requests_waiting")),
                     "finished": _nums(m.by(e + "requests_finished_total", "reason"))},
        "tokens": {"prefilled": _num(m.total(e + "tokens_prefilled_total")),
                   "decoded": _num(m.total(e + "tokens_decoded_total"))},
        "ttft_mean_ms": m.mean_ms(e + "time_to_first_token_seconds"),
        "cache_hit_tokens": _nums(m.by(e + "cache_hit_tokens_total", "level")),
        "cache_lookups": _nums(m.by(e + "cache_lookups_total", "result")),
        "kv_pages": {"used": _num(m.total(e + "kv_pages_used")), "total": _num(m.total(e + "kv_pages_total"))},
        "state_slots": {"used": _num(m.total(e + "state_slots_used")), "total": _num(m.total(e + "state_slots_total"))},
        "cache_resident": {"entries": _num(m.total(e + "cache_entries", tier="resident")),
                           "bytes": _num(m.total(e + "cache_bytes", tier="resident"))},
        "entries_created": _nums(m.by(e + "cache_entries_created_total", "kind")),
        "evictions": _nums(m.by(e + "cache_evictions_total", "cause")),
        "spills": _nums({"ok": 0.0, "failed": 0.0, **m.by(e + "cache_spills_total", "result")}),
        "restores": _nums({"ok": 0.0, "failed": 0.0, **m.by(e + "cache_restores_total", "result")}),
        "copy_bytes": _nums(m.by(e + "cache_copy_bytes_total", "direction")),
    }


def scrape(url: str, timeout: float) -> Metrics:
    return Metrics(parse_metrics(http_get(url, timeout=timeout).decode("utf-8", errors="replace")))


def metrics_url(url: str) -> str:
    """A base URL gets ``/metrics``; a URL with a path is taken as it is."""
    parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    return urllib.parse.urlunsplit(parts._replace(path="/metrics")) if parts.path in ("", "/") else parts.geturl()


DAEMON_FIELDS = ("epoch", "arena_bytes", "budget_bytes", "committed_bytes", "reserved_bytes", "taken_bytes",
                 "free_bytes", "largest_free_run_bytes", "fragmentation", "entries", "evictions", "compactions",
                 "compaction_bytes_moved", "leases", "oldest_lease_age_s", "lookups", "hits")


def daemon_figures(address: str, token_file: str, timeout: float) -> dict[str, Any]:
    import grpc

    from deepwell import grpcx
    from deepwell.auth import TokenError, read_token_file
    from deepwell.kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc

    try:
        token = read_token_file(token_file) if token_file else ""
    except TokenError as exc:
        raise OpsError(str(exc)) from None
    try:
        with grpcx.sync_channel(address, token) as ch:
            reply = kvcache_pb2_grpc.KVCacheStub(ch).Stats(kvcache_pb2.StatsRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        raise OpsError(f"cannot reach the daemon at {address}: {exc.code().name} {exc.details()}") from None
    out: dict[str, Any] = {f: _num(float(getattr(reply, f))) for f in DAEMON_FIELDS}
    out["clients"] = len(reply.clients)
    return out


def gather_stats(url: str, engine_metrics: str, daemon_address: str, token_file: str,
                 timeout: float = 10.0) -> dict[str, Any]:
    """Each given source's figures, or ``{"source": ..., "error": ...}`` when it cannot be read."""
    out: dict[str, Any] = {}
    sources: list[tuple[str, str, Callable[[], dict[str, Any]]]] = []
    if url:
        sources.append(("gateway", metrics_url(url), lambda: gateway_figures(scrape(metrics_url(url), timeout))))
    if engine_metrics:
        src = metrics_url(engine_metrics)
        sources.append(("engine", src, lambda: engine_figures(scrape(src, timeout))))
    if daemon_address:
        sources.append(("daemon", daemon_address, lambda: daemon_figures(daemon_address, token_file, timeout)))
    for name, source, read in sources:
        try:
            out[name] = {"source": source, **read()}
        except OpsError as exc:
            out[name] = {"source": source, "error": str(exc)}
    return out


def _kv(d: dict[str, Any], fmt: Callable[[Any], str] = str) -> str:
    return "  ".join(f"{k} {fmt(v)}" for k, v in d.items()) or "-"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def stats_text(stats: dict[str, Any]) -> str:
    lines: list[str] = []

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<16}{text}")

    for name, figs in stats.items():
        lines.append(f"{name}  {figs['source']}")
        if "error" in figs:
            row("error", figs["error"])
            continue
        if name == "gateway":
            row("requests", _kv(figs["requests"]) + "   (" + _kv(figs["requests_by_status"]) + ")")
            tok = figs["tokens"]
            share = ""
            if tok.get("prompt"):
                share = f"   cached {100 * tok.get('cached', 0) / tok['prompt']:.1f}% of prompt"
            row("tokens", _kv(tok) + share)
            row("ttft", f"mean {_ms(figs['ttft_mean_ms'])} over {figs['ttft_count']}")
            row("streams", f"open {figs['streams_open']}   engines healthy {figs['engines_healthy']}")
            if figs["tool_parse"]:
                row("tool calls", _kv(figs["tool_parse"]))
        elif name == "engine":
            r = figs["requests"]
            row("requests", f"running {r['running']}  waiting {r['waiting']}  finished "
                            f"{_num(sum(r['finished'].values()))} ({_kv(r['finished'])})")
            row("tokens", _kv(figs["tokens"]))
            row("ttft", f"mean {_ms(figs['ttft_mean_ms'])}")
            hits = figs["cache_hit_tokens"]
            row("cache hits", _kv(hits) + f"   (tokens; lookups {_kv(figs['cache_lookups'])})")
            p, s = figs["kv_pages"], figs["state_slots"]
            row("pages / slots", f"kv pages {p['used']} / {p['total']}   state slots {s['used']} / {s['total']}")
            c = figs["cache_resident"]
            row("resident cache", f"entries {c['entries']}  bytes {human_bytes(c['bytes'])}   created "
                                  f"{_kv(figs['entries_created'])}")
            row("evictions", _kv(figs["evictions"]))
            row("spills", _kv(figs["spills"]) + f"   {human_bytes(figs['copy_bytes'].get('spill', 0))}")
            row("restores", _kv(figs["restores"]) + f"   {human_bytes(figs['copy_bytes'].get('restore', 0))}")
        elif name == "daemon":
            row("arena", f"size {human_bytes(figs['arena_bytes'])}  budget {human_bytes(figs['budget_bytes'])}  "
                         f"committed {human_bytes(figs['committed_bytes'])}  free {human_bytes(figs['free_bytes'])}  "
                         f"fragmentation {figs['fragmentation']:.2f}")
            row("entries", f"{figs['entries']}  lookups {figs['lookups']}  hits {figs['hits']}  "
                           f"evictions {figs['evictions']}")
            row("holdings", f"clients {figs['clients']}  leases {figs['leases']}  reserved "
                            f"{human_bytes(figs['reserved_bytes'])}  taken {human_bytes(figs['taken_bytes'])}")
    return "\n".join(lines) if lines else "nothing to show: give --url, --engine-metrics or --daemon-address"


def _stats_configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("DEEPWELL_URL", DEFAULT_URL),
                        help=f"gateway URL, whose /metrics is read ('' = skip) [env DEEPWELL_URL; default: "
                             f"{DEFAULT_URL}]")
    parser.add_argument("--engine-metrics", default=os.environ.get("DEEPWELL_ENGINE_METRICS_URL", ""), metavar="URL",
                        help="the engine's Prometheus URL (deepwell up: http://127.0.0.1:9101/metrics; '' = skip) "
                             "[env DEEPWELL_ENGINE_METRICS_URL]")
    parser.add_argument("--daemon-address", default=os.environ.get("DEEPWELL_KVCACHE_ADDRESS", ""), metavar="ADDR",
                        help="the KV-cache daemon's address (unix:///path or host:port; '' = skip) "
                             "[env DEEPWELL_KVCACHE_ADDRESS]")
    parser.add_argument("--internal-token-file", default=os.environ.get("DEEPWELL_INTERNAL_TOKEN_FILE", ""),
                        metavar="FILE", help="the internal token the daemon requires, if it does "
                                             "[env DEEPWELL_INTERNAL_TOKEN_FILE]")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each source")


def _stats_run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    stats = gather_stats(args.url, args.engine_metrics, args.daemon_address, args.internal_token_file, args.timeout)
    print(json.dumps(stats, indent=2) if args.json else stats_text(stats), file=out)
    if not stats:
        return 2
    return 1 if all("error" in figs for figs in stats.values()) else 0

