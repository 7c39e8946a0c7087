"""Decode steps as CUDA graphs: one captured graph per batch bucket, replayed per step.

A decode step (every slice one new token) launches thousands of small kernels; replaying a
captured graph launches them as one. The graphs read every per-step input from persistent
device buffers (``StaticInputs``) that ``load`` fills before each replay, the way nano-vllm's
and vLLM's model runners do it:

- token ids, positions, KV rows (``page * page_size + offset``) ``[max_batch]``;
- block tables ``[max_batch, max_pages]`` int32 (``max_pages`` covers the served context, so a
  sequence never outgrows its graph) and context lengths ``[max_batch]`` int32;
- state slots ``[max_batch]`` (hybrid models).

A batch of ``n`` sequences runs the smallest bucket ``b >= n`` (buckets 1, 2, 4, 8, ... up to
``max_batch``). Rows ``n..b-1`` are padding: they read and write one *scratch* KV page and one
scratch state slot that the runner allocates beyond the pools the scheduler manages, so a
padded row never touches a real sequence. The graph computes logits for every row; the caller
takes the first ``n``.

Eligible steps (``accepts``): at most ``max_batch`` slices, each exactly one token at a
position >= 1 (position 0 is a sequence's first token: the quantized append rounds that key
differently, see ``kv.quant_pool.append_tokens``), no speculative verify slice and no
``all_logits``. Everything else (prefill chunks, verify rounds, scoring) runs eagerly.

The attention kernels take a fixed split count and derive everything else from the
context lengths on the device (``kernels.backend``: "graph-capturable"); GDN decode runs fla's
fused recurrent kernel over gathered states. Capture runs each bucket twice eagerly on the
capture stream first (Triton compilation and autotuning, lazily built device constants), then
captures into one memory pool shared by all buckets (largest first). ``check`` replays the
smallest bucket against the same step run eagerly, from the same scratch state, and must agree
bit for bit: a graph that read a stale pointer would not.

Without capture (``capture=False``, the CPU tests) ``run`` executes the same static-buffer
forward eagerly: the loading and padding logic is the same code on every device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepwell.engine_service.layers.context import DecodeGroup, PageTables, SeqInfo, StepContext
from deepwell.engine_service.runner_api import ForwardBatch
from deepwell.logs import get_logger

if TYPE_CHECKING:
    from deepwell.engine_service.runner import TorchModelRunner

log = get_logger(__name__)

MAX_GRAPH_BATCH = 128  # the largest bucket captured when the engine's concurrency is higher
# replayed vs eager logits of the start-up check, relative to the largest logit: the same kernels
# on the same inputs agree exactly; a graph reading a stale buffer would be far off
CHECK_TOLERANCE = 1e-3


def reserve_bytes(args: Any, spec: Any, max_batch: int, dtype: torch.dtype) -> int:
    """What the graphs take beside the pools, reserved before the KV pool is sized: the scratch
    page and slot, and the captured steps' activations (one shared pool, the largest bucket's
    peak), estimated per row as the logits (fp32 and the LM head's own dtype), 32 buffers of the
    widest projection in fp32 and the attention's split-K partials (64 splits, fp32). Logged
    beside what the capture measured (``cuda_graphs``: ``memory_mib``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    widths = [args.hidden, args.intermediate, args.attention.num_heads * args.attention.head_dim * 2]
    if args.gdn is not None:
        widths.append(args.gdn.conv_dim + args.gdn.value_dim)
    per_row = args.vocab_size * (4 + elem) + 32 * max(widths) * 4 + args.attention.num_heads * 64 * args.attention.head_dim * 4
    return spec.bytes_per_page + spec.bytes_per_state_slot + max_batch * per_row


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself: (1, 2, 4, ..., max_batch)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


@dataclass(frozen=True)
class Scratch:
    """Where padded rows read and write: a KV page and a state slot no sequence owns."""

    page: int  # -1: no KV pool
    slot: int  # -1: no state pool


class StaticInputs:
    """The persistent device buffers every captured graph reads, and their host staging."""

    def __init__(self, max_batch: int, max_pages: int, device: torch.device, scratch: Scratch,
                 page_size: int) -> None:
        self.max_batch, self.max_pages, self.page_size = max_batch, max(1, max_pages), page_size
        self.scratch = scratch
        dev = device
        # token ids, positions, KV rows, state slots: one int64 buffer, one copy per step
        self.meta = torch.zeros(4, max_batch, dtype=torch.long, device=dev)
        self.tables = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, device=dev)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.rows = torch.arange(max_batch, dtype=torch.long, device=dev)
        pin = dev.type == "cuda"
        self._meta_host = torch.zeros(4, max_batch, dtype=torch.long, pin_memory=pin)
        self._lens_host = torch.ones(max_batch, dtype=torch.int32, pin_memory=pin)
        self._tables_host = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, pin_memory=pin)
        self._copied: Any = None  # CUDA event after the last upload: the host buffers are free again
        self.fill_padding(0, max_batch)
        self._upload(max_batch, self.max_pages)

    @property
    def ids(self) -> torch.Tensor:
        return self.meta[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.meta[1]

    @property
    def kv_rows(self) -> torch.Tensor:
        return self.meta[2]

    @property
    def slots(self) -> torch.Tensor:
        return self.meta[3]

    def fill_padding(self, lo: int, hi: int, token: int = 0) -> None:
        """Host rows ``lo..hi-1`` become padding: ``token`` at position 0 of the scratch page, in
        the scratch slot."""
        sc = self.scratch
        self._meta_host[0, lo:hi] = token
        self._meta_host[1, lo:hi] = 0
        self._meta_host[2, lo:hi] = max(sc.page, 0) * self.page_size
        self._meta_host[3, lo:hi] = max(sc.slot, 0)
        self._lens_host[lo:hi] = 1
        self._tables_host[lo:hi, 0] = max(sc.page, 0)

    def load(self, batch: ForwardBatch, bucket: int) -> None:
        """Stage ``batch`` (validated by the caller) into rows ``0..n-1``, pad to ``bucket``, upload."""
        n, ps = len(batch.seqs), self.page_size
        if self._copied is not None:
            self._copied.synchronize()  # (already past: the engine read the last step's tokens)
        width = 1
        meta = self._meta_host
        meta[0, :n] = batch.input_ids.to("cpu", torch.long)
        for i, s in enumerate(batch.seqs):
            pages = -(-(s.start + 1) // ps)
            width = max(width, pages)
            self._tables_host[i, :pages] = torch.as_tensor(s.block_table[:pages], dtype=torch.int32)
            meta[1, i] = s.start
            meta[2, i] = int(s.block_table[s.start // ps]) * ps + s.start % ps
            meta[3, i] = max(s.state_slot, 0)
            self._lens_host[i] = s.start + 1
        self.fill_padding(n, bucket)
        self._upload(bucket, width)

    def _upload(self, bucket: int, width: int) -> None:
        nb = self.ids.device.type == "cuda"
        self.meta[:, :bucket].copy_(self._meta_host[:, :bucket], non_blocking=nb)
        self.lens[:bucket].copy_(self._lens_host[:bucket], non_blocking=nb)
        # columns beyond a row's context are never read (the kernels stop at its length)
        self.tables[:bucket, :width].copy_(self._tables_host[:bucket, :width], non_blocking=nb)
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()


class DecodeGraphs:
    """Captured (or, without CUDA, eagerly replayed) decode steps of one runner."""

    def __init__(self, runner: TorchModelRunner, max_batch: int, scratch: Scratch, capture: bool) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_batch)
        self.max_batch = max_batch
        self.capture_enabled = capture
        ps = runner.page_size
        self.inputs = StaticInputs(max_batch, -(-runner.max_context // ps), runner.device, scratch, ps)
        self._graphs: dict[int, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (hidden, logits)
        self._pool: Any = None
        self.replays = 0
        self.capture_s = 0.0
        self.memory_bytes = 0

    # -- eligibility -------------------------------------------------------------------
    def accepts(self, batch: ForwardBatch) -> bool:
        seqs = batch.seqs
        if not seqs or len(seqs) > self.max_batch or batch.num_tokens != len(seqs):
            return False
        return all(s.num_tokens == 1 and s.start >= 1 and not s.verify and not s.all_logits for s in seqs)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # -- the static forward ------------------------------------------------------------
    def _context(self, b: int) -> StepContext:
        inp = self.inputs
        rows = inp.rows[:b]
        pages = PageTables(rows=rows, block_tables=inp.tables[:b], context_lens=inp.lens[:b], q_lens=(1,) * b)
        seqs = tuple(SeqInfo(i, 1, 1, -1, None) for i in range(b))  # start >= 1: no sink rows
        group = DecodeGroup(rows=rows, state_slots=inp.slots[:b], token_index=None, lengths=None, pages=pages)
        return StepContext(positions=inp.positions[:b], kv_slots=inp.kv_rows[:b], seqs=seqs, decode=group)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        with torch.inference_mode():
            hidden = r.model(self.inputs.ids[:b], self._context(b), r.kv, r.state)
            return hidden, r.model.logits(hidden)

    # -- capture -----------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket (largest first, one shared memory pool). Needs CUDA."""
        if not self.capture_enabled:
            raise RuntimeError("capture() needs a DecodeGraphs built with capture=True (a CUDA device)")
        dev = self.runner.device
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        stream = torch.cuda.Stream(dev)
        inp = self.inputs
        for b in sorted(self.buckets, reverse=True):
            inp.fill_padding(0, b)
            inp._upload(b, 1)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile / autotune / lazy constants outside the capture
                    self._forward(b)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=stream):
                out = self._forward(b)
            self._pool = graph.pool()
            self._graphs[b] = graph
            self._outputs[b] = out
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = torch.cuda.memory_reserved(dev) - before

    def check(self) -> tuple[float, float]:
        """Replay the smallest bucket and run it eagerly from the same scratch state; returns the
        largest absolute logit difference (0.0 expected: the same kernels on the same inputs) and
        the largest absolute logit."""
        b = self.buckets[0]
        inp, r = self.inputs, self.runner
        inp.fill_padding(0, b, token=1 % r.vocab_size)
        inp._upload(b, 1)
        sc = inp.scratch
        if sc.slot >= 0:
            r.state.reset(sc.slot)
        graphed = self._replay(b)[1].clone()
        if sc.slot >= 0:
            r.state.reset(sc.slot)
        eager = self._forward(b)[1]
        if sc.slot >= 0:
            r.state.reset(sc.slot)
        return float((graphed - eager).abs().max()), float(eager.abs().max())

    # -- serving -----------------------------------------------------------------------
    def _replay(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        graph = self._graphs.get(b)
        if graph is None:
            return self._forward(b)
        graph.replay()
        return self._outputs[b]

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [n, H], logits [n, vocab] fp32)`` of an accepted, validated decode batch; both
        are views of the graph's output buffers, valid until the next ``run``."""
        n = len(batch.seqs)
        b = self.bucket(n)
        self.inputs.load(batch, b)
        hidden, logits = self._replay(b)
        self.replays += 1
        return hidden[:n], logits[:n]

    def describe(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "captured": sorted(self._graphs), "capture_s": round(self.capture_s, 2),
                "memory_mib": round(self.memory_bytes / 2**20, 1), "table_pages": self.inputs.max_pages}
