"""Configuration of the KV-cache daemon (frozen; flags ``--x`` and env ``DEEPWELL_KVCACHE_X``).

Invariants checked here: the arena is a whole number of granules, the budget fits the
arena, and the grace period is longer than any copy is expected to take (it must be
positive; operators size it above their worst copy time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepwell.configs import check

ENV_PREFIX = "KVCACHE"
DEFAULT_ADDRESS = "unix:///tmp/deepwell-kvcache.sock"
MiB = 1024 * 1024


@dataclass(frozen=True)
class DaemonConfig:
    address: str = field(default=DEFAULT_ADDRESS, metadata={"help": "gRPC listen address: unix:///path or host:port"})
    arena_path: str = field(default="/dev/shm/deepwell-kvcache.arena",
                            metadata={"help": "arena file (under /dev/shm, or any path for a file-backed arena)"})
    arena_bytes: int = field(default=4096 * MiB, metadata={"help": "arena size in bytes (multiple of granule_bytes)"})
    granule_bytes: int = field(default=2 * MiB, metadata={"help": "allocation unit in bytes (multiple of 4096)"})
    budget_bytes: int = field(default=0, metadata={"help": "charged-bytes budget; 0 = the whole arena"})
    max_extents_per_entry: int = field(default=16,
                                       metadata={"help": "allocations with more extents trigger compaction"})
    compaction_max_ms: float = field(default=50.0, metadata={"help": "time slice of one compaction pass (ms)"})
    lease_warn_s: float = field(default=60.0, metadata={"help": "log leases older than this (never revoked)"})
    grace_s: float = field(default=30.0,
                           metadata={"help": "seconds after a client's session closes before its holdings are reclaimed"})
    pin_quota_bytes: int = field(default=0, metadata={"help": "per-client pinned-bytes quota; 0 = unlimited"})
    index_page_tokens: int = field(default=64, metadata={"help": "tokens per shortlist digest page"})
    persist: bool = field(default=False,
                          metadata={"help": "journal committed entries so they survive a daemon restart"})
    journal_path: str = field(default="", metadata={"help": "index journal file; default <arena_path>.journal"})
    prefault: bool = field(default=True, metadata={"help": "touch every arena page at start"})
    internal_token_file: str = field(default="", metadata={
        "help": "file holding the internal token (mode 0600): every call but health checks must carry it "
                "('' = only the socket's file mode protects the daemon)"})
    metrics_address: str = field(default="", metadata={"help": "host:port for Prometheus /metrics; empty = off"})
    log_level: str = field(default="info", metadata={"help": "debug|info|warning|error"})
    op_cache_per_client: int = field(default=4096, metadata={"help": "remembered op ids per client (idempotency)"})

    def __post_init__(self) -> None:
        check(bool(self.address), "address", self.address, "must not be empty")
        check(bool(self.arena_path), "arena_path", self.arena_path, "must not be empty")
        check(self.granule_bytes > 0 and self.granule_bytes % 4096 == 0, "granule_bytes", self.granule_bytes,
              "must be a positive multiple of 4096")
        check(self.arena_bytes >= self.granule_bytes and self.arena_bytes % self.granule_bytes == 0,
              "arena_bytes", self.arena_bytes, "must be a positive multiple of granule_bytes")
        check(0 <= self.budget_bytes <= self.arena_bytes, "budget_bytes", self.budget_bytes,
              "must be between 0 (whole arena) and arena_bytes")
        check(self.max_extents_per_entry >= 1, "max_extents_per_entry", self.max_extents_per_entry, "must be >= 1")
        check(self.compaction_max_ms >= 0, "compaction_max_ms", self.compaction_max_ms, "must be >= 0")
        check(self.grace_s > 0, "grace_s", self.grace_s, "must be > 0 (longer than any copy)")
        check(self.lease_warn_s > 0, "lease_warn_s", self.lease_warn_s, "must be > 0")
        check(self.pin_quota_bytes >= 0, "pin_quota_bytes", self.pin_quota_bytes, "must be >= 0")
        check(self.index_page_tokens >= 1, "index_page_tokens", self.index_page_tokens, "must be >= 1")
        check(self.op_cache_per_client >= 1, "op_cache_per_client", self.op_cache_per_client, "must be >= 1")
        check(self.log_level in ("debug", "info", "warning", "error"), "log_level", self.log_level,
              "must be debug|info|warning|error")

    @property
    def effective_budget(self) -> int:
        return self.budget_bytes or self.arena_bytes

    @property
    def effective_journal_path(self) -> str:
        return self.journal_path or self.arena_path + ".journal"
