"""MTP drafting as one CUDA graph per batch bucket: the chain of draft steps with no host in it.

``TorchModelRunner.propose`` first runs the MTP layer over each sequence's computed rows (their
number varies per sequence: it stays eager), which gives every sequence the normed hidden
state ``h_0`` its first draft comes from. The rest is a fixed chain, captured here for up to
``k`` drafts per sequence:

    for j in 0 .. k-1:   d_j = argmax(draft_logits(h_j))
                         h_{j+1} = mtp(d_j, h_j) at position p_0 + j   (j < k - 1)

All on the device: the drafted ids feed the next step without a host read (the eager loop read
each step's ids back), positions and KV rows come from ``p_0`` and the block tables by device
arithmetic, and the host reads the ``[b, k]`` drafts once at the end. A sequence asked for
``n < k`` drafts has its later steps masked: their K/V go to the scratch page (its block table
need not reach that far: the scheduler reserves pages for ``n`` drafts only) and their lengths
stop at its last reserved position; their drafts are dropped on the host. Padding rows (a batch
of ``b`` runs the bucket ``>= b``) read and write the scratch page only.

After a speculative verify step (every sequence ``T = k + 1`` rows, ``runner.propose`` sees
that) the MTP pass over the kept rows is captured too, in front of the chain (``run_after_verify``,
one graph per bucket): it runs over all ``T`` rows of every sequence, a fixed shape, as the
verify step did (the decode kernels with ``T`` tokens per sequence). Row ``t`` of a sequence
that kept ``m`` tokens is real for ``t < m`` and stands on position ``start + t``, where its
MTP K/V goes; rows ``t >= m`` are filler whose K/V goes to the scratch page, and being later in
causal order they change no real row. The chain starts from row ``m - 1``. The real rows see
exactly the keys the eager pass gives them (the same K/V rows, written before the attention);
the kernel differs (``T`` queries per sequence instead of ``m``), so a draft can differ from the
eager one by floating-point summation order, never an output token (verification decides).

Without CUDA (``capture=False``) ``run`` and ``run_after_verify`` execute the same static-buffer
steps eagerly (CPU tests compare them with the eager loop).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from deepwell.engine_service.graph_audit import audit
from deepwell.engine_service.graphs import CaptureHazards, graph_buckets
from deepwell.engine_service.layers.context import DecodeGroup, PageTables, SeqInfo, StepContext, VerifyGroup
from deepwell.engine_service.runner_api import page_tensor

if TYPE_CHECKING:
    from deepwell.engine_service.runner import TorchModelRunner


class DraftGraphs:
    """The draft chain of up to ``max_drafts`` tokens for up to ``max_batch`` sequences."""

    def __init__(self, runner: TorchModelRunner, max_batch: int, max_drafts: int, scratch_page: int,
                 capture: bool) -> None:
        if max_drafts < 1 or scratch_page < 0:
            raise ValueError(f"need max_drafts >= 1 and a scratch page, got {max_drafts}, {scratch_page}")
        if max_drafts > runner.page_size:
            raise ValueError(f"max_drafts {max_drafts} exceeds the page size {runner.page_size}")
        self.runner = runner
        self.max_batch, self.max_drafts, self.scratch_page = max_batch, max_drafts, scratch_page
        self.buckets = graph_buckets(max_batch)
        self.capture_enabled = capture
        dev, ps = runner.device, runner.page_size
        self.width = -(-runner.max_context // ps)
        hidden = runner.args.hidden
        self.last = torch.zeros(max_batch, hidden, dtype=runner.dtype, device=dev)
        # per sequence: first draft position, drafts wanted; block tables
        self.meta = torch.zeros(2, max_batch, dtype=torch.long, device=dev)
        self.tables = torch.zeros(max_batch, self.width, dtype=torch.int32, device=dev)
        self.drafts = torch.zeros(max_batch, max_drafts, dtype=torch.long, device=dev)
        # the MTP pass after a verify step: T = k + 1 rows per sequence (sequence-major)
        self.verify_tokens = t = max_drafts + 1
        self.hidden = torch.zeros(max_batch * t, hidden, dtype=runner.dtype, device=dev)
        # per row: the token that follows it, its position, its K/V row; per sequence: context
        # length (start + T) in lens, the row the chain starts from in ends
        self.rows_meta = torch.zeros(3, max_batch * t, dtype=torch.long, device=dev)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.ends = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.row_index = torch.arange(max_batch * t, dtype=torch.long, device=dev)
        self.no_slots = torch.zeros(max_batch, dtype=torch.long, device=dev)  # the MTP layers keep no state
        pin = dev.type == "cuda"
        self._meta_host = torch.zeros(2, max_batch, dtype=torch.long, pin_memory=pin)
        self._tables_host = torch.zeros(max_batch, self.width, dtype=torch.int32, pin_memory=pin)
        self._rows_host = torch.zeros(3, max_batch * t, dtype=torch.long, pin_memory=pin)
        self._lens_host = torch.ones(max_batch, dtype=torch.int32, pin_memory=pin)
        self._ends_host = torch.zeros(max_batch, dtype=torch.long, pin_memory=pin)
        self._copied: Any = None
        self._graphs: dict[int, Any] = {}
        self._verify_graphs: dict[int, Any] = {}  # bucket -> the MTP pass over T rows, then the chain
        self.verify_replays = 0
        self._pool: Any = None
        self.replays = 0
        self.capture_s = 0.0

    # -- the static chain ----------------------------------------------------------------
    def _chain(self, b: int) -> None:
        r, ps = self.runner, self.runner.page_size
        model, dev = r.model, r.device
        rows = torch.arange(b, dtype=torch.long, device=dev)
        pos0, wanted = self.meta[0, :b], self.meta[1, :b]
        tables = self.tables[:b]
        seqs = tuple(SeqInfo(i, 1, 1, -1, None) for i in range(b))  # start >= 1: no sink rows
        with torch.inference_mode():
            h = self.last[:b]
            for j in range(self.max_drafts):
                ids = model.draft_logits(h).argmax(dim=-1)
                self.drafts[:b, j] = ids
                if j == self.max_drafts - 1:
                    break
                live = j + 1 < wanted  # this step feeds a draft the sequence asked for
                pos = pos0 + j
                # the position a masked row stands on: its last reserved one (a step's own if live)
                held = pos0 - 1 + torch.minimum(torch.full_like(wanted, j + 1), wanted - 1)
                page = tables.gather(1, (held // ps).unsqueeze(1)).squeeze(1).long()
                kv_rows = torch.where(live, page * ps + held % ps, self.scratch_page * ps + j)
                lens = (held + 1).to(torch.int32)
                pages = PageTables(rows=rows, block_tables=tables, context_lens=lens, q_lens=(1,) * b)
                ctx = StepContext(positions=pos, kv_slots=kv_rows, seqs=seqs,
                                  decode=DecodeGroup(rows=rows, state_slots=rows, token_index=None, lengths=None,
                                                     pages=pages))
                h = model.mtp_forward(ids, h, ctx, r.kv)  # type: ignore[arg-type]

    def _after_verify(self, b: int) -> None:
        """The MTP pass over ``b`` sequences' ``T`` verify rows (normed hidden states in
        ``hidden``), each sequence's row ``ends[i]`` into ``last``, then the chain."""
        r, t = self.runner, self.verify_tokens
        model, n = r.model, b * t
        seqs = tuple(SeqInfo(i * t, t, t, -1, None) for i in range(b))  # start >= 1: no sink rows
        pages = PageTables(rows=self.row_index[:n], block_tables=self.tables[:b], context_lens=self.lens[:b],
                           q_lens=(t,) * b)
        ctx = StepContext(positions=self.rows_meta[1, :n], kv_slots=self.rows_meta[2, :n], seqs=seqs,
                          verify_group=VerifyGroup(t, (), self.no_slots[:b], pages))
        with torch.inference_mode():
            out = model.mtp_forward(self.rows_meta[0, :n], model.model.norm(self.hidden[:n]), ctx,
                                    r.kv)  # type: ignore[arg-type]
            self.last[:b].copy_(out.index_select(0, self.ends[:b]))
        self._chain(b)

    # -- capture -------------------------------------------------------------------------
    def capture(self) -> None:
        if not self.capture_enabled:
            raise RuntimeError("capture() needs DraftGraphs built with capture=True (a CUDA device)")
        dev = self.runner.device
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(dev)
        for b in sorted(self.buckets, reverse=True):
            self._stage_padding(0, b)
            self._upload(b)
            self._graphs[b] = self._capture_one(lambda b=b: self._chain(b), b == self.buckets[-1], stream)
            self._stage_verify_padding(0, b)
            self._upload_verify(b)
            self._verify_graphs[b] = self._capture_one(lambda b=b: self._after_verify(b), b == self.buckets[-1],
                                                       stream)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0

    def _capture_one(self, step: Any, check: bool, stream: Any) -> Any:
        """``step`` warmed up twice on ``stream``, audited for host syncs (``check``: once, on the
        smallest bucket), then captured into the shared pool."""
        dev = self.runner.device
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
            if check:
                hazards = audit(step, dev)
                if hazards:
                    raise CaptureHazards(hazards)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            step()
        self._pool = graph.pool()
        return graph

    # -- serving -------------------------------------------------------------------------
    def accepts(self, n: int, wanted: Sequence[int]) -> bool:
        return 1 <= n <= self.max_batch and all(1 <= w <= self.max_drafts for w in wanted)

    def _stage_padding(self, lo: int, hi: int) -> None:
        self._meta_host[0, lo:hi] = 1
        self._meta_host[1, lo:hi] = 1  # one draft: no step writes
        self._tables_host[lo:hi, 0] = self.scratch_page

    def _stage_verify_padding(self, lo: int, hi: int) -> None:
        """Sequences ``lo..hi-1`` of a verify pass become padding: every row on the scratch page
        (positions 0..T-1), one draft."""
        t, ps = self.verify_tokens, self.runner.page_size
        self._stage_padding(lo, hi)
        offs = torch.arange(t, dtype=torch.long).repeat(hi - lo)
        rows = slice(lo * t, hi * t)
        self._rows_host[0, rows] = 0
        self._rows_host[1, rows] = offs
        self._rows_host[2, rows] = self.scratch_page * ps + offs
        self._lens_host[lo:hi] = t
        self._ends_host[lo:hi] = torch.arange(lo, hi, dtype=torch.long) * t

    def _upload(self, b: int) -> None:
        nb = self.meta.device.type == "cuda"
        self.meta[:, :b].copy_(self._meta_host[:, :b], non_blocking=nb)
        self.tables[:b].copy_(self._tables_host[:b], non_blocking=nb)
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _upload_verify(self, b: int) -> None:
        nb = self.meta.device.type == "cuda"
        n = b * self.verify_tokens
        self.rows_meta[:, :n].copy_(self._rows_host[:, :n], non_blocking=nb)
        self.lens[:b].copy_(self._lens_host[:b], non_blocking=nb)
        self.ends[:b].copy_(self._ends_host[:b], non_blocking=nb)
        self._upload(b)  # the chain's inputs, and the event after every copy

    def accepts_verify(self, n: int, kept: Sequence[int], wanted: Sequence[int]) -> bool:
        """Whether ``run_after_verify`` takes ``n`` sequences that kept ``kept`` rows each and
        want ``wanted`` drafts (0: the MTP K/V only)."""
        t = self.verify_tokens
        return (1 <= n <= self.max_batch and all(1 <= m <= t for m in kept)
                and all(0 <= w <= self.max_drafts for w in wanted))

    def _stage_tables(self, i: int, table: Sequence[int], need: int, what: str) -> None:
        num_pages = self.runner.kv.num_pages if self.runner.kv is not None else 0
        pages = page_tensor(table, need)
        if len(table) < need or need > self.width or (need and (
                int(pages.min()) < 0 or int(pages.max()) >= num_pages or bool((pages == self.scratch_page).any()))):
            raise ValueError(f"draft {i}: block table {list(table[:need])[:8]}... ({len(table)} pages) does not "
                             f"cover {what} with pool pages")
        self._tables_host[i, :need] = pages

    def run_after_verify(self, hidden: torch.Tensor, starts: Sequence[int], tokens: Sequence[Sequence[int]],
                         wanted: Sequence[int], tables: Sequence[Sequence[int]]) -> list[list[int]]:
        """MTP drafting after a verify step of ``T`` rows per sequence, as one graph: ``hidden``
        ``[n * T, H]`` the step's (un-normed) hidden rows, sequence-major; per sequence the verify
        slice's ``start``, the tokens following its kept rows (``1..T`` of them: the rows
        ``start .. start + m - 1``), the drafts wanted (``0..k``; 0 fills the MTP K/V only) and
        its block table (covering ``start + m + wanted - 1`` positions; checked)."""
        t, ps = self.verify_tokens, self.runner.page_size
        n = len(starts)
        if hidden.shape[0] != n * t:
            raise ValueError(f"{hidden.shape[0]} hidden rows for {n} sequences of {t}")
        b = next(x for x in self.buckets if x >= n)
        if self._copied is not None:
            self._copied.synchronize()
        for i, (p, toks, w, table) in enumerate(zip(starts, tokens, wanted, tables, strict=True)):
            m = len(toks)
            if not 1 <= m <= t or not 0 <= w <= self.max_drafts:
                raise ValueError(f"draft {i}: {m} kept rows and {w} drafts (want 1..{t}, 0..{self.max_drafts})")
            if p < 1 or p + t > self.width * ps or p + m + max(w, 1) - 1 > self.runner.max_context:
                raise ValueError(f"draft {i}: positions {p}..{p + t - 1} outside the context")
            first = p + m  # the chain's first draft position
            self._stage_tables(i, table, -(-(first + max(w, 1) - 1) // ps),
                               f"positions < {first + max(w, 1) - 1}")
            rows = slice(i * t, (i + 1) * t)
            pos = torch.arange(p, p + t, dtype=torch.long)
            self._rows_host[0, rows] = 0
            self._rows_host[0, i * t:i * t + m] = torch.tensor(list(toks), dtype=torch.long)
            self._rows_host[1, rows] = pos
            kv_rows = self.scratch_page * ps + torch.arange(t, dtype=torch.long)  # filler rows
            kv_rows[:m] = self._tables_host[i].long()[pos[:m] // ps] * ps + pos[:m] % ps
            self._rows_host[2, rows] = kv_rows
            self._lens_host[i] = p + t
            self._ends_host[i] = i * t + m - 1
            self._meta_host[0, i], self._meta_host[1, i] = first, max(w, 1)
        self._stage_verify_padding(n, b)
        self._upload_verify(b)
        self.hidden[:n * t].copy_(hidden)
        self.verify_replays += 1
        return self._replay(self._verify_graphs.get(b), lambda: self._after_verify(b), wanted)

    def run(self, last: torch.Tensor, starts: Sequence[int], wanted: Sequence[int],
            tables: Sequence[Sequence[int]]) -> list[list[int]]:
        """Drafts for ``n`` sequences: ``last`` ``[n, H]`` their first draft's normed hidden state,
        ``starts`` the position of each first draft, ``wanted`` how many each drafts (1..k),
        ``tables`` their block tables (covering ``start + wanted - 1`` positions; checked)."""
        n, ps = last.shape[0], self.runner.page_size
        b = next(x for x in self.buckets if x >= n)
        if self._copied is not None:
            self._copied.synchronize()
        for i, (p, w, t) in enumerate(zip(starts, wanted, tables, strict=True)):
            if p < 1 or p + w - 1 > self.runner.max_context:
                raise ValueError(f"draft {i}: positions {p}..{p + w - 2} outside the context")
            # pages of positions < p + w - 1 (the last step's is p + w - 2)
            self._stage_tables(i, t, -(-(p + w - 1) // ps), f"positions < {p + w - 1}")
            self._meta_host[0, i], self._meta_host[1, i] = p, w
        self._stage_padding(n, b)
        self._upload(b)
        self.last[:n].copy_(last)
        self.replays += 1
        return self._replay(self._graphs.get(b), lambda: self._chain(b), wanted)

    def _replay(self, graph: Any, eager: Any, wanted: Sequence[int]) -> list[list[int]]:
        """The captured ``graph`` (else ``eager()``, the same static-buffer steps), then each
        sequence's first ``wanted`` drafts: the one host read."""
        if graph is None:
            eager()
        else:
            graph.replay()
        got = self.drafts[: len(wanted)].tolist()
        return [row[:w] for row, w in zip(got, wanted, strict=True)]
