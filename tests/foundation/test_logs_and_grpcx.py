"""Shared logging setup and gRPC helpers: JSON logs off a TTY, request ids through metadata,
health + reflection on every server."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from deepwell import grpcx
from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc


def test_json_logs_when_not_a_tty() -> None:
    code = (
        "from deepwell import logs\n"
        "logs.setup_logging('demo')\n"
        "logs.bind_context(request_id='r-1')\n"
        "logs.get_logger('x').info('hello', answer=42)\n"
        "import logging; logging.getLogger('stdlib').warning('from stdlib')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.strip().splitlines()]
    assert lines[0]["event"] == "hello" and lines[0]["answer"] == 42
    assert lines[0]["request_id"] == "r-1" and lines[0]["component"] == "demo"
    assert lines[0]["level"] == "info" and "timestamp" in lines[0]
    assert lines[1]["event"] == "from stdlib" and lines[1]["level"] == "warning"


def test_bad_log_level_is_rejected() -> None:
    from deepwell import logs

    with pytest.raises(ValueError, match="loud"):
        logs.setup_logging("x", level="loud")


class _EchoEngine(engine_pb2_grpc.EngineServicer):
    """Answers GetModelInfo with the request id it saw, to observe propagation."""

    async def GetModelInfo(self, request, context):  # noqa: N802 (gRPC naming)
        return engine_pb2.ModelInfo(model_id=grpcx.current_request_id() or "")


async def test_request_id_propagates_and_health_and_reflection_work() -> None:
    handle = grpcx.build_server(
        "127.0.0.1:0",
        [lambda s: engine_pb2_grpc.add_EngineServicer_to_server(_EchoEngine(), s)],
        ["deepwell.engine.v1.Engine"],
    )
    await handle.server.start()
    try:
        address = f"127.0.0.1:{handle.bound_port}"
        async with grpcx.aio_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="deepwell.engine.v1.Engine")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(check)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND  # not yet registered as serving
            await handle.set_serving("deepwell.engine.v1.Engine")
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING

            stub = engine_pb2_grpc.EngineStub(channel)
            # explicit metadata wins
            reply = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), metadata=[(grpcx.REQUEST_ID_KEY, "abc")])
            assert reply.model_id == "abc"
            # the caller's bound id is forwarded by the client interceptor
            grpcx.set_request_id("from-context")
            reply = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
            assert reply.model_id == "from-context"

            refl = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def requests():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for answer in refl.ServerReflectionInfo(requests()):
                names = {s.name for s in answer.list_services_response.service}
                assert {"deepwell.engine.v1.Engine", "grpc.health.v1.Health"} <= names
                break
    finally:
        await handle.stop(0.1)


async def test_wait_healthy_times_out_on_nothing_listening() -> None:
    assert await grpcx.wait_healthy("127.0.0.1:1", timeout_s=0.3) is False


async def test_idle_keepalive_pings_do_not_get_the_connection_dropped() -> None:
    """Clients ping idle connections (``channel_options``); servers must accept that, where
    gRPC's default answers a second early ping with GOAWAY ``too_many_pings``."""
    import asyncio

    handle = grpcx.build_server("127.0.0.1:0", [], [])
    await handle.server.start()
    await handle.set_serving()
    fast = [(k, 100 if k == "grpc.keepalive_time_ms" else v) for k, v in grpcx.channel_options()]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.bound_port}", options=fast)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest())  # a long-lived idle stream, like a daemon session
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(3.0)  # ~30 pings without data
        assert not watch.done(), await watch.code()
        assert channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY
        watch.cancel()
    finally:
        await channel.close()
        await handle.server.stop(None)
