"""The real engine process (``python -m deepwell.engine_service``) on a tiny hybrid model, over gRPC."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deepwell import grpcx
from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.engine.helpers_process import engine_process

VOCAB = 256  # tests.engine.helpers_models.VOCAB
TOKENIZER_BYTES = 2_500_123  # > 2 MiB: ReadModelFile must stream it in 3 chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.helpers_models import save_tiny

    d = tmp_path_factory.mktemp("tiny_qwen3_5")
    save_tiny("qwen3_5", d)
    blob = json.dumps({"pad": "x" * TOKENIZER_BYTES})[:TOKENIZER_BYTES - 2] + '"}'
    (d / "tokenizer.json").write_text(blob)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    return d


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    run_dir = tmp_path_factory.mktemp("engine")
    with engine_process(run_dir, [
        "--model", str(model_dir), "--num-pages", "40", "--page-size", "8", "--max-concurrency", "4",
        "--token-budget", "24", "--queue-size", "8", "--log-level", "warning", "--cpu-threads", "1",
        "--device", "cpu",  # what the tests expect (fp32 KV etc.), also where a GPU is visible
    ]) as (address, metrics_url):
        yield address, metrics_url  # type: ignore[misc]


def greedy(max_tokens: int, **kw) -> engine_pb2.SamplingParams:
    return engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 37 + i * 11) % (VOCAB - 3) + 3 for i in range(n)]


async def generate(stub, ids: list[int], sampling: engine_pb2.SamplingParams, **kw) -> list:
    return [m async for m in stub.Generate(engine_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling, **kw))]


def tokens_of(msgs: list) -> list[int]:
    return [t for m in msgs if m.HasField("tokens") for t in m.tokens.token_ids]


async def baseline(stub) -> engine_pb2.EngineStats:
    """Wait until nothing runs, then return Stats."""
    for _ in range(200):
        s = await stub.Stats(engine_pb2.StatsRequest())
        if s.requests_running == 0 and s.requests_waiting == 0:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine never went idle: {s}")


async def test_streaming_generate(engine) -> None:
    addr, _ = engine
    async with grpcx.aio_channel(addr) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        msgs = await generate(stub, prompt(20, 1), greedy(6, logprobs=2), request_id="s1")
        kinds = [m.WhichOneof("event") for m in msgs]
        assert kinds[0] == "admitted" and kinds[-1] == "finished" and set(kinds[1:-1]) == {"tokens"}
        assert (msgs[0].admitted.request_id, msgs[0].admitted.prompt_tokens, msgs[0].admitted.max_tokens) == (
            "s1", 20, 6)
        fin = msgs[-1].finished
        toks = tokens_of(msgs)
        assert fin.reason in (engine_pb2.FINISH_REASON_LENGTH, engine_pb2.FINISH_REASON_STOP)
        assert fin.usage.prompt_tokens == 20
        assert fin.usage.completion_tokens == len(toks) + (1 if fin.HasField("stop_token_id") else 0)
        assert fin.usage.cached.resident_frontier == 0
        assert fin.timings.ttft_ms > 0
        assert all(len(m.tokens.logprobs) == 1 and len(m.tokens.logprobs[0].top) == 2 for m in msgs[1:-1])
        # deterministic: the same greedy request gives the same tokens
        again = await generate(stub, prompt(20, 1), greedy(6))
        assert tokens_of(again) == toks


async def test_concurrent_streams_equal_alone(engine) -> None:
    addr, _ = engine
    specs = [(2, 30, 5), (3, 7, 9), (4, 50, 4), (5, 13, 7)]
    async with grpcx.aio_channel(addr) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        alone = [tokens_of(await generate(stub, prompt(n, s), greedy(mt, ignore_eos=True))) for s, n, mt in specs]

        async def delayed(i: int, s: int, n: int, mt: int) -> list[int]:
            await asyncio.sleep(0.02 * i)
            return tokens_of(await generate(stub, prompt(n, s), greedy(mt, ignore_eos=True)))

        together = await asyncio.gather(*(delayed(i, *spec) for i, spec in enumerate(specs)))
        assert list(together) == alone
        assert [len(t) for t in alone] == [5, 9, 4, 7]


async def test_cancel_mid_stream_frees_pages_and_slots(engine) -> None:
    addr, _ = engine
    async with grpcx.aio_channel(addr) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        base = await baseline(stub)
        assert (base.kv_pages_used, base.state_slots_used) == (base.cache_pages, base.cache_state_slots)
        assert (base.kv_pages_total, base.state_slots_total) == (40, 12)  # 4 running + 8 for cached state images
        call = stub.Generate(engine_pb2.GenerateRequest(prompt_token_ids=prompt(60, 9),
                                                        sampling=greedy(0, ignore_eos=True)))
        seen = 0
        async for m in call:
            if m.HasField("tokens"):
                seen += 1
                if seen == 2:
                    s = await stub.Stats(engine_pb2.StatsRequest())
                    assert s.requests_running == 1 and s.kv_pages_used - s.cache_pages >= 8
                    assert s.state_slots_used - s.cache_state_slots == 1
                    call.cancel()
                    break
        after = await baseline(stub)
        assert (after.kv_pages_used, after.state_slots_used) == (after.cache_pages, after.cache_state_slots)
        assert after.requests_finished >= base.requests_finished + 1

        # Cancel RPC by id: the stream ends with FINISH_REASON_CANCELLED
        call = stub.Generate(engine_pb2.GenerateRequest(request_id="to-cancel", prompt_token_ids=prompt(10, 3),
                                                        sampling=greedy(0, ignore_eos=True)))
        msgs = []
        async for m in call:
            msgs.append(m)
            if m.HasField("tokens") and len(msgs) == 2:
                assert (await stub.Cancel(engine_pb2.CancelRequest(request_id="to-cancel"))).found
        assert msgs[-1].finished.reason == engine_pb2.FINISH_REASON_CANCELLED
        assert not (await stub.Cancel(engine_pb2.CancelRequest(request_id="to-cancel"))).found
        after = await baseline(stub)
        assert (after.kv_pages_used, after.state_slots_used) == (after.cache_pages, after.cache_state_slots)


async def test_deadline_frees_memory() -> None:
    """In-process server over a FakeRunner that sleeps 50 ms per step: a 250-token request
    cannot finish before its 1 s deadline, so the deadline always wins."""
    import time

    from deepwell.engine_service.engine import Engine, EngineCore, EngineLimits
    from deepwell.engine_service.service import SERVICE_NAME, EngineService
    from tests.engine.test_scheduler_fakerunner import FakeRunner

    class SlowRunner(FakeRunner):
        def forward(self, batch):
            time.sleep(0.05)
            return super().forward(batch)

    core = EngineCore(SlowRunner(vocab=VOCAB), EngineLimits(80, 2, 2, 16, 2, 256))
    engine = Engine(core)
    engine.start()
    service = EngineService(engine, engine_pb2.ModelInfo(), {}, "cpu")
    handle = grpcx.build_server("127.0.0.1:0", [lambda s: engine_pb2_grpc.add_EngineServicer_to_server(service, s)],
                                [SERVICE_NAME])
    await handle.server.start()
    try:
        async with grpcx.aio_channel(f"127.0.0.1:{handle.bound_port}") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(engine_pb2.GenerateRequest(prompt_token_ids=prompt(5, 4),
                                                                        sampling=greedy(0, ignore_eos=True)),
                                             timeout=1.0):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            after = await baseline(stub)
            assert (after.kv_pages_used, after.state_slots_used, after.requests_finished) == (
                after.cache_pages, after.cache_state_slots, 1)
    finally:
        await handle.stop(0)
        engine.stop()


BAD = [
    (dict(prompt_token_ids=[]), "empty prompt"),
    (dict(prompt_token_ids=[1, VOCAB]), f"token id {VOCAB} outside the vocabulary [0, {VOCAB})"),
    (dict(prompt_token_ids=[5] * 400), "prompt of 400 tokens is longer than the context: 320 tokens"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(temperature=-1)), "sampling.temperature"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(top_p=0)), "sampling.top_p"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(top_k=-5)), "sampling.top_k"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(min_p=2)), "sampling.min_p"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(presence_penalty=9)), "presence_penalty"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(frequency_penalty=-9)), "frequency_penalty"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(repetition_penalty=0)), "repetition_penalty"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(logprobs=50)), "sampling.logprobs"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(stop_token_ids=[VOCAB + 1])), "stop_token_ids"),
    (dict(prompt_token_ids=[5], sampling=engine_pb2.SamplingParams(max_tokens=2, min_tokens=5)), "min_tokens"),
    (dict(prompt_token_ids=[5, 6], turn_boundary=3), "turn_boundary 3 outside the prompt"),
    (dict(prompt_token_ids=[5, 6], prefix_boundary=0), "prefix_boundary 0 outside the prompt"),
]


async def test_bad_input_is_invalid_argument_and_server_keeps_serving(engine) -> None:
    addr, _ = engine
    async with grpcx.aio_channel(addr) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        for fields, reason in BAD:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, sampling=fields.pop("sampling", engine_pb2.SamplingParams()),
                               ids=fields.pop("prompt_token_ids"), **fields)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, reason
            assert reason in err.value.details()
        msgs = await generate(stub, prompt(5, 5), greedy(2, ignore_eos=True))
        assert len(tokens_of(msgs)) == 2
        base = await baseline(stub)
        assert base.kv_pages_used == base.cache_pages


async def test_model_info_and_files(engine, model_dir: Path) -> None:
    addr, _ = engine
    async with grpcx.aio_channel(addr) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
        assert (info.model_id, info.vocab_size, info.max_context_tokens, info.page_size) == (
            model_dir.name, VOCAB, 320, 8)
        assert info.hybrid and info.max_concurrency == 4 and info.kv_dtype == "float32"
        assert info.kv_calibration_digest == ""  # float pools have no calibration
        assert list(info.eos_token_ids) == [2] and info.bos_token_id == 1 and info.pad_token_id == 0
        assert (info.bos_token, info.eos_token) == ("<s>", "</s>")
        assert info.chat_template == (model_dir / "chat_template.jinja").read_text()
        files = {f.name: f for f in info.files}
        assert files["tokenizer.json"].size == TOKENIZER_BYTES
        chunks = [c async for c in stub.ReadModelFile(engine_pb2.ReadModelFileRequest(name="tokenizer.json"))]
        assert [len(c.data) for c in chunks] == [1 << 20, 1 << 20, TOKENIZER_BYTES - (2 << 20)]
        assert [c.offset for c in chunks] == [0, 1 << 20, 2 << 20] and [c.last for c in chunks] == [0, 0, 1]
        assert b"".join(c.data for c in chunks) == (model_dir / "tokenizer.json").read_bytes()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.ReadModelFile(engine_pb2.ReadModelFileRequest(name="../etc/passwd")):
                pass
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_and_metrics(engine) -> None:
    addr, metrics_url = engine
    assert await grpcx.wait_healthy(addr, "deepwell.engine.v1.Engine", timeout_s=5)
    async with grpcx.aio_channel(addr) as ch:
        await generate(engine_pb2_grpc.EngineStub(ch), prompt(9, 8), greedy(3, ignore_eos=True))
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=10).read().decode())
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#") and "{" in line}
    assert values["deepwell_engine_kv_pages_total"] == 40 and values["deepwell_engine_state_slots_total"] == 12
    assert values["deepwell_engine_tokens_decoded_total"] >= 3
    assert values["deepwell_engine_time_to_first_token_seconds_count"] >= 1
    assert values["deepwell_engine_inter_token_latency_seconds_count"] >= 2


def test_sigterm_shuts_down_cleanly(model_dir: Path, tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "deepwell.engine_service", "--model", str(model_dir), "--listen",
                             "127.0.0.1:0", "--port-file", str(port_file), "--metrics-port", "-1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "engine listening on" in line and "metrics on off" in line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_config_exits_2() -> None:
    r = subprocess.run([sys.executable, "-m", "deepwell.engine_service", "--token-budget", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "invalid token_budget=0: must be >= 1" in r.stderr, r.stderr


def test_a_model_it_cannot_read_or_serve_exits_2_with_the_reason(model_dir: Path, tmp_path: Path) -> None:
    """A path that is not a model, a file that is not a GGUF, an architecture the engine does
    not have: each a usage error naming the model and why, never a traceback."""
    import shutil

    bad_gguf = tmp_path / "x.gguf"
    bad_gguf.write_bytes(b"not a gguf")
    other = shutil.copytree(model_dir, tmp_path / "bert")
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(model_type="bert", architectures=["BertModel"])
    cfg.pop("text_config", None)
    (other / "config.json").write_text(json.dumps(cfg))
    for model, why in ((tmp_path / "none", "does not exist"), (bad_gguf, "not a GGUF file"),
                       (other, "unsupported architecture (model_type='bert'")):
        r = subprocess.run([sys.executable, "-m", "deepwell.engine_service", "--model", str(model), "--listen",
                            "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and f"invalid model={str(model)!r}" in r.stderr and why in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_a_listen_address_in_use_exits_2_and_leaves_nothing_running(model_dir: Path) -> None:
    """The engine binds after loading its model and starting its step thread: a port in use is a
    usage error naming it, and the process still exits (nothing left waiting on that thread)."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "deepwell.engine_service", "--model", str(model_dir), "--listen",
                            f"127.0.0.1:{port}", "--metrics-port", "-1"], capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    assert r.returncode == 2 and f"engine: invalid listen address '127.0.0.1:{port}'" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


async def test_full_queue_is_resource_exhausted() -> None:
    """In-process server over a FakeRunner whose step thread is not started: nothing is ever
    admitted, so the waiting queue fills deterministically."""
    from deepwell.engine_service.engine import Engine, EngineCore, EngineLimits
    from deepwell.engine_service.service import SERVICE_NAME, EngineService
    from tests.engine.test_scheduler_fakerunner import FakeRunner

    core = EngineCore(FakeRunner(vocab=VOCAB), EngineLimits(16, 2, 2, 16, 2, 64))
    service = EngineService(Engine(core), engine_pb2.ModelInfo(), {}, "cpu")
    handle = grpcx.build_server("127.0.0.1:0", [lambda s: engine_pb2_grpc.add_EngineServicer_to_server(service, s)],
                                [SERVICE_NAME])
    await handle.server.start()
    try:
        async with grpcx.aio_channel(f"127.0.0.1:{handle.bound_port}") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            calls = [stub.Generate(engine_pb2.GenerateRequest(request_id=f"q{i}", prompt_token_ids=[3, 4],
                                                              sampling=greedy(1))) for i in range(2)]
            reads = [asyncio.ensure_future(c.read()) for c in calls]
            for _ in range(200):
                if (await stub.Stats(engine_pb2.StatsRequest())).requests_waiting == 2:
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, [5, 6], greedy(1))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == "waiting queue is full (2 requests); retry later"
            for c in calls:
                c.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            for _ in range(200):
                s = await stub.Stats(engine_pb2.StatsRequest())
                if s.requests_waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert (s.requests_waiting, s.requests_finished) == (0, 2)
    finally:
        await handle.stop(0)


@pytest.mark.slow  # loads SmolLM2 (about a minute on 2 busy cores)
def test_default_model_answers_paris_over_grpc(tmp_path: Path) -> None:
    """``python -m deepwell.engine_service`` without --model serves SmolLM2; a client that has only the
    gRPC API (ModelInfo + ReadModelFile) renders the chat template, tokenizes, and generates."""
    import jinja2
    from tokenizers import Tokenizer

    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "deepwell.engine_service", "--listen", "127.0.0.1:0", "--port-file",
                             str(port_file), "--metrics-port", "-1", "--log-level", "warning", "--cpu-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    async def client(addr: str) -> tuple[engine_pb2.ModelInfo, str]:
        async with grpcx.aio_channel(addr) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
            blob = b"".join([c.data async for c in stub.ReadModelFile(
                engine_pb2.ReadModelFileRequest(name="tokenizer.json"))])
            tok = Tokenizer.from_str(blob.decode())
            text = jinja2.Environment().from_string(info.chat_template).render(
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                add_generation_prompt=True, bos_token=info.bos_token, eos_token=info.eos_token)
            ids = tok.encode(text, add_special_tokens=False).ids
            msgs = await generate(stub, ids, greedy(12))
            return info, tok.decode(tokens_of(msgs))

    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "engine listening on" in line
        info, answer = asyncio.run(client(f"127.0.0.1:{int(port_file.read_text())}"))
        assert info.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct" and not info.hybrid
        assert "Paris" in answer, answer
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
