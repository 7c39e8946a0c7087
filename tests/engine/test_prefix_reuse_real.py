"""The prefix-reuse invariant on real models (CPU, fp32 weights): a continuation served from a
reuse level gives exactly the greedy tokens, and logits within 1e-5 x max|logit|, of a cold
prefill of the same prompt; ``CacheHits`` names the level that served it.

Models: SmolLM2-135M (attention-only, the embedded GGUF) and a tiny random ``qwen3_5`` hybrid
(Gated DeltaNet + attention, head_dim 64); KV caches fp32 and nvfp4 (the cached pages and the
state images are the very bytes the first request wrote; the cold engine gets the same
calibration). Levels 3 and 4 go through a real KV-cache daemon process: the cached engine's
entries are spilled (the bytes of its pages and state image), dropped from the device, and
restored into fresh pages and a fresh slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deepwell.engine_service.engine import EngineCore, EngineLimits, FinishedEvent, TokensEvent
from deepwell.engine_service.kv.settings import KVSettings
from deepwell.engine_service.loading import open_model
from deepwell.engine_service.runner import TorchModelRunner, build_runner
from deepwell.engine_service.sampling import SamplingParams
from tests.engine.helpers_models import one_torch_thread  # noqa: F401 - fixture

PAGES = 24
TOL = 1e-5  # fp32 on CPU (and the float pool on CUDA)
KERNEL_TOL = 1e-3  # CUDA's quantized-KV kernels: their accumulation order differs between prefill and decode


@pytest.fixture(scope="module", autouse=True)
def _single_thread(one_torch_thread: None) -> Iterator[None]:  # noqa: F811
    yield


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TorchModelRunner]:
    """One loaded model per name (its weights shared by every runner built on it)."""
    from tests.engine.fixtures_smollm2 import smollm2_gguf_path
    from tests.engine.test_kv_quant import save_hybrid

    hybrid_dir = tmp_path_factory.mktemp("hybrid")
    save_hybrid(hybrid_dir)
    return {"smollm2": build_runner(open_model(smollm2_gguf_path())),
            "qwen3_5": build_runner(open_model(hybrid_dir))}


@pytest.fixture(scope="module")
def daemon() -> Iterator[object]:
    from tests.kvcache.kvtest_helpers import Daemon

    d = Daemon(arena_bytes=96 << 20, granule_bytes=1 << 20).start()
    yield d
    d.cleanup()


class Engines:
    """A caching engine and a cold one (no prefix cache) over the same weights and KV calibration;
    with ``daemon`` the caching one has a host tier."""

    def __init__(self, base: TorchModelRunner, kv: str, daemon: object = None) -> None:
        self.runners = [TorchModelRunner(base.model, base.device, torch.float32, KVSettings(kv), 64)
                        for _ in range(2)]
        self.cached, self.cold = (self._core(r, cache) for r, cache in zip(self.runners, (True, False), strict=True))
        if kv == "nvfp4":
            from deepwell.engine_service.kv.calibration import calibration_token_ids

            src, dst = self.runners
            src.calibrate_kv(calibration_token_ids(None, src.vocab_size)[0][:256], source="random_ids")
            q = src.kv_store.quant_pool()
            dst.kv_store.set_scales(q.scales(), None, q.k_feedbacks(), q.page_means(), q.sink_keys(), q.hadamard())
        self.logits: dict[int, list[torch.Tensor]] = {id(r): [] for r in self.runners}
        for r in self.runners:
            forward = r.forward

            def record(batch, forward=forward, r=r):  # type: ignore[no-untyped-def]
                out = forward(batch)
                self.logits[id(r)].extend(out)
                return out

            r.forward = record  # type: ignore[method-assign]
        self.client = None
        if daemon is not None:
            from deepwell.kvclient.client import KVClient
            from deepwell.engine_service.cache.host import HostTier

            self.client = KVClient(daemon.address, "test", rpc_timeout_s=5.0)  # type: ignore[attr-defined]
            assert self.client.start(10.0)
            r = self.runners[0]
            fp = f"{id(self)}-{kv}".encode()  # one engine's entries only
            self.cached.attach_host(HostTier(self.client, r, fingerprint=fp, page_size=64,
                                             hybrid=r.memory_spec().hybrid))

    def close(self) -> None:
        """The host tier first (it unpins the arena while its mapping lives), then the client."""
        host = self.cached.cache.host
        if host is not None:
            host.close()
        if self.client is not None:
            self.client.close()

    def spill_all(self) -> None:
        """Every device entry to the daemon, then off the device (what memory pressure does)."""
        cache = self.cached.cache
        for e in list(cache.entries.values()):
            assert cache.spill(e)
            cache.drop(e, "pressure")

    @staticmethod
    def _core(runner: TorchModelRunner, cache: bool) -> EngineCore:
        return EngineCore(runner, EngineLimits(num_pages=PAGES, num_state_slots=8, max_concurrency=2, token_budget=96,
                                               queue_size=4, max_context=PAGES * 64, prefix_cache=cache), eos_ids=())

    def run(self, core: EngineCore, prompt: list[int], max_tokens: int, pages: list | None = None,
            **kw) -> tuple[list[int], dict, torch.Tensor]:
        """Greedy tokens, CacheHits and the logits of the first generated token; with ``pages`` (and a
        quantized pool), the prompt's KV bytes when those logits came go there (``_token_kv_bytes``)."""
        events: list = []
        logs = self.logits[id(core.runner)]
        seen = len(logs)
        req = core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                sink=events.append, **kw)
        core.submit(req)
        while core.has_work():
            core.step()
            if pages is not None and not pages and len(logs) > seen and core.runner.kv_spec.quantized \
                    and torch.device(core.runner.device).type == "cpu":
                pages.extend(_token_kv_bytes(core.runner, core.scheduler.blocks.block_table(req.request_id),
                                             len(prompt)))
        core.blocks.check()
        fin = next(e for e in events if isinstance(e, FinishedEvent))
        return [t for e in events if isinstance(e, TokensEvent) for t in e.token_ids], fin.cached, logs[seen]

    def check(self, prompt: list[int], level: str, reused: int, **kw) -> None:
        pages: list[torch.Tensor] = []
        cold_pages: list[torch.Tensor] = []
        tokens, hits, first = self.run(self.cached, prompt, 4, pages, **kw)
        cold_tokens, cold_hits, cold_first = self.run(self.cold, prompt, 4, cold_pages)
        assert hits == {level: reused} and cold_hits == {}
        assert tokens == cold_tokens
        diff = float((first - cold_first).abs().max())
        quantized = self.runners[0].kv_spec.quantized
        tol = KERNEL_TOL if first.device.type == "cuda" and quantized else TOL
        differ = sum(int((a != b).sum()) for a, b in zip(pages, cold_pages, strict=True))
        if quantized and tol == TOL and differ:
            # a reuse that served wrong bytes (another page, a stale one) differs nearly everywhere;
            # rounding differs in a few positions' bytes (decode rows: 5 of 170 positions here)
            total = sum(a.numel() for a in pages)
            assert differ <= 0.1 * total, (level, f"{differ} of {total} KV bytes differ")
            # The reused KV is the very bytes the first request wrote, but a position it wrote while
            # decoding (one row) got its K/V from another GEMM than the cold prefill's (many rows):
            # the same floats up to their last bits, which may round to another nvfp4 code. Then the
            # logits differ by that code's effect (~1e-2), not by rounding: 1e-5 needs the same bytes.
            pytest.skip(f"{level}: the cold prefill quantized the prompt's KV to other bytes than the reused "
                        f"entries hold (this CPU's BLAS: a decode row's K/V differs from a prefill row's in its last "
                        f"bits); {differ} of {total} bytes; greedy tokens equal, logits differ by {diff:.3g}")
        assert diff <= tol * float(cold_first.abs().max()), (level, diff)


def _token_kv_bytes(runner: TorchModelRunner, table: list[int], n: int) -> list[torch.Tensor]:
    """Per attention layer the quantized pool's bytes (codes and scales) of positions 0..n-1 of the
    request whose pages are ``table``: ``[n, 2 (K, V), Hkv, token bytes]``."""
    out = []
    for cache in runner.kv_store.kv.caches:
        lay = cache.layout
        pos = torch.arange(n, device=cache.data.device)
        rows = pos % lay.page_size
        pages = torch.as_tensor(list(table), device=pos.device)[pos // lay.page_size]
        data = cache.data[pages]  # [n, 2, Hkv, head page bytes]
        per_kv = []
        for kv in (0, 1):
            idx = torch.cat([rows[:, None] * lay.code_bytes + torch.arange(lay.code_bytes, device=pos.device)[None, :],
                             lay.scale_offset + lay.scale_index(kv, rows)], dim=1)  # [n, token bytes]
            per_kv.append(data[:, kv].gather(-1, idx[:, None, :].expand(-1, data.shape[2], -1)))
        out.append(torch.stack(per_kv, dim=1))
    return out


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 5000), (n,), generator=g).tolist()


CASES = [(m, kv) for m in ("smollm2", "qwen3_5") for kv in ("fp32", "nvfp4")]


@pytest.mark.parametrize("model,kv", CASES)
def test_resident_frontier(bases: dict, model: str, kv: str) -> None:
    e = Engines(bases[model], kv)
    p1 = _prompt(1, 150, e.runners[0].vocab_size)  # 2 full pages + a partial one: copy-on-write
    gen, _, _ = e.run(e.cached, p1, 6)
    p2 = p1 + gen + _prompt(2, 20, e.runners[0].vocab_size)
    e.check(p2, "resident_frontier", 150 + 5)  # the 6th generated token was never fed back


@pytest.mark.parametrize("model,kv", CASES)
def test_resident_checkpoint(bases: dict, model: str, kv: str) -> None:
    e = Engines(bases[model], kv)
    p1 = _prompt(3, 140, e.runners[0].vocab_size)
    e.run(e.cached, p1, 3, turn_boundary=100)
    rewritten = p1[:120] + _prompt(4, 30, e.runners[0].vocab_size)  # history rewritten after 120
    # hybrid: the state exists at the turn boundary only; attention-only: any cut (here 120)
    e.check(rewritten, "resident_checkpoint", 100 if model == "qwen3_5" else 120)


@pytest.mark.parametrize("model,kv", CASES)
def test_shared_prefix(bases: dict, model: str, kv: str) -> None:
    e = Engines(bases[model], kv)
    vocab = e.runners[0].vocab_size
    system = _prompt(5, 90, vocab)  # the system prompt + tools every session sends
    e.run(e.cached, system + _prompt(6, 40, vocab), 2, session_key="t/a", prefix_boundary=90)
    e.check(system + _prompt(7, 25, vocab), "shared_prefix", 90, session_key="t/b", prefix_boundary=90)


@pytest.mark.parametrize("model,kv", CASES)
def test_host_entry(bases: dict, daemon: object, model: str, kv: str) -> None:
    e = Engines(bases[model], kv, daemon)
    try:
        p1 = _prompt(9, 150, e.runners[0].vocab_size)
        gen, _, _ = e.run(e.cached, p1, 6, turn_boundary=120, session_key="t/h")
        e.spill_all()
        p2 = p1 + gen + _prompt(10, 20, e.runners[0].vocab_size)
        e.check(p2, "host_entry", 155, session_key="t/h")
    finally:
        e.close()


@pytest.mark.parametrize("kv", ["fp32", "nvfp4"])
def test_session_lookup(bases: dict, daemon: object, kv: str) -> None:
    """Attention-only (a hybrid model resumes only at a state image, which the digest path
    always finds): a prompt that leaves the session's entry inside its first 64 tokens."""
    e = Engines(bases["smollm2"], kv, daemon)
    try:
        p1 = _prompt(11, 100, e.runners[0].vocab_size)
        e.run(e.cached, p1, 2, session_key="t/k")
        e.spill_all()
        e.check(p1[:40] + _prompt(12, 30, e.runners[0].vocab_size), "session_lookup", 40, session_key="t/k")
    finally:
        e.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp32", "nvfp4"])
def test_cuda_levels_with_the_host_tier(tmp_path_factory: pytest.TempPathFactory, daemon: object, kv: str) -> None:
    """On CUDA (the Triton KV kernels for nvfp4, the host tier's copy stream and page-locked arena):
    frontier, checkpoint and host entry equal a cold run of the tiny hybrid.

    The layer ops are the reference's (torch on CUDA, fp32): what is checked is that a reused
    entry holds what a cold run computes, to 1e-5. On fla's kernels (the default on CUDA) a
    resumed prefill splits the Gated DeltaNet's chunks elsewhere than the cold one, and fla
    multiplies fp32 through TF32 (agreement with the reference 3e-3, tests/kernels/test_gdn_fla.py),
    which no reuse check can tell from a wrong state at this size."""
    from tests.engine.test_kv_quant import save_hybrid

    d = tmp_path_factory.mktemp("hybrid-cuda")
    save_hybrid(d)
    base = build_runner(open_model(d), device="cuda", dtype=torch.float32, backend="reference")
    e = Engines(base, kv, daemon)
    try:
        vocab = e.runners[0].vocab_size
        p1 = _prompt(13, 150, vocab)
        gen, _, _ = e.run(e.cached, p1, 6, turn_boundary=120, session_key="t/c")
        e.spill_all()
        e.check(p1 + gen + _prompt(16, 9, vocab), "host_entry", 155, session_key="t/c")
        p2 = _prompt(17, 150, vocab)
        gen, _, _ = e.run(e.cached, p2, 6, turn_boundary=120, session_key="t/d")
        e.check(p2 + gen + _prompt(14, 20, vocab), "resident_frontier", 155, session_key="t/d")
        e.check(p2[:130] + _prompt(15, 30, vocab), "resident_checkpoint", 120, session_key="t/d")
    finally:
        e.close()


def test_other_kv_dtype_or_tenant_never_matches(bases: dict) -> None:
    """Entries live in one engine's pool, whose KV format is fixed: another format is another
    engine (the daemon's host entries carry the fingerprint). Tenants split one pool's entries."""
    e = Engines(bases["qwen3_5"], "fp32")
    p = _prompt(8, 120, e.runners[0].vocab_size)
    e.run(e.cached, p, 2, tenant="a", turn_boundary=100)
    tokens, hits, _ = e.run(e.cached, p[:110] + [9, 9], 2, tenant="b")
    assert hits == {}
    _, hits, _ = e.run(e.cached, p[:110] + [9, 9], 2, tenant="a")
    assert hits == {"resident_checkpoint": 100}


def test_entries_are_what_a_model_dir_says(tmp_path: Path) -> None:
    """(guard) the tiny hybrid really is hybrid and its head_dim fits nvfp4."""
    from tests.engine.test_kv_quant import save_hybrid

    save_hybrid(tmp_path)
    r = build_runner(open_model(tmp_path), kv_dtype="nvfp4")
    assert r.memory_spec().hybrid and r.kv_spec.quant_layout is not None
