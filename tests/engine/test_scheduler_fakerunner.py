"""FakeRunner: a deterministic model that honours the runner memory contract (and its tests).

Its "attention KV" is the token ids themselves, written to ``pages[page, offset]`` through
the block tables; its "recurrent state" is a running polynomial hash of the tokens a slot
has consumed, plus their count. Logits for a sequence are a pseudo-random vector seeded by
the hash of the history *read back from the pages*; the forward raises when the state slot
does not hold exactly ``start`` tokens or disagrees with the pages. So a wrong block table,
a page freed under a live sequence, a missing state reset or a wrong snapshot changes the
output or fails the step: scheduling bugs show.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from deepwell.engine_service.runner_api import ForwardBatch, MemorySpec, SeqSlice

_MOD = (1 << 61) - 1


def _fold(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) % _MOD


class FakeRunner:
    def __init__(self, vocab: int = 97, max_context: int = 4096, page_size: int = 4, hybrid: bool = True) -> None:
        self._vocab = vocab
        self._max_context = max_context
        self.page_size = page_size
        self.hybrid = hybrid
        self.pages = torch.empty(0)
        self.state = torch.empty(0)
        self.forward_calls: list[list[tuple[int, int, int]]] = []  # per step: (slot, start, n)
        self.state_copies: list[tuple[int, int, int]] = []  # (src slot, dst slot, position)
        self.page_copies: list[tuple[int, int]] = []  # (src page, dst page)
        self.fail_on_token: int | None = None  # forward raises when a slice holds this token
        self.nan_on_token: int | None = None  # that sequence's logits row is NaN when its slice holds it

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_context(self) -> int:
        return self._max_context

    def memory_spec(self) -> MemorySpec:
        return MemorySpec(page_size=self.page_size, bytes_per_page=8 * self.page_size,
                          bytes_per_state_slot=16 if self.hybrid else 0, num_attention_layers=1,
                          num_recurrent_layers=1 if self.hybrid else 0)

    def allocate(self, num_pages: int, num_state_slots: int) -> None:
        self.pages = torch.full((num_pages, self.page_size), -1, dtype=torch.long)
        self.state = torch.zeros((num_state_slots, 2), dtype=torch.long)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        ids = batch.input_ids.tolist()
        out: list[torch.Tensor] = []
        off = 0
        self.forward_calls.append([(s.state_slot, s.start, s.num_tokens) for s in batch.seqs])
        for s in batch.seqs:
            toks = ids[off: off + s.num_tokens]
            off += s.num_tokens
            if self.fail_on_token is not None and self.fail_on_token in toks:
                raise RuntimeError(f"injected failure on token {self.fail_on_token}")
            self._write(s, toks)
            if s.need_logits:
                row = self._logits(s)
                out.append(row * float("nan") if self.nan_on_token in toks else row)
        if off != len(ids):
            raise AssertionError("input_ids longer than the slices")
        return torch.stack(out) if out else torch.empty((0, self._vocab))

    def _write(self, s: SeqSlice, toks: list[int]) -> None:
        ps = self.page_size
        if len(s.block_table) * ps < s.start + s.num_tokens:
            raise AssertionError(f"block table of {len(s.block_table)} pages too short for {s.start + s.num_tokens}")
        if self.hybrid:
            count, h = self.state[s.state_slot].tolist()
            if count != s.start:
                raise AssertionError(f"slot {s.state_slot} holds {count} tokens, slice starts at {s.start}")
        for i, t in enumerate(toks):
            pos = s.start + i
            self.pages[s.block_table[pos // ps], pos % ps] = t
            if self.hybrid:
                h = _fold(h, t)
        if self.hybrid:
            self.state[s.state_slot] = torch.tensor([s.start + len(toks), h])

    def _history_hash(self, s: SeqSlice) -> int:
        ps = self.page_size
        h = 0
        for pos in range(s.start + s.num_tokens):
            t = int(self.pages[s.block_table[pos // ps], pos % ps])
            if t < 0:
                raise AssertionError(f"position {pos} was never written")
            h = _fold(h, t)
        return h

    def _logits(self, s: SeqSlice) -> torch.Tensor:
        h = self._history_hash(s)
        if self.hybrid and int(self.state[s.state_slot, 1]) != h:
            raise AssertionError(f"slot {s.state_slot} state disagrees with the pages")
        g = torch.Generator().manual_seed(h)
        return torch.randn(self._vocab, generator=g, dtype=torch.float32) * 3.0

    def reset_state(self, slot: int) -> None:
        self.state[slot] = 0

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        if self.hybrid:
            self.state_copies.append((src_slot, dst_slot, int(self.state[src_slot, 0])))
            self.state[dst_slot] = self.state[src_slot]

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        for a, b in zip(src, dst, strict=True):
            self.page_copies.append((a, b))
            self.pages[b] = self.pages[a]

    # a host cache entry's bytes: its pages row-major, then the state slot (kv.pool)
    def entry_nbytes(self, num_pages: int, with_state: bool) -> int:
        return num_pages * self.page_size * 8 + (16 if with_state and self.hybrid else 0)

    def export_kv(self, pages: Sequence[int], slot: int, out) -> None:
        from deepwell.engine_service.kv.pool import export_rows

        export_rows([self.pages], pages, out)
        if slot >= 0 and self.hybrid:
            export_rows([self.state], [slot], out, start=len(pages) * self.page_size * 8)

    def import_kv(self, pages: Sequence[int], slot: int, position: int, src, entry_pages: int) -> None:
        from deepwell.engine_service.kv.pool import import_rows

        import_rows([self.pages], pages, src)
        if slot >= 0 and self.hybrid:
            import_rows([self.state], [slot], src, start=entry_pages * self.page_size * 8)
            assert int(self.state[slot, 0]) == position, "restored state is not at the entry's position"


def greedy_reference(runner: FakeRunner, prompt: list[int], n: int) -> list[int]:
    """What a fresh sequence generates greedily, token by token, with no engine at all."""
    history = list(prompt)
    out = []
    for _ in range(n):
        h = 0
        for t in history:
            h = _fold(h, t)
        g = torch.Generator().manual_seed(h)
        tok = int(torch.argmax(torch.randn(runner.vocab_size, generator=g) * 3.0))
        out.append(tok)
        history.append(tok)
    return out


# -- the fake's own contract checks --------------------------------------------------------
def _slice(slot: int, table: list[int], start: int, n: int) -> SeqSlice:
    return SeqSlice(state_slot=slot, block_table=table, start=start, num_tokens=n)


def test_fake_runner_chunked_equals_whole() -> None:
    r = FakeRunner()
    r.allocate(8, 2)
    a = r.forward(ForwardBatch(torch.tensor([5, 6, 7, 8, 9]), [_slice(0, [3, 1], 0, 5)]))
    r.forward(ForwardBatch(torch.tensor([5, 6, 7]), [_slice(1, [0, 2], 0, 3, )]))
    b = r.forward(ForwardBatch(torch.tensor([8, 9]), [_slice(1, [0, 2], 3, 2)]))
    assert torch.equal(a, b)


def test_fake_runner_detects_wrong_state_and_unwritten_pages() -> None:
    r = FakeRunner()
    r.allocate(8, 2)
    r.forward(ForwardBatch(torch.tensor([5, 6]), [_slice(0, [0], 0, 2)]))
    with pytest.raises(AssertionError, match="holds 2 tokens"):  # state not reset for a new sequence
        r.forward(ForwardBatch(torch.tensor([5]), [_slice(0, [1], 0, 1)]))
    r.reset_state(1)
    r.state[1] = torch.tensor([2, 12345])
    with pytest.raises(AssertionError, match="never written"):  # claims 2 computed tokens on fresh pages
        r.forward(ForwardBatch(torch.tensor([7]), [_slice(1, [5], 2, 1)]))


def test_greedy_reference_matches_forward() -> None:
    r = FakeRunner()
    r.allocate(8, 1)
    prompt = [1, 2, 3]
    ref = greedy_reference(r, prompt, 3)
    logits = r.forward(ForwardBatch(torch.tensor(prompt), [_slice(0, [0, 1], 0, 3)]))
    got = [int(torch.argmax(logits[0]))]
    for i in range(2):
        logits = r.forward(ForwardBatch(torch.tensor([got[-1]]), [_slice(0, [0, 1], 3 + i, 1)]))
        got.append(int(torch.argmax(logits[0])))
    assert got == ref
