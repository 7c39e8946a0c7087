"""The internal token (``deepwell.auth``): the engine's and the daemon's gRPC services refuse
callers without it (UNAUTHENTICATED), serve callers with it, keep health checks open, and
refuse to start on a token file others can read; unix sockets are born private."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deepwell import grpcx
from deepwell.auth import TokenError, generate_token_file, read_token_file
from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc
from deepwell.kvcache.v1 import kvcache_pb2 as kpb
from deepwell.kvcache.v1 import kvcache_pb2_grpc as kpbg
from deepwell.kvclient.client import KVClient
from tests.engine.helpers_process import engine_process
from tests.kvcache.kvtest_helpers import Daemon


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "token"
    generate_token_file(path)
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[str]:
    from tests.engine.helpers_models import save_tiny

    model = tmp_path_factory.mktemp("tiny_llama")
    save_tiny("llama", model)
    with engine_process(tmp_path_factory.mktemp("engine"), [
        "--model", str(model), "--num-pages", "16", "--page-size", "8", "--log-level", "warning",
        "--cpu-threads", "1", "--internal-token-file", str(token_file),
    ]) as (address, _metrics):
        yield address


def test_token_file_is_private_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "t"
    token = generate_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_token_file(path) == token
    with pytest.raises(FileExistsError):
        generate_token_file(path)  # never overwritten
    path.chmod(0o644)
    with pytest.raises(TokenError, match="chmod 600"):
        read_token_file(path)
    (tmp_path / "short").write_text("abc")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(TokenError, match="no token"):
        read_token_file(tmp_path / "short")


async def _generate(address: str, token: str) -> list[engine_pb2.GenerateReply]:
    async with grpcx.aio_channel(address, token=token) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        req = engine_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], tenant="other-tenant", session_key="s",
                                         sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=3))
        return [m async for m in stub.Generate(req)]


def test_engine_refuses_calls_without_the_token(engine: str, token_file: Path) -> None:
    for token in ("", "x" * 43):  # none, or a wrong one
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(_generate(engine, token))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "internal token" in (err.value.details() or "")

    async def stats_without_token() -> None:
        async with grpcx.aio_channel(engine) as ch:
            await engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.StatsRequest())

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(stats_without_token())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # health stays open (orchestrators probe it), and the token's holder is served
    assert asyncio.run(grpcx.wait_healthy(engine, timeout_s=5.0))
    msgs = asyncio.run(_generate(engine, read_token_file(token_file)))
    assert msgs[-1].WhichOneof("event") == "finished"


def test_engine_refuses_to_start_on_a_readable_token_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    generate_token_file(token)
    token.chmod(0o640)
    proc = subprocess.run([sys.executable, "-m", "deepwell.engine_service", "--internal-token-file", str(token),
                           "--listen", "127.0.0.1:0", "--metrics-port", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "internal_token_file" in proc.stderr and "chmod 600" in proc.stderr


def test_daemon_refuses_clients_without_the_token(token_file: Path) -> None:
    daemon = Daemon(extra=["--internal-token-file", str(token_file)]).start()
    try:
        sock = daemon.address.removeprefix("unix://")
        assert stat.S_IMODE(os.stat(sock).st_mode) & 0o077 == 0  # created private, not chmod-ed after bind
        with grpcx.sync_channel(daemon.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                kpbg.KVCacheStub(ch).Stats(kpb.StatsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        anonymous = KVClient(daemon.address, name="anon", reconnect_max_s=0.2)
        try:
            assert not anonymous.start(wait_s=1.5)  # Attach is refused: never attached
        finally:
            anonymous.close()
        with KVClient(daemon.address, name="engine", token=read_token_file(token_file)) as client:
            assert client.wait_attached(10.0)
        with grpcx.sync_channel(daemon.address, read_token_file(token_file)) as ch:
            assert kpbg.KVCacheStub(ch).Stats(kpb.StatsRequest(), timeout=5).epoch
        stats = subprocess.run([sys.executable, "-m", "deepwell.kvcache_daemon", "--internal-token-file", str(token_file),
                                "stats", "--address", daemon.address, "--json"], capture_output=True, text=True,
                               timeout=60)
        assert stats.returncode == 0, stats.stderr
        bare = subprocess.run([sys.executable, "-m", "deepwell.kvcache_daemon", "stats", "--address", daemon.address],
                              capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if "TOKEN" not in k})
        assert bare.returncode == 1 and "UNAUTHENTICATED" in bare.stderr
    finally:
        daemon.cleanup()
