"""ChatTemplate renders exactly like transformers' apply_chat_template(tokenize=False).

Templates: SmolLM2's own (from its GGUF), a Qwen3.5-style XML-tools + thinking template,
a Qwen3/Hermes-style JSON-tools template, and a feature template exercising the HF
environment (tojson options, loop controls, namespace, dict, strftime_now, kwargs).
"""

from __future__ import annotations

import copy
import functools
import pathlib

import pytest

from deepwell.gateway.templates import ChatTemplate, TemplateError

HERE = pathlib.Path(__file__).parent / "templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — ünïcode",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WRITE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, WRITE]


def _call(i: str, name: str, args) -> dict:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS: dict[str, list[dict]] = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    "multi_turn_thinking": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Weather in Paris? 日本語 too 😀"},
    ],
    "tool_use_multi_turn": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Oslo, then save it."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two cities: call twice.",
            "tool_calls": [_call("c1", "get_weather", {"city": "Paris", "days": 2}), _call("c2", "get_weather", {"city": "Oslo"})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 12}'},
        {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 3}'},
        {
            "role": "assistant",
            "content": "Saving now.",
            "tool_calls": [_call("c3", "write_file", {"path": "w.txt", "content": "Paris 12\nOslo 3\n</parameter> literal"})],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "ok"},
    ],
    "tool_call_content_none": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "get_weather", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ],
    "inline_system": [
        {"role": "user", "content": "First"},
        {"role": "assistant", "content": "Ok"},
        {"role": "system", "content": "Be brief from now on."},
        {"role": "user", "content": "Second"},
    ],
    "think_in_content": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<think>\nhidden\n</think>\n\nvisible"},
        {"role": "user", "content": "Q2"},
    ],
}

KWARGS = [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"preserve_thinking": True}, {"custom_flag": "x"}]


@functools.cache
def smollm2_template() -> str:
    import gguf

    from tests.engine.fixtures_smollm2 import smollm2_gguf_path

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    field = reader.fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def template_source(name: str) -> str:
    if name == "smollm2":
        return smollm2_template()
    return (HERE / f"{name}.jinja").read_text()


@functools.cache
def hf_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def require_hf_message_normalization(messages) -> None:
    """Skip when this transformers predates the message normalization our renderer follows.

    Before it renders, transformers >= 5.21 aliases a message's reasoning (``reasoning_content``,
    ``thinking``, ``reasoning``: each is filled from the first present) and >= 5.23 drops keys whose
    value is None (OpenAI's ``content=None``), so templates see them as undefined. ChatTemplate does
    both; an older transformers is no reference for messages that either step changes.
    """
    import transformers
    from packaging.version import Version

    have = Version(transformers.__version__)
    if have < Version("5.21") and any(m.get(k) is not None for m in messages for k in _REASONING_FIELDS):
        pytest.skip(f"needs transformers >= 5.21 (has {have}): older versions do not alias a message's "
                    "reasoning_content/thinking/reasoning fields before rendering")
    if have < Version("5.23") and any(v is None for m in messages for v in m.values()):
        pytest.skip(f"needs transformers >= 5.23 (has {have}): older versions pass None-valued message keys "
                    "(content=None) to the template instead of dropping them")


def hf_render(source: str, messages, tools, add_generation_prompt: bool, kwargs: dict) -> str:
    require_hf_message_normalization(messages)
    return hf_tokenizer().apply_chat_template(
        copy.deepcopy(messages),
        tools=copy.deepcopy(tools),
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **kwargs,
    )


def ours(source: str) -> ChatTemplate:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TEMPLATES = ["smollm2", "qwen3_5_xml", "qwen3_hermes", "features"]


@pytest.mark.parametrize("kwargs", KWARGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "none")
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", TEMPLATES)
def test_render_equals_transformers(template: str, conv: str, kwargs: dict) -> None:
    source = template_source(template)
    messages = CONVERSATIONS[conv]
    tpl = ours(source)
    if template == "smollm2" and any(m.get("content") is None for m in messages):
        # SmolLM2's template reads message['content'] unconditionally: both renderers fail alike
        import jinja2

        with pytest.raises(jinja2.exceptions.UndefinedError) as hf_exc:
            hf_render(source, messages, None, False, kwargs)
        with pytest.raises(TemplateError) as our_exc:
            tpl.render(copy.deepcopy(messages), None, **kwargs)
        assert str(our_exc.value) == str(hf_exc.value)
        return
    for tools in (None, TOOLS):
        for agp in (False, True):
            expected = hf_render(source, messages, tools, agp, kwargs)
            assert tpl.render(copy.deepcopy(messages), tools, add_generation_prompt=agp, **kwargs) == expected


def test_template_errors_match_transformers_messages() -> None:
    import jinja2

    tpl = ours(template_source("features"))
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "FAIL"}]
    with pytest.raises(TemplateError, match="template refused: FAIL in message 1"):
        tpl.render(msgs)
    with pytest.raises(jinja2.exceptions.TemplateError, match="template refused: FAIL in message 1"):
        hf_render(template_source("features"), msgs, None, False, {})
    with pytest.raises(TemplateError, match="No user query found"):
        ours(template_source("qwen3_5_xml")).render([{"role": "system", "content": "x"}])


def test_template_failures_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for x in %}")
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplate("   ")
    # sandbox: no attribute escapes, no mutation of inputs
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    with pytest.raises(TemplateError, match="UndefinedError|undefined"):
        ChatTemplate("{{ nothing.here }}").render([])
    with pytest.raises(TemplateError, match="TypeError|unsupported|can only"):
        ChatTemplate("{{ 'a' + messages }}").render([])


def test_tojson_is_hf_style() -> None:
    tpl = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=1) }}|{{ x | tojson(sort_keys=true) }}")
    out = tpl.render([], x={"b": "<ü>&", "a": 1})
    assert out == '{"b": "<ü>&", "a": 1}|{\n "b": "<ü>&",\n "a": 1\n}|{"a": 1, "b": "<ü>&"}'


def test_special_tokens_and_kwargs_override() -> None:
    tpl = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}", bos_token="<s>", eos_token="</s>", pad_token="<p>")
    assert tpl.render([]) == "<s>|</s>|<p>"
    assert tpl.render([], bos_token="B") == "B|</s>|<p>"


def test_reasoning_aliases_like_hf() -> None:
    src = "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}"
    msgs = [{"role": "assistant", "content": "x", "reasoning": "r1"}, {"role": "assistant", "content": "y", "thinking": "r2"}]
    assert ours(src).render(copy.deepcopy(msgs)) == "r1/r1;r2/r2;"
    assert hf_render(src, msgs, None, False, {}) == "r1/r1;r2/r2;"


@pytest.mark.parametrize("template", ["smollm2", "qwen3_5_xml", "qwen3_hermes", "features"])
@pytest.mark.parametrize("prefill", ["The answer is", "Sure:\n", "  spaced  "])
def test_continue_final_message_equals_transformers(template: str, prefill: str) -> None:
    source = template_source(template)
    messages = [*CONVERSATIONS["multi_turn_thinking"], {"role": "assistant", "content": prefill}]
    require_hf_message_normalization(messages)
    expected = hf_tokenizer().apply_chat_template(
        copy.deepcopy(messages), chat_template=source, continue_final_message=True, tokenize=False
    )
    assert ours(source).render(copy.deepcopy(messages), continue_final_message=True) == expected


def test_continue_final_message_errors() -> None:
    tpl = ours(template_source("qwen3_5_xml"))
    with pytest.raises(TemplateError, match="cannot both be set"):
        tpl.render([{"role": "user", "content": "x"}], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(TemplateError, match="does not render"):
        ChatTemplate("{{ 'fixed' }}").render([{"role": "assistant", "content": "abc"}], continue_final_message=True)
