"""End to end: the official SDKs -> live gateway -> real engine (SmolLM2-135M on CPU).

The engine process is started from ``python -m deepwell.engine_service`` with the embedded SmolLM2
GGUF (fetched once per machine by ``tests.engine.fixtures_smollm2``). Greedy decoding, so
the answers are deterministic; asserts check structure and the tool-call round trip, not
the model's prose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import openai
import pytest

from tests.gateway.fake_engine import _die_with_parent, start_gateway

SYSTEM = ('You call tools. To call get_weather, reply exactly: <tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "CITY"}}\n</tool_call>')
EXAMPLE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MAX_CONTEXT = 2048

# Runs by default: this is the acceptance check that the official SDKs work against the
# real engine (SmolLM2 on CPU); it loads the model once per module (~10-45 s on 2 cores).


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory):
    try:
        from tests.engine.fixtures_smollm2 import smollm2_gguf_path

        model = smollm2_gguf_path()
    except Exception as exc:  # no network and no cached copy
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    tmp = tmp_path_factory.mktemp("engine")
    port_file = tmp / "port"
    log = open(tmp / "engine.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "deepwell.engine_service", "--model", str(model), "--listen",
                             "127.0.0.1:0", "--port-file", str(port_file), "--metrics-port", "-1",
                             "--max-context", str(MAX_CONTEXT),
                             # 182 pages (5.7 full contexts): zeroing the default 2 GiB pool took ~23 s
                             "--cpu-kv-gib", "0.5"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "DEEPWELL_LOG_JSON": "1"}, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + 180
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("engine did not start:\n" + Path(tmp / "engine.log").read_text()[-3000:])
        time.sleep(0.1)
    yield f"127.0.0.1:{port_file.read_text().strip()}"
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def gw(real_engine, tmp_path_factory):
    proc = start_gateway([real_engine], str(tmp_path_factory.mktemp("gw")), "--tool-parser", "hermes_json",
                         timeout_s=120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def oai(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(gw):
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=120)


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_openai_chat_and_stream_agree(oai):
    r = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 0
    chunks = list(oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_openai_completions(oai):
    r = oai.completions.create(model="m", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 8


def test_anthropic_messages_stream_and_count_tokens(claude):
    r = claude.messages.create(model="m", max_tokens=24, extra_body={"temperature": 0}, messages=QUESTION)
    assert r.content[0].type == "text" and r.content[0].text
    with claude.messages.stream(model="m", max_tokens=24, extra_body={"temperature": 0}, messages=QUESTION) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == r.content[0].text == final.content[0].text
    n = claude.messages.count_tokens(model="m", messages=QUESTION).input_tokens
    assert n == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)


def test_errors_parse_as_sdk_types(oai, claude):
    long = [{"role": "user", "content": "word " * (MAX_CONTEXT + 100)}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=long, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and str(MAX_CONTEXT) in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e2:
        claude.messages.create(model="m", max_tokens=4, messages=long)
    assert "prompt is too long" in e2.value.message


def test_tool_call_round_trip(oai):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": EXAMPLE}, {"role": "user", "content": "Weather in Paris?"}]
    first = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."},
                 {"role": "user", "content": "Thanks. Summarize the weather in Paris in a few words."}]
    second = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=24, temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_each_turn_reuses_the_conversation_so_far(oai, claude):
    """A 3-turn chat resending its history: every turn after the first is served from the
    prefix cache up to (at least) the previous turn's whole prompt, and says so in usage."""
    messages = [{"role": "user", "content": "Name a colour of the rainbow."}]
    before = 0
    for turn in range(3):
        r = oai.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0, user="cache-test")
        cached = r.usage.prompt_tokens_details.cached_tokens
        # (turn 0 may reuse the template's default system prompt from earlier requests)
        assert before <= cached < r.usage.prompt_tokens, (turn, cached, before)
        before = r.usage.prompt_tokens
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "And another one?"}]
    # Anthropic usage counts the same tokens as read from the cache
    a = claude.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0}, messages=messages)
    assert a.usage.cache_read_input_tokens >= before
    assert a.usage.input_tokens + a.usage.cache_read_input_tokens == claude.messages.count_tokens(
        model="m", messages=messages).input_tokens
