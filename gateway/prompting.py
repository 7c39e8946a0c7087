"""Build the engine prompt for a chat request: render, tokenize, mark the turn boundary.

Contract of :func:`build_prompt`:
- Anthropic's positional billing-header system block (a first system text block starting
  with ``x-anthropic-billing-header:``, which changes on every request) is removed before
  rendering and counting; a system message left empty is dropped.
- Token stability: unless ``preserve_thinking``, reasoning is removed from every
  assistant message of the history; an empty reasoning string counts as absent. So turn
  N+1's prompt starts with turn N's prompt up to its turn boundary.
- The template is rendered twice, with and without the generation prompt. The turn
  boundary is the token count of the latter when the former's tokens extend it (a text
  prefix AND a token prefix); otherwise ``turn_boundary`` is None and
  ``boundary_reason`` says why (also logged).
- Assistant prefill: a last assistant message with text and no tool calls is continued
  (rendered like HF's ``continue_final_message``), and the boundary is the end of the
  turns before it.
- Shared-prefix boundary: the end of the block every session with the same system prompt and
  tools renders identically — the leading system messages and the tools, up to where the first
  user message's text starts (found by rendering them with a sentinel user message). It is
  the token count of that text when the prompt starts with it as text and as tokens, else the
  end of the last special token inside it; None when the prompt has no such block or the
  template cannot render it. The engine keeps a state image there once per distinct prefix.
- Generic tools (``generic_tools``: the model's template cannot render tools, e.g. SmolLM2's):
  the tools go into the system turn as JSON schemas with the instruction to answer in the
  Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` form (which the gateway
  then parses, as llama.cpp does for generic models); earlier tool calls are written into their
  assistant message in that form and each run of tool results becomes one user message of
  ``<tool_response>`` blocks, so the history reads the same way.
- System messages after the first position (Claude Code sends them mid-conversation) and
  ``developer`` messages (Codex; system messages for a template that never names the role)
  are rendered as they are when the template accepts them; a
  template that refuses them (``raise_exception``) gets them merged into one leading system
  message instead.
- Tokenization uses ``add_special_tokens=False``: the template writes BOS and the role
  markers itself (as ``transformers`` does for chat templates).
- Errors: :class:`~gateway.templates.TemplateError` from rendering,
  :class:`~gateway.chat_types.InvalidRequest` for content that cannot be rendered (e.g.
  images, reserved template variable names).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from deepwell.logs import get_logger
from deepwell.gateway.chat_types import ChatMessage, ChatRequest, InvalidRequest, ToolCallSpec
from deepwell.gateway.reasoning import prompt_opens_reasoning
from deepwell.gateway.templates import ChatTemplate, TemplateError

log = get_logger(__name__)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class _Encoding(Protocol):
    ids: list[int]


class _Tokenizer(Protocol):
    def encode(self, sequence: str, add_special_tokens: bool = True) -> _Encoding: ...


@dataclass(frozen=True, slots=True)
class PromptResult:
    token_ids: list[int]
    text: str
    turn_boundary: int | None
    boundary_reason: str | None
    opens_reasoning: bool = False  # the prompt ends inside an open <think>
    prefix_boundary: int | None = None  # end of the shared system-and-tools block


def _is_billing_header(text: str) -> bool:
    return text.lstrip().lower().startswith(BILLING_HEADER_PREFIX)


def strip_billing_header(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Drop the billing-header block: the first text block of the first system message."""
    out = list(messages)
    for i, m in enumerate(out):
        if m.role != "system":
            continue
        if isinstance(m.content, list):
            parts = list(m.content)
            first_text = next((j for j, p in enumerate(parts) if p.type == "text"), None)
            if first_text is not None and _is_billing_header(parts[first_text].text):
                del parts[first_text]
                new: ChatMessage | None = _replace_content(m, parts) if parts else None
            else:
                return out
        elif _is_billing_header(m.content):
            rest = m.content.lstrip().split("\n", 1)
            remainder = rest[1].lstrip("\n") if len(rest) == 2 else ""
            new = _replace_content(m, remainder) if remainder else None
        else:
            return out
        if new is None:
            del out[i]
        else:
            out[i] = new
        return out
    return out


def _replace_content(m: ChatMessage, content: Any) -> ChatMessage:
    return ChatMessage(
        role=m.role, content=content, reasoning=m.reasoning, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id, name=m.name
    )


def _content_text(m: ChatMessage, index: int) -> str:
    if isinstance(m.content, str):
        return m.content
    kinds = sorted({p.type for p in m.content if p.type != "text"})
    if kinds:
        raise InvalidRequest(f"message {index}: content parts of type {', '.join(kinds)} are not supported by this model")
    return "".join(p.text for p in m.content)  # as given (HF templates, the OpenAI API)


def _template_arguments(call: ToolCallSpec) -> dict[str, Any] | str:
    if isinstance(call.arguments, dict):
        return call.arguments
    try:
        parsed = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return call.arguments
    return parsed if isinstance(parsed, dict) else call.arguments


def message_dicts(messages: list[ChatMessage], preserve_thinking: bool) -> list[dict[str, Any]]:
    """The HF/OpenAI message dicts chat templates expect."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": _content_text(m, i)}
        if m.role == "assistant" and preserve_thinking and m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _template_arguments(c)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def template_kwargs(req: ChatRequest) -> dict[str, Any]:
    bad = sorted(_RESERVED_KWARGS & req.template_kwargs.keys())
    if bad:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(bad)}")
    kwargs = dict(req.template_kwargs)
    if req.enable_thinking is not None:
        kwargs["enable_thinking"] = req.enable_thinking
    if req.preserve_thinking:
        kwargs["preserve_thinking"] = True
    return kwargs


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """A last assistant message with text and no tool calls is continued (Anthropic's
    "prefill"), not answered."""
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and bool(last.get("content")) and not last.get("tool_calls")


def _plain_added_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of added tokens that split the input into independent segments (no strip,
    not normalized); empty when the tokenizer cannot list them."""
    get = getattr(tokenizer, "get_added_tokens_decoder", None)
    if get is None:
        return frozenset()
    try:
        added = get()
    except Exception:  # a tokenizer-like object without the full API
        return frozenset()
    return frozenset(
        i for i, t in added.items() if not (getattr(t, "lstrip", False) or getattr(t, "rstrip", False) or getattr(t, "normalized", False))
    )


def _base_token_count(tokenizer: Any, full_enc: Any, base: str) -> int | None:
    """Token count of ``encode(base)`` when it is a prefix of ``full_enc``, else None.

    Fast path: added (special) tokens split the text into segments that tokenize
    independently, so only the segment after the last one before the end of ``base``
    is encoded again and compared with the full encoding (ids and end offset). When that
    cannot be shown, ``base`` is encoded in full and compared."""
    ids: list[int] = list(full_enc.ids)
    n = len(base)
    offsets = getattr(full_enc, "offsets", None)
    added = _plain_added_ids(tokenizer)
    if offsets is not None and added:
        j = 0
        for k in range(len(ids) - 1, -1, -1):
            if ids[k] in added and offsets[k][1] <= n:
                j = k + 1
                break
        if j:
            start = offsets[j - 1][1]
            tail = list(tokenizer.encode(base[start:], add_special_tokens=False).ids)
            m = len(tail)
            if ids[j : j + m] == tail and (m == 0 and start == n or m > 0 and offsets[j + m - 1][1] == n):
                return j + m
    base_ids = list(tokenizer.encode(base, add_special_tokens=False).ids)
    return len(base_ids) if ids[: len(base_ids)] == base_ids else None


PREFIX_SENTINEL = "dwprefixsentinel7f3a"  # a user message's text no real prompt contains


def shared_prefix_boundary(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                           kwargs: dict[str, Any], template: ChatTemplate, tokenizer: Any, enc: Any,
                           full: str) -> int | None:
    """Tokens of ``full`` (encoded as ``enc``) that every prompt with the same leading system
    messages and tools shares (see the module doc), or None."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    if not (lead or tools) or lead == len(messages) or messages[lead]["role"] != "user":
        return None
    try:
        probe = template.render([*messages[:lead], {"role": "user", "content": PREFIX_SENTINEL}], tools,
                                add_generation_prompt=False, **kwargs)
    except Exception:  # a template that cannot render the probe: no boundary, never an error
        return None
    cut = probe.find(PREFIX_SENTINEL)
    if cut <= 0 or not full.startswith(probe[:cut]):
        return None
    n = _base_token_count(tokenizer, enc, probe[:cut])
    if n is None:  # tokens merge across the cut: back off to the end of the last special token inside
        offsets, added = getattr(enc, "offsets", None), _plain_added_ids(tokenizer)
        if offsets is None or not added:
            return None
        n = next((k + 1 for k in range(len(enc.ids) - 1, -1, -1)
                  if enc.ids[k] in added and offsets[k][1] <= cut), None)
    return n if n and n < len(enc.ids) else None


GENERIC_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to help with the request. They are listed below as JSON "
    "schemas:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with one block per call, each a JSON "
    "object with the function's name and its arguments:\n<tool_call>\n{{\"name\": \"<function name>\", "
    "\"arguments\": {{<arguments as JSON>}}}}\n</tool_call>"
)


def generic_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template that cannot render tools (see the module doc)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    header = GENERIC_TOOLS_HEADER.format(tools=listing)
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                              "arguments": c["function"]["arguments"]},
                                                             ensure_ascii=False) + "\n</tool_call>"
                              for c in m.pop("tool_calls"))
            m["content"] = (m["content"] + "\n" if m["content"] else "") + calls
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
                continue
            m = {"role": "user", "content": block, "tool_results": True}
        out.append(m)
    for m in out:
        m.pop("tool_results", None)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + header}
    else:
        out.insert(0, {"role": "system", "content": header})
    return out


_INSTRUCTION_ROLES = ("system", "developer")


def merge_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system (and developer) message folded into one leading system message, for
    templates that refuse them later or do not know the developer role."""
    system = [m["content"] for m in messages if m["role"] in _INSTRUCTION_ROLES]
    rest = [m for m in messages if m["role"] not in _INSTRUCTION_ROLES]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def _needs_merge(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "developer" for m in messages) or any(
        m["role"] == "system" for m in messages[1:])


def _render_pair(template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 prefill: bool, kwargs: dict[str, Any]) -> tuple[str, str]:
    """(the prompt, the prompt without the generation prologue)."""
    if prefill:
        # assistant prefill: the prompt ends inside the last (assistant) message, which
        # the model continues; the turn boundary is where the previous turns end
        full = template.render(messages, tools, continue_final_message=True, **kwargs)
        return full, template.render(messages[:-1], tools, add_generation_prompt=False, **kwargs)
    full = template.render(messages, tools, add_generation_prompt=True, **kwargs)
    return full, template.render(messages, tools, add_generation_prompt=False, **kwargs)


def build_prompt(req: ChatRequest, template: ChatTemplate, tokenizer: _Tokenizer,
                 generic_tools: bool = False) -> PromptResult:
    messages = message_dicts(strip_billing_header(req.messages), req.preserve_thinking)
    tools = [t.to_template() for t in req.active_tools()] or None
    if generic_tools and tools:
        messages, tools = generic_tool_messages(messages, tools), None
    if "developer" not in template.source:  # a template that has never heard of the role
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    kwargs = template_kwargs(req)
    prefill = bool(req.continue_final_message and is_prefill(messages))
    try:
        full, base = _render_pair(template, messages, tools, prefill, kwargs)
    except TemplateError:
        if not _needs_merge(messages):
            raise
        messages = merge_system_messages(messages)  # late system / developer messages refused
        full, base = _render_pair(template, messages, tools, prefill, kwargs)
    enc = tokenizer.encode(full, add_special_tokens=False)
    ids = list(enc.ids)
    boundary: int | None = None
    reason: str | None = None
    if not full.startswith(base):
        reason = "the prompt with the generation prologue does not start with the prompt without it"
    else:
        boundary = _base_token_count(tokenizer, enc, base)
        if boundary is None:
            reason = "tokens merge across the end of the last turn (the generation prologue changes its tokens)"
    if reason is not None:
        log.info("no turn boundary", reason=reason, prompt_tokens=len(ids))
    prefix = shared_prefix_boundary(messages, tools, kwargs, template, tokenizer, enc, full)
    return PromptResult(
        token_ids=ids, text=full, turn_boundary=boundary, boundary_reason=reason,
        opens_reasoning=prompt_opens_reasoning(full), prefix_boundary=prefix,
    )
