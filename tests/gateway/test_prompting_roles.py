"""build_prompt for what real agents send beyond plain chat: tools for a template that
cannot render them (the generic Hermes prompt), system messages mid-conversation (Claude
Code) and ``developer`` messages (Codex)."""

from __future__ import annotations

import json

import pytest

from deepwell.gateway.chat_types import ChatMessage, ChatRequest, ToolCallSpec
from deepwell.gateway.prompting import GENERIC_TOOLS_HEADER, build_prompt, generic_tool_messages
from deepwell.gateway.templates import ChatTemplate, TemplateError
from tests.gateway.test_prompting import WEATHER, WRITE, agent_turns, template, tokenizer

STRICT_SYSTEM = (  # refuses system messages anywhere but first, and unknown roles (as many real templates do)
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}"
    "{%- elif m.role not in ('system', 'user', 'assistant') %}{{ raise_exception('Unexpected message role.') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def strict() -> ChatTemplate:
    return ChatTemplate(STRICT_SYSTEM, bos_token="<|im_start|>", eos_token="<|im_end|>")


def test_generic_tools_go_into_the_system_turn_in_hermes_form() -> None:
    req = ChatRequest(messages=[ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Paris?")],
                      tools=[WEATHER, WRITE])
    plain = build_prompt(req, template("smollm2"), tokenizer())
    assert "get_weather" not in plain.text  # SmolLM2's template drops tools on the floor
    p = build_prompt(req, template("smollm2"), tokenizer(), generic_tools=True)
    system = p.text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER.to_template(), ensure_ascii=False) in system
    assert json.dumps(WRITE.to_template(), ensure_ascii=False) in system
    assert '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>' in system
    assert p.turn_boundary is not None and p.token_ids[: p.turn_boundary] == tokenizer().encode(
        p.text[: p.text.rindex("<|im_start|>assistant")], add_special_tokens=False).ids


def test_generic_tools_write_history_calls_and_results_in_the_same_form() -> None:
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "12", "tool_call_id": "c1"},
            {"role": "tool", "content": "3", "tool_call_id": "c2"},
            {"role": "user", "content": "thanks"}]
    out = generic_tool_messages(msgs, [WEATHER.to_template()])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert out[0]["content"] == GENERIC_TOOLS_HEADER.format(tools=json.dumps(WEATHER.to_template()))
    assert out[2] == {"role": "assistant", "content": (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12\n</tool_response>\n<tool_response>\n3\n</tool_response>"}
    assert msgs[1]["tool_calls"]  # the caller's dicts are not modified


def test_generic_tool_loop_keeps_the_turn_prefix() -> None:
    """Each request of a tool loop starts with the previous one's turn tokens, so prefix reuse
    works for generic-tool models exactly as for tool-aware templates."""
    tpl = template("smollm2")
    ps = [build_prompt(ChatRequest(messages=h, tools=[WEATHER, WRITE]), tpl, tokenizer(), generic_tools=True)
          for h in agent_turns()]
    for prev, nxt in [(0, 1), (1, 2), (2, 3), (3, 4)]:
        b = ps[prev].turn_boundary
        assert b is not None and ps[nxt].token_ids[:b] == ps[prev].token_ids[:b]


def test_late_system_message_rendered_in_place_when_the_template_allows_it() -> None:
    msgs = [ChatMessage("system", "Rules."), ChatMessage("user", "hi"), ChatMessage("system", "Reminder: be terse."),
            ChatMessage("user", "go")]
    p = build_prompt(ChatRequest(messages=msgs), template("qwen3_5_xml"), tokenizer())
    assert p.text.index("hi") < p.text.index("<|im_start|>system\nReminder: be terse.") < p.text.index("go<|im_end|>")


def test_late_system_and_developer_messages_merged_for_a_strict_template() -> None:
    msgs = [ChatMessage("system", "Rules."), ChatMessage("user", "hi"), ChatMessage("developer", "Dev note."),
            ChatMessage("system", "Reminder."), ChatMessage("user", "go")]
    with pytest.raises(TemplateError):  # what the template does with them as they are
        strict().render([{"role": m.role, "content": m.content} for m in msgs], None)
    p = build_prompt(ChatRequest(messages=msgs), strict(), tokenizer())
    assert p.text == ("<|im_start|>system\nRules.\n\nDev note.\n\nReminder.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n")


def test_developer_becomes_system_for_a_template_that_never_names_it() -> None:
    msgs = [ChatMessage("developer", "Be precise."), ChatMessage("user", "hi")]
    p = build_prompt(ChatRequest(messages=msgs), template("smollm2"), tokenizer())
    assert p.text.startswith("<|im_start|>system\nBe precise.<|im_end|>")
    assert "developer" not in p.text


def test_other_template_errors_still_raise() -> None:
    msgs = [ChatMessage("user", "hi"), ChatMessage("assistant", "", tool_calls=[ToolCallSpec("c", "f", {})]),
            ChatMessage("tool", "x", tool_call_id="c")]
    with pytest.raises(TemplateError, match="Unexpected message role"):
        build_prompt(ChatRequest(messages=msgs), strict(), tokenizer())
