"""Reliability of a live gateway (issue "Reliability and security"): lone UTF-16 surrogates
are a 400 naming the field in each API's error shape, every response status is counted
under its endpoint, and ``--max-output-tokens`` caps every request's output."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.gateway.fake_engine import WEATHER_TOOL, FakeEngine, Script, read_sse, start_gateway

CAP = 160
LONG = " ".join(f"word{i}" for i in range(300))  # many more tokens than CAP
EMOJI = "x " * 20 + "😀👍🏽 日本語 — ünï " * 3  # pushed 40 ids at a time: pushes end inside characters
SCRIPTS = [Script(trigger="talk a lot", text=LONG), Script(trigger="engine fails", text="partial", finish="error"),
           Script(trigger="engine stops", text="The musical", finish="cancelled"),
           Script(trigger="engine deadline", text="The", finish="deadline"),
           Script(trigger="emoji burst", text=EMOJI, chunk=40),
           Script(trigger="typed call", chunk=3, text='<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Paris", "days": "3"}}\n</tool_call>')]
LS = "\ud800"  # a lone surrogate (json.dumps writes it as the escape "\ud800")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS).start()
    gw = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")), "--max-output-tokens", str(CAP))
    client = httpx.Client(base_url=gw.url, timeout=30)
    yield engine, gw, client
    client.close()
    gw.stop()
    engine.stop()


def send(client: httpx.Client, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    """POST ``body`` as ASCII JSON (a lone surrogate becomes the escape ``\\ud800``; httpx's
    own ``json=`` cannot encode it)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json", **(headers or {})})


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "x' + LS + '"}'}}]
SURROGATE_CASES = [
    ("/v1/chat/completions", {"messages": user("hi " + LS)}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LS}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "", "tool_calls": CALL}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": user("hi"), "user": "u" + LS}, "user"),
    ("/v1/chat/completions", {"messages": user("hi"), "stream": True, "prompt_cache_key": LS}, "prompt_cache_key"),
    ("/v1/completions", {"prompt": "say " + LS}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "user": LS}, "user"),
    ("/v1/responses", {"input": "hi", "instructions": "be " + LS}, "instructions"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": LS}]},
     "input[0].arguments"),
    ("/v1/messages", {"max_tokens": 5, "messages": user("hi"), "metadata": {"user_id": LS}}, "metadata.user_id"),
    ("/v1/messages", {"max_tokens": 5, "messages": user("hi"), "system": [{"type": "text", "text": LS}]},
     "system[0].text"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": LS}]}]}, "messages[0].content[0].content"),
    ("/v1/messages/count_tokens", {"messages": user(LS)}, "messages[0].content"),
    ("/v1/messages/count_tokens", {"messages": user("hi"), "metadata": {"user_id": '{"session_id": "' + LS + '"}'}},
     "metadata.user_id"),
]


@pytest.mark.parametrize("path,extra,field", SURROGATE_CASES, ids=[f"{c[0]}:{c[2]}" for c in SURROGATE_CASES])
def test_lone_surrogate_is_a_400_naming_the_field(env, path, extra, field):
    _, _, client = env
    r = send(client, path, {"model": "m", **extra})
    assert r.status_code == 400, r.text
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == field
    message = body["error"]["message"]
    assert message.startswith(field + " contains a lone UTF-16 surrogate (\\ud800)"), message
    assert "U+FFFD" in message


def test_surrogate_in_an_object_key_and_paired_surrogates(env):
    _, _, client = env
    r = send(client, "/v1/chat/completions", {"model": "m", "messages": user("hi"), "chat_template_kwargs": {LS: 1}})
    assert r.status_code == 400 and "an object key in chat_template_kwargs" in r.json()["error"]["message"]
    # a valid pair written as two escapes is one character, not an error
    raw = b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}]}'
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_utf8_encoded_surrogate_bytes_are_a_400(env, path):
    _, _, client = env
    # json.loads(bytes) decodes with "surrogatepass": the bytes ED A0 80 would become a lone surrogate
    raw = b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "h\xed\xa0\x80i"}]}'
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "not valid UTF-8 (byte 75" in r.text and "send UTF-8 encoded JSON" in r.text


def test_session_headers_with_arbitrary_bytes(env):
    engine, _, client = env
    # header values arrive as latin-1 text: UTF-8 bytes of a surrogate are three odd characters, never a 500
    for name in ("x-session-id", "x-claude-code-session-id", "session_id"):
        r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3, "messages": user("hi")},
                        headers={name: b"s\xed\xa0\x80\xff"})
        assert r.status_code == 200, r.text
        assert engine.requests[-1].session_key == "default/s\xed\xa0\x80\xff"


def counters(client) -> dict[tuple[str, str], float]:
    out = {}
    for m in re.finditer(r'deepwell_gateway_requests_total\{endpoint="([^"]+)",status="(\d+)"\} ([0-9.e+]+)',
                         client.get("/metrics").text):
        out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def test_every_status_is_counted_once_under_its_endpoint(env):
    _, _, client = env
    before = counters(client)
    sent: dict[tuple[str, str], int] = {}

    def post(path, endpoint, expect, **kw):
        r = client.post(path, **kw)
        assert r.status_code == expect, (path, r.status_code, r.text)
        sent[(endpoint, str(expect))] = sent.get((endpoint, str(expect)), 0) + 1

    bad = {"content": b"{nope", "headers": {"content-type": "application/json"}}
    for path, endpoint in [("/v1/chat/completions", "chat.completions"), ("/v1/completions", "completions"),
                           ("/v1/messages", "messages"), ("/v1/messages/count_tokens", "messages.count_tokens"),
                           ("/v1/responses", "responses")]:
        post(path, endpoint, 400, **bad)
        post(path, endpoint, 400, content=json.dumps({"model": "m", "messages": user(LS), "prompt": LS, "input": LS,
                                                      "max_tokens": 3}), headers={"content-type": "application/json"})
    post("/v1/messages/count_tokens", "messages.count_tokens", 200, json={"model": "m", "messages": user("hi")})
    post("/v1/messages", "messages", 200, json={"model": "m", "max_tokens": 3, "messages": user("hi")})
    post("/v1/chat/completions", "chat.completions", 500, json={"model": "m", "messages": user("engine fails")})
    post("/v1/messages", "messages", 500, json={"model": "m", "max_tokens": 9, "messages": user("engine fails")})
    post("/v1/responses", "responses", 500, json={"model": "m", "input": "engine fails"})
    with client.stream("POST", "/v1/chat/completions", json={"model": "m", "stream": True,
                                                            "messages": user("engine fails")}) as s:
        assert s.status_code == 200 and "error" in s.read().decode()
    sent[("chat.completions", "500")] += 1
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405
    sent[("chat.completions", "405")] = 1
    after = counters(client)
    for key, n in sent.items():
        assert after.get(key, 0) - before.get(key, 0) == n, (key, n, after.get(key, 0) - before.get(key, 0))
    # nothing else was counted for these endpoints (no 200 beside the 500 of a failed generation)
    for key in set(after) - set(sent):
        if key[0] in {k[0] for k in sent}:
            assert after[key] == before.get(key, 0), key


def test_unhandled_exception_is_counted_as_500_for_every_endpoint(monkeypatch):
    """In process: a gateway bug (any exception) is a 500 in the API's shape, counted."""
    from fastapi.testclient import TestClient

    from deepwell.gateway.config import GatewayConfig
    from deepwell.gateway.http import anthropic_api, app as app_module, openai_api, responses_api

    def boom(*args, **kwargs):
        raise RuntimeError("injected bug")

    for module in (openai_api, anthropic_api, responses_api):
        monkeypatch.setattr(module, "to_chat_request", boom)
    monkeypatch.setattr(openai_api.session, "session_key", boom)
    app = app_module.create_app(GatewayConfig(engines=("127.0.0.1:9",), grpc_listen=""))
    with TestClient(app, raise_server_exceptions=False) as tc:
        bodies = {"/v1/chat/completions": {"messages": user("hi")}, "/v1/completions": {"prompt": "hi"},
                  "/v1/messages": {"max_tokens": 3, "messages": user("hi")},
                  "/v1/messages/count_tokens": {"messages": user("hi")}, "/v1/responses": {"input": "hi"}}
        for path, body in bodies.items():
            r = tc.post(path, json={"model": "m", **body})
            assert r.status_code == 500, r.text
            assert "internal gateway error" in r.text
        text = tc.get("/metrics").text
    for endpoint in ("chat.completions", "completions", "messages", "messages.count_tokens", "responses"):
        assert f'deepwell_gateway_requests_total{{endpoint="{endpoint}",status="500"}} 1.0' in text, endpoint


# ---------------------------------------------------------------------------- --max-output-tokens
@pytest.mark.parametrize("limit", [None, 10**9, 2**40, CAP + 1])
def test_max_output_tokens_caps_every_api(env, limit):
    engine, _, client = env
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": user("talk a lot"), "max_tokens": limit})
    assert chat.status_code == 200, chat.text
    assert engine.requests[-1].sampling.max_tokens == CAP
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    assert chat.json()["usage"]["completion_tokens"] == CAP
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": user("talk a lot"),
                                                  "max_completion_tokens": limit})
    assert r.status_code == 200 and engine.requests[-1].sampling.max_tokens == CAP
    r = client.post("/v1/completions", json={"model": "m", "prompt": "talk a lot", "max_tokens": limit})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert engine.requests[-1].sampling.max_tokens == CAP
    if limit is not None:  # Anthropic requires max_tokens
        r = client.post("/v1/messages", json={"model": "m", "messages": user("talk a lot"), "max_tokens": limit})
        assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens", r.text
        assert engine.requests[-1].sampling.max_tokens == CAP
    r = client.post("/v1/responses", json={"model": "m", "input": "talk a lot", "max_output_tokens": limit})
    assert r.status_code == 200 and r.json()["status"] == "incomplete", r.text
    assert r.json()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert engine.requests[-1].sampling.max_tokens == CAP


def test_max_output_tokens_streaming_and_smaller_requests(env):
    engine, _, client = env
    with client.stream("POST", "/v1/chat/completions", json={"model": "m", "stream": True, "max_tokens": None,
                                                            "messages": user("talk a lot")}) as s:
        events = read_sse(s.iter_lines())
    assert engine.requests[-1].sampling.max_tokens == CAP
    assert [e for e in events if isinstance(e[1], dict)][-1][1]["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": user("talk a lot"), "max_tokens": 3})
    assert r.status_code == 200 and engine.requests[-1].sampling.max_tokens == 3


def test_max_output_tokens_config():
    from deepwell.configs import ConfigError
    from deepwell.gateway.config import GatewayConfig
    from deepwell.gateway.pipeline import effective_max_tokens

    assert GatewayConfig().max_output_tokens == 32768
    for bad in ({"max_output_tokens": -1}, {"max_output_tokens": 2**32},
                {"max_output_tokens": 100, "default_max_tokens": 200}):
        with pytest.raises(ConfigError) as e:
            GatewayConfig(**bad)
        assert "max_output_tokens" in str(e.value) or "default_max_tokens" in str(e.value)
    assert effective_max_tokens(None, 0, 32768) == 32768
    assert effective_max_tokens(10**12, 0, 32768) == 32768
    assert effective_max_tokens(None, 100, 32768) == 100
    assert effective_max_tokens(50, 100, 32768) == 50
    assert effective_max_tokens(None, 0, 0) == 0  # no cap: up to the context (the engine decides)
    assert effective_max_tokens(10**12, 0, 0) == 2**32 - 1  # still fits the engine's uint32


# ---------------------------------------------------------------------------- OpenAPI
def test_openapi_describes_every_post_body(env):
    _, _, client = env
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert set(posts) == {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                          "/v1/responses"}
    expected = {"/v1/chat/completions": ("ChatCompletionRequest", "messages"),
                "/v1/completions": ("CompletionRequest", "prompt"), "/v1/messages": ("MessagesRequest", "max_tokens"),
                "/v1/messages/count_tokens": ("CountTokensRequest", "messages"),
                "/v1/responses": ("ResponsesRequest", "input")}
    for path, (name, required) in expected.items():
        body = posts[path]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert required in schemas[name]["required"] and required in schemas[name]["properties"]
    # every $ref resolves, and operation ids are unique (schema-driven tools rely on both)
    text = client.get("/openapi.json").text
    for ref in set(re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', text)):
        assert ref in schemas, ref
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------------------- detokenization
def test_streamed_equals_non_streamed_with_large_pushes(env):
    engine, _, client = env
    body = {"model": "m", "max_tokens": 500, "messages": user("emoji burst")}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = read_sse(s.iter_lines())
    parts = [e[1]["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e[1], dict)]
    assert whole == "".join(parts) == EMOJI
    assert "\ufffd" not in whole


# ---------------------------------------------------------------------------- tool-call typing over HTTP
def test_json_form_arguments_typed_streamed_and_not(env):
    _, _, client = env
    body = {"model": "m", "messages": user("typed call"), "tools": [WEATHER_TOOL]}
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    whole = json.loads(msg["tool_calls"][0]["function"]["arguments"])
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = read_sse(s.iter_lines())
    frags = [tc["function"].get("arguments", "") for _, e in events if isinstance(e, dict) and e["choices"]
             for tc in e["choices"][0]["delta"].get("tool_calls") or []]
    assert whole == json.loads("".join(frags)) == {"city": "Paris", "days": 3}
    anthropic = {"model": "m", "max_tokens": 50, "messages": user("typed call"),
                 "tools": [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]}
    block = client.post("/v1/messages", json=anthropic).json()["content"][0]
    assert block["type"] == "tool_use" and block["input"] == {"city": "Paris", "days": 3}
    with client.stream("POST", "/v1/messages", json={**anthropic, "stream": True}) as s:
        events = read_sse(s.iter_lines())
    partial = "".join(e["delta"]["partial_json"] for _, e in events
                      if isinstance(e, dict) and e.get("type") == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("trigger", ["engine stops", "engine deadline"])
def test_a_request_the_engine_ends_itself_is_an_error_never_a_normal_finish(env, trigger: str) -> None:
    """Found by benchmarks/soak.py: an engine shutting down (or a deadline) ends its requests as
    cancelled, which used to reach the client as finish_reason "stop" / "end_turn" on a cut-short
    answer. Now: 503 with Retry-After without a stream, an error event in one; the log says error."""
    _, gw, client = env
    msgs = [{"role": "user", "content": trigger}]
    r = send(client, "/v1/chat/completions", {"model": "m", "messages": msgs})
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    assert "stopped this request before it finished" in r.json()["error"]["message"]
    r = send(client, "/v1/messages", {"model": "m", "max_tokens": 50, "messages": msgs})
    assert r.status_code == 503 and r.json()["type"] == "error", r.text
    for path, body in (("/v1/chat/completions", {"model": "m", "messages": msgs, "stream": True}),
                       ("/v1/messages", {"model": "m", "max_tokens": 50, "messages": msgs, "stream": True}),
                       ("/v1/responses", {"model": "m", "input": trigger, "stream": True})):
        with client.stream("POST", path, content=json.dumps(body), headers={"content-type": "application/json"}) as r:
            text = r.read().decode()
        assert "stopped this request before it finished" in text, (path, text[-500:])
        assert '"finish_reason": "stop"' not in text and '"finish_reason":"stop"' not in text
        assert "end_turn" not in text and "response.completed" not in text
