"""MTP drafting as one CUDA graph per batch bucket: the chain of draft steps with no host in it.

``TorchModelRunner.propose`` first runs the MTP layer over each sequence's computed rows (their
number varies per sequence: it stays eager), which gives every sequence the normed hidden
state ``h_0`` its first draft comes from. The rest is a fixed chain, captured here for up to
``k`` drafts per sequence:

    for j in 0 .. k-1:   d_j = argmax(lm_head(h_j))
                         h_{j+1} = mtp(d_j, h_j) at position p_0 + j   (j < k - 1)

All on the device: the drafted ids feed the next step without a host read (the eager loop read
each step's ids back), positions and KV rows come from ``p_0`` and the block tables by device
arithmetic, and the host reads the ``[b, k]`` drafts once at the end. A sequence asked for
``n < k`` drafts has its later steps masked: their K/V go to the scratch page (its block table
need not reach that far: the scheduler reserves pages for ``n`` drafts only) and their lengths
stop at its last reserved position; their drafts are dropped on the host. Padding rows (a batch
of ``b`` runs the bucket ``>= b``) read and write the scratch page only.

Without CUDA (``capture=False``) ``run`` executes the same static-buffer chain eagerly (CPU
tests compare it with the eager loop).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from deepwell.engine_service.graph_audit import audit
from deepwell.engine_service.graphs import CaptureHazards, graph_buckets
from deepwell.engine_service.layers.context import DecodeGroup, PageTables, SeqInfo, StepContext
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
        pin = dev.type == "cuda"
        self._meta_host = torch.zeros(2, max_batch, dtype=torch.long, pin_memory=pin)
        self._tables_host = torch.zeros(max_batch, self.width, dtype=torch.int32, pin_memory=pin)
        self._copied: Any = None
        self._graphs: dict[int, Any] = {}
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
                ids = model.lm_head(h).float().argmax(dim=-1)
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
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._chain(b)
                if b == self.buckets[-1]:
                    hazards = audit(lambda: self._chain(b), dev)
                    if hazards:
                        raise CaptureHazards(hazards)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                self._chain(b)
            self._pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0

    # -- serving -------------------------------------------------------------------------
    def accepts(self, n: int, wanted: Sequence[int]) -> bool:
        return 1 <= n <= self.max_batch and all(1 <= w <= self.max_drafts for w in wanted)

    def _stage_padding(self, lo: int, hi: int) -> None:
        self._meta_host[0, lo:hi] = 1
        self._meta_host[1, lo:hi] = 1  # one draft: no step writes
        self._tables_host[lo:hi, 0] = self.scratch_page

    def _upload(self, b: int) -> None:
        nb = self.meta.device.type == "cuda"
        self.meta[:, :b].copy_(self._meta_host[:, :b], non_blocking=nb)
        self.tables[:b].copy_(self._tables_host[:b], non_blocking=nb)
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def run(self, last: torch.Tensor, starts: Sequence[int], wanted: Sequence[int],
            tables: Sequence[Sequence[int]]) -> list[list[int]]:
        """Drafts for ``n`` sequences: ``last`` ``[n, H]`` their first draft's normed hidden state,
        ``starts`` the position of each first draft, ``wanted`` how many each drafts (1..k),
        ``tables`` their block tables (covering ``start + wanted - 1`` positions; checked)."""
        n, ps = last.shape[0], self.runner.page_size
        b = next(x for x in self.buckets if x >= n)
        if self._copied is not None:
            self._copied.synchronize()
        num_pages = self.runner.kv.num_pages if self.runner.kv is not None else 0
        for i, (p, w, t) in enumerate(zip(starts, wanted, tables, strict=True)):
            need = -(-(p + w - 1) // ps)  # pages of positions < p + w - 1 (the last step's is p + w - 2)
            pages = page_tensor(t, need)
            if len(t) < need or need > self.width or (need and (
                    int(pages.min()) < 0 or int(pages.max()) >= num_pages or bool((pages == self.scratch_page).any()))):
                raise ValueError(f"draft {i}: block table {list(t[:need])[:8]}... ({len(t)} pages) does not cover "
                                 f"positions < {p + w - 1} with pool pages")
            if p < 1 or p + w - 1 > self.runner.max_context:
                raise ValueError(f"draft {i}: positions {p}..{p + w - 2} outside the context")
            self._meta_host[0, i], self._meta_host[1, i] = p, w
            self._tables_host[i, :need] = pages
        self._stage_padding(n, b)
        self._upload(b)
        self.last[:n].copy_(last)
        graph = self._graphs.get(b)
        if graph is None:
            self._chain(b)
        else:
            graph.replay()
        self.replays += 1
        got = self.drafts[:n].tolist()
        return [row[:w] for row, w in zip(got, wanted, strict=True)]
