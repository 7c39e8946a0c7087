"""Tools for a model whose chat template ignores them (SmolLM2's does): the gateway writes
them into the system turn in the Hermes form and parses the model's ``<tool_call>`` blocks
back into tool calls, over a live gateway process and the scripted engine."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.fake_engine import WEATHER_TOOL, FakeEngine, Script, start_gateway

PLAIN_CHATML = (  # no tools, no tool calls: what many small models ship
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPTS = [
    Script(trigger='"name": "get_weather", "arguments": ', text='{"city": "Oslo"}}\n</tool_call>', chunk=2),
    Script(trigger="weather in paris", text="Let me check.\n" + CALL, chunk=3),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS, chat_template=PLAIN_CHATML, model_type="llama").start()
    log = tmp_path_factory.getbasetemp() / "generic-requests.jsonl"
    gw = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")), "--request-log", str(log))
    gw.request_log = log
    yield engine, gw
    gw.stop()
    engine.stop()


def prompt_of(engine) -> str:
    return engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)


def test_tools_reach_the_prompt_and_calls_come_back(env):
    engine, gw = env
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "tools": [WEATHER_TOOL], "messages": [{"role": "user", "content": "weather in paris?"}]})
    assert r.status_code == 200, r.text
    prompt = prompt_of(engine)
    assert prompt.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in prompt
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}


def test_history_and_results_are_written_in_the_same_form(env):
    engine, gw = env
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                   json={"model": "m", "tools": [WEATHER_TOOL], "messages": msgs})
    assert r.status_code == 200, r.text
    prompt = prompt_of(engine)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>') in prompt


def test_forced_tool_choice_and_anthropic_tool_use(env):
    engine, gw = env
    r = httpx.post(gw.url + "/v1/messages", timeout=30, json={
        "model": "m", "max_tokens": 64, "tool_choice": {"type": "tool", "name": "get_weather"},
        "tools": [{"name": "get_weather", "description": "weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}],
        "messages": [{"role": "user", "content": "anything"}]})
    assert r.status_code == 200, r.text
    assert prompt_of(engine).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')
    block = r.json()["content"][0]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {"city": "Oslo"}
    assert r.json()["stop_reason"] == "tool_use"


def test_without_tools_the_prompt_is_the_template_alone(env):
    engine, gw = env
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert prompt_of(engine) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_request_log_names_the_tool_format(env):
    _, gw = env
    rows = [json.loads(line) for line in gw.request_log.read_text().splitlines()]
    assert [(r["endpoint"], r["tool_format"]) for r in rows] == [
        ("chat.completions", "generic_hermes"), ("chat.completions", "generic_hermes"), ("messages", "generic_hermes"),
        ("chat.completions", None)]
