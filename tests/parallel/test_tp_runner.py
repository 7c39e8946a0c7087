"""The 2-rank tensor-parallel runner (gloo, CPU, fp32) against the single-process runner.

Tiny ``qwen3_5`` (Gated DeltaNet + gated attention) and ``llama`` (tied embeddings): the logits of
steps that mix chunked prefill, decodes, an all-logits slice and a slice without logits are
within 1e-5 x max |logit| of the single-process runner's; a prefix-cache entry spilled to a host
region (two segments) and restored into other pages and another state slot continues exactly as
the original sequence (a prefix of its pages too); a call one rank refuses is refused by all and
the ranks stay in step. (One process holds one group: the module's runners live until its end,
so tests that start their own are in other modules.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from deepwell.engine_service.kv.pool import Region
from deepwell.engine_service.parallel.runner import TPModelRunner
from deepwell.engine_service.runner import TorchModelRunner
from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice
from tests.engine.helpers_models import prompt
from tests.parallel.helpers_tp import close_to, rel, single_runner, tp_runner

NAMES = ["qwen3_5", "llama"]
PAGE = 8


@pytest.fixture(scope="module", params=NAMES)
def pair(request: pytest.FixtureRequest, tiny_dir: Callable[[str], Path]
         ) -> Iterator[tuple[str, TPModelRunner, TorchModelRunner]]:
    """The TP runner and the single-process one over the same model, with the same pools."""
    path = tiny_dir(request.param)
    single = single_runner(path, page_size=PAGE)
    single.allocate(32, 8)
    with tp_runner(path, page_size=PAGE) as tp:
        tp.allocate(32, 8)
        yield request.param, tp, single


def _step(runner: TorchModelRunner | TPModelRunner, ids: list[int], slices: list[SeqSlice]) -> torch.Tensor:
    return runner.forward(ForwardBatch(torch.tensor(ids), slices))


def test_logits_match_the_single_process_runner(pair: tuple[str, TPModelRunner, TorchModelRunner]) -> None:
    _, tp, single = pair
    seqs = [prompt(30, seed=1), prompt(17, seed=2), prompt(12, seed=3)]
    tables = [[3, 11, 6, 0], [8, 1, 14], [5, 12]]
    # (start, tokens, need_logits, all_logits) per sequence and step: a prompt prefilled in three
    # chunks, one in one step then decoding, one scored token by token, one step without logits
    plan = [[(0, 13, False, False), (0, 9, True, False), (0, 5, True, True)],
            [(13, 10, True, False), (9, 1, True, False), (5, 1, True, False)],
            [(23, 1, True, False), (10, 1, True, False), (6, 4, True, True)],
            [(24, 1, True, False), (11, 1, True, False), (10, 1, True, False)]]
    for r in (tp, single):
        for slot in range(3):
            r.reset_state(slot)
    for step in plan:
        ids = [t for i, (s, n, _, _) in enumerate(step) for t in seqs[i][s:s + n]]
        slices = [SeqSlice(i, tables[i], s, n, need, every) for i, (s, n, need, every) in enumerate(step)]
        got, ref = _step(tp, ids, slices), _step(single, ids, slices)
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert close_to(got, ref), rel(got, ref)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    if tp.local.state is not None:
        assert [tp.slot_position(s) for s in range(3)] == [25, 12, 11]


def test_spilled_entry_restores_exactly(pair: tuple[str, TPModelRunner, TorchModelRunner]) -> None:
    """Export a sequence's pages and state image to a host region, import them into other pages and
    another slot: the copy continues bit-identically to the original (and as the single-process
    runner does, within the bound)."""
    name, tp, single = pair
    hybrid = tp.local.state is not None
    ids = prompt(28, seed=7)
    src_pages, dst_pages, src, dst = [16, 17, 18], [19, 20, 21], 3, 4
    for r in (tp, single):
        r.reset_state(src)
        _step(r, ids[:12], [SeqSlice(src, src_pages, 0, 12)])
        _step(r, ids[12:20], [SeqSlice(src, src_pages, 12, 8)])
    slot = src if hybrid else -1
    n = tp.entry_nbytes(3, hybrid)
    assert n == 2 * tp.local.entry_nbytes(3, hybrid) == single.entry_nbytes(3, hybrid)
    arena = torch.full((n + 100,), 0xAB, dtype=torch.uint8)
    region = Region([arena[:777], arena[777:n]])  # scatter-gather: an extent boundary inside a page
    tp.export_kv(src_pages, slot, region)
    assert not (arena[:n] == 0xAB).all() and (arena[n:] == 0xAB).all()
    tp.import_kv(dst_pages, dst if hybrid else -1, 20, region, 3)
    if hybrid:
        assert tp.slot_position(dst) == 20
    a = _step(tp, ids[20:23], [SeqSlice(src, src_pages, 20, 3)])
    b = _step(tp, ids[20:23], [SeqSlice(dst, dst_pages, 20, 3)])
    ref = _step(single, ids[20:23], [SeqSlice(src, src_pages, 20, 3)])
    assert torch.equal(a, b)
    assert close_to(b, ref), rel(b, ref)
    a = _step(tp, ids[23:24], [SeqSlice(src, src_pages, 23, 1)])
    b = _step(tp, ids[23:24], [SeqSlice(dst, dst_pages, 23, 1)])
    assert torch.equal(a, b)
    if not hybrid:  # attention only: a prefix of the entry (its first 2 pages, 16 tokens) restores too
        tp.import_kv([22, 23], -1, 16, region, 3)
        c = _step(tp, ids[16:20], [SeqSlice(-1, [22, 23, 24], 16, 4)])
        single.import_kv([22, 23], -1, 16, _single_entry(single, src_pages), 3)
        ref = _step(single, ids[16:20], [SeqSlice(-1, [22, 23, 24], 16, 4)])
        assert close_to(c, ref), rel(c, ref)


def _single_entry(runner: TorchModelRunner, pages: list[int]) -> Region:
    buf = torch.empty(runner.entry_nbytes(len(pages), False), dtype=torch.uint8)
    runner.export_kv(pages, -1, Region([buf]))
    return Region([buf])


def test_a_refused_call_is_refused_on_every_rank(pair: tuple[str, TPModelRunner, TorchModelRunner]) -> None:
    """Bad calls fail with the runner's own error and leave every rank able to go on in step."""
    _, tp, single = pair
    ids = prompt(6, seed=4)
    with pytest.raises(ValueError, match="page ids"):
        _step(tp, ids, [SeqSlice(5, [99], 0, 6)])
    with pytest.raises(ValueError, match="overlap"):
        tp.copy_pages([1, 2], [2, 3])
    with pytest.raises(ValueError, match="region holds"):
        tp.export_kv([0], -1, Region([torch.empty(8, dtype=torch.uint8)]))
    with pytest.raises(ValueError, match="outside"):
        tp.export_kv([99], -1, Region([torch.empty(tp.entry_nbytes(1, False), dtype=torch.uint8)]))
    for r in (tp, single):
        r.reset_state(5)
    got, ref = _step(tp, ids, [SeqSlice(5, [25], 0, 6)]), _step(single, ids, [SeqSlice(5, [25], 0, 6)])
    assert close_to(got, ref), rel(got, ref)

