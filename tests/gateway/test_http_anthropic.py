"""Anthropic Messages endpoints of a live gateway over the scripted engine: exact SSE."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.fake_engine import FakeEngine, Script, read_sse, start_gateway

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPTS = [
    Script(trigger="say hello", text="Hello there!", chunk=2, cached=5),
    Script(trigger="weather please", text="Checking.\n" + CALL, chunk=3),
    Script(trigger="reason first", text="Let me think.</think>It is 4.", chunk=2),
    Script(trigger="stop at END", text="abc END def", chunk=1),
    Script(trigger="too long", text="a b c d e f g h", finish="length"),
    Script(trigger="slow start", text="late", admit_delay_s=1.3),
]
TOOLS = [{"name": "get_weather", "description": "weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS).start()
    gw = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")), "--keepalive-s", "0.5")
    yield engine, gw
    gw.stop()
    engine.stop()


def post(gw, content, path="/v1/messages", **extra):
    body = {"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(gw.url + path, json=body, timeout=30)


def stream(gw, content, pings=False, **extra):
    body = {"model": "claude-x", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": content}], **extra}
    with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [(ev, data) for ev, data in read_sse(r.iter_lines()) if pings or ev != "ping"]


def test_message_non_stream(env):
    engine, gw = env
    body = post(gw, "say hello").json()
    n_prompt = len(engine.requests[-1].prompt_token_ids)
    assert body["type"] == "message" and body["role"] == "assistant" and body["model"] == "claude-x"
    assert body["content"] == [{"type": "text", "text": "Hello there!"}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    assert body["usage"]["input_tokens"] == n_prompt - 5
    assert body["usage"]["cache_read_input_tokens"] == 5
    assert body["usage"]["output_tokens"] == len(engine.tokenizer.encode("Hello there!").ids)


def test_message_stream_exact_sequence(env):
    engine, gw = env
    events = stream(gw, "say hello")
    names = [e for e, _ in events]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    n_prompt = len(engine.requests[-1].prompt_token_ids)
    assert start["usage"] == {"input_tokens": n_prompt - 5, "output_tokens": 0, "cache_read_input_tokens": 5,
                              "cache_creation_input_tokens": 0}
    assert start["content"] == [] and start["stop_reason"] is None
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for e, d in events if e == "content_block_delta")
    assert text == "Hello there!"
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] > 0
    assert all(e == d["type"] for e, d in events)


def test_tool_use_stream_and_server_tools_ignored(env):
    engine, gw = env
    events = stream(gw, "weather please", tools=TOOLS)
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "web_search" not in prompt
    starts = [d["content_block"] for e, d in events if e == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {} and starts[1]["id"]
    partial = "".join(d["delta"]["partial_json"] for e, d in events
                      if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert all(d["index"] == 1 for e, d in events if e == "content_block_delta"
               and d["delta"]["type"] == "input_json_delta")
    assert [d["index"] for e, d in events if e == "content_block_stop"] == [0, 1]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_use_non_stream_and_round_trip_history(env):
    engine, gw = env
    body = post(gw, "weather please", tools=TOOLS).json()
    assert body["stop_reason"] == "tool_use"
    tool_use = body["content"][1]
    assert tool_use["type"] == "tool_use" and tool_use["input"] == {"city": "Paris"}
    messages = [{"role": "user", "content": "weather please"},
                {"role": "assistant", "content": body["content"]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"],
                                              "content": [{"type": "text", "text": "sunny"}]},
                                             {"type": "text", "text": "say hello"}]}]
    r = httpx.post(gw.url + "/v1/messages", json={"model": "m", "max_tokens": 20, "messages": messages,
                                                  "tools": TOOLS})
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert '<tool_response>\nsunny\n</tool_response>' in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt


def test_thinking_blocks_with_signature(env):
    _, gw = env
    thinking = {"type": "enabled", "budget_tokens": 1024}
    body = post(gw, "reason first", thinking=thinking).json()
    assert [b["type"] for b in body["content"]] == ["thinking", "text"]
    assert body["content"][0]["thinking"] == "Let me think." and body["content"][0]["signature"]
    events = stream(gw, "reason first", thinking={"type": "adaptive"}, output_config={"effort": "high"})
    starts = [d["content_block"] for e, d in events if e == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    kinds = [d["delta"]["type"] for e, d in events if e == "content_block_delta"]
    first_text = kinds.index("text_delta")
    assert kinds[first_text - 1] == "signature_delta"
    assert set(kinds[:first_text - 1]) == {"thinking_delta"}
    sig = next(d["delta"]["signature"] for e, d in events if e == "content_block_delta"
               and d["delta"]["type"] == "signature_delta")
    assert sig == body["content"][0]["signature"]


def test_thinking_disabled_closes_think_in_prompt(env):
    engine, gw = env
    post(gw, "say hello", thinking={"type": "disabled"})
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_stop_sequence_reported(env):
    _, gw = env
    body = post(gw, "stop at END", stop_sequences=["END"]).json()
    assert body["content"] == [{"type": "text", "text": "abc "}]
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "END"
    events = stream(gw, "stop at END", stop_sequences=["END"])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_max_tokens_stop_reason(env):
    _, gw = env
    assert post(gw, "too long", max_tokens=2).json()["stop_reason"] == "max_tokens"


def test_count_tokens_equals_prompt_and_strips_billing_header(env):
    engine, gw = env
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3; cch=abc"},
              {"type": "text", "text": "You are helpful."}]
    for path in ("/v1/messages/count_tokens", "/v1/messages/count_tokens?beta=true"):
        n = httpx.post(gw.url + path, json={"model": "m", "system": system,
                                            "messages": [{"role": "user", "content": "say hello"}]}).json()
        post(gw, "say hello", system=system)
        req = engine.requests[-1]
        assert n == {"input_tokens": len(req.prompt_token_ids)}
        prompt = engine.tokenizer.decode(list(req.prompt_token_ids), skip_special_tokens=False)
        assert "billing-header" not in prompt and "You are helpful." in prompt


def test_session_from_metadata_user_id(env):
    engine, gw = env
    post(gw, "say hello", metadata={"user_id": "user_abc_session_1"})
    assert engine.requests[-1].session_key == "default/user_abc_session_1"
    body = {"model": "m", "max_tokens": 8, "metadata": {"user_id": "u"},
            "messages": [{"role": "user", "content": "say hello"}]}
    httpx.post(gw.url + "/v1/messages", json=body, headers={"x-claude-code-session-id": "sess-9"})
    assert engine.requests[-1].session_key == "default/sess-9"
    body["metadata"] = {"user_id": '{"device_id":"00","account_uuid":"","session_id":"e9e2"}'}  # current Claude Code
    httpx.post(gw.url + "/v1/messages", json=body)
    assert engine.requests[-1].session_key == "default/e9e2"


def test_keepalives_are_ping_events(env):
    _, gw = env
    events = stream(gw, "slow start", pings=True)
    assert events[0] == ("ping", {"type": "ping"})  # at least one while the engine admits
    assert all(ev != ":" for ev, _ in events)  # no SSE comments
    names = [e for e, _ in events if e != "ping"]
    assert names[0] == "message_start" and names[-1] == "message_stop"


def test_system_role_message_mid_conversation(env):
    """Claude Code puts ``system``-role entries (text or text blocks) into ``messages``."""
    engine, gw = env
    msgs = [{"role": "user", "content": "first question"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}, {"type": "text", "text": "cwd /x"}]},
            {"role": "user", "content": "say hello"}]
    r = httpx.post(gw.url + "/v1/messages?beta=true", json={"model": "m", "max_tokens": 8, "messages": msgs},
                   headers={"anthropic-beta": "claude-code-20250219,context-management-2025-06-27"})
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    # text blocks are concatenated as they are (no separator added)
    assert "first question<|im_end|>\n<|im_start|>system\n# Environmentcwd /x<|im_end|>\n<|im_start|>user\nsay hello" in prompt
    empty = [{"role": "user", "content": "say hello"}, {"role": "system", "content": [], "output_config": {"effort": "low"}}]
    r = httpx.post(gw.url + "/v1/messages", json={"model": "m", "max_tokens": 8, "messages": empty})
    assert r.status_code == 200 and "system" not in engine.tokenizer.decode(
        list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "image", "source": {}}]}]
    r = httpx.post(gw.url + "/v1/messages", json={"model": "m", "max_tokens": 8, "messages": bad})
    assert r.status_code == 400 and "messages[1].content[0]: only text blocks" in r.json()["error"]["message"]


def test_probes_of_the_base_url(env):
    _, gw = env
    for path in ("/", "/api/hello"):
        assert httpx.head(gw.url + path).status_code == 200
        body = httpx.get(gw.url + path).json()
        assert body["name"] == "deepwell gateway" and "/v1/messages" in body["endpoints"]
