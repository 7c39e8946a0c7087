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
``all_logits``; and, when the runner planned verify graphs (``verify_tokens`` = drafts + 1),
steps of at most ``MAX_VERIFY_BATCH`` verify slices of exactly that many tokens each
(``context.VerifyGroup``). A verify graph has a second graph beside it, its *group commit*:
given the tokens kept per slice (``lengths``, a static buffer), it replays every recurrent
layer over each slice's first L tokens from the inputs the verify graph left in its own
buffers and writes the states back. Everything else (prefill chunks, verify rounds of another
length or mixed with other slices, scoring) runs eagerly.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepwell.engine_service.graph_audit import Hazard, audit
from deepwell.engine_service.layers.context import (DecodeGroup, PageTables, SeqInfo, StepContext, VerifyGroup,
                                                    VerifyRecord)
from deepwell.engine_service.runner_api import ForwardBatch, page_tensor
from deepwell.kernels.fp8_gemm.triton_kernel import DEQUANT_MIN_TOKENS
from deepwell.logs import get_logger

if TYPE_CHECKING:
    from deepwell.engine_service.runner import TorchModelRunner

log = get_logger(__name__)

MAX_GRAPH_BATCH = 128  # the largest bucket captured when the engine's concurrency is higher
# the largest verify bucket: every verify graph keeps its recurrent layers' inputs for the commit
# (about 2 x conv_dim x 2 bytes per token and GDN layer: 1.9 MiB per token at the 27B shape)
MAX_VERIFY_BATCH = 32
# replayed vs eager logits of the start-up check, relative to the largest logit: the same kernels
# on the same inputs agree exactly; a graph reading a stale buffer would be far off
CHECK_TOLERANCE = 1e-3


def reserve_bytes(args: Any, spec: Any, max_batch: int, dtype: torch.dtype, verify_tokens: int = 0,
                  dequant_bytes: int = 0) -> int:
    """What the graphs take beside the pools, reserved before the KV pool is sized: the scratch
    page and slot, and the captured steps' activations (one shared pool, the largest step's
    peak), estimated per row as the logits (fp32 and the LM head's own dtype), 32 buffers of the
    widest projection in fp32 and the attention's split-K partials (64 splits, fp32); with verify
    steps (``verify_tokens`` per sequence), every verify graph's kept outputs and commit inputs
    (its logits, and per recurrent layer three conv-width rows in the model dtype); and where a
    captured step has ``fp8_gemm.DEQUANT_MIN_TOKENS`` rows or more, ``dequant_bytes`` (FP8
    weights: the largest layer dequantized into the model dtype, ``fp8_linear.dequant_bytes``).
    Logged beside what the capture measured (``cuda_graphs``: ``memory_mib``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    widths = [args.hidden, args.intermediate, args.attention.num_heads * args.attention.head_dim * 2]
    if args.gdn is not None:
        widths.append(args.gdn.conv_dim + args.gdn.value_dim)
    per_row = args.vocab_size * (4 + elem) + 32 * max(widths) * 4 + args.attention.num_heads * 64 * args.attention.head_dim * 4
    rows = max_batch
    kept = 0
    if verify_tokens > 1 and args.gdn is not None:
        vb = graph_buckets(min(max_batch, MAX_VERIFY_BATCH))
        rows = max(rows, vb[-1] * verify_tokens)
        gdn_layers = args.num_layers - len(args.attention_layers)
        kept = sum(vb) * verify_tokens * (args.vocab_size * 4 + gdn_layers * 3 * args.gdn.conv_dim * elem)
    dequant = dequant_bytes if rows >= DEQUANT_MIN_TOKENS else 0
    return spec.bytes_per_page + spec.bytes_per_state_slot + rows * per_row + kept + dequant


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


class CaptureHazards(RuntimeError):
    """The decode step does something a CUDA graph cannot hold (``graph_audit``): not captured."""

    def __init__(self, hazards: list[Hazard]) -> None:
        self.hazards = hazards
        shown = "; ".join(str(h) for h in hazards[:6])
        more = f" (+{len(hazards) - 6} more)" if len(hazards) > 6 else ""
        super().__init__(f"the decode step has {len(hazards)} capture hazard(s): {shown}{more}")


@dataclass(frozen=True)
class Scratch:
    """Where padded rows read and write: a KV page and a state slot no sequence owns."""

    page: int  # -1: no KV pool
    slot: int  # -1: no state pool


class StaticInputs:
    """The persistent device buffers every captured graph reads, and their host staging. A step
    of ``b`` sequences of ``t`` tokens uses rows ``0 .. b * t - 1`` (sequence-major) of the
    per-token buffers and entries ``0 .. b - 1`` of the per-sequence ones."""

    def __init__(self, max_batch: int, max_pages: int, device: torch.device, scratch: Scratch,
                 page_size: int, max_tokens: int = 1) -> None:
        self.max_batch, self.max_pages, self.page_size = max_batch, max(1, max_pages), page_size
        self.scratch = scratch
        dev = device
        width = max_batch * max(1, max_tokens)
        # per token: ids, positions, KV rows; per sequence (the first columns): state slots. One
        # int64 buffer, one copy per step
        self.meta = torch.zeros(4, width, dtype=torch.long, device=dev)
        self.tables = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, device=dev)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.rows = torch.arange(width, dtype=torch.long, device=dev)
        pin = dev.type == "cuda"
        self._meta_host = torch.zeros(4, width, dtype=torch.long, pin_memory=pin)
        self._lens_host = torch.ones(max_batch, dtype=torch.int32, pin_memory=pin)
        self._tables_host = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, pin_memory=pin)
        self._copied: Any = None  # CUDA event after the last upload: the host buffers are free again
        self.fill_padding(0, max_batch)
        self._upload(max_batch, 1, self.max_pages)

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

    def fill_padding(self, lo: int, hi: int, t: int = 1, token: int = 0) -> None:
        """Host sequences ``lo..hi-1`` (``t`` tokens each) become padding: ``token`` at positions
        0..t-1 of the scratch page, in the scratch slot."""
        sc = self.scratch
        rows = slice(lo * t, hi * t)
        offs = torch.arange(t, dtype=torch.long).repeat(hi - lo)
        self._meta_host[0, rows] = token
        self._meta_host[1, rows] = offs
        self._meta_host[2, rows] = max(sc.page, 0) * self.page_size + offs
        self._meta_host[3, lo:hi] = max(sc.slot, 0)
        self._lens_host[lo:hi] = t
        self._tables_host[lo:hi, 0] = max(sc.page, 0)

    def pad(self, bucket: int, t: int = 1, token: int = 0) -> None:
        """Every sequence of ``bucket`` padding (capture, the start-up check), uploaded."""
        self.fill_padding(0, bucket, t, token)
        self._upload(bucket, t, 1)

    def load(self, batch: ForwardBatch, bucket: int, t: int = 1) -> None:
        """Stage ``batch`` (validated by the caller; ``t`` tokens per slice) into sequences
        ``0..n-1``, pad to ``bucket``, upload."""
        n, ps = len(batch.seqs), self.page_size
        if self._copied is not None:
            self._copied.synchronize()  # (already past: the engine read the last step's tokens)
        width = 1
        meta = self._meta_host
        meta[0, : n * t] = batch.input_ids.to("cpu", torch.long)
        for i, s in enumerate(batch.seqs):
            pages = -(-(s.start + t) // ps)
            width = max(width, pages)
            self._tables_host[i, :pages] = page_tensor(s.block_table, pages)
            for j in range(t):
                pos = s.start + j
                meta[1, i * t + j] = pos
                meta[2, i * t + j] = int(s.block_table[pos // ps]) * ps + pos % ps
            meta[3, i] = max(s.state_slot, 0)
            self._lens_host[i] = s.start + t
        self.fill_padding(n, bucket, t)
        self._upload(bucket, t, width)

    def _upload(self, bucket: int, t: int, width: int) -> None:
        nb = self.ids.device.type == "cuda"
        self.meta[:, : bucket * t].copy_(self._meta_host[:, : bucket * t], non_blocking=nb)
        self.lens[:bucket].copy_(self._lens_host[:bucket], non_blocking=nb)
        # columns beyond a row's context are never read (the kernels stop at its length)
        self.tables[:bucket, :width].copy_(self._tables_host[:bucket, :width], non_blocking=nb)
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()


Shape = tuple[int, int]  # (bucket: sequences, tokens per sequence)
Outputs = tuple[torch.Tensor, torch.Tensor, VerifyRecord | None]  # hidden, logits, a verify step's commits


class DecodeGraphs:
    """Captured (or, without CUDA, eagerly replayed) decode steps of one runner, and with
    ``verify_tokens`` > 1 its speculative verify steps of that many tokens per sequence (buckets
    up to ``MAX_VERIFY_BATCH``) with their group commits."""

    def __init__(self, runner: TorchModelRunner, max_batch: int, scratch: Scratch, capture: bool,
                 verify_tokens: int = 0) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_batch)
        self.max_batch = max_batch
        self.verify_tokens = verify_tokens if verify_tokens > 1 and runner.state is not None else 0
        self.verify_batch = min(max_batch, MAX_VERIFY_BATCH) if self.verify_tokens else 0
        self.verify_buckets = graph_buckets(self.verify_batch) if self.verify_tokens else ()
        self.shapes: list[Shape] = [(b, 1) for b in self.buckets] + [(b, self.verify_tokens)
                                                                        for b in self.verify_buckets]
        self.capture_enabled = capture
        ps = runner.page_size
        self.inputs = StaticInputs(max_batch, -(-runner.max_context // ps), runner.device, scratch, ps,
                                   max(1, self.verify_tokens))
        self.lengths = torch.zeros(max(1, self.verify_batch), dtype=torch.long, device=runner.device)
        self._graphs: dict[Shape, Any] = {}  # shape -> torch.cuda.CUDAGraph
        self._commits: dict[Shape, Any] = {}  # verify shape -> the CUDA graph of its group commit
        self._outputs: dict[Shape, Outputs] = {}
        self._pool: Any = None
        self._last_record: VerifyRecord | None = None  # the commits of the last verify step run
        self.replays = 0
        self.verify_replays = 0
        self.capture_s = 0.0
        self.memory_bytes = 0

    # -- eligibility -------------------------------------------------------------------
    def accepts(self, batch: ForwardBatch) -> bool:
        seqs = batch.seqs
        if not seqs:
            return False
        t = seqs[0].num_tokens
        if batch.num_tokens != t * len(seqs) or any(s.num_tokens != t or s.start < 1 for s in seqs):
            return False
        if t == 1:
            return len(seqs) <= self.max_batch and not any(s.verify or s.all_logits for s in seqs)
        return t == self.verify_tokens and len(seqs) <= self.verify_batch and all(s.verify for s in seqs)

    def bucket(self, n: int, t: int = 1) -> int:
        return next(b for b in (self.buckets if t == 1 else self.verify_buckets) if b >= n)

    # -- the static forward ------------------------------------------------------------
    def _context(self, b: int, t: int = 1) -> StepContext:
        inp = self.inputs
        n = b * t
        rows = inp.rows[:n]
        pages = PageTables(rows=rows, block_tables=inp.tables[:b], context_lens=inp.lens[:b], q_lens=(t,) * b)
        if t == 1:
            seqs = tuple(SeqInfo(i, 1, 1, -1, None) for i in range(b))  # start >= 1: no sink rows
            group = DecodeGroup(rows=rows, state_slots=inp.slots[:b], token_index=None, lengths=None, pages=pages)
            return StepContext(positions=inp.positions[:b], kv_slots=inp.kv_rows[:b], seqs=seqs, decode=group)
        seqs = tuple(SeqInfo(i * t, t, t, i, None, verify=True) for i in range(b))
        return StepContext(positions=inp.positions[:n], kv_slots=inp.kv_rows[:n], seqs=seqs, verify=VerifyRecord(),
                           verify_group=VerifyGroup(t, tuple(range(b)), inp.slots[:b], pages))

    def _forward(self, b: int, t: int = 1) -> Outputs:
        r = self.runner
        ctx = self._context(b, t)
        with torch.inference_mode():
            hidden = r.model(self.inputs.ids[: b * t], ctx, r.kv, r.state)
            return hidden, r.model.logits(hidden), ctx.verify

    def _commit(self, record: VerifyRecord | None, b: int) -> None:
        assert record is not None
        with torch.inference_mode():
            for commit in record.group:
                commit(self.lengths[:b])

    # -- capture -----------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every shape (most rows first, one shared memory pool). Needs CUDA."""
        if not self.capture_enabled:
            raise RuntimeError("capture() needs a DecodeGraphs built with capture=True (a CUDA device)")
        dev = self.runner.device
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        # measured with the allocator's free cache released on both sides (entering a capture
        # releases it too, which made the plain difference negative on the H100)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        stream = torch.cuda.Stream(dev)
        inp = self.inputs
        audited: set[int] = set()
        self.lengths.zero_()  # padding commits nothing
        for b, t in sorted(self.shapes, key=lambda s: (s[0] * s[1], s[1]), reverse=True):
            inp.pad(b, t)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile / autotune / lazy constants outside the capture
                    record = self._forward(b, t)[2]
                    if t > 1:
                        self._commit(record, b)
                if t not in audited:  # what would break the capture (or bake a stale copy into it)
                    audited.add(t)
                    hazards = audit(lambda: self._forward(b, t), dev)
                    if t > 1 and not hazards:
                        record = self._forward(b, t)[2]
                        hazards = audit(lambda: self._commit(record, b), dev)
                    if hazards:
                        raise CaptureHazards(hazards)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=stream):
                out = self._forward(b, t)
            self._pool = graph.pool()
            self._graphs[(b, t)] = graph
            self._outputs[(b, t)] = out
            if t > 1:  # the commit reads the verify graph's own buffers (q, k, v, gates, conv inputs)
                commit = torch.cuda.CUDAGraph()
                with torch.cuda.graph(commit, pool=self._pool, stream=stream):
                    self._commit(out[2], b)
                self._commits[(b, t)] = commit
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        torch.cuda.empty_cache()
        self.memory_bytes = max(0, torch.cuda.memory_reserved(dev) - before)

    def check(self) -> tuple[float, float]:
        """Replay the smallest bucket of every shape and run it eagerly from the same scratch state
        (a verify shape with its commit of every token, compared through the scratch slot's state
        and the next decode step's logits); returns the largest absolute logit difference (0.0
        expected: the same kernels on the same inputs) and the largest absolute logit."""
        inp, r = self.inputs, self.runner
        sc = inp.scratch
        diff, scale = 0.0, 0.0

        def reset() -> None:
            if sc.slot >= 0:
                r.state.reset(sc.slot)

        for t in sorted({t for _, t in self.shapes}):
            b = self.bucket(1, t)
            results = []
            for graphed in (True, False):
                inp.pad(b, t, token=1 % r.vocab_size)
                reset()
                out = self._replay(b, t) if graphed else self._forward(b, t)
                logits = out[1][: b * t].clone()
                if t > 1:
                    self.lengths[:b] = t
                    if graphed:
                        self._replay_commit(b, t)
                    else:
                        self._commit(out[2], b)
                    self.lengths.zero_()
                    inp.fill_padding(0, 1, 1, token=2 % r.vocab_size)  # a decode step from the committed state
                    inp._meta_host[1, 0] = t
                    inp._meta_host[2, 0] = max(sc.page, 0) * inp.page_size + t
                    inp._lens_host[0] = t + 1
                    inp._upload(1, 1, 1)
                    logits = torch.cat([logits, self._forward(1, 1)[1][:1].clone()])
                results.append(logits)
            reset()
            diff = max(diff, float((results[0] - results[1]).abs().max()))
            scale = max(scale, float(results[1].abs().max()))
        return diff, scale

    # -- serving -----------------------------------------------------------------------
    def _replay(self, b: int, t: int = 1) -> Outputs:
        graph = self._graphs.get((b, t))
        if graph is None:
            out = self._forward(b, t)
            self._last_record = out[2]
            return out
        graph.replay()
        self._last_record = self._outputs[(b, t)][2]
        return self._outputs[(b, t)]

    def _replay_commit(self, b: int, t: int) -> None:
        graph = self._commits.get((b, t))
        if graph is None:
            self._commit(self._last_record, b)
        else:
            graph.replay()

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], None] | None]:
        """``(hidden [n * t, H], logits [n * t, vocab] fp32, commit)`` of an accepted, validated
        batch of ``n`` slices of ``t`` tokens; hidden and logits are views of the graph's output
        buffers, valid until the next ``run``. For a verify step, ``commit(lengths)`` (``[n]``
        int64 on the device, tokens kept per slice) replays its group commit; else None."""
        n, t = len(batch.seqs), batch.seqs[0].num_tokens
        b = self.bucket(n, t)
        self.inputs.load(batch, b, t)
        hidden, logits, _ = self._replay(b, t)
        self.replays += 1
        self.verify_replays += t > 1
        commit = None
        if t > 1:
            def commit(lengths: torch.Tensor) -> None:
                self.lengths[:n].copy_(lengths)
                self.lengths[n:b].zero_()
                self._replay_commit(b, t)
        return hidden[: n * t], logits[: n * t], commit

    def describe(self) -> dict[str, Any]:
        out = {"buckets": list(self.buckets), "captured": sorted(b for b, t in self._graphs if t == 1),
               "capture_s": round(self.capture_s, 2), "memory_mib": round(self.memory_bytes / 2**20, 1),
               "table_pages": self.inputs.max_pages}
        if self.verify_tokens:
            out["verify_tokens"] = self.verify_tokens
            out["verify_captured"] = sorted(b for b, t in self._graphs if t > 1)
        return out
