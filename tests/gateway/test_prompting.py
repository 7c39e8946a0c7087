"""build_prompt: rendering + tokenization + the turn boundary, token stability across
turns when reasoning is dropped, and the billing-header strip. Uses SmolLM2's real
tokenizer (rebuilt from its GGUF)."""

from __future__ import annotations

import functools
import pathlib

import pytest

from deepwell.gateway.chat_types import ChatMessage, ChatRequest, ContentPart, InvalidRequest, ToolCallSpec, ToolDef
from deepwell.gateway.prompting import build_prompt, message_dicts, strip_billing_header
from deepwell.gateway.templates import ChatTemplate

HERE = pathlib.Path(__file__).parent / "templates"
WEATHER = ToolDef("get_weather", "Weather", {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}})
WRITE = ToolDef("write_file", "Write", {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}})


@functools.cache
def tokenizer():
    import gguf

    from deepwell.engine_service.loading.gguf import read_metadata
    from deepwell.engine_service.loading.gguf_tokenizer import GGUFTokenizerData, build_tokenizer
    from tests.engine.fixtures_smollm2 import smollm2_gguf_path

    meta = read_metadata(gguf.GGUFReader(str(smollm2_gguf_path())))
    return build_tokenizer(GGUFTokenizerData.from_metadata(meta))


@functools.cache
def smollm2_source() -> str:
    import gguf

    from tests.engine.fixtures_smollm2 import smollm2_gguf_path

    field = gguf.GGUFReader(str(smollm2_gguf_path())).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def template(name: str) -> ChatTemplate:
    src = smollm2_source() if name == "smollm2" else (HERE / f"{name}.jinja").read_text()
    return ChatTemplate(src, bos_token="<|im_start|>", eos_token="<|im_end|>")


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False).ids


def test_prompt_is_rendered_text_tokenized_with_boundary() -> None:
    tpl = template("qwen3_5_xml")
    req = ChatRequest(messages=[ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Paris?")], tools=[WEATHER])
    p = build_prompt(req, tpl, tokenizer())
    dicts = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    tools = [WEATHER.to_template()]
    assert p.text == tpl.render(dicts, tools, add_generation_prompt=True)
    assert p.token_ids == encode(p.text)
    base = tpl.render(dicts, tools, add_generation_prompt=False)
    assert p.turn_boundary == len(encode(base)) and p.boundary_reason is None
    assert p.text[len(base) :] == "<|im_start|>assistant\n<think>\n"
    assert p.opens_reasoning is True
    off = build_prompt(ChatRequest(messages=req.messages, tools=[WEATHER], enable_thinking=False), tpl, tokenizer())
    assert off.text.endswith("<think>\n\n</think>\n\n") and off.opens_reasoning is False


def test_tool_choice_none_hides_tools() -> None:
    req = ChatRequest(messages=[ChatMessage("user", "hi")], tools=[WEATHER], tool_choice="none")
    p = build_prompt(req, template("qwen3_5_xml"), tokenizer())
    assert "<tools>" not in p.text


def agent_turns(with_reasoning: bool = True) -> list[list[ChatMessage]]:
    """Histories of successive requests of one agent session (each extends the last)."""
    r = (lambda s: s) if with_reasoning else (lambda s: None)
    h0 = [ChatMessage("system", "You are a coding agent."), ChatMessage("user", "Check the weather in Paris, then write it to w.txt.")]
    a1 = ChatMessage("assistant", "", reasoning=r("Need the weather first."), tool_calls=[ToolCallSpec("c1", "get_weather", {"city": "Paris", "days": 1})])
    t1 = ChatMessage("tool", '{"temp": 12}', tool_call_id="c1")
    a2 = ChatMessage(
        "assistant", "Writing it.", reasoning=r("Now save."), tool_calls=[ToolCallSpec("c2", "write_file", '{"path": "w.txt", "content": "12C\\n"}')]
    )
    t2 = ChatMessage("tool", "ok", tool_call_id="c2")
    a3 = ChatMessage("assistant", "Done: 12°C saved.", reasoning=r("All done."))
    u2 = ChatMessage("user", "And Oslo?")
    a4 = ChatMessage("assistant", "", reasoning=r("Oslo now."), tool_calls=[ToolCallSpec("c3", "get_weather", {"city": "Oslo"})])
    t3 = ChatMessage("tool", '{"temp": 3}', tool_call_id="c3")
    return [h0, h0 + [a1, t1], h0 + [a1, t1, a2, t2], h0 + [a1, t1, a2, t2, a3, u2], h0 + [a1, t1, a2, t2, a3, u2, a4, t3]]


def prompts(name: str, **kw) -> list:
    tpl = template(name)
    out = []
    for history in agent_turns():
        p = build_prompt(ChatRequest(messages=history, tools=[WEATHER, WRITE], **kw), tpl, tokenizer())
        assert p.turn_boundary is not None, p.boundary_reason
        out.append(p)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", ["qwen3_5_xml", "qwen3_hermes", "smollm2"])
def test_tool_loop_turn_starts_with_previous_boundary_prefix(name: str) -> None:
    ps = prompts(name)
    for p in ps:
        assert "Need the weather first." not in p.text and "Oslo now." not in p.text
    for prev, nxt in [(0, 1), (1, 2), (3, 4)]:  # consecutive requests of one tool loop
        b = ps[prev].turn_boundary
        assert ps[nxt].token_ids[:b] == ps[prev].token_ids[:b]


@pytest.mark.parametrize("name", ["qwen3_hermes", "smollm2"])
def test_new_user_turn_starts_with_previous_boundary_prefix(name: str) -> None:
    ps = prompts(name)
    b = ps[2].turn_boundary
    assert ps[3].token_ids[:b] == ps[2].token_ids[:b]


def test_qwen3_5_style_template_rewrites_the_open_turn_at_a_new_user_message() -> None:
    """A template property, not the gateway's: Qwen3.5-style templates give assistant
    messages after the last user query an (empty) <think></think> block and drop it once
    a new user message arrives, so at that transition the prompt diverges right after the
    previous user query (the engine resumes from an earlier point)."""
    ps = prompts("qwen3_5_xml")
    b = ps[2].turn_boundary
    assert ps[3].token_ids[:b] != ps[2].token_ids[:b]
    assert common_prefix(ps[3].token_ids, ps[2].token_ids) >= ps[0].turn_boundary


def test_preserved_reasoning_breaks_the_prefix_so_dropping_is_needed() -> None:
    """Control: the Qwen3 template keeps reasoning only after the last user query, so
    without dropping it the prompt of the turn after a new user message rewrites
    history — the property above is not vacuous."""
    tpl = template("qwen3_hermes")
    turns = agent_turns()
    before = build_prompt(ChatRequest(messages=turns[2], tools=[WEATHER, WRITE], preserve_thinking=True), tpl, tokenizer())
    after = build_prompt(ChatRequest(messages=turns[3], tools=[WEATHER, WRITE], preserve_thinking=True), tpl, tokenizer())
    assert "Need the weather first." in before.text
    assert after.token_ids[: before.turn_boundary] != before.token_ids[: before.turn_boundary]


def test_empty_reasoning_counts_as_absent() -> None:
    msgs = [ChatMessage("assistant", "x", reasoning=""), ChatMessage("assistant", "y", reasoning="r")]
    assert message_dicts(msgs, preserve_thinking=True) == [
        {"role": "assistant", "content": "x"},
        {"role": "assistant", "content": "y", "reasoning_content": "r"},
    ]
    assert message_dicts(msgs, preserve_thinking=False) == [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]


def test_tool_call_arguments_reach_the_template_as_objects() -> None:
    msgs = agent_turns()[2]
    d = message_dicts(msgs, preserve_thinking=False)
    assert d[4]["tool_calls"][0]["function"]["arguments"] == {"path": "w.txt", "content": "12C\n"}
    assert d[3] == {"role": "tool", "content": '{"temp": 12}', "tool_call_id": "c1"}


def billing(value: str) -> ContentPart:
    return ContentPart("text", f"x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch={value};")


def test_billing_header_is_stripped_before_rendering_and_counting() -> None:
    tpl = template("qwen3_5_xml")

    def prompt(value: str, as_string: bool = False) -> list[int]:
        if as_string:
            system = ChatMessage("system", billing(value).text + "\nYou are Claude Code.")
        else:
            system = ChatMessage("system", [billing(value), ContentPart("text", "You are Claude Code.")])
        p = build_prompt(ChatRequest(messages=[system, ChatMessage("user", "hi")]), tpl, tokenizer())
        assert "billing" not in p.text and "You are Claude Code." in p.text
        return p.token_ids

    assert prompt("aaa") == prompt("bbb") == prompt("ccc", as_string=True)
    only = strip_billing_header([ChatMessage("system", [billing("x")]), ChatMessage("user", "hi")])
    assert [m.role for m in only] == ["user"]
    # only the positional (first) block of the first system message is a billing header
    later = [ChatMessage("system", [ContentPart("text", "Intro"), billing("x")])]
    assert strip_billing_header(later) == later


def test_no_boundary_when_generation_prompt_rewrites_the_prompt() -> None:
    tpl = ChatTemplate("{% if add_generation_prompt %}PREFIX {% endif %}{{ messages[0].content }}")
    p = build_prompt(ChatRequest(messages=[ChatMessage("user", "hello")]), tpl, tokenizer())
    assert p.turn_boundary is None and "does not start with" in p.boundary_reason
    assert p.token_ids == encode("PREFIX hello")


def test_no_boundary_when_tokens_merge_across_it() -> None:
    tpl = ChatTemplate("{{ messages[0].content }}{% if add_generation_prompt %}ning{% endif %}")
    text = "run"
    assert encode(text + "ning")[: len(encode(text))] != encode(text)  # the tokenizer merges here
    p = build_prompt(ChatRequest(messages=[ChatMessage("user", text)]), tpl, tokenizer())
    assert p.turn_boundary is None and "merge" in p.boundary_reason


def test_bad_requests_are_invalid_request() -> None:
    tpl = template("qwen3_5_xml")
    img = ChatMessage("user", [ContentPart("text", "see"), ContentPart("image_url", data={"url": "x"})])
    with pytest.raises(InvalidRequest, match="image_url"):
        build_prompt(ChatRequest(messages=[img]), tpl, tokenizer())
    with pytest.raises(InvalidRequest, match="may not set messages"):
        build_prompt(ChatRequest(messages=[ChatMessage("user", "x")], template_kwargs={"messages": []}), tpl, tokenizer())
    with pytest.raises(InvalidRequest):
        ChatRequest(messages=[])
    with pytest.raises(InvalidRequest, match="not among the declared tools"):
        ChatRequest(messages=[ChatMessage("user", "x")], tools=[WEATHER], tool_choice={"name": "nope"})
    with pytest.raises(InvalidRequest, match="role"):
        ChatMessage("robot", "x")


@pytest.mark.parametrize("name", ["qwen3_5_xml", "qwen3_hermes", "smollm2"])
def test_fast_boundary_equals_full_encode(name: str) -> None:
    from deepwell.gateway.prompting import _base_token_count, template_kwargs

    tpl = template(name)
    for history in agent_turns():
        for kw in ({}, {"enable_thinking": False}):
            req = ChatRequest(messages=history, tools=[WEATHER, WRITE], **kw)
            dicts = message_dicts(history, False)
            tools = [WEATHER.to_template(), WRITE.to_template()]
            base = tpl.render(dicts, tools, add_generation_prompt=False, **template_kwargs(req))
            full = tpl.render(dicts, tools, add_generation_prompt=True, **template_kwargs(req))
            enc = tokenizer().encode(full, add_special_tokens=False)
            assert _base_token_count(tokenizer(), enc, base) == len(encode(base))
            # text ending just before / inside an added token, and right after one
            for cut in (base[:-1], base + "<|im_start|>", base + "<|im_start|>assi"):
                fast = _base_token_count(tokenizer(), enc, cut)
                slow = len(encode(cut)) if enc.ids[: len(encode(cut))] == encode(cut) else None
                assert fast == slow


def test_boundary_with_a_minimal_tokenizer_object() -> None:
    class Minimal:  # only encode(); no offsets, no added-token listing
        def encode(self, text, add_special_tokens=False):
            class E:
                ids = list(text.encode("utf-8"))

            return E()

    tpl = template("qwen3_5_xml")
    p = build_prompt(ChatRequest(messages=[ChatMessage("user", "hé")]), tpl, Minimal())
    base = tpl.render([{"role": "user", "content": "hé"}], None, add_generation_prompt=False)
    assert p.turn_boundary == len(base.encode("utf-8"))


def test_assistant_prefill_is_continued() -> None:
    tpl = template("qwen3_5_xml")
    history = [ChatMessage("user", "Name a color."), ChatMessage("assistant", "My favourite color is")]
    p = build_prompt(ChatRequest(messages=history), tpl, tokenizer())
    assert p.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nMy favourite color is")
    assert p.opens_reasoning is False
    base = tpl.render([{"role": "user", "content": "Name a color."}], None, add_generation_prompt=False)
    assert p.turn_boundary == len(encode(base))
    assert p.token_ids == encode(p.text)
    fresh = build_prompt(ChatRequest(messages=history, continue_final_message=False), tpl, tokenizer())
    assert fresh.text.endswith("My favourite color is<|im_end|>\n<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("name", ["qwen3_5_xml", "qwen3_hermes", "smollm2"])
def test_prefix_boundary_ends_the_shared_system_and_tools_block(name: str) -> None:
    """Two sessions with the same system prompt and tools, different conversations: their
    prompts agree on exactly the tokens before the prefix boundary (and it is the same in both)."""
    tpl = template(name)
    system = ChatMessage("system", "You are a coding agent. Follow the repository's rules.")
    a = build_prompt(ChatRequest(messages=[system, ChatMessage("user", "Fix the bug in main.py")], tools=[WEATHER, WRITE]),
                     tpl, tokenizer())
    b = build_prompt(ChatRequest(messages=[system, ChatMessage("user", "Add a test"),
                                           ChatMessage("assistant", "Sure."), ChatMessage("user", "Now run it")],
                                 tools=[WEATHER, WRITE]), tpl, tokenizer())
    assert a.prefix_boundary is not None and a.prefix_boundary == b.prefix_boundary
    n = a.prefix_boundary
    assert a.token_ids[:n] == b.token_ids[:n] and n < len(a.token_ids)
    assert "coding agent" in tokenizer().decode(a.token_ids[:n])
    # no system prompt and no tools: nothing worth a shared checkpoint
    plain = build_prompt(ChatRequest(messages=[ChatMessage("user", "hi")]), tpl, tokenizer())
    assert plain.prefix_boundary is None
