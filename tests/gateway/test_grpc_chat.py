"""``deepwell.gateway.v1.Chat`` on a live gateway process over the scripted engine."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from deepwell.gateway.v1 import chat_pb2, chat_pb2_grpc
from tests.gateway.fake_engine import FakeEngine, Script, start_gateway

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPTS = [
    Script(trigger="say hello", text="Hello there!", chunk=2, cached=3),
    Script(trigger="weather please", text="Ok.\n" + CALL, chunk=3),
    Script(trigger="reason first", text="Hmm.</think>Yes.", chunk=2),
    Script(trigger="two calls", text=CALL + "\n" + CALL.replace("Paris", "Rome"), chunk=4),
    Script(trigger="overload me", error_code="RESOURCE_EXHAUSTED", error_message="queue full"),
    Script(trigger="hang forever", text="partial", hang=True),
]
TOOL = chat_pb2.Tool(name="get_weather", description="weather",
                     parameters_json=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
NODE_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node_chat_client"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS).start()
    gw = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")))
    channel = grpc.insecure_channel(gw.grpc_address)
    yield engine, gw, chat_pb2_grpc.ChatStub(channel), channel
    channel.close()
    gw.stop()
    engine.stop()


def req(content, **kw):
    return chat_pb2.ChatRequest(model="m", messages=[chat_pb2.Message(role="user", content=content)], **kw)


def test_complete_stream(env):
    engine, _, stub, _ = env
    events = list(stub.Complete(req("say hello", max_tokens=16, session_id="s1")))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert set(kinds[1:-1]) == {"content_delta"}
    assert "".join(e.content_delta for e in events[1:-1]) == "Hello there!"
    n_prompt = len(engine.requests[-1].prompt_token_ids)
    assert events[0].started.prompt_tokens == n_prompt and events[0].started.cached_tokens == 3
    fin = events[-1].finished
    assert fin.finish_reason == "stop" and fin.usage.prompt_tokens == n_prompt and fin.usage.cached_tokens == 3
    assert engine.requests[-1].session_key == "default/s1" and engine.requests[-1].sampling.max_tokens == 16


def test_tool_call_events(env):
    _, _, stub, _ = env
    events = list(stub.Complete(req("weather please", tools=[TOOL])))
    kinds = [e.WhichOneof("event") for e in events]
    start = kinds.index("tool_call_start")
    end = kinds.index("tool_call_end")
    assert start < end and set(kinds[start + 1:end]) == {"tool_call_delta"}
    assert events[start].tool_call_start.name == "get_weather"
    frag = "".join(e.tool_call_delta.json_fragment for e in events[start + 1:end])
    assert json.loads(frag) == {"city": "Paris"} == json.loads(events[end].tool_call_end.call.arguments_json)
    assert events[-1].finished.finish_reason == "tool_calls"
    assert "".join(e.content_delta for e in events if e.WhichOneof("event") == "content_delta") == "Ok."


def test_parallel_tool_calls_off_keeps_one_call(env):
    _, _, stub, _ = env
    events = list(stub.Complete(req("two calls", tools=[TOOL], parallel_tool_calls=False)))
    ends = [e.tool_call_end for e in events if e.WhichOneof("event") == "tool_call_end"]
    assert [json.loads(c.call.arguments_json)["city"] for c in ends] == ["Paris"]
    both = list(stub.Complete(req("two calls", tools=[TOOL])))
    assert sum(e.WhichOneof("event") == "tool_call_end" for e in both) == 2


def test_reasoning_events(env):
    _, _, stub, _ = env
    events = list(stub.Complete(req("reason first", enable_thinking=True)))
    assert "".join(e.reasoning_delta for e in events) == "Hmm."
    assert "".join(e.content_delta for e in events) == "Yes."


def test_count_tokens_and_models(env):
    engine, _, stub, _ = env
    n = stub.CountTokens(req("say hello")).input_tokens
    list(stub.Complete(req("say hello")))
    assert n == len(engine.requests[-1].prompt_token_ids)
    models = stub.ListModels(chat_pb2.ListModelsRequest()).models
    assert [(m.id, m.max_model_len) for m in models] == [("fake-model", 4096)]


@pytest.mark.parametrize("request_,text", [
    (chat_pb2.ChatRequest(model="m"), "messages must not be empty"),
    (req("x", tool_choice="required"), "needs at least one tool"),
    (req("x", chat_template_kwargs_json="[1]"), "must be a JSON object"),
    (chat_pb2.ChatRequest(messages=[chat_pb2.Message(role="wizard", content="x")]), "role"),
    (req("x", top_p=2.0), "top_p"),
])
def test_invalid_argument(env, request_, text):
    _, gw, stub, _ = env
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Complete(request_))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.CountTokens(request_)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert gw.alive()


def test_overloaded(env):
    _, _, stub, _ = env
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Complete(req("overload me")))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_client_cancel_cancels_engine_request(env):
    engine, _, stub, _ = env
    call = stub.Complete(req("hang forever"))
    for ev in call:
        if ev.WhichOneof("event") == "content_delta":
            break
    call.cancel()
    rid = engine.requests[-1].request_id
    deadline = time.monotonic() + 10
    while rid not in engine.stream_closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rid in engine.stream_closed


def test_health_and_reflection(env):
    _, _, _, channel = env
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="deepwell.gateway.v1.Chat")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "deepwell.gateway.v1.Chat" in names and "grpc.health.v1.Health" in names


@pytest.mark.skipif(shutil.which("node") is None or not (NODE_EXAMPLE / "node_modules").is_dir(),
                    reason="needs node and `npm install` in examples/node_chat_client")
def test_node_example_client(env):
    _, gw, _, _ = env
    out = subprocess.run(["node", str(NODE_EXAMPLE / "chat.js"), gw.grpc_address, "say hello"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Hello there!" in out.stdout and "finish_reason: stop" in out.stdout
