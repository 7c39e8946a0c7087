"""Prometheus metrics of the engine, served over HTTP at ``/metrics``.

Each ``EngineMetrics`` has its own ``CollectorRegistry`` (several engines in one test
process never collide). It is the engine's ``StepObserver``: gauges are set from the
engine snapshot after every step, counters advance by the step's prefilled / decoded
tokens, and TTFT / inter-token latency go to histograms (seconds).

A quantized KV cache's start-up calibration (``set_kv_calibration``) sets
``deepwell_engine_kv_scale_blocks{kv="k|v",kind="zero|subnormal|saturated|total"}`` (block
scales - fp8: elements - of the calibration K/V under the calibrated global scales) and
``deepwell_engine_kv_global_scale{kv="k|v",stat="min|max"}`` (over layers and KV heads) and
``deepwell_engine_kv_k_centering{stat="channels|energy_removed"}`` (K centering: channels
centered per head, 0 when off, and the share of the calibration K's energy it removed) and
``deepwell_engine_kv_k_rounding{mode="nearest|feedback"}`` (1 for the rounding of K the cache
uses, ``--kv-k-rounding``; 0 for the other) and ``deepwell_engine_kv_k_rotated_layers{rotation="whole|16-blocks|none"}``
(attention layers whose K is Hadamard-rotated as a whole, per 16-element block, or not at all,
``--kv-hadamard``; with ``layer`` the calibration's choice). On a GPU the start-up check of the KV
kernels (``set_kv_kernel_check``, ``kv.selfcheck``) sets ``deepwell_engine_kv_append_kernel{kernel="gluon|triton"}``
(1 for the append serving: triton after a fallback), ``deepwell_engine_kv_decode_kernel{kernel}``
(the same for decode attention) and
``deepwell_engine_kv_kernel_check_error{kind="decode|prefill"}`` (the largest relative L2 error against the reference).
While serving, ``deepwell_engine_kv_served_scales_total{kv="k|v",kind="zero|subnormal|saturated|total"}``
counts the block scales (fp8: elements, int8: token scales) of every K/V the quantized cache
stored (read from the device at most once a second): a growing saturated or subnormal share
means the calibrated global scales do not fit the traffic (int8: saturated rows had values
beyond +-1905, clamped there).

The prefix cache (``engine_service.cache``): ``deepwell_engine_cache_hit_tokens_total{level}``
(prompt tokens served from each reuse level instead of computed: resident_frontier,
resident_checkpoint, host_entry, session_lookup, shared_prefix),
``deepwell_engine_cache_lookups_total{result="hit|miss"}``,
``deepwell_engine_cache_entries{tier="resident"}`` and ``deepwell_engine_cache_bytes{tier="resident"}``
(entries kept on the device and the page and state-slot bytes only they hold),
``deepwell_engine_cache_entries_created_total{kind="exec|turn|prefix"}`` (ended sequences, turn
checkpoints, shared-prefix checkpoints), ``deepwell_engine_cache_checkpoints_skipped_total`` (no
state slot for the image) and ``deepwell_engine_cache_evictions_total{cause="pressure|superseded|chain"}``
(memory needed; a longer entry of the same conversation made it redundant; an older checkpoint
of a conversation's chain). With the host tier (``--kv-daemon``):
``deepwell_engine_cache_spills_total{result="ok|failed"}`` and ``..._restores_total{result}``,
``deepwell_engine_cache_copy_bytes_total{direction="spill|restore"}``, and the latency histograms
``deepwell_engine_cache_spill_seconds`` / ``deepwell_engine_cache_restore_seconds`` (Reserve or
Lookup to Commit or Release, copies included). The host tier's entries and bytes are the daemon's
own metrics (``deepwell kvcache --metrics-address``).

Speculative decoding (MTP, ``--speculative-tokens``): ``deepwell_engine_spec_draft_tokens_total``
and ``deepwell_engine_spec_accepted_tokens_total`` (their ratio is the acceptance rate) and the
histogram ``deepwell_engine_spec_accepted_per_round`` (drafts accepted per verify step; each
step also yields one token of the model's own).

CUDA graphs (``--cuda-graphs``): ``deepwell_engine_cuda_graph_buckets{which="count|largest"}`` (the
decode batch sizes captured; 0 where decode runs eagerly) and
``deepwell_engine_cuda_graph_memory_bytes`` (what the capture took).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from deepwell.engine_service.engine import Snapshot, StepObserver

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COPY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class EngineMetrics(StepObserver):
    def __init__(self, model: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model"]
        self.running = Gauge("deepwell_engine_requests_running", "Requests being computed", labels, registry=r)
        self.waiting = Gauge("deepwell_engine_requests_waiting", "Requests queued", labels, registry=r)
        self.pages_used = Gauge("deepwell_engine_kv_pages_used", "KV pages in use", labels, registry=r)
        self.pages_total = Gauge("deepwell_engine_kv_pages_total", "KV pages in the pool", labels, registry=r)
        self.slots_used = Gauge("deepwell_engine_state_slots_used", "Recurrent-state slots in use", labels,
                                registry=r)
        self.slots_total = Gauge("deepwell_engine_state_slots_total", "Recurrent-state slots", labels, registry=r)
        self.prefilled = Counter("deepwell_engine_tokens_prefilled", "Prompt tokens computed", labels, registry=r)
        self.decoded = Counter("deepwell_engine_tokens_decoded", "Tokens generated", labels, registry=r)
        self.finished = Counter("deepwell_engine_requests_finished", "Requests finished", labels + ["reason"],
                                registry=r)
        self.ttft = Histogram("deepwell_engine_time_to_first_token_seconds", "Arrival to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("deepwell_engine_inter_token_latency_seconds", "Gap between a request's tokens",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_scale_blocks = Gauge("deepwell_engine_kv_scale_blocks",
                                     "Quantized-KV block scales of the start-up calibration K/V, by kind",
                                     labels + ["kv", "kind"], registry=r)
        self.kv_global_scale = Gauge("deepwell_engine_kv_global_scale",
                                     "Calibrated KV global scales (power of two), min/max over layers and heads",
                                     labels + ["kv", "stat"], registry=r)
        self.kv_k_centering = Gauge("deepwell_engine_kv_k_centering",
                                    "K centering of the start-up calibration: channels centered per head "
                                    "(stat=channels) and the share of the calibration K's energy removed "
                                    "(stat=energy_removed)", labels + ["stat"], registry=r)
        self.kv_k_rounding = Gauge("deepwell_engine_kv_k_rounding",
                                   "Rounding of K in the quantized cache: 1 for the mode in use (nearest, or "
                                   "feedback: query-weighted), 0 for the other", labels + ["mode"], registry=r)
        self.kv_k_rotated = Gauge("deepwell_engine_kv_k_rotated_layers",
                                  "Attention layers of the quantized cache whose K is Hadamard-rotated as a "
                                  "whole, per 16-element block, or not", labels + ["rotation"], registry=r)
        self.kv_append_kernel = Gauge("deepwell_engine_kv_append_kernel",
                                      "KV append kernel serving after the start-up check: 1 for the one in use "
                                      "(gluon, triton; triton after a fallback)", labels + ["kernel"], registry=r)
        self.kv_decode_kernel = Gauge("deepwell_engine_kv_decode_kernel",
                                      "KV decode attention kernel serving after the start-up check: 1 for the one "
                                      "in use (gluon, triton; triton after a fallback)", labels + ["kernel"],
                                      registry=r)
        self.kv_check_error = Gauge("deepwell_engine_kv_kernel_check_error",
                                    "Largest relative L2 error of the start-up check's attention against the "
                                    "reference, by kind", labels + ["kind"], registry=r)
        self.graph_buckets = Gauge("deepwell_engine_cuda_graph_buckets",
                                   "Decode batch sizes captured as CUDA graphs (--cuda-graphs; 0: eager decode), "
                                   "by which: count, or the largest", labels + ["which"], registry=r)
        self.graph_memory = Gauge("deepwell_engine_cuda_graph_memory_bytes", "Device memory the captured decode "
                                  "graphs took at start-up", labels, registry=r)
        self.kv_served_scales = Counter("deepwell_engine_kv_served_scales",
                                        "Block scales (fp8: elements) of the K/V stored in the quantized cache, "
                                        "by kind", labels + ["kv", "kind"], registry=r)
        self._served_seen: dict[tuple[str, str], int] = {}
        self.cache_hit_tokens = Counter("deepwell_engine_cache_hit_tokens", "Prompt tokens served from the prefix "
                                        "cache instead of computed, by reuse level", labels + ["level"], registry=r)
        self.cache_lookups = Counter("deepwell_engine_cache_lookups", "Prefix-cache lookups at admission, by result",
                                     labels + ["result"], registry=r)
        self.cache_entries = Gauge("deepwell_engine_cache_entries", "Prefix-cache entries, by tier",
                                   labels + ["tier"], registry=r)
        self.cache_bytes = Gauge("deepwell_engine_cache_bytes", "Bytes only prefix-cache entries hold (KV pages "
                                 "and state images), by tier", labels + ["tier"], registry=r)
        self.cache_created = Counter("deepwell_engine_cache_entries_created", "Prefix-cache entries created, by "
                                     "kind (exec: an ended sequence; turn / prefix: a checkpoint)",
                                     labels + ["kind"], registry=r)
        self.cache_skipped = Counter("deepwell_engine_cache_checkpoints_skipped", "Checkpoints not kept: no state "
                                     "slot for the image", labels, registry=r)
        self.cache_evictions = Counter("deepwell_engine_cache_evictions", "Prefix-cache entries dropped, by cause",
                                       labels + ["cause"], registry=r)
        self._totals: dict[tuple[str, ...], float] = {}
        self.cache_copies = {kind: Counter(f"deepwell_engine_cache_{kind}s", f"Host-tier {kind}s, by result",
                                           labels + ["result"], registry=r) for kind in ("spill", "restore")}
        self.cache_copy_bytes = Counter("deepwell_engine_cache_copy_bytes", "Bytes moved between the device and "
                                        "the host tier, by direction", labels + ["direction"], registry=r)
        self.cache_copy_seconds = {kind: Histogram(f"deepwell_engine_cache_{kind}_seconds",
                                                   f"Host-tier {kind} latency (RPCs and copies)", labels,
                                                   buckets=_COPY_BUCKETS, registry=r)
                                   for kind in ("spill", "restore")}
        self.spec_drafted = Counter("deepwell_engine_spec_draft_tokens", "Speculative decoding: draft tokens verified",
                                    labels, registry=r)
        self.spec_accepted = Counter("deepwell_engine_spec_accepted_tokens", "Speculative decoding: draft tokens "
                                     "accepted", labels, registry=r)
        self.spec_per_round = Histogram("deepwell_engine_spec_accepted_per_round", "Speculative decoding: draft "
                                        "tokens accepted per verify step of one request", labels,
                                        buckets=tuple(range(16)), registry=r)
        for metric in (self.spec_drafted, self.spec_accepted, self.spec_per_round):
            metric.labels(model)  # exported (at 0) from the start, speculating or not: the dashboard's series
        self.model = model
        self._server: Any = None

    def set_kv_calibration(self, cal: Any) -> None:
        """Export a ``kv.calibration.KVCalibration``."""
        m = self.model
        for kv, counts in ((0, cal.k), (1, cal.v)):
            name = "kv"[kv]
            for kind, value in (("zero", counts.zero), ("subnormal", counts.subnormal),
                                ("saturated", counts.saturated), ("total", counts.blocks)):
                self.kv_scale_blocks.labels(m, name, kind).set(value)
            lo, hi = cal.scale_range(kv)
            self.kv_global_scale.labels(m, name, "min").set(lo)
            self.kv_global_scale.labels(m, name, "max").set(hi)
        self.kv_k_centering.labels(m, "channels").set(cal.centered_channels)
        self.kv_k_centering.labels(m, "energy_removed").set(cal.k_energy_removed)
        feedback = cal.k_feedback is not None
        self.kv_k_rounding.labels(m, "feedback").set(int(feedback))
        self.kv_k_rounding.labels(m, "nearest").set(int(not feedback))
        whole = len(cal.hadamard) - cal.layers_rotated(16) - cal.layers_rotated(0)
        for name, count in (("whole", whole), ("16-blocks", cal.layers_rotated(16)), ("none", cal.layers_rotated(0))):
            self.kv_k_rotated.labels(m, name).set(count)

    def set_kv_kernel_check(self, check: Any) -> None:
        """Export a ``kv.selfcheck.KVKernelCheck`` (the start-up check of the device's KV kernels)."""
        m = self.model
        for kernel in ("gluon", "triton"):
            self.kv_append_kernel.labels(m, kernel).set(int(check.append_kernel == kernel))
            self.kv_decode_kernel.labels(m, kernel).set(int(check.decode_kernel == kernel))
        self.kv_check_error.labels(m, "decode").set(check.decode_error)
        self.kv_check_error.labels(m, "prefill").set(check.prefill_error)

    def set_cuda_graphs(self, graphs: Any) -> None:
        """Export the runner's ``graphs.DecodeGraphs`` (None: decode runs eagerly)."""
        m = self.model
        info = graphs.describe() if graphs is not None else {"captured": [], "memory_mib": 0}
        self.graph_buckets.labels(m, "count").set(len(info["captured"]))
        self.graph_buckets.labels(m, "largest").set(max(info["captured"], default=0))
        self.graph_memory.labels(m).set(info["memory_mib"] * 2**20)

    def on_kv_scales(self, k: Any, v: Any) -> None:
        """Advance the served block-scale counters to the totals ``k``, ``v`` (``ScaleCounts``)."""
        for name, counts in (("k", k), ("v", v)):
            for kind, total in (("zero", counts.zero), ("subnormal", counts.subnormal),
                                ("saturated", counts.saturated), ("total", counts.blocks)):
                delta = total - self._served_seen.get((name, kind), 0)
                if delta > 0:
                    self.kv_served_scales.labels(self.model, name, kind).inc(delta)
                    self._served_seen[(name, kind)] = total

    def on_step(self, snap: Snapshot, prefilled: int, decoded: int) -> None:
        m = self.model
        self.running.labels(m).set(snap.requests_running)
        self.waiting.labels(m).set(snap.requests_waiting)
        self.pages_used.labels(m).set(snap.kv_pages_used)
        self.pages_total.labels(m).set(snap.kv_pages_total)
        self.slots_used.labels(m).set(snap.state_slots_used)
        self.slots_total.labels(m).set(snap.state_slots_total)
        if prefilled:
            self.prefilled.labels(m).inc(prefilled)
        if decoded:
            self.decoded.labels(m).inc(decoded)
        c = snap.cache
        if c is not None:
            self.cache_entries.labels(m, "resident").set(snap.cache_entries)
            self.cache_bytes.labels(m, "resident").set(snap.cache_bytes)
            for level, n in c.hit_tokens.items():
                self._advance(self.cache_hit_tokens, n, level)
            self._advance(self.cache_lookups, c.hits, "hit")
            self._advance(self.cache_lookups, c.lookups - c.hits, "miss")
            for kind, n in c.inserted.items():
                self._advance(self.cache_created, n, kind)
            for cause, n in c.evictions.items():
                self._advance(self.cache_evictions, n, cause)
            self._advance(self.cache_skipped, c.checkpoints_skipped)

    def on_host_copy(self, kind: str, seconds: float, nbytes: int, ok: bool) -> None:
        self.cache_copies[kind].labels(self.model, "ok" if ok else "failed").inc()
        if ok:
            self.cache_copy_bytes.labels(self.model, kind).inc(nbytes)
            self.cache_copy_seconds[kind].labels(self.model).observe(seconds)

    def _advance(self, counter: Counter, total: float, *labels: str) -> None:
        """Move ``counter{labels}`` up to the running ``total`` the engine keeps."""
        key = (str(id(counter)), *labels)
        delta = total - self._totals.get(key, 0)
        child = counter.labels(self.model, *labels)
        if delta > 0:
            child.inc(delta)
            self._totals[key] = total

    def on_spec_round(self, drafted: int, accepted: int) -> None:
        self.spec_drafted.labels(self.model).inc(drafted)
        self.spec_accepted.labels(self.model).inc(accepted)
        self.spec_per_round.labels(self.model).observe(accepted)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self.model).observe(ttft_s)

    def on_token_gap(self, gap_s: float) -> None:
        self.itl.labels(self.model).observe(gap_s)

    def on_finished(self, reason: str) -> None:
        self.finished.labels(self.model, reason).inc()

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP server on a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
