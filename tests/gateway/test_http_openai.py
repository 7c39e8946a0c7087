"""OpenAI endpoints of a live gateway process over the scripted engine: exact SSE sequences."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.fake_engine import WEATHER_TOOL, FakeEngine, Script, read_sse, start_gateway

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
SCRIPTS = [
    Script(trigger="say hello", text="Hello there!", chunk=2),
    Script(trigger="weather in paris", text="Checking.\n" + CALL, chunk=3),
    Script(trigger="two cities", text=CALL + "\n" + CALL.replace("Paris", "Rome"), chunk=4),
    Script(trigger="stop at END", text="abc END def", chunk=1),
    Script(trigger="cached please", text="ok", cached=8),
    Script(trigger="slow start", text="late", admit_delay_s=1.3),
    Script(trigger="reason first", text="Let me think.</think>The answer is 4.", chunk=2),
    Script(trigger='"name": "get_weather", "arguments": ', text='{"city": "Oslo"}}\n</tool_call>', chunk=2),
    Script(trigger="hang forever", text="partial", hang=True),
    Script(trigger="too long", text="x y z w v u t s r q p o n m", finish="length"),
    Script(trigger="engine fails", text="half", finish="error"),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS).start()
    gw = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")), "--keepalive-s", "0.5",
                       "--request-log", str(tmp_path_factory.getbasetemp() / "requests.jsonl"))
    yield engine, gw
    gw.stop()
    engine.stop()


def chat(gw, content, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)


def stream_chat(gw, content, **extra):
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}], **extra}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_sse(r.iter_lines())


def deltas(events):
    return [d["choices"][0]["delta"] if d != "[DONE]" and d.get("choices") else d
            for _, d in events if _ != ":"]


def test_chat_non_stream(env):
    engine, gw = env
    r = chat(gw, "say hello", max_tokens=20, temperature=0, seed=7)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello there!"},
                                "logprobs": None, "finish_reason": "stop"}]
    n_out = len(engine.tokenizer.encode("Hello there!", add_special_tokens=False).ids)
    req = engine.requests[-1]
    assert body["usage"] == {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": n_out,
                             "total_tokens": len(req.prompt_token_ids) + n_out,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert req.sampling.max_tokens == 20 and req.sampling.temperature == 0 and req.sampling.seed == 7
    assert req.HasField("turn_boundary") and 0 < req.turn_boundary < len(req.prompt_token_ids)
    text = engine.tokenizer.decode(list(req.prompt_token_ids), skip_special_tokens=False)
    assert text == "<|im_start|>user\nsay hello<|im_end|>\n<|im_start|>assistant\n"


def test_chat_stream_exact_sequence_with_usage(env):
    _, gw = env
    events = stream_chat(gw, "say hello", stream_options={"include_usage": True})
    ds = deltas(events)
    assert ds[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in ds[1:-3]) == "Hello there!"
    assert all(set(d) == {"content"} for d in ds[1:-3])
    assert ds[-3] == {}
    assert events[-3][1]["choices"][0]["finish_reason"] == "stop"
    usage_chunk = events[-2][1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(e[1]["usage"] is None for e in events[:-2])
    assert events[-1] == (None, "[DONE]")
    ids = {e[1]["id"] for e in events[:-1]}
    assert len(ids) == 1


def test_chat_stream_without_usage_has_no_usage_field(env):
    _, gw = env
    events = stream_chat(gw, "say hello")
    assert all("usage" not in e[1] for e in events[:-1])
    assert events[-2][1]["choices"][0]["finish_reason"] == "stop"


def test_tool_call_non_stream(env):
    _, gw = env
    r = chat(gw, "weather in paris", tools=[WEATHER_TOOL])
    msg = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["content"] == "Checking."
    assert len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_tool_call_stream_sequence(env):
    _, gw = env
    ds = deltas(stream_chat(gw, "weather in paris", tools=[WEATHER_TOOL]))
    assert ds[0] == {"role": "assistant", "content": ""}
    tool_deltas = [d["tool_calls"][0] for d in ds[1:-2] if "tool_calls" in d]
    first = tool_deltas[0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(t["function"]["arguments"] for t in tool_deltas[1:])
    assert json.loads(args) == {"city": "Paris", "days": 2}
    assert all(set(t) == {"index", "function"} for t in tool_deltas[1:])
    assert "".join(d.get("content", "") for d in ds[1:-2]) == "Checking."
    assert ds[-1] == "[DONE]"


def test_parallel_tool_calls_and_disabling_them(env):
    engine, gw = env
    calls = chat(gw, "two cities", tools=[WEATHER_TOOL]).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    one = chat(gw, "two cities", tools=[WEATHER_TOOL], parallel_tool_calls=False).json()["choices"][0]
    assert [json.loads(c["function"]["arguments"])["city"] for c in one["message"]["tool_calls"]] == ["Paris"]
    assert one["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_markup_as_text_and_hides_tools(env):
    engine, gw = env
    r = chat(gw, "weather in paris", tools=[WEATHER_TOOL], tool_choice="none")
    msg = r.json()["choices"][0]["message"]
    assert "tool_calls" not in msg and "<tool_call>" in msg["content"]
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert "<tools>" not in prompt


def test_named_tool_choice_forces_the_call(env):
    engine, gw = env
    r = chat(gw, "anything", tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    body = r.json()["choices"][0]
    assert body["finish_reason"] == "tool_calls"
    assert body["message"]["content"] is None
    assert json.loads(body["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')


def test_stop_string_with_hold_back_and_cancel(env):
    engine, gw = env
    before = len(engine.cancelled)
    r = chat(gw, "stop at END", stop=["END"])
    assert r.json()["choices"][0]["message"]["content"] == "abc "
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    events = stream_chat(gw, "stop at END", stop="END")
    assert "".join(d.get("content", "") for d in deltas(events)[1:-2]) == "abc "


def test_reasoning_content(env):
    _, gw = env
    msg = chat(gw, "reason first", chat_template_kwargs={"enable_thinking": True}).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Let me think."}
    ds = deltas(stream_chat(gw, "reason first", chat_template_kwargs={"enable_thinking": True}))
    assert "".join(d.get("reasoning_content", "") for d in ds[1:-2]) == "Let me think."
    assert "".join(d.get("content", "") for d in ds[1:-2]) == "The answer is 4."
    first_content = next(i for i, d in enumerate(ds) if d.get("content"))
    last_reasoning = max(i for i, d in enumerate(ds) if isinstance(d, dict) and d.get("reasoning_content"))
    assert last_reasoning < first_content


def test_cached_tokens_reported(env):
    _, gw = env
    assert chat(gw, "cached please").json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}


def test_keepalive_comments_while_prefilling(env):
    _, gw = env
    events = stream_chat(gw, "slow start")
    assert events[0][0] == ":"  # at least one keep-alive before the role chunk
    assert "".join(d.get("content", "") for d in deltas(events)[1:-2]) == "late"


def test_length_finish(env):
    _, gw = env
    r = chat(gw, "too long", max_tokens=3)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 3


def test_engine_error_mid_request(env):
    _, gw = env
    r = chat(gw, "engine fails")
    assert r.status_code == 500 and "scripted engine error" in r.json()["error"]["message"]
    events = stream_chat(gw, "engine fails")
    assert "error" in events[-2][1] and events[-1] == (None, "[DONE]")


def test_client_disconnect_cancels_engine_request(env):
    engine, gw = env
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hang forever"}]}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"content":"' in line and '"role"' not in line:
                break  # the first generated text arrived: hang up
    rid = engine.requests[-1].request_id
    import time

    deadline = time.monotonic() + 30
    while (rid not in engine.stream_closed or rid not in engine.cancelled) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (rid in engine.stream_closed, rid in engine.cancelled) == (True, True), gw.log_text()[-2000:]


def test_completions(env):
    engine, gw = env
    r = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "say hello", "max_tokens": 10})
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello there!" and body["choices"][0]["finish_reason"] == "stop"
    assert list(engine.requests[-1].prompt_token_ids) == engine.tokenizer.encode("say hello").ids
    with httpx.stream("POST", gw.url + "/v1/completions",
                      json={"prompt": "say hello", "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = read_sse(s.iter_lines())
    texts = [e[1]["choices"][0]["text"] for e in events[:-2]]
    assert "".join(texts) == "Hello there!"
    assert events[-3][1]["choices"][0]["finish_reason"] == "stop"
    assert events[-2][1]["usage"]["completion_tokens"] > 0 and events[-1][1] == "[DONE]"
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
    assert r.status_code == 200 and list(engine.requests[-1].prompt_token_ids) == [5, 6, 7]


def test_models_and_health_and_metrics(env):
    _, gw = env
    models = httpx.get(gw.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["fake-model"] == [m["id"] for m in models["models"]]
    assert models["data"][0]["max_model_len"] == 4096
    assert httpx.get(gw.url + "/v1/models/fake-model").json()["id"] == "fake-model"
    assert httpx.get(gw.url + "/v1/models/nope").status_code == 404
    assert httpx.get(gw.url + "/health").status_code == 200
    text = httpx.get(gw.url + "/metrics").text
    assert 'deepwell_gateway_requests_total{endpoint="chat.completions",status="200"}' in text
    assert "deepwell_gateway_ttft_seconds_bucket" in text
    assert 'deepwell_gateway_tool_parse_total{outcome="ok"}' in text


def test_session_key_namespaced_by_tenant(env):
    engine, gw = env
    chat(gw, "say hello", user="alice")
    assert engine.requests[-1].session_key == "default/alice"
    body = {"model": "m", "user": "alice", "messages": [{"role": "user", "content": "say hello"}]}
    httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "s1"})
    assert engine.requests[-1].session_key == "default/s1"
    httpx.post(gw.url + "/v1/chat/completions", json=body,
               headers={"X-Session-Id": "s1", "X-Claude-Code-Session-Id": "cc"})
    assert engine.requests[-1].session_key == "default/s1"  # deepwell's own header wins
    httpx.post(gw.url + "/v1/chat/completions", json={**body, "prompt_cache_key": "pck"})
    assert engine.requests[-1].session_key == "default/pck"
    httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"session_id": "codex-1", "thread_id": "t"})
    assert engine.requests[-1].session_key == "default/codex-1"
    assert engine.requests[-1].tenant == "default"


def test_request_log_has_no_prompt_text(env, tmp_path_factory):
    _, gw = env
    chat(gw, "say hello secret-words")
    path = tmp_path_factory.getbasetemp() / "requests.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert "secret-words" not in path.read_text()
    rec = lines[-1]
    assert rec["endpoint"] == "chat.completions" and rec["status"] == 200 and rec["tenant"] == "default"
    assert rec["prompt_tokens"] > 0 and rec["completion_tokens"] > 0
    assert set(rec["cached_tokens"]) == {"resident_frontier", "resident_checkpoint", "host_entry", "session_lookup",
                                         "shared_prefix", "total"}
    assert {"total_ms", "ttft_ms", "queue_ms", "prefill_ms", "decode_ms"} <= set(rec["timings"])
    assert rec["tool_parse"] == "none" and rec["finish_reason"] == "stop"


def test_non_stream_client_disconnect_cancels_engine_request(env):
    engine, gw = env
    n = len(engine.requests)
    with pytest.raises(httpx.ReadTimeout):
        chat_body = {"model": "m", "messages": [{"role": "user", "content": "hang forever"}]}
        httpx.post(gw.url + "/v1/chat/completions", json=chat_body, timeout=httpx.Timeout(30, read=1.0))
    import time

    deadline = time.monotonic() + 30
    while (len(engine.requests) == n or engine.requests[-1].request_id not in engine.stream_closed) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    rid = engine.requests[-1].request_id
    assert rid in engine.stream_closed, gw.log_text()[-2000:]


@pytest.mark.parametrize("stream", [False, True])
def test_request_id_travels_to_the_engine(env, stream):
    """The client's x-request-id is the engine request id and its gRPC metadata."""
    engine, gw = env
    rid = f"trace-{int(stream)}"
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "say hello"}]}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == rid
    assert engine.requests[-1].request_id == rid
    assert engine.metadata_request_ids[-1] == rid
