"""``/v1/responses`` on a live gateway over the scripted engine: raw events and the SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway.fake_engine import FakeEngine, Script, read_sse, start_gateway

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPTS = [
    Script(trigger="say hello", text="Hello there!", chunk=2),
    Script(trigger="weather please", text="Ok.\n" + CALL, chunk=3),
    Script(trigger="reason first", text="Hmm.</think>Yes.", chunk=2),
    Script(trigger="too long", text="a b c d e f", finish="length"),
]
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": []}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS).start()
    proc = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")), "--default-max-tokens", "300")
    proc.engine = engine
    yield proc
    proc.stop()
    engine.stop()


@pytest.fixture(scope="module")
def oai(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def test_text_non_stream(oai):
    r = oai.responses.create(model="m", input="say hello", instructions="Be nice.")
    assert r.output_text == "Hello there!" and r.status == "completed"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0


def test_stream_event_sequence(gw):
    body = {"model": "m", "input": "reason first", "stream": True, "reasoning": {"effort": "high"}}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body) as r:
        events = [(e, d) for e, d in read_sse(r.iter_lines()) if e != ":"]
    kinds = [e for e, _ in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert "".join(d["delta"] for e, d in events if e == "response.reasoning_text.delta") == "Hmm."
    assert "".join(d["delta"] for e, d in events if e == "response.output_text.delta") == "Yes."
    done = [d["item"]["type"] for e, d in events if e == "response.output_item.done"]
    assert done == ["reasoning", "message"]
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]


def test_function_tools_and_unknown_tools_ignored(oai):
    r = oai.responses.create(model="m", input="weather please", tools=TOOLS)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    follow = oai.responses.create(model="m", tools=TOOLS, input=[
        {"role": "user", "content": "weather please"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        {"role": "user", "content": "say hello"}])
    assert follow.output_text == "Hello there!"


def test_sdk_stream_helper(oai):
    with oai.responses.stream(model="m", input="weather please", tools=TOOLS[:1]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    kinds = [o.type for o in final.output]
    assert kinds == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}


def test_incomplete_and_unsupported(oai):
    r = oai.responses.create(model="m", input="too long", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="m", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="m", input=[{"role": "user", "content": [{"type": "input_image",
                                                                             "image_url": "data:x"}]}])


def test_default_max_tokens_caps_requests_without_one(gw, oai):
    """Codex sends no output cap: ``--default-max-tokens`` bounds such requests, not others."""
    oai.responses.create(model="m", input="say hello")
    assert gw.engine.requests[-1].sampling.max_tokens == 300
    oai.responses.create(model="m", input="say hello", max_output_tokens=1000)
    assert gw.engine.requests[-1].sampling.max_tokens == 1000
