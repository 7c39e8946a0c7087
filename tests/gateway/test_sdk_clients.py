"""The official ``openai`` and ``anthropic`` SDKs against a live gateway (scripted engine)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.gateway.fake_engine import WEATHER_TOOL, FakeEngine, Script, start_gateway

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
SCRIPTS = [
    Script(trigger="say hello", text="Hello there, friend!", chunk=2),
    Script(trigger="weather please", text="One moment.\n" + CALL, chunk=3),
    Script(trigger="reason first", text="Thinking hard.</think>Four.", chunk=2),
    Script(trigger="overload me", error_code="RESOURCE_EXHAUSTED", error_message="queue full"),
]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS, max_context=400).start()
    proc = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")))
    yield proc
    proc.stop()
    engine.stop()


@pytest.fixture(scope="module")
def oai(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(gw):
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)


def test_openai_chat(oai):
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "say hello"}], max_tokens=32)
    assert r.choices[0].message.content == "Hello there, friend!"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0


def test_openai_chat_stream(oai):
    stream = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "say hello"}], stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there, friend!"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_openai_tool_call_stream_helper(oai):
    with oai.chat.completions.stream(model="m", messages=[{"role": "user", "content": "weather please"}],
                                     tools=[WEATHER_TOOL]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.content == "One moment."


def test_openai_tool_round_trip(oai):
    first = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "weather please"}],
                                        tools=[WEATHER_TOOL])
    msg = first.choices[0].message
    history = [{"role": "user", "content": "weather please"}, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"},
               {"role": "user", "content": "say hello"}]
    second = oai.chat.completions.create(model="m", messages=history, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "Hello there, friend!"


def test_openai_reasoning_content(oai):
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "reason first"}],
                                    extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert r.choices[0].message.content == "Four."
    assert r.choices[0].message.model_extra["reasoning_content"] == "Thinking hard."


def test_openai_completions(oai):
    r = oai.completions.create(model="m", prompt="say hello", max_tokens=16)
    assert r.choices[0].text == "Hello there, friend!"
    text = "".join(c.choices[0].text for c in oai.completions.create(model="m", prompt="say hello", stream=True)
                   if c.choices)
    assert text == "Hello there, friend!"


def test_openai_models(oai):
    assert [m.id for m in oai.models.list()] == ["fake-model"]
    assert oai.models.retrieve("fake-model").id == "fake-model"


def test_openai_errors(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 500}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=3)
    with pytest.raises(openai.RateLimitError):
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "overload me"}])
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")


def test_anthropic_messages(claude):
    r = claude.messages.create(model="claude-x", max_tokens=32, messages=[{"role": "user", "content": "say hello"}])
    assert r.content[0].type == "text" and r.content[0].text == "Hello there, friend!"
    assert r.stop_reason == "end_turn" and r.usage.output_tokens > 0


def test_anthropic_stream(claude):
    with claude.messages.stream(model="claude-x", max_tokens=32,
                                messages=[{"role": "user", "content": "say hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there, friend!" == final.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def test_anthropic_tool_use_stream(claude):
    tools = [{"name": "get_weather", "description": "weather",
              "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    with claude.messages.stream(model="claude-x", max_tokens=64, tools=tools,
                                messages=[{"role": "user", "content": "weather please"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    tool = [b for b in final.content if b.type == "tool_use"][0]
    assert tool.name == "get_weather" and tool.input == {"city": "Paris", "days": 3}


def test_anthropic_thinking_stream(claude):
    with claude.messages.stream(model="claude-x", max_tokens=64, thinking={"type": "enabled", "budget_tokens": 1024},
                                messages=[{"role": "user", "content": "reason first"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Thinking hard." and final.content[0].signature
    assert final.content[1].text == "Four."


def test_anthropic_count_tokens(claude, gw):
    msgs = [{"role": "user", "content": "say hello"}]
    n = claude.messages.count_tokens(model="claude-x", messages=msgs, system="Be brief.").input_tokens
    beta = claude.beta.messages.count_tokens(model="claude-x", messages=msgs, system="Be brief.").input_tokens
    r = claude.messages.create(model="claude-x", max_tokens=8, messages=msgs, system="Be brief.")
    assert n == beta == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)


def test_anthropic_errors(claude):
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "word " * 500}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "prompt is too long" in e.value.message
    with pytest.raises(anthropic.OverloadedError):
        claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "overload me"}])
