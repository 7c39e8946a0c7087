"""Prometheus metrics of the daemon (a private registry per server, so tests can run several).

Gauges mirror ``Core.stats()`` and are refreshed by the server's periodic task (the core
is only ever read on the event loop thread); counters and latency histograms are updated
per RPC.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .model import Snapshot

_GAUGES = (
    ("arena_bytes", "arena size"), ("budget_bytes", "charged-bytes budget"),
    ("committed_bytes", "bytes of committed entries"), ("reserved_bytes", "bytes under reservation"),
    ("taken_bytes", "bytes of taken entries"), ("free_bytes", "free arena bytes"),
    ("largest_free_run_bytes", "largest contiguous free run"), ("fragmentation", "1 - largest free run / free"),
    ("entries", "matchable entries"), ("leases", "live leases"), ("oldest_lease_age_s", "age of the oldest lease"),
)
_TOTALS = (("evictions", "entries evicted"), ("compactions", "compaction passes that moved entries"),
           ("compaction_bytes_moved", "bytes moved by compaction"), ("lookups", "lookups"), ("hits", "lookup hits"))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = Counter("deepwell_kvcache_rpcs", "RPCs by method and result code", ["method", "code"],
                            registry=self.registry)
        self.latency = Histogram("deepwell_kvcache_rpc_seconds", "RPC handling time", ["method"],
                                 registry=self.registry,
                                 buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0))
        self.reclaims = Counter("deepwell_kvcache_client_reclaims", "clients reclaimed after grace",
                                registry=self.registry)
        self.gauges = {name: Gauge(f"deepwell_kvcache_{name}", doc, registry=self.registry) for name, doc in _GAUGES}
        self.totals = {name: Gauge(f"deepwell_kvcache_{name}_total", doc, registry=self.registry)
                       for name, doc in _TOTALS}
        self.clients = Gauge("deepwell_kvcache_clients", "known clients (attached or in grace)", registry=self.registry)

    def update(self, snap: Snapshot) -> None:
        for name, g in self.gauges.items():
            g.set(getattr(snap, name))
        for name, g in self.totals.items():
            g.set(getattr(snap, name))
        self.clients.set(len(snap.clients))
