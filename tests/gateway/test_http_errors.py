"""Error paths of a live gateway: shapes, statuses, Retry-After, limits, auth, no engine."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.fake_engine import CHATML_TOOLS_TEMPLATE, FakeEngine, Script, free_port, start_gateway

RAISING_TEMPLATE = ("{%- if messages[-1].content == 'boom' %}{{ raise_exception('boom is not allowed') }}{%- endif %}"
                    + CHATML_TOOLS_TEMPLATE)
SCRIPTS = [Script(trigger="overload me", error_code="RESOURCE_EXHAUSTED", error_message="queue full"),
           Script(trigger="reject me", error_code="INVALID_ARGUMENT", error_message="bad sampling")]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS, max_context=300, chat_template=RAISING_TEMPLATE).start()
    gw = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")), "--max-body-bytes", "20000",
                       "--max-messages", "5", "--retry-after-s", "7")
    yield engine, gw
    gw.stop()
    engine.stop()


def chat(gw, content="hi", **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)


def msg(gw, content="hi", **extra):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(gw.url + "/v1/messages", json=body, timeout=30)


def assert_openai_error(r, status, etype=None, code=None, text=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if etype:
        assert err["type"] == etype
    if code:
        assert err["code"] == code
    if text:
        assert text in err["message"]


def assert_anthropic_error(r, status, etype, text=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == etype
    if text:
        assert text in body["error"]["message"]


def test_context_length(env):
    _, gw = env
    long = "hello " * 400
    r = chat(gw, long)
    assert_openai_error(r, 400, "invalid_request_error", "context_length_exceeded", "maximum context length is 300")
    assert r.json()["error"]["max_context_tokens"] == 300 and r.json()["error"]["prompt_tokens"] > 300
    assert str(r.json()["error"]["prompt_tokens"]) in r.json()["error"]["message"]
    r = msg(gw, long)  # Anthropic's status, type and wording (Claude Code compacts on "prompt is too long")
    assert_anthropic_error(r, 400, "invalid_request_error", "300")
    n = r.json()["error"]["message"].split()[4]
    assert r.json()["error"]["message"].startswith(f"prompt is too long: {n} tokens > 299 maximum")


def test_overloaded_engine(env):
    _, gw = env
    r = chat(gw, "overload me")
    assert_openai_error(r, 429, "rate_limit_error", text="queue full")
    assert r.headers["retry-after"] == "7"
    r = chat(gw, "overload me", stream=True)
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    r = msg(gw, "overload me")
    assert_anthropic_error(r, 529, "overloaded_error")
    assert r.headers["retry-after"] == "7"
    r = msg(gw, "overload me", stream=True)
    assert_anthropic_error(r, 529, "overloaded_error")


def test_engine_rejection_is_400(env):
    _, gw = env
    assert_openai_error(chat(gw, "reject me"), 400, text="bad sampling")
    assert_anthropic_error(msg(gw, "reject me"), 400, "invalid_request_error", "bad sampling")


def test_template_error_is_400(env):
    _, gw = env
    assert_openai_error(chat(gw, "boom"), 400, text="boom is not allowed")
    assert_anthropic_error(msg(gw, "boom"), 400, "invalid_request_error", "boom is not allowed")


@pytest.mark.parametrize("extra,text", [
    ({"n": 2}, "n > 1 is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "constrained decoding"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tool_choice": "required"}, "needs at least one tool"),
    ({"stop": [""]}, "stop"),
])
def test_openai_unsupported_and_invalid(env, extra, text):
    _, gw = env
    assert_openai_error(chat(gw, **extra), 400, text=text)


def test_images_refused(env):
    _, gw = env
    content = [{"type": "text", "text": "what is this"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    assert_openai_error(chat(gw, content), 400, text="image_url content is not supported")
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]
    assert_anthropic_error(msg(gw, blocks), 400, "invalid_request_error", "image blocks are not supported")


def test_malformed_bodies(env):
    _, gw = env
    for path, check in (("/v1/chat/completions", assert_openai_error), ("/v1/messages", None)):
        for raw in (b"{not json", b"[]", b"", b'{"messages": []}', b'{"messages": "x"}'):
            r = httpx.post(gw.url + path, content=raw, headers={"content-type": "application/json"})
            if check:
                check(r, 400)
            else:
                assert_anthropic_error(r, 400, "invalid_request_error")
    assert_anthropic_error(msg(gw, max_tokens=None), 400, "invalid_request_error", "max_tokens")


def test_limits(env):
    _, gw = env
    assert_openai_error(chat(gw, "x" * 30000), 413, text="exceeds the limit of 20000 bytes")
    assert_anthropic_error(msg(gw, "x" * 30000), 413, "request_too_large")
    many = [{"role": "user", "content": "hi"}] * 6
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": many})
    assert_openai_error(r, 413, text="6 messages exceed the limit of 5")


def test_unknown_route_and_method(env):
    _, gw = env
    assert_openai_error(httpx.get(gw.url + "/v1/nope"), 404)
    assert httpx.get(gw.url + "/v1/chat/completions").status_code == 405
    assert httpx.get(gw.url + "/v1/messages").json()["type"] == "error"


def test_no_healthy_engine(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    gw = start_gateway([dead], str(tmp_path), "--retry-after-s", "3", wait_healthy=False)
    try:
        r = httpx.get(gw.url + "/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["engines"][0]["healthy"] is False
        r = chat(gw)
        assert_openai_error(r, 503, code="no_healthy_engine")
        assert r.headers["retry-after"] == "3"
        assert_anthropic_error(msg(gw), 503, "api_error", "no healthy engine")
        assert gw.alive()
    finally:
        gw.stop()


def test_api_keys_and_tenant(tmp_path):
    engine = FakeEngine().start()
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nteam1:sk-one\nteam2:sk-two\n")
    gw = start_gateway([engine.address], str(tmp_path), "--api-keys-file", str(keys))
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "s"}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body)
        assert_openai_error(r, 401, "authentication_error", text="missing API key")
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert_openai_error(r, 401, text="invalid API key")
        assert_anthropic_error(httpx.post(gw.url + "/v1/messages", json={**body, "max_tokens": 5}), 401,
                               "authentication_error")
        assert httpx.get(gw.url + "/v1/models").status_code == 401
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-one"})
        assert r.status_code == 200 and engine.requests[-1].session_key == "team1/s"
        assert engine.requests[-1].tenant == "team1"
        anth = {"model": "m", "max_tokens": 5, "messages": body["messages"], "metadata": {"user_id": "s"}}
        r = httpx.post(gw.url + "/v1/messages", json=anth, headers={"x-api-key": "sk-two"})
        assert r.status_code == 200 and engine.requests[-1].session_key == "team2/s"
        import grpc

        from deepwell.gateway.v1 import chat_pb2, chat_pb2_grpc

        with grpc.insecure_channel(gw.grpc_address) as channel:
            stub = chat_pb2_grpc.ChatStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(chat_pb2.ListModelsRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            req = chat_pb2.ChatRequest(messages=[chat_pb2.Message(role="user", content="hi")], session_id="g")
            events = list(stub.Complete(req, metadata=[("authorization", "Bearer sk-two")]))
            assert events[-1].finished.finish_reason == "stop"
            assert engine.requests[-1].session_key == "team2/g" and engine.requests[-1].tenant == "team2"
    finally:
        gw.stop()
        engine.stop()
