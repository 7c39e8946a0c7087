"""``--batch-invariant`` (``layers.invariant``): on the CPU reference a sequence's numbers do not
depend on what shares its step, so a speculative round leaves bit for bit the recurrent state,
conv state and KV that plain decoding leaves at the same position (issue 45's acceptance), with
requests arriving at different steps (batch 1 to 4, chunked prefill beside decodes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deepwell.engine_service.config import EngineConfig
from deepwell.configs import ConfigError
from deepwell.engine_service.engine import EngineCore, EngineLimits
from deepwell.engine_service.layers.invariant import (ROW_MULTIPLE, BatchInvariantBackend, RowInvarianceError,
                                                      RowPaddedLinear, check_row_invariance, pad_linear_rows,
                                                      padded_linear)
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import build_runner
from tests.engine.test_spec_decode import SPECS, _oracle, _prompt, _run, mtp_model  # noqa: F401 - fixture

SLOT_POS_KEY = tuple[str, int]


def require_row_invariant_gemm(shapes: list[tuple[int, int]]) -> None:
    """Skip, with the reason, where this CPU's BLAS is not row-invariant at multiples of
    ``ROW_MULTIPLE`` rows for these (out, in) weight shapes (``invariant.check_row_invariance``,
    which makes ``--batch-invariant`` refuse to start there): the property the mode builds on."""
    model = torch.nn.Sequential(*(torch.nn.Linear(i, o, bias=False) for o, i in sorted(set(shapes))))
    try:
        check_row_invariance(model)
    except RowInvarianceError as exc:
        pytest.skip(str(exc))


def test_a_blas_that_is_not_row_invariant_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepwell.engine_service.layers import invariant

    real = torch.nn.functional.linear

    def wobbly(x, w, b=None):  # a last-bit difference that depends on the row count
        out = real(x, w, b)
        return out if x.shape[0] <= ROW_MULTIPLE else torch.nextafter(out, torch.full_like(out, float("inf")))

    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    invariant.check_row_invariance(model)  # this machine: passes (the module's measurements)
    monkeypatch.setattr(invariant.F, "linear", wobbly)
    with pytest.raises(RowInvarianceError, match="cannot hold on this machine"):
        invariant.check_row_invariance(model)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_padded_linear_rows_are_their_own(threads: int) -> None:
    """Each row of a padded product equals that row alone, for every row count (the plain
    ``F.linear`` does not: MKL takes another kernel below 4 rows)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(192, 96, generator=g), torch.randn(192, generator=g)
    x = torch.randn(13, 96, generator=g)
    require_row_invariant_gemm([(192, 96)])
    alone = torch.cat([padded_linear(x[i:i + 1], w, b) for i in range(13)])
    for m in range(1, 14):
        assert torch.equal(padded_linear(x[:m], w, b), alone[:m]), m
    assert padded_linear(x.view(13, 1, 96), w).shape == (13, 1, 192)
    model = torch.nn.Sequential(torch.nn.Linear(96, 192), torch.nn.ReLU())
    weight = model[0].weight
    assert pad_linear_rows(model) == 1 and isinstance(model[0], RowPaddedLinear) and model[0].weight is weight
    assert torch.equal(model[0](x[:3]), padded_linear(x[:3], weight, model[0].bias))


def test_decode_rows_and_verify_rows_attend_alike(threads: int) -> None:
    """Per-row decode attention over exactly each row's context: a row alone, a row in a batch
    of other lengths, and a verify slice's query at the same position give the same bits."""
    ops = BatchInvariantBackend()
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, rows = 6, 2, 16, 40
    kc, vc = torch.randn(rows, hkv, d, generator=g), torch.randn(rows, hkv, d, generator=g)
    index = torch.randperm(rows, generator=g)
    q = torch.randn(5, hq, d, generator=g)
    lengths = torch.tensor([17, 3, 40, 18, 19])
    batch = ops.paged_decode_attention(q, kc, vc, index.expand(5, -1), lengths, 0.25)
    for i, n in enumerate(lengths.tolist()):
        alone = ops.paged_decode_attention(q[i:i + 1], kc, vc, index[None, :n], torch.tensor([n]), 0.25)
        assert torch.equal(batch[i], alone[0]), i
    verify = ops.verify_attention(q[[0, 3, 4]], kc, vc, index[:19], 16, 0.25)  # positions 16, 17, 18
    assert torch.equal(verify, batch[[0, 3, 4]])
    ref = ops.paged_attention(q[[0, 3, 4]], kc, vc, index[:19], 16, 0.25)  # the causal form: same maths
    assert torch.allclose(verify, ref, rtol=1e-5, atol=1e-6)


def _core(path: Path, spec: int, cache: bool = False) -> EngineCore:
    """An engine in ``--batch-invariant`` mode; skipped, with the reason, where this machine's BLAS
    makes the mode refuse to start (the device host's MKL at one thread: 64 x 128, 5 rows)."""
    try:
        runner = build_runner(open_model(path), page_size=8, mtp=spec > 0, batch_invariant=True)
    except RowInvarianceError as exc:
        pytest.skip(str(exc))
    return EngineCore(runner, EngineLimits(num_pages=96, num_state_slots=12, max_concurrency=4, token_budget=64,
                                           queue_size=8, max_context=512, chunk_tokens=24, prefix_cache=cache,
                                           speculative_tokens=spec))


def _same_states(seen: dict[SLOT_POS_KEY, list[torch.Tensor]], plain_seen: dict[SLOT_POS_KEY, list[torch.Tensor]],
                 what: object) -> int:
    """Every (request, position) the speculative run recorded equals the plain run's there, bit
    for bit (the speculative runner's KV has the MTP layer's K and V last); returns how many."""
    for key, tensors in seen.items():
        want = plain_seen[key]  # the plain run passed every position one token at a time
        assert len(tensors) == len(want) + 2
        for a, b in zip(tensors, want):
            assert torch.equal(a, b), (what, key)
    return len(seen)


def _recording(core: EngineCore) -> dict[SLOT_POS_KEY, list[torch.Tensor]]:
    """After every step, each running request's state-slot tensors and KV rows, keyed by
    (request, the position its slot holds)."""
    seen: dict[SLOT_POS_KEY, list[torch.Tensor]] = {}
    step, runner = core.step, core.runner

    def recorded() -> None:
        step()
        kv = runner.kv_store.kv
        for req in core.scheduler.running:
            slot = core.scheduler.blocks.state_slot(req.request_id)
            pos = runner._slot_pos[slot]
            pages = core.scheduler.blocks.block_table(req.request_id)
            rows = [p * 8 + i for p in pages for i in range(8)][:pos]
            kv_rows = [t.view(-1, *t.shape[2:])[rows].clone() for t in kv.page_tensors()]
            seen[(req.request_id, pos)] = [t[slot].clone() for t in runner.state.slot_tensors()] + kv_rows

    core.step = recorded  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("specs", [SPECS[:1], SPECS], ids=["batch-1", "batch-4"])
def test_states_after_partial_acceptance_are_plain_decodings_bit_for_bit(mtp_model: Path,  # noqa: F811
                                                                        specs: list) -> None:
    plain_core = _core(mtp_model, 0)
    require_row_invariant_gemm([tuple(m.weight.shape) for m in plain_core.runner.model.modules()
                                if isinstance(m, torch.nn.Linear)])
    plain_seen = _recording(plain_core)
    plain = _run(plain_core, specs)
    for k in (1, 3, 5):
        core = _core(mtp_model, k)
        seen = _recording(core)
        _oracle(core, plain, wrong=lambda i: i % 3 == 1)  # partial acceptances of every length
        assert _run(core, specs) == plain, k
        assert 0 < core.counters.spec_accepted < core.counters.spec_drafted
        assert _same_states(seen, plain_seen, k) > len(specs) * 4


def test_states_bit_for_bit_across_a_prefix_cache_restore(mtp_model: Path) -> None:  # noqa: F811
    """Turn 2 extends turn 1 and its reply and restores turn 1's cached state image in both runs;
    the speculative run's states after every round are the plain run's."""
    turn1 = _prompt(11, 40)
    plain_core, spec_core = _core(mtp_model, 0, cache=True), _core(mtp_model, 3, cache=True)
    plain_seen, seen = _recording(plain_core), _recording(spec_core)
    truth: dict[int, list[int]] = {}  # the drafter's continuations, filled turn by turn
    _oracle(spec_core, truth, wrong=lambda i: i % 3 == 1)
    truth.update(a1 := _run(plain_core, [(11, 40, 10, 0)], prompts={11: turn1}))
    assert _run(spec_core, [(11, 40, 10, 0)], prompts={11: turn1}) == a1
    turn2 = turn1 + a1[11] + _prompt(12, 15)
    truth.update(a2 := _run(plain_core, [(12, 0, 10, 0)], prompts={12: turn2}))
    assert _run(spec_core, [(12, 0, 10, 0)], prompts={12: turn2}) == a2
    assert spec_core.cache is not None and sum(spec_core.cache.counters.hit_tokens.values()) > 0
    assert 0 < spec_core.counters.spec_accepted < spec_core.counters.spec_drafted
    assert sum(rid == "12" for rid, _ in seen) >= 3  # turn 2's rounds recorded
    _same_states(seen, plain_seen, "turns")


def test_batch_invariant_refuses_what_it_does_not_cover(mtp_model: Path) -> None:  # noqa: F811
    with pytest.raises(ConfigError, match="device"):
        EngineConfig(batch_invariant=True, device="cuda")
    with pytest.raises(ConfigError, match="kv_dtype"):
        EngineConfig(batch_invariant=True, device="cpu", kv_dtype="nvfp4", page_size=64)
    with pytest.raises(ValueError, match="float KV cache"):
        build_runner(open_model(mtp_model), kv_dtype="int8", page_size=64, batch_invariant=True)
