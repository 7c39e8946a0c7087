"""``deepwell stats``: the gateway's, engine's and daemon's counters on one screen (``deepwell.ops_cli``)."""

from __future__ import annotations

from deepwell.ops_cli import _stats_configure as configure
from deepwell.ops_cli import _stats_run as run

HELP = "print the gateway's, engine's and KV-cache daemon's key counters on one screen"
DESCRIPTION = (
    "Print key figures grouped by process: the gateway's and the engine's Prometheus /metrics (requests, "
    "tokens, TTFT, cache hits by level, KV pages and state slots, spills and restores) and the KV-cache "
    "daemon's Stats (arena bytes, entries, lookups). Sources not given are skipped."
)

__all__ = ["DESCRIPTION", "HELP", "configure", "run"]
