"""Qwen3.5-style model (XML tool calls, prompt opens ``<think>``) through a live gateway."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.gateway.fake_engine import FakeEngine, Script, read_sse, start_gateway

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_5_xml.jinja").read_text()
CODE = 'def f():\n    return "</parameter>"\n'
CALL = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
        + CODE + "\n</parameter>\n</function>\n</tool_call>")
SCRIPTS = [
    Script(trigger="write it", text="I will write the file.\n</think>\n\nWriting.\n" + CALL, chunk=3),
    Script(trigger="<function=write_file>\n", text="<parameter=path>\nb.py\n</parameter>\n"
           "<parameter=content>\nx\n</parameter>\n</function>\n</tool_call>", chunk=2),
]
TOOLS = [{"name": "write_file", "description": "write a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                           "required": ["path", "content"]}}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    engine = FakeEngine(scripts=SCRIPTS, chat_template=TEMPLATE, model_type="qwen3_5").start()
    gw = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")))
    yield engine, gw
    gw.stop()
    engine.stop()


def test_anthropic_stream_reasoning_then_xml_tool_use(env):
    engine, gw = env
    body = {"model": "m", "max_tokens": 200, "stream": True, "tools": TOOLS,
            "messages": [{"role": "user", "content": "write it"}]}
    with httpx.stream("POST", gw.url + "/v1/messages", json=body) as r:
        events = [(e, d) for e, d in read_sse(r.iter_lines()) if e != ":"]
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    starts = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    thinking = "".join(d["delta"].get("thinking", "") for e, d in events if e == "content_block_delta")
    assert thinking.strip() == "I will write the file."
    partial = "".join(d["delta"].get("partial_json", "") for e, d in events if e == "content_block_delta")
    assert json.loads(partial) == {"path": "a.py", "content": CODE}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_openai_named_tool_choice_with_xml_prefix(env):
    engine, gw = env
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS]
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": "m", "tools": tools, "messages": [{"role": "user", "content": "anything"}],
        "tool_choice": {"type": "function", "function": {"name": "write_file"}}})
    choice = r.json()["choices"][0]
    prompt = engine.tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n</think>\n\n<tool_call>\n<function=write_file>\n")
    assert choice["finish_reason"] == "tool_calls" and "reasoning_content" not in choice["message"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"path": "b.py", "content": "x"}
