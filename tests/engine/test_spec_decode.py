"""MTP speculative decoding on the real runner (CPU, fp32): outputs exactly as without it.

A tiny random Qwen3.5 hybrid with one MTP layer (random MTP weights: its drafts are almost
always rejected, which exercises the recurrent-state rollback at every step), and the same
engine with an *oracle* drafter that proposes the plain run's continuation with planted
mistakes (every acceptance length from none to all, and the bonus token). Greedy tokens equal
the non-speculative engine's through batching, chunked prefill, page boundaries, stop tokens,
max_tokens, the prefix cache and a quantized KV cache; the sampler's acceptance keeps the
sampling distribution.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepwell.engine_service.engine import EngineCore, EngineLimits, TokensEvent
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.models import build_model
from deepwell.engine_service.runner import build_runner
from deepwell.engine_service.sampling import SampleRow, Sampler, SamplingParams, make_generator
from tests.engine.helpers_models import save_tiny

SPECS = [(1, 37, 12, 0), (2, 9, 15, 0), (3, 70, 9, 1), (4, 21, 14, 3)]  # seed, prompt len, max tokens, arrival


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _add_mtp(d: Path) -> Path:
    """Give the HF directory ``d`` ``mtp_num_hidden_layers: 1`` and random ``mtp.*`` weights."""
    cfg = json.loads((d / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    model, _, _ = build_model(cfg)
    assert model.mtp is not None
    g = torch.Generator().manual_seed(7)
    mtp = {f"mtp.{k}": (torch.randn(v.shape, generator=g) * 0.08 if v.dim() > 1 else 1 + 0.1 * torch.randn(
        v.shape, generator=g)) for k, v in model.mtp.state_dict().items()}
    f = next(d.glob("*.safetensors"))
    save_file({**load_file(str(f)), **mtp}, str(f))
    return d


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen3_5 hybrid (head_dim 32) with one MTP layer."""
    d = tmp_path_factory.mktemp("qwen3_5_mtp")
    save_tiny("qwen3_5", d)
    return _add_mtp(d)


@pytest.fixture(scope="module")
def mtp_model64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with head_dim 64 (the quantized KV kernels need 64/128/256)."""
    from tests.engine.test_kv_quant import save_hybrid

    d = tmp_path_factory.mktemp("qwen3_5_mtp64")
    save_hybrid(d)
    return _add_mtp(d)


def _core(path: Path, spec: int, *, budget: int = 64, page_size: int = 8, pages: int = 96, chunk: int = 0,
          cache: bool = False, kv_dtype: str = "auto", eos: tuple[int, ...] = (), device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> EngineCore:
    runner = build_runner(open_model(path), device=device, dtype=dtype, page_size=page_size, kv_dtype=kv_dtype,
                          mtp=spec > 0)
    return EngineCore(runner, EngineLimits(num_pages=pages, num_state_slots=12, max_concurrency=4,
                                           token_budget=budget, queue_size=8, max_context=512, chunk_tokens=chunk,
                                           prefix_cache=cache, speculative_tokens=spec), eos_ids=eos)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(core: EngineCore, specs: list[tuple[int, int, int, int]], params: Callable[[int], SamplingParams] | None
         = None, prompts: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {s[0]: [] for s in specs}
    arrivals: dict[int, list] = {}
    for seed, n, mt, at in specs:
        def sink(ev, seed=seed) -> None:
            if isinstance(ev, TokensEvent):
                out[seed].extend(ev.token_ids)
        p = params(mt) if params else SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True)
        req = core.make_request((prompts or {}).get(seed) or _prompt(seed, n), p, sink=sink, request_id=str(seed))
        arrivals.setdefault(at, []).append(req)
    step = 0
    while step <= max(arrivals) or core.has_work():
        for req in arrivals.get(step, []):
            core.submit(req)
        core.step()
        step += 1
        assert step < 3000
    return out


def _oracle(core: EngineCore, truth: dict[int, list[int]], wrong: Callable[[int], bool]) -> None:
    """Replace the MTP drafts by the plain run's continuation, with position ``i`` of the output
    drafted wrong where ``wrong(i)`` (the engine's own drafting still runs: same page reservations)."""
    run = core._run

    def patched(plan, batch):  # type: ignore[no-untyped-def]
        sampled, drafts = run(plan, batch)
        for rid, d in drafts.items():
            req = core.scheduler.get(rid)
            assert req is not None
            done = len(req.output_ids) + len(sampled[rid])
            want = truth[int(rid)][done: done + len(d)]
            drafts[rid] = [(t + 1) % 250 if wrong(done + i) else t for i, t in enumerate(want)]
            drafts[rid] = drafts[rid] or d
        return sampled, drafts

    core._run = patched  # type: ignore[method-assign]


def test_mtp_drafts_rejected_or_not_tokens_equal_plain(mtp_model: Path) -> None:
    plain = _run(_core(mtp_model, 0), SPECS)
    core = _core(mtp_model, 3)
    assert core.runner.mtp_layers == 1
    assert _run(core, SPECS) == plain
    c = core.counters
    assert c.spec_rounds > 0 and c.spec_drafted >= c.spec_rounds
    assert core.blocks.used_pages == 0 and core.blocks.used_slots == 0


@pytest.mark.parametrize(("k", "budget", "page_size", "chunk"), [(3, 64, 8, 0), (4, 7, 4, 0), (2, 32, 16, 5),
                                                                 (6, 13, 8, 0)])
def test_every_acceptance_length_gives_the_plain_tokens(mtp_model: Path, k: int, budget: int, page_size: int,
                                                        chunk: int) -> None:
    plain = _run(_core(mtp_model, 0), SPECS)
    core = _core(mtp_model, k, budget=budget, page_size=page_size, chunk=chunk)
    _oracle(core, plain, wrong=lambda i: i % 7 in (2, 5))
    assert _run(core, SPECS) == plain
    c = core.counters
    assert 0 < c.spec_accepted < c.spec_drafted  # some accepted, some not
    assert core.blocks.used_pages == 0 and core.blocks.used_slots == 0


def test_all_drafts_right_takes_few_steps(mtp_model: Path) -> None:
    spec = [(2, 9, 15, 0)]
    plain = _run(_core(mtp_model, 0), spec)
    core = _core(mtp_model, 4)
    _oracle(core, plain, wrong=lambda i: False)
    assert _run(core, spec) == plain
    c = core.counters
    assert c.spec_accepted == c.spec_drafted  # every draft kept
    assert c.steps <= 1 + -(-14 // 5)  # prefill, then 5 tokens per verify step


def test_all_drafts_wrong_takes_one_token_per_step(mtp_model: Path) -> None:
    spec = [(2, 9, 15, 0)]
    plain = _run(_core(mtp_model, 0), spec)
    core = _core(mtp_model, 4)
    _oracle(core, plain, wrong=lambda i: True)
    assert _run(core, spec) == plain
    c = core.counters
    assert c.spec_accepted == 0 and c.spec_drafted > 0  # every draft rejected
    assert c.steps == 15  # prefill (its token), then one token per verify step: the plain run's count


def test_stop_token_and_max_tokens_inside_a_verify_slice(mtp_model: Path) -> None:
    spec = [(1, 37, 20, 0), (3, 70, 6, 0)]
    plain = _run(_core(mtp_model, 0), spec)
    stop = plain[1][9]  # a token the first request generates 10th
    first = plain[1].index(stop)

    def params(mt: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=mt, stop_token_ids=(stop,))

    expect = _run(_core(mtp_model, 0), spec, params)
    assert expect[1] == plain[1][:first]  # the stop token ends it, unshown
    core = _core(mtp_model, 5)
    _oracle(core, plain, wrong=lambda i: False)
    assert _run(core, spec, params) == expect
    assert core.blocks.used_pages == 0


def test_prefix_cache_turns_with_speculation(mtp_model: Path) -> None:
    """Turn 2 extends turn 1's prompt and reply: it reuses the cache and decodes the same tokens."""
    turn1 = _prompt(11, 40)
    plain_core, spec_core = _core(mtp_model, 0, cache=True), _core(mtp_model, 3, cache=True)
    a1 = _run(plain_core, [(11, 40, 10, 0)], prompts={11: turn1})
    b1 = _run(spec_core, [(11, 40, 10, 0)], prompts={11: turn1})
    assert a1 == b1
    turn2 = turn1 + a1[11] + _prompt(12, 15)
    a2 = _run(plain_core, [(12, 0, 10, 0)], prompts={12: turn2})
    b2 = _run(spec_core, [(12, 0, 10, 0)], prompts={12: turn2})
    assert a2 == b2
    assert spec_core.cache is not None and sum(spec_core.cache.counters.hit_tokens.values()) > 0


def test_quantized_kv_with_speculation(mtp_model64: Path) -> None:
    spec = SPECS[:2]
    base = _core(mtp_model64, 0, page_size=64, kv_dtype="nvfp4")
    base.runner.calibrate_kv(_prompt(5, 96))
    plain = _run(base, spec)
    core = _core(mtp_model64, 3, page_size=64, kv_dtype="nvfp4")
    cal = core.runner.calibrate_kv(_prompt(5, 96))  # the MTP layer's K/V calibrated too: one more layer
    assert cal is not None and len(cal.scales) == len(base.runner.kv_calibration.scales) + 1
    _oracle(core, plain, wrong=lambda i: i % 4 == 1)
    assert _run(core, spec) == plain
    assert core.counters.spec_accepted > 0


@pytest.mark.gpu
@pytest.mark.timeout(900)  # the first run compiles every kernel the tiny model's shapes need
@pytest.mark.parametrize("kv_dtype", ["auto", "nvfp4"])
def test_cuda_backend_speculation_equals_plain(mtp_model64: Path, kv_dtype: str) -> None:
    """On CUDA (fla-core's recurrent kernel for verify and commit, the Triton KV kernels), fp32."""
    kw = {"device": "cuda", "page_size": 64, "kv_dtype": kv_dtype}
    plain = _run(_core(mtp_model64, 0, **kw), SPECS)
    core = _core(mtp_model64, 3, **kw)
    _oracle(core, plain, wrong=lambda i: i % 5 == 2)
    assert _run(core, SPECS) == plain
    assert 0 < core.counters.spec_accepted < core.counters.spec_drafted
    assert _run(_core(mtp_model64, 3, **kw), SPECS) == plain  # the MTP drafter itself


def test_speculation_needs_mtp_weights(tmp_path: Path) -> None:
    save_tiny("qwen3_5", tmp_path)
    runner = build_runner(open_model(tmp_path), page_size=8, mtp=True)  # logged, not enabled
    assert runner.mtp_layers == 0
    with pytest.raises(ValueError, match="MTP"):
        EngineCore(runner, EngineLimits(num_pages=16, num_state_slots=2, max_concurrency=1, token_budget=16,
                                        queue_size=2, max_context=128, speculative_tokens=2))


# -- the sampler's acceptance ---------------------------------------------------------------
def _row(params: SamplingParams, seed: int, output: list[int] | None = None) -> SampleRow:
    return SampleRow(params=params, prompt_ids=[1, 2], output_ids=output or [],
                     generator=None if params.greedy else make_generator(seed, torch.device("cpu")))


def test_greedy_verify_is_sequential_sampling_with_penalties() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, generator=g)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5)
    s = Sampler()
    seq: list[int] = []  # what plain decoding picks row by row
    for j in range(4):
        seq.append(s.sample(logits[j: j + 1], [_row(p, 0, [5, *seq])])[0].token_id)
    got = [x.token_id for x in s.verify(logits, _row(p, 0, [5]), seq[:3])]
    assert got == seq  # all three drafts kept, then the bonus
    wrong = [seq[0], (seq[1] + 1) % 12, seq[2]]
    got = [x.token_id for x in s.verify(logits, _row(p, 0, [5]), wrong)]
    assert got == seq[:2]  # the first draft, then the model's own token where the second was wrong


@pytest.mark.parametrize("min_tokens", [0, 4])
def test_plain_greedy_verify_reads_every_row_at_once_with_the_same_tokens(min_tokens: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy without penalties or logprobs: one argmax over all rows (one host read), the same
    tokens as row-by-row sampling; min_tokens still pending keeps the row-by-row path (EOS banned)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 12, generator=g)
    logits[2, 7] = logits[2].max() + 1  # row 2's argmax: the EOS id below
    p = SamplingParams(temperature=0.0, min_tokens=min_tokens)
    row = SampleRow(params=p, prompt_ids=[1], output_ids=[4], generator=None, eos_ids=(7,))
    s = Sampler()
    seq: list[int] = []
    for j in range(5):
        r = SampleRow(params=p, prompt_ids=[1], output_ids=[4, *seq], generator=None, eos_ids=(7,))
        seq.append(s.sample(logits[j: j + 1], [r])[0].token_id)
    calls: list[int] = []
    real_argmax = torch.argmax
    monkeypatch.setattr(torch, "argmax", lambda x, *a, **kw: calls.append(x.dim()) or real_argmax(x, *a, **kw))
    got = [x.token_id for x in s.verify(logits, row, seq[:4])]
    assert got == seq and (7 in seq) == (min_tokens == 0)
    assert (calls == [2]) == (min_tokens == 0)  # one call over every row, or one per row
    wrong = [seq[0], seq[1], (seq[2] + 1) % 12, seq[3]]
    assert [x.token_id for x in s.verify(logits, row, wrong)] == seq[:3]


def test_rejection_sampling_keeps_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])
    p = SamplingParams(temperature=0.9, top_k=5)
    probs = Sampler._probs(logits / 1.0, [_row(p, 0)])[0]
    n = 4000
    for draft in (0, 5, 4):  # a likely, the likeliest and a filtered-out (top_k) draft
        counts = torch.zeros(6)
        for seed in range(n):
            tok = Sampler().verify(torch.cat([logits, logits]), _row(p, seed), [draft])[0].token_id
            counts[tok] += 1
        assert torch.allclose(counts / n, probs, atol=0.025), (draft, counts / n, probs)
    assert float(probs[4]) == 0.0  # top_k=5 drops the worst token


# -- the engine process --------------------------------------------------------------------
async def test_engine_process_speculates_and_reports_it(mtp_model: Path, tmp_path: Path) -> None:
    """``--speculative-tokens 2`` over gRPC: ModelInfo says so, the tokens equal a run without,
    Usage carries the request's drafted / accepted counts and /metrics the totals."""
    import asyncio
    import urllib.request

    from deepwell import grpcx
    from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
    from tests.engine.helpers_process import engine_process

    ids = _prompt(3, 30)
    sampling = engine_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for k in (0, 2):
        args = ["--model", str(mtp_model), "--num-pages", "40", "--page-size", "8", "--token-budget", "24",
                "--log-level", "warning", "--cpu-threads", "1", "--speculative-tokens", str(k)]
        (tmp_path / f"k{k}").mkdir()
        with engine_process(tmp_path / f"k{k}", args) as (address, metrics_url):
            async with grpcx.aio_channel(address) as ch:
                stub = engine_pb2_grpc.EngineStub(ch)
                info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
                assert info.speculative_tokens == k
                msgs = [m async for m in stub.Generate(engine_pb2.GenerateRequest(prompt_token_ids=ids,
                                                                                  sampling=sampling))]
            got[k] = [t for m in msgs if m.HasField("tokens") for t in m.tokens.token_ids]
            usage = msgs[-1].finished.usage
            text = await asyncio.to_thread(lambda u=metrics_url: urllib.request.urlopen(u, timeout=10).read().decode())
        drafted = usage.spec_draft_tokens
        assert (drafted > 0) == (k > 0) and usage.spec_accepted_tokens <= drafted
        if k:
            assert f'deepwell_engine_spec_draft_tokens_total{{model="{info.model_id}"}} {float(drafted)}' in text
            assert "deepwell_engine_spec_accepted_per_round_count" in text
    assert got[2] == got[0] and len(got[0]) == 12


def test_speculative_tokens_without_mtp_refuses_to_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    save_tiny("qwen3_5", tmp_path)
    r = subprocess.run([sys.executable, "-m", "deepwell.engine_service", "--model", str(tmp_path), "--speculative-tokens",
                        "2", "--num-pages", "16", "--metrics-port", "-1"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "no MTP weights" in r.stderr


def test_auto_drafts_where_the_model_has_mtp() -> None:
    from types import SimpleNamespace

    from deepwell.engine_service.cli import speculative_tokens
    from deepwell.engine_service.config import DEFAULT_SPECULATIVE_TOKENS, EngineConfig

    mtp = SimpleNamespace(mtp_layers=1)
    auto, two, off = (EngineConfig(speculative_tokens=n) for n in (-1, 2, 0))
    assert speculative_tokens(auto, mtp) == DEFAULT_SPECULATIVE_TOKENS  # graphed or eager alike
    assert speculative_tokens(two, mtp) == 2
    assert speculative_tokens(off, mtp) == 0
    assert speculative_tokens(auto, SimpleNamespace(mtp_layers=0)) == 0


# -- a step of verify slices of one length: batched (context.VerifyGroup) -------------------
def _verify_runner(path: Path, groups: bool):  # type: ignore[no-untyped-def]
    from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice

    r = build_runner(open_model(path), page_size=64, kv_dtype="nvfp4")
    r.allocate(8, 4)
    r.calibrate_kv(_prompt(5, 96))
    r.verify_groups = groups
    for slot in range(3):
        r.reset_state(slot)
    lens = (30, 45, 20)
    r.forward(ForwardBatch(torch.tensor([t for i, n in enumerate(lens) for t in _prompt(40 + i, n)]),
                           [SeqSlice(i, [2 * i, 2 * i + 1], 0, n) for i, n in enumerate(lens)]))
    return r, lens, ForwardBatch, SeqSlice


def test_masked_replay_is_the_shorter_run_bit_for_bit() -> None:
    """The group commit's two tricks: a zero gate and beta leave the recurrent state exactly as
    it was, and the conv state after L tokens is a gather of the last K-1 inputs."""
    from deepwell.engine_service.layers.backend import get_backend
    from deepwell.engine_service.layers.gdn import conv_after

    ops = get_backend("reference")
    g = torch.Generator().manual_seed(0)
    b, t, hk, hv, dk, dv, c = 3, 5, 2, 4, 8, 6, 12
    q, k = torch.randn(b, t, hk, dk, generator=g), torch.randn(b, t, hk, dk, generator=g)
    v = torch.randn(b, t, hv, dv, generator=g)
    gate, beta = -torch.rand(b, t, hv, generator=g), torch.rand(b, t, hv, generator=g)
    states = torch.randn(b, hv, dk, dv, generator=g)
    lengths = torch.tensor([0, 2, 5])
    keep = (torch.arange(t)[None] < lengths[:, None])[..., None]
    _, masked = ops.gated_delta_rule_multi(q, k, v, torch.where(keep, gate, 0.0), torch.where(keep, beta, 0.0), states)
    x, conv0, w = torch.randn(b, t, c, generator=g), torch.randn(b, c, 3, generator=g), torch.randn(c, 4, generator=g)
    conv = conv_after(conv0, x, w, lengths)
    for i, n in enumerate(lengths.tolist()):
        _, short = ops.gated_delta_rule_multi(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], gate[i:i + 1, :n],
                                              beta[i:i + 1, :n], states[i:i + 1])
        assert torch.equal(masked[i], short[0])
        _, cs = ops.causal_conv1d_multi(x[i:i + 1, :n], conv0[i:i + 1], w)
        assert torch.equal(conv[i], cs[0])


def test_verify_group_commits_the_states_of_plain_decode_steps(mtp_model64: Path) -> None:
    """B = 3 verify slices of T = 4 in one batched step, then 0, 2 and 4 tokens accepted: every
    slot's recurrent and conv state that of decode steps over the same tokens, the logits of the
    accepted rows those steps' logits (within fp32 rounding: the linear layers see 12 rows
    instead of 1-3, so BLAS sums in another order; the slice-by-slice path differs alike)."""
    t = 4
    drafts = [_prompt(60 + i, t) for i in range(3)]
    accept = {0: 0, 1: 2, 2: 4}
    g, lens, ForwardBatch, SeqSlice = _verify_runner(mtp_model64, True)
    calls = []
    orig = g._context
    g._context = lambda *a: calls.append(orig(*a)) or calls[-1]  # type: ignore[method-assign]
    logits = g.forward(ForwardBatch(torch.tensor([x for d in drafts for x in d]),
                                    [SeqSlice(i, [2 * i, 2 * i + 1], lens[i], t, verify=True) for i in range(3)]))
    assert calls[-1].verify_group is not None and calls[-1].verify_group.tokens_per_seq == t
    g.accept_many(accept)
    p, *_ = _verify_runner(mtp_model64, True)
    rows = {i: [] for i in range(3)}
    for step in range(t):
        live = [i for i in range(3) if step < accept[i]]
        if not live:
            break
        out = p.forward(ForwardBatch(torch.tensor([drafts[i][step] for i in live]),
                                     [SeqSlice(i, [2 * i, 2 * i + 1], lens[i] + step, 1) for i in live]))
        for j, i in enumerate(live):
            rows[i].append(out[j])
    for i in range(3):
        for a, b in zip(g.state.slot_tensors(), p.state.slot_tensors(), strict=True):
            assert torch.allclose(a[i], b[i], rtol=1e-5, atol=1e-5), f"slot {i}"
            assert accept[i] or torch.equal(a[i], b[i])  # nothing accepted: untouched
        for step, row in enumerate(rows[i]):
            assert torch.allclose(logits[i * t + step], row, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no verify slice"):
        g.accept_many({0: 1})  # committed already


def test_verify_group_tokens_equal_slice_by_slice(mtp_model64: Path) -> None:
    """The engine with batched verify steps gives the tokens of verify slices run one by one
    and of no speculation, for k = 1..5, four requests of staggered arrival."""
    base = _core(mtp_model64, 0, page_size=64, kv_dtype="nvfp4")
    base.runner.calibrate_kv(_prompt(5, 96))
    plain = _run(base, SPECS)
    for k in (1, 2, 5):
        for groups in (True, False):
            core = _core(mtp_model64, k, page_size=64, kv_dtype="nvfp4")
            core.runner.calibrate_kv(_prompt(5, 96))
            core.runner.verify_groups = groups
            _oracle(core, plain, wrong=lambda i: i % 5 in (1, 3))
            assert _run(core, SPECS) == plain, (k, groups)
            assert 0 < core.counters.spec_accepted < core.counters.spec_drafted


def test_graphed_verify_steps_give_the_plain_tokens(mtp_model64: Path) -> None:
    """Verify steps and their group commits through ``graphs.DecodeGraphs`` (the static-buffer
    steps a CUDA capture records, run eagerly on CPU), padded to their buckets: the tokens of
    no speculation, with every acceptance length."""
    from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice

    base = _core(mtp_model64, 0, page_size=64, kv_dtype="nvfp4")
    base.runner.calibrate_kv(_prompt(5, 96))
    plain = _run(base, SPECS)
    k = 3
    runner = build_runner(open_model(mtp_model64), page_size=64, kv_dtype="nvfp4", mtp=True)
    runner.plan_graphs(4, verify_tokens=k + 1)
    core = EngineCore(runner, EngineLimits(num_pages=96, num_state_slots=12, max_concurrency=4, token_budget=64,
                                           queue_size=8, max_context=512, speculative_tokens=k), eos_ids=())
    runner.calibrate_kv(_prompt(5, 96))
    g = runner.capture_graphs(capture=False)
    assert g.shapes[-1] == (4, k + 1) and g.describe()["verify_tokens"] == k + 1
    diff, scale = g.check()
    assert diff == 0.0 and scale > 0
    _oracle(core, plain, wrong=lambda i: i % 5 in (1, 3))
    assert _run(core, SPECS) == plain
    assert g.verify_replays > 0 and 0 < core.counters.spec_accepted < core.counters.spec_drafted
    dg = runner.draft_graphs
    assert dg is not None and dg.verify_replays > 0
    hidden = torch.zeros(k + 1, runner.args.hidden, dtype=runner.dtype)
    with pytest.raises(ValueError, match="does not cover"):  # checked before anything runs
        dg.run_after_verify(hidden, [70], [[1, 2]], [2], [[0]])
    with pytest.raises(ValueError, match="kept rows"):
        dg.run_after_verify(hidden, [5], [[1] * (k + 2)], [1], [[0]])
    assert not dg.accepts_verify(1, [k + 2], [1]) and not dg.accepts_verify(5, [1] * 5, [1] * 5)
    # a verify slice of another length, or mixed with a decode slice, runs eagerly
    assert not g.accepts(ForwardBatch(torch.tensor([1, 2]), [SeqSlice(0, [0], 5, 2, verify=True)]))
    assert not g.accepts(ForwardBatch(torch.tensor([1] * 5), [SeqSlice(0, [0], 5, 4, verify=True),
                                                             SeqSlice(1, [1], 5, 1)]))
    with pytest.raises(ValueError, match="verify_tokens"):
        build_runner(open_model(mtp_model64), page_size=64, kv_dtype="nvfp4").plan_graphs(2, verify_tokens=65)


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_captured_verify_steps_equal_plain_on_gpu(mtp_model64: Path) -> None:
    """Verify steps and their commits captured as CUDA graphs (fp32 model, nvfp4 KV): the tokens
    of the same engine without speculation, and the start-up check passes."""
    from deepwell.engine_service.graphs import CHECK_TOLERANCE

    kw = {"device": "cuda", "page_size": 64, "kv_dtype": "nvfp4"}
    plain = _run(_core(mtp_model64, 0, **kw), SPECS)
    k = 3
    runner = build_runner(open_model(mtp_model64), device="cuda", dtype=torch.float32, page_size=64,
                          kv_dtype="nvfp4", mtp=True)
    runner.plan_graphs(4, verify_tokens=k + 1)
    core = EngineCore(runner, EngineLimits(num_pages=96, num_state_slots=12, max_concurrency=4, token_budget=64,
                                           queue_size=8, max_context=512, speculative_tokens=k), eos_ids=())
    g = runner.capture_graphs()
    diff, scale = g.check()
    assert diff <= CHECK_TOLERANCE * max(scale, 1.0), (diff, scale)
    assert g.describe()["verify_captured"] == [1, 2, 4]
    _oracle(core, plain, wrong=lambda i: i % 5 in (1, 3))
    assert _run(core, SPECS) == plain
    assert g.verify_replays > 0 and runner.draft_graphs is not None and runner.draft_graphs.verify_replays > 0


def test_graphed_drafting_drafts_what_the_eager_loop_drafts(mtp_model64: Path) -> None:
    """The MTP draft chain through ``draft_graphs.DraftGraphs`` (static buffers, masked steps for
    sequences wanting fewer drafts, padding rows; after verify steps the MTP pass over every
    verify row in front of it, filler rows on the scratch page) drafts the eager loop's tokens:
    the same number accepted, and the plain tokens."""
    plain = _run(_core(mtp_model64, 0, page_size=64, kv_dtype="nvfp4"), SPECS)
    accepted = {}
    for graphs in (False, True):
        runner = build_runner(open_model(mtp_model64), page_size=64, kv_dtype="nvfp4", mtp=True)
        runner.plan_graphs(4, verify_tokens=4)
        core = EngineCore(runner, EngineLimits(num_pages=96, num_state_slots=12, max_concurrency=4, token_budget=64,
                                               queue_size=8, max_context=512, speculative_tokens=3), eos_ids=())
        if graphs:
            runner.capture_graphs(capture=False)
        seen: list[list[list[int]]] = []
        propose = runner.propose
        runner.propose = lambda inputs, f=propose: seen.append(f(inputs)) or seen[-1]  # type: ignore[method-assign]
        assert _run(core, SPECS) == plain
        accepted[graphs] = (seen, core.counters.spec_drafted, core.counters.spec_accepted)
        if graphs:  # chains after prefill steps, and MTP passes + chains after verify steps
            assert runner.draft_graphs is not None and runner.draft_graphs.replays > 0
            assert runner.draft_graphs.verify_replays > 0
    assert accepted[True] == accepted[False]
    assert any(len(d) == 3 for call in accepted[True][0] for d in call)  # whole chains were drafted


def test_fp8_weights_draft_through_an_fp8_copy_of_the_head(mtp_model64: Path) -> None:
    """With FP8 weights, drafting reads ``model.draft_head`` (the LM head in FP8: half the bytes
    per draft) for calls of fewer than 128 rows, the 16-bit head for more; the main model's
    logits keep the 16-bit head, so the tokens are those of plain decoding, with the graphed
    chain too. Without speculation, or with 16-bit weights, there is no copy."""
    from torch import nn

    from deepwell.engine_service.layers.fp8_linear import FP8Linear, dequant_bytes

    def limits(spec: int) -> EngineLimits:
        return EngineLimits(num_pages=96, num_state_slots=12, max_concurrency=4, token_budget=64, queue_size=8,
                            max_context=512, speculative_tokens=spec)

    paged = dict(page_size=64, kv_dtype="nvfp4", weight_dtype="fp8")  # graphs need a paged KV
    plain = _run(EngineCore(build_runner(open_model(mtp_model64), **paged), limits(0), eos_ids=()), SPECS)
    runner = build_runner(open_model(mtp_model64), mtp=True, **paged)
    model = runner.model
    assert isinstance(model.draft_head, FP8Linear) and isinstance(model.lm_head, nn.Linear)
    h = torch.randn(130, model.args.hidden)
    assert torch.equal(model.draft_logits(h[:5]), model.draft_head(h[:5]).float())
    assert torch.equal(model.draft_logits(h), model.lm_head(h).float())  # 130 rows: the 16-bit head
    assert not torch.equal(model.draft_head(h[:5]), model.lm_head(h[:5]))
    assert dequant_bytes(model, torch.float32) < model.draft_head.weight.numel() * 4  # never dequantized
    calls = []
    head_forward = model.draft_head.forward
    model.draft_head.forward = lambda x: calls.append(x.shape[0]) or head_forward(x)  # type: ignore[method-assign]
    runner.plan_graphs(4, verify_tokens=4)
    core = EngineCore(runner, limits(3), eos_ids=())
    runner.capture_graphs(capture=False)  # the static-buffer chain (CUDA graphs replay the same steps)
    assert _run(core, SPECS) == plain
    assert calls and core.counters.spec_drafted > 0
    assert runner.draft_graphs is not None and runner.draft_graphs.replays > 0
    assert build_runner(open_model(mtp_model64), weight_dtype="fp8").model.draft_head is None
    assert build_runner(open_model(mtp_model64), mtp=True).model.draft_head is None


def test_fp8_draft_head_can_be_turned_off(mtp_model64: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPWELL_FP8_DRAFT_HEAD", "0")
    assert build_runner(open_model(mtp_model64), weight_dtype="fp8", mtp=True).model.draft_head is None
    monkeypatch.setenv("DEEPWELL_FP8_DRAFT_HEAD", "yes")
    from deepwell import configs
    from deepwell.engine_service import cli
    from deepwell.engine_service.config import EngineConfig

    cfg = EngineConfig(model=str(mtp_model64), weight_dtype="fp8", speculative_tokens=2)
    with pytest.raises(configs.ConfigError, match="invalid environment: DEEPWELL_FP8_DRAFT_HEAD='yes'"):
        cli._build_runner(build_runner, cfg, open_model(mtp_model64), "cpu", torch.float32)


def test_speculation_across_a_host_restore(mtp_model: Path) -> None:
    """Turn 1 decodes with speculation (every acceptance length), its cache entries spill to a
    real KV-cache daemon and leave the device; turn 2 is restored from the daemon (the MTP
    layer's KV travels in the entry) and decodes, speculating, the tokens of a cold plain run."""
    import time

    from deepwell.engine_service.cache.host import HostTier
    from deepwell.kvclient.client import KVClient
    from tests.kvcache.kvtest_helpers import Daemon

    turn1 = _prompt(21, 40)
    plain = _core(mtp_model, 0)
    a1 = _run(plain, [(21, 40, 10, 0)], prompts={21: turn1})[21]
    turn2 = turn1 + a1 + _prompt(22, 12)
    a2 = _run(plain, [(22, 0, 10, 0)], prompts={22: turn2})[22]
    daemon = Daemon(arena_bytes=32 << 20, granule_bytes=1 << 20).start()
    client = KVClient(daemon.address, "test", rpc_timeout_s=5.0)
    host = None
    try:
        assert client.start(10.0)
        core = _core(mtp_model, 3, cache=True)
        host = HostTier(client, core.runner, fingerprint=b"spec-host", page_size=8,
                        hybrid=core.runner.memory_spec().hybrid)
        core.attach_host(host)
        truth = {21: a1, 22: a2}
        _oracle(core, truth, wrong=lambda i: i % 3 == 1)

        def run(seed: int, prompt: list[int]) -> list[int]:
            out: list[int] = []
            core.submit(core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                          sink=lambda ev: out.extend(ev.token_ids) if isinstance(ev, TokensEvent)
                                          else None, request_id=str(seed)))
            deadline = time.monotonic() + 60
            while core.has_work() and time.monotonic() < deadline:
                if core.step() == 0:
                    time.sleep(0.001)  # a restore on the host tier's worker
            return out

        assert run(21, turn1) == a1
        with core.lock:
            for e in list(core.cache.entries.values()):
                assert core.cache.spill(e)
                core.cache.drop(e, "pressure")
        assert not core.cache.entries
        assert run(22, turn2) == a2
        assert host.counters.restores == {"ok": 1, "failed": 0}
        assert 0 < core.counters.spec_accepted < core.counters.spec_drafted
        core.blocks.check()  # (the cache holds turn 2's entries)
    finally:
        if host is not None:
            host.close()
        client.close()
        daemon.cleanup()


def test_a_verify_commit_keeps_only_its_own_rows(mtp_model64: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify slice beside a prefill chunk: the commits kept until ``accept`` hold copies of
    the slice's rows, never views of the step's projection outputs (a 4k prefill chunk beside a
    verify slice once kept every GDN layer's, 22 GiB at the 27B shape)."""
    from deepwell.engine_service.layers.gdn import GatedDeltaNet

    g, lens, ForwardBatch, SeqSlice = _verify_runner(mtp_model64, False)
    step_storages: set[int] = set()
    project = GatedDeltaNet._project

    def recording(self, x):  # type: ignore[no-untyped-def]
        out = project(self, x)
        step_storages.update(t.untyped_storage().data_ptr() for t in out)
        return out

    monkeypatch.setattr(GatedDeltaNet, "_project", recording)
    t, chunk = 4, 120
    g.forward(ForwardBatch(torch.tensor(_prompt(70, t) + _prompt(71, chunk)),
                           [SeqSlice(0, [0, 1], lens[0], t, verify=True), SeqSlice(3, [6, 7], 0, chunk)]))
    commits = g._verify.commits[0]
    assert commits and step_storages
    for commit in commits:
        held = [c.cell_contents for c in commit.__closure__ or () if isinstance(c.cell_contents, torch.Tensor)]
        assert held
        assert not {h.untyped_storage().data_ptr() for h in held} & step_storages
    g.accept(0, 2)
