"""Opt-in JSONL request log: one line per finished request, never any prompt text.

Fields: ``ts`` (unix seconds at finish), ``request_id``, ``tenant``, ``session`` (the
namespaced session key ``<tenant>/<key>`` in clear, only with ``--request-log-session-keys``;
else null), ``session_hash`` (``deepwell.log_cli.session_hash`` of that key: the first 16 hex
digits of its SHA-256, the same for every request of the session and across restarts; null
without a session), ``endpoint``, ``status`` (HTTP-style code), ``engine``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (a dict per reuse level plus
``total``), ``timings`` (gateway ``ttft_ms`` / ``total_ms`` and the engine's
``queue_ms`` / ``prefill_ms`` / ``decode_ms`` / ``engine_ttft_ms`` / ``restore_ms``: the time
the request spent restoring its prefix from the host tier, out of every step, 0 without one;
a first admission's restore is neither queue nor prefill time), ``finish_reason``, ``tool_parse``
(``ok`` | ``failure`` | ``none``), ``tool_parse_reasons`` and ``tool_format`` (how the
request's tools reached the prompt: ``template``, ``generic_hermes`` for a template that
ignores tools, null without tools), ``speculative`` (the engine's MTP ``draft_tokens`` and
``accepted_tokens`` for the request; empty when it ended before the engine reported). Writes are line-atomic
(one ``write`` of a full line on an append-mode file) and serialized by a lock.

The session hash is a pseudonym, not a secret: it lets a log be shipped elsewhere and still be
grouped by session (``deepwell log summarize``), and whoever knows a key can compute its hash to
find it; a guessable key (an OpenAI ``user`` that is an e-mail address) can be confirmed the same
way. Spills have no per-request time (they happen after a request ends, per cache entry): their
latency is the engine's Prometheus ``deepwell_engine_cache_spill_seconds``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from deepwell.log_cli import session_hash

CACHE_LEVELS = ("resident_frontier", "resident_checkpoint", "host_entry", "session_lookup", "shared_prefix")


@dataclass
class RequestRecord:
    request_id: str
    tenant: str
    endpoint: str
    session: str | None = None  # in clear only with --request-log-session-keys
    session_hash: str | None = None
    status: int = 200
    engine: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None
    tool_parse: str = "none"
    tool_parse_reasons: list[str] = field(default_factory=list)
    tool_format: str | None = None
    speculative: dict[str, int] = field(default_factory=dict)  # draft_tokens / accepted_tokens (MTP)


__all__ = ["CACHE_LEVELS", "RequestLog", "RequestRecord", "session_hash"]


class RequestLog:
    """Appends ``RequestRecord`` lines to ``path``; a no-op when ``path`` is empty."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, record: RequestRecord) -> None:
        if self._file is None:
            return
        payload: dict[str, Any] = {"ts": round(time.time(), 3), **asdict(record)}
        line = json.dumps(payload, separators=(",", ":"), ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
