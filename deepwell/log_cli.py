"""``deepwell log summarize FILE``: the gateway's JSONL request log (``--request-log``) per session.

Requests are grouped by session (``session_hash``; a line from an older log without it is
grouped by the hash of its clear ``session``), requests without a session under
``(no session)``. Each session gets a turn table, in the order the turns started (finish
``ts`` minus ``total_ms``; log order where that is not known):

    TURN  STARTED  PROMPT  CACHED  CACHED %  LEVEL  TTFT ms  DECODE tok/s  RESTORE ms  FINISH

LEVEL is the reuse level that served the most cached tokens (``frontier``, ``checkpoint``,
``host``, ``session``, ``shared``: the engine's ``CacheHits`` levels), TTFT the gateway's
``ttft_ms``, decode tok/s ``completion_tokens / decode_ms * 1000`` (engine decode time, from its
first token to its end; ``-`` when ``decode_ms`` is 0), RESTORE ms the engine's time restoring
the prefix from the host tier; FINISH the finish reason (or the HTTP status of a request that
has none). A ``total`` row follows: turns, prompt and cached sums, mean TTFT, decode tok/s over
all its decode time, restore sum, finish reasons counted. Missing fields (older logs) show as
``-``; lines that are not JSON objects are counted, skipped and reported with their numbers;
blank lines are ignored. ``--session`` keeps one session (a hash or a prefix of one, a clear
namespaced key, or ``none``); ``--json`` prints the same as one JSON document.

``session_hash`` is the one definition of the log's session pseudonym (the gateway's
``gateway.accounting`` writes it). Spills are per cache entry and happen after a request ends,
so the log has no spill time: see the engine's ``deepwell_engine_cache_spill_seconds``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from deepwell.ops_cli import table

HELP = "read the gateway's JSONL request log: per-session turn tables (prompt, cached, TTFT, decode tok/s)"
DESCRIPTION = (
    "Tools for the gateway's JSONL request log (deepwell gateway --request-log, env "
    "DEEPWELL_GATEWAY_REQUEST_LOG). 'deepwell log summarize FILE' prints one turn table per session: "
    "prompt and cached tokens, the reuse level that served most, TTFT, decode tok/s, host-tier restore "
    "time and finish reason, with a total row."
)
SUMMARIZE_DESCRIPTION = (
    "Print one turn table per session of a gateway request log (grouped by session_hash; requests "
    "without a session under '(no session)'), in the order the turns started: turn, start time, prompt "
    "tokens, cached tokens and their share, the reuse level that served most (frontier, checkpoint, host, "
    "session, shared), TTFT ms (the gateway's), decode tok/s (completion_tokens / decode_ms), the engine's "
    "host-tier restore ms and the finish reason (or the HTTP status), then a total row (sums; mean TTFT; "
    "decode tok/s over all decode time; finish reasons counted). Fields an older log lacks show as '-'; "
    "lines that are not JSON objects are skipped and reported. Spill time is per cache entry, not per "
    "request: see the engine's Prometheus deepwell_engine_cache_spill_seconds."
)
NO_SESSION = "(no session)"
HASH_CHARS = 16
LEVELS = {"resident_frontier": "frontier", "resident_checkpoint": "checkpoint", "host_entry": "host",
          "session_lookup": "session", "shared_prefix": "shared"}
MALFORMED_SHOWN = 10  # line numbers of malformed lines listed in the report


def session_hash(key: str | None) -> str | None:
    """The request log's pseudonym of a namespaced session key: the first 16 hex digits of its
    SHA-256 (stable across processes and restarts); None without a key."""
    if not key:
        return None
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:HASH_CHARS]


# -- reading -----------------------------------------------------------------------------------
def _num(v: Any) -> float | None:
    """A finite number from a JSON value, else None (wrong types in a hand-edited or foreign log)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _int(v: Any) -> int | None:
    n = _num(v)
    return int(n) if n is not None else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


@dataclass
class Turn:
    line: int
    request_id: str | None
    endpoint: str | None
    status: int | None
    started: float | None  # unix seconds (ts - total_ms), else the finish ts
    prompt_tokens: int | None
    cached_tokens: int | None
    cached_by_level: dict[str, int]
    ttft_ms: float | None
    decode_ms: float | None
    completion_tokens: int | None
    restore_ms: float | None
    finish_reason: str | None
    number: int = 0

    @property
    def cached_fraction(self) -> float | None:
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens

    @property
    def level(self) -> str | None:
        """The level that served the most cached tokens (None: nothing cached)."""
        best = max(self.cached_by_level.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best is not None and best[1] > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        if not self.decode_ms or self.decode_ms <= 0 or self.completion_tokens is None:
            return None
        return self.completion_tokens / self.decode_ms * 1000.0


def parse_record(rec: dict[str, Any], line: int) -> Turn:
    """A log line as a turn; any field may be missing or of the wrong type."""
    cached = rec.get("cached_tokens")
    cached = cached if isinstance(cached, dict) else {}
    by_level = {k: n for k, v in cached.items() if k != "total" and (n := _int(v)) is not None}
    total = _int(cached.get("total"))
    if total is None and by_level:
        total = sum(by_level.values())
    timings = rec.get("timings")
    timings = timings if isinstance(timings, dict) else {}
    ts, total_ms = _num(rec.get("ts")), _num(timings.get("total_ms"))
    started = ts - total_ms / 1000.0 if ts is not None and total_ms is not None else ts
    ttft = _num(timings.get("ttft_ms"))
    if ttft is None:
        ttft = _num(timings.get("engine_ttft_ms"))
    return Turn(line=line, request_id=_str(rec.get("request_id")), endpoint=_str(rec.get("endpoint")),
                status=_int(rec.get("status")), started=started, prompt_tokens=_int(rec.get("prompt_tokens")),
                cached_tokens=total, cached_by_level=by_level, ttft_ms=ttft, decode_ms=_num(timings.get("decode_ms")),
                completion_tokens=_int(rec.get("completion_tokens")), restore_ms=_num(timings.get("restore_ms")),
                finish_reason=_str(rec.get("finish_reason")))


@dataclass
class Session:
    hash: str | None  # None: the requests without a session
    key: str | None = None  # the clear key, when the log has it (--request-log-session-keys)
    tenant: str | None = None
    turns: list[Turn] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.hash or NO_SESSION


@dataclass
class Summary:
    path: str
    lines: int = 0  # non-blank lines read
    malformed: list[int] = field(default_factory=list)  # their line numbers
    sessions: list[Session] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def summarize_lines(lines: Iterable[str], path: str = "") -> Summary:
    """Group a log's lines by session; never raises on content."""
    out = Summary(path)
    by_hash: dict[str | None, Session] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        out.lines += 1
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON; nested too deep for the parser
            rec = None
        if not isinstance(rec, dict):
            out.malformed.append(number)
            continue
        key = _str(rec.get("session"))
        h = _str(rec.get("session_hash")) or session_hash(key)
        s = by_hash.get(h)
        if s is None:
            s = by_hash[h] = Session(h)
            out.sessions.append(s)
        s.key = s.key or key
        if h is not None:  # a session is one tenant's; the requests without one may be any tenant's
            s.tenant = s.tenant or _str(rec.get("tenant"))
        s.turns.append(parse_record(rec, number))
    for s in out.sessions:
        if all(t.started is not None for t in s.turns):
            s.turns.sort(key=lambda t: (t.started, t.line))
        for i, t in enumerate(s.turns, start=1):
            t.number = i
    return out


def read_log(path: str) -> Summary:
    """``path`` ('-' = stdin) summarized; OSError when it cannot be opened."""
    if path == "-":
        return summarize_lines(sys.stdin, "-")
    with open(path, encoding="utf-8", errors="replace") as f:
        return summarize_lines(f, path)


def select(summary: Summary, wanted: str) -> list[Session]:
    """The sessions ``--session`` names: a hash or its prefix, a clear key, or ``none``."""
    w = wanted.strip()
    if w.lower() in ("none", NO_SESSION):
        return [s for s in summary.sessions if s.hash is None]
    by_key = session_hash(w)
    return [s for s in summary.sessions if s.hash is not None
            and (s.hash == by_key or s.key == w or s.hash.startswith(w.lower()))]


# -- totals and output -------------------------------------------------------------------------
def totals(s: Session) -> dict[str, Any]:
    turns = s.turns
    prompt = sum(t.prompt_tokens or 0 for t in turns)
    cached = sum(t.cached_tokens or 0 for t in turns)
    levels: dict[str, int] = {}
    for t in turns:
        for k, v in t.cached_by_level.items():
            levels[k] = levels.get(k, 0) + v
    level = max(levels.items(), key=lambda kv: kv[1], default=None)
    ttfts = [t.ttft_ms for t in turns if t.ttft_ms is not None]
    timed = [t for t in turns if t.decode_tok_s is not None]
    decode_ms = sum(t.decode_ms or 0.0 for t in timed)
    restores = [t.restore_ms for t in turns if t.restore_ms is not None]
    finishes: dict[str, int] = {}
    for t in turns:
        f = _finish(t)
        f = "unknown" if f == "-" else f
        finishes[f] = finishes.get(f, 0) + 1
    return {
        "turns": len(turns), "prompt_tokens": prompt, "cached_tokens": cached,
        "cached_fraction": cached / prompt if prompt else None,
        "level": level[0] if level is not None and level[1] > 0 else None,
        "ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None,
        "decode_tok_s": sum(t.completion_tokens or 0 for t in timed) / decode_ms * 1000.0 if decode_ms > 0 else None,
        "restore_ms": sum(restores) if restores else None,
        "finish": finishes,
    }


def _finish(t: Turn) -> str:
    if t.finish_reason:
        return t.finish_reason
    return f"HTTP {t.status}" if t.status is not None and t.status != 200 else "-"


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _i(v: int | None) -> str:
    return "-" if v is None else str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _clock(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%H:%M:%S", time.localtime(ts))


def _level(name: str | None) -> str:
    return "-" if name is None else LEVELS.get(name, name)


HEADER = ["TURN", "STARTED", "PROMPT", "CACHED", "CACHED %", "LEVEL", "TTFT ms", "DECODE tok/s", "RESTORE ms",
          "FINISH"]


def session_text(s: Session) -> str:
    starts = [t.started for t in s.turns if t.started is not None]
    head = f"session {s.name}"
    if s.key:
        head += f"  {s.key}"
    if s.tenant:
        head += f"  tenant {s.tenant}"
    head += f"  {len(s.turns)} turn{'s' if len(s.turns) != 1 else ''}"
    if starts:
        head += "  " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(min(starts)))
        if max(starts) != min(starts):
            head += f" .. {_clock(max(starts))}"
    rows = [[str(t.number), _clock(t.started), _i(t.prompt_tokens), _i(t.cached_tokens), _pct(t.cached_fraction),
             _level(t.level), _f(t.ttft_ms), _f(t.decode_tok_s), _f(t.restore_ms), _finish(t)] for t in s.turns]
    tot = totals(s)
    rows.append(["total", "", str(tot["prompt_tokens"]), str(tot["cached_tokens"]), _pct(tot["cached_fraction"]),
                 _level(tot["level"]), _f(tot["ttft_ms_mean"]), _f(tot["decode_tok_s"]), _f(tot["restore_ms"]),
                 ", ".join(f"{n} {k}" for k, n in sorted(tot["finish"].items(), key=lambda kv: (-kv[1], kv[0])))])
    body = table(HEADER, rows, right=(0, 2, 3, 4, 6, 7, 8))
    return head + "\n" + "\n".join("  " + line for line in body.splitlines())


def malformed_note(summary: Summary) -> str:
    shown = ", ".join(str(n) for n in summary.malformed[:MALFORMED_SHOWN])
    more = f" and {len(summary.malformed) - MALFORMED_SHOWN} more" if len(summary.malformed) > MALFORMED_SHOWN else ""
    s = "s" if len(summary.malformed) != 1 else ""
    return f"{len(summary.malformed)} malformed line{s} skipped (line{s} {shown}{more})"


def summary_text(summary: Summary, sessions: list[Session]) -> str:
    parts = [session_text(s) for s in sessions]
    n = len(summary.sessions)
    foot = f"{summary.requests} request{'s' if summary.requests != 1 else ''} in {n} session{'s' if n != 1 else ''}"
    if not n:
        foot = f"no requests in {summary.path}"
    if len(sessions) != n:
        foot += f" ({len(sessions)} shown)"
    if summary.malformed:
        foot += "; " + malformed_note(summary)
    parts.append(foot)
    return "\n\n".join(parts)


def summary_json(summary: Summary, sessions: list[Session]) -> dict[str, Any]:
    def turn(t: Turn) -> dict[str, Any]:
        return {"turn": t.number, "line": t.line, "request_id": t.request_id, "endpoint": t.endpoint,
                "status": t.status, "started": t.started, "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens, "cached_fraction": t.cached_fraction,
                "cached_by_level": t.cached_by_level, "level": t.level, "ttft_ms": t.ttft_ms,
                "decode_ms": t.decode_ms, "completion_tokens": t.completion_tokens, "decode_tok_s": t.decode_tok_s,
                "restore_ms": t.restore_ms, "finish_reason": t.finish_reason}

    return {
        "file": summary.path, "lines": summary.lines, "requests": summary.requests,
        "malformed": len(summary.malformed), "malformed_lines": summary.malformed,
        "sessions": [{"session_hash": s.hash, "session": s.key, "tenant": s.tenant,
                      "turns": [turn(t) for t in s.turns], "totals": totals(s)} for s in sessions],
    }


# -- the command -------------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(_log_parser=parser)
    sub = parser.add_subparsers(dest="log_command", metavar="<subcommand>")
    p = sub.add_parser("summarize", help="per-session turn tables of a request log",
                       description=SUMMARIZE_DESCRIPTION)
    p.add_argument("file", nargs="?", default=os.environ.get("DEEPWELL_GATEWAY_REQUEST_LOG", ""), metavar="FILE",
                   help="the JSONL request log ('-' = stdin) [default: env DEEPWELL_GATEWAY_REQUEST_LOG, the "
                        "gateway's own setting]")
    p.add_argument("--session", default="", metavar="HASH",
                   help="only this session: its session_hash (or a prefix of it), its clear namespaced key "
                        "('<tenant>/<key>'), or 'none' for the requests without a session")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if getattr(args, "log_command", None) != "summarize":
        args._log_parser.print_help(out)
        return 2
    if not args.file:
        print("deepwell log summarize: give FILE (or set DEEPWELL_GATEWAY_REQUEST_LOG)", file=sys.stderr)
        return 2
    try:
        summary = read_log(args.file)
    except OSError as exc:
        print(f"deepwell log summarize: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    sessions = select(summary, args.session) if args.session else summary.sessions
    if args.session and not sessions:
        print(f"deepwell log summarize: no session {args.session!r} in {args.file} "
              f"({len(summary.sessions)} sessions)", file=sys.stderr)
        return 1
    text = json.dumps(summary_json(summary, sessions), indent=2) if args.json else summary_text(summary, sessions)
    try:
        print(text, file=out, flush=True)
    except BrokenPipeError:  # deepwell log summarize FILE | head
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


__all__ = ["DESCRIPTION", "HELP", "Summary", "configure", "read_log", "run", "session_hash", "summarize_lines"]
