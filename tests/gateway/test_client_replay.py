"""Replay of real agent-CLI requests (``tests/gateway/clients/*.json``, recorded by
``tests/gateway/record_clients.py``; clients, versions and commands in that folder's README)
against a live gateway process over the scripted fake engine.

For every recorded request: HTTP 200 and the exact response grammar the client parses —
Anthropic ``message_start`` -> (``content_block_start`` -> deltas -> ``content_block_stop``)* ->
``message_delta`` -> ``message_stop`` (``ping`` allowed between), OpenAI chat chunks ending in
``data: [DONE]``, the Responses event sequence with consecutive ``sequence_number``s — and the
usage fields each client reads (Anthropic ``input_tokens`` / ``cache_read_input_tokens``,
OpenAI ``prompt_tokens_details.cached_tokens``, Responses ``input_tokens_details.cached_tokens``)
against the engine's scripted cache hits. Requests that offer tools are replayed a second time
with the engine answering with a call to the first offered tool (the tool-call grammar).

Then the behaviours a client depends on beyond the grammar: the session key the engine sees
(from each source a client sends), Anthropic's context-overflow error (Claude Code compacts on
``prompt is too long``), and the tools of a template that cannot render them.

What the gateway does not do yet is marked ``xfail(strict=True)`` with the gap as the reason:
``GAPS`` (rules over the fixtures), ``SessionSource.gap``, or a mark on a test; delete the mark
when its gap closes. At b75a3f2 (where the fixtures were recorded) 24 cases were such xfails —
the rules in ``CLOSED_GAPS``, the session keys from ``metadata.user_id`` JSON / ``session-id`` /
``thread-id`` / ``prompt_cache_key``, Anthropic's ``prompt is too long`` and the generic tool
format; f860c0a closed them all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.fake_engine import FakeEngine, Script, read_sse, start_gateway

FIXTURES_DIR = Path(__file__).parent / "clients"
CACHED = 5  # prompt tokens the fake engine reports as served from its cache
ANSWER = "Hi! How can I help?"
THOUGHT = "The user greets me."
CALL_ARGS = {"file_path": "README.md"}

# The API each recorded model route belongs to.
ANTHROPIC, OPENAI_CHAT, RESPONSES = "anthropic", "openai_chat", "responses"
ROUTES = {"/v1/messages": ANTHROPIC, "/v1/chat/completions": OPENAI_CHAT, "/v1/responses": RESPONSES}


# ------------------------------------------------------------------------ the gaps
@dataclass(frozen=True)
class Gap:
    reason: str
    applies: Callable[[dict[str, Any]], bool]  # fixture -> does this gap make its replay fail today


def _api(fx: dict[str, Any]) -> str | None:
    return ROUTES.get(fx["path"].split("?")[0])


def _has_system_message(fx: dict[str, Any]) -> bool:
    return _api(fx) == ANTHROPIC and any(m.get("role") == "system" for m in (fx["body"] or {}).get("messages", []))


def _is_probe(fx: dict[str, Any]) -> bool:
    return fx["method"] in ("HEAD", "GET") and not fx["path"].startswith(("/v1/", "/health", "/metrics"))


# Open gaps: a fixture a rule applies to is replayed as xfail(strict=True) with the reason.
GAPS: dict[str, Gap] = {}

# Gaps open at b75a3f2 (the recordings' gateway), closed in f860c0a: move a rule back into
# GAPS to replay against a gateway without the fix.
CLOSED_GAPS = {
    "system_role": Gap(
        "gateway gap: Anthropic `messages` entries with role 'system' (Claude Code sends its environment block "
        "as a mid-conversation system message) are refused with 400 \"messages.N.role: Input should be 'user' "
        "or 'assistant'\"", _has_system_message),
    "root_probe": Gap(
        "gateway gap: HEAD / GET connectivity probes outside /v1 answer 404 (Claude Code 2.1.332 sends "
        "HEAD /api/hello to ANTHROPIC_BASE_URL before its first request)", _is_probe),
}


def gap_for(fx: dict[str, Any]) -> Gap | None:
    return next((g for g in GAPS.values() if g.applies(fx)), None)


# ------------------------------------------------------------------------ fixtures
def load_fixtures() -> list[tuple[str, dict[str, Any]]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted(FIXTURES_DIR.glob("*.json"))]


FIXTURES = load_fixtures()


def params(select: Callable[[dict[str, Any]], bool] = lambda fx: True) -> list[Any]:
    out = []
    for name, fx in FIXTURES:
        if not select(fx):
            continue
        gap = gap_for(fx)
        marks = [pytest.mark.xfail(strict=True, reason=gap.reason)] if gap else []
        out.append(pytest.param(fx, id=name, marks=marks))
    return out


def offered_tools(fx: dict[str, Any]) -> list[str]:
    """Names of the client-side function tools the request offers, in order."""
    body, api = fx["body"] or {}, _api(fx)
    names = []
    for t in body.get("tools") or []:
        if api == ANTHROPIC and t.get("type") in (None, "custom"):
            names.append(t["name"])
        elif api == OPENAI_CHAT and t.get("type") == "function":
            names.append(t["function"]["name"])
        elif api == RESPONSES and t.get("type") == "function":
            names.append(t["name"])
    return names


# ------------------------------------------------------------------------ the engine and gateway
class ScriptedEngine(FakeEngine):
    """The fake engine answering ``ANSWER`` (after a short reasoning when the prompt opened
    ``<think>``) or, while ``call_tool`` is set, a call to that tool."""

    call_tool: str | None = None

    def script_for(self, prompt_text: str) -> Script:
        thinking_open = prompt_text.rstrip().endswith("<think>")
        head = THOUGHT + "\n</think>\n\n" if thinking_open else ""
        if self.call_tool:
            call = json.dumps({"name": self.call_tool, "arguments": CALL_ARGS})
            return Script(trigger="", text=f"{head}<tool_call>\n{call}\n</tool_call>", chunk=3, cached=CACHED)
        return Script(trigger="", text=head + ANSWER, chunk=2, cached=CACHED)


@pytest.fixture(scope="module")
def engine():
    eng = ScriptedEngine(max_context=1_000_000).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def gw(engine, tmp_path_factory):
    proc = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def replay(client: httpx.Client, base: str, fx: dict[str, Any], *, drop_headers: tuple[str, ...] = (),
           body: dict[str, Any] | None = None) -> httpx.Response:
    headers = {k: v for k, v in fx["headers"].items() if k not in ("accept-encoding", *drop_headers)}
    body = fx["body"] if body is None else body
    content = json.dumps(body).encode() if body is not None else None
    return client.request(fx["method"], base + fx["path"], headers=headers, content=content)


def events_of(resp: httpx.Response) -> list[tuple[str | None, Any]]:
    assert resp.headers["content-type"].startswith("text/event-stream"), resp.headers
    return [(e, d) for e, d in read_sse(resp.text.splitlines()) if e != ":"]  # keep-alive comments aside


# ------------------------------------------------------------------------ grammar checks
ANTHROPIC_DELTAS = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
                    "tool_use": {"input_json_delta"}}
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}


def check_anthropic_usage(usage: dict[str, Any]) -> None:
    assert isinstance(usage["input_tokens"], int) and usage["input_tokens"] > 0, usage
    assert usage["cache_read_input_tokens"] == CACHED, usage
    assert isinstance(usage.get("cache_creation_input_tokens", 0), int), usage


def check_anthropic_stream(events: list[tuple[str | None, Any]]) -> list[dict[str, Any]]:
    """The Messages streaming grammar; returns the blocks (type + accumulated payload)."""
    for name, data in events:
        assert isinstance(data, dict) and data.get("type") == name, (name, data)  # event name == data.type
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    start = events[0][1]["message"]
    assert start["type"] == "message" and start["role"] == "assistant" and start["content"] == [], start
    assert start["stop_reason"] is None
    check_anthropic_usage(start["usage"])
    blocks: list[dict[str, Any]] = []
    open_index: int | None = None
    for name, data in events[1:]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks), (data, open_index)
            block = dict(data["content_block"])
            assert block["type"] in ANTHROPIC_DELTAS, block
            if block["type"] == "tool_use":
                assert block["id"] and block["name"] and block["input"] == {}, block
                block["partial_json"] = ""
            blocks.append(block)
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index, (data, open_index)
            block, delta = blocks[open_index], data["delta"]
            assert delta["type"] in ANTHROPIC_DELTAS[block["type"]], (block["type"], delta)
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                block["partial_json"] += delta["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index, (data, open_index)
            open_index = None
        elif name == "message_delta":
            assert open_index is None, "message_delta with a content block still open"
            assert data["delta"]["stop_reason"] in STOP_REASONS, data
            assert isinstance(data["usage"]["output_tokens"], int) and data["usage"]["output_tokens"] > 0, data
        elif name == "message_stop":
            pass
        else:
            raise AssertionError(f"unexpected event {name!r}: {data}")
    for b in blocks:
        if b["type"] == "thinking":
            assert b["signature"], "a thinking block needs its signature_delta"
    return blocks


def check_openai_stream(events: list[tuple[str | None, Any]], include_usage: bool) -> dict[str, Any]:
    """OpenAI chat chunks: data-only events, role first, one finish, usage chunk, [DONE]."""
    assert events[-1] == (None, "[DONE]"), events[-3:]
    chunks = [d for _, d in events[:-1]]
    assert all(n is None for n, _ in events), "chat completion chunks carry no event names"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant", chunks[0]
    finishes = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1, finishes
    content, calls = "", {}
    for c in chunks[:finishes[0] + 1]:
        delta = c["choices"][0]["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            if "id" in tc:
                assert tc["type"] == "function" and tc["function"]["name"], tc
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
            else:
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    rest = chunks[finishes[0] + 1:]
    if include_usage:
        assert len(rest) == 1 and rest[0]["choices"] == [], rest
        usage = rest[0]["usage"]
        assert usage["prompt_tokens"] > CACHED and usage["completion_tokens"] > 0, usage
        assert usage["prompt_tokens_details"]["cached_tokens"] == CACHED, usage
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert rest == []
    return {"content": content, "calls": list(calls.values()),
            "finish_reason": chunks[finishes[0]]["choices"][0]["finish_reason"]}


def check_responses_stream(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """Responses events: created, in_progress, per item added -> deltas -> done, completed."""
    for name, data in events:
        assert data.get("type") == name, (name, data)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"], names
    assert names[-1] in ("response.completed", "response.incomplete"), names
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    open_items: dict[int, dict[str, Any]] = {}
    done_items: dict[int, dict[str, Any]] = {}
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert data["output_index"] == len(open_items) + len(done_items) and not open_items, data
            open_items[data["output_index"]] = data["item"]
        elif name == "response.output_item.done":
            item = open_items.pop(data["output_index"])
            assert item["id"] == data["item"]["id"] and item["type"] == data["item"]["type"]
            done_items[data["output_index"]] = data["item"]
        else:
            assert data["output_index"] in open_items, (name, data)
            assert name in ("response.content_part.added", "response.output_text.delta",
                            "response.output_text.done", "response.content_part.done",
                            "response.reasoning_text.delta", "response.reasoning_text.done",
                            "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
                            "response.function_call_arguments.delta", "response.function_call_arguments.done"), name
    assert not open_items, open_items
    final = events[-1][1]["response"]
    assert final["status"] in ("completed", "incomplete")
    assert [o["id"] for o in final["output"]] == [done_items[i]["id"] for i in range(len(done_items))]
    usage = final["usage"]
    assert usage["input_tokens"] > CACHED and usage["output_tokens"] > 0, usage
    assert usage["input_tokens_details"]["cached_tokens"] == CACHED, usage
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], usage
    assert isinstance(usage["output_tokens_details"]["reasoning_tokens"], int), usage
    return final


def check_response(fx: dict[str, Any], resp: httpx.Response, tool: str | None = None) -> None:
    """Status 200 and the API's grammar; with ``tool``, that the call to it came back."""
    assert resp.status_code == 200, (resp.status_code, resp.text[:2000])
    body, api = fx["body"] or {}, _api(fx)
    stream = bool(body.get("stream"))
    if api == ANTHROPIC:
        if stream:
            blocks = check_anthropic_stream(events_of(resp))
        else:
            msg = resp.json()
            assert msg["type"] == "message" and msg["role"] == "assistant", msg
            assert msg["stop_reason"] in STOP_REASONS
            check_anthropic_usage(msg["usage"])
            blocks = msg["content"]
        if tool:
            uses = [b for b in blocks if b["type"] == "tool_use"]
            assert [u["name"] for u in uses] == [tool], blocks
            assert (json.loads(uses[0]["partial_json"]) if stream else uses[0]["input"]) == CALL_ARGS
        else:
            assert "".join(b.get("text", "") for b in blocks if b["type"] == "text") == ANSWER, blocks
    elif api == OPENAI_CHAT:
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            out = check_openai_stream(events_of(resp), include_usage)
        else:
            data = resp.json()
            assert data["object"] == "chat.completion"
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED
            msg = data["choices"][0]["message"]
            out = {"content": msg.get("content") or "", "finish_reason": data["choices"][0]["finish_reason"],
                   "calls": [c["function"] for c in msg.get("tool_calls") or []]}
        if tool:
            assert out["finish_reason"] == "tool_calls" and [c["name"] for c in out["calls"]] == [tool], out
            assert json.loads(out["calls"][0]["arguments"]) == CALL_ARGS
        else:
            assert out["content"] == ANSWER and out["finish_reason"] == "stop", out
    elif api == RESPONSES:
        final = check_responses_stream(events_of(resp)) if stream else resp.json()
        if not stream:
            assert final["usage"]["input_tokens_details"]["cached_tokens"] == CACHED
        if tool:
            calls = [o for o in final["output"] if o["type"] == "function_call"]
            assert [c["name"] for c in calls] == [tool] and json.loads(calls[0]["arguments"]) == CALL_ARGS, final
        else:
            texts = [c["text"] for o in final["output"] if o["type"] == "message" for c in o["content"]]
            assert "".join(texts) == ANSWER, final["output"]


# ------------------------------------------------------------------------ the replays
def test_fixtures_present() -> None:
    clients = {fx["recorded"]["client"] for _, fx in FIXTURES}
    assert {"claude-code", "codex", "qwen-code", "opencode"} <= clients, clients
    for name, fx in FIXTURES:
        assert set(fx) >= {"method", "path", "headers", "body", "recorded"}, name
        lowered = {k.lower() for k in fx["headers"]}
        assert not lowered & {"authorization", "x-api-key", "cookie"}, f"{name} keeps a credential header"


@pytest.mark.parametrize("fx", params())
def test_replay(fx: dict[str, Any], gw, engine, client) -> None:
    engine.call_tool = None
    resp = replay(client, gw.url, fx)
    if _api(fx) is None:  # a probe (HEAD / GET) or another route the client calls
        assert resp.status_code == 200, (resp.status_code, resp.text[:500])
        return
    check_response(fx, resp)


@pytest.mark.parametrize("fx", params(lambda fx: fx["method"] == "POST" and bool(offered_tools(fx))))
def test_replay_tool_call(fx: dict[str, Any], gw, engine, client) -> None:
    tool = offered_tools(fx)[0]
    engine.call_tool = tool
    try:
        resp = replay(client, gw.url, fx)
    finally:
        engine.call_tool = None
    check_response(fx, resp, tool=tool)


# ------------------------------------------------------------------------ sessions
def _claude_user_id_session(fx: dict[str, Any]) -> str | None:
    raw = ((fx["body"] or {}).get("metadata") or {}).get("user_id")
    try:
        return json.loads(raw).get("session_id") if raw else None
    except (ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class SessionSource:
    name: str
    session: Callable[[dict[str, Any]], str | None]  # the id the client sends this way
    strip: tuple[str, ...]  # headers removed so that this source is the only one left
    gap: str | None = None
    strip_body: tuple[str, ...] = ()


SESSION_SOURCES = [
    SessionSource("x-claude-code-session-id", lambda fx: fx["headers"].get("x-claude-code-session-id"), ()),
    # OpenCode (a custom provider): `x-session-id` and `x-session-affinity`, both its session id;
    # the gateway reads the first
    SessionSource("x-session-id", lambda fx: fx["headers"].get("x-session-id"), ()),
    # the four below were gaps at b75a3f2 (no key from Codex; the whole user_id JSON string as the key)
    SessionSource("metadata.user_id", _claude_user_id_session, ("x-claude-code-session-id",)),
    SessionSource("session-id", lambda fx: fx["headers"].get("session-id"), ("thread-id",),
                  strip_body=("prompt_cache_key",)),
    SessionSource("thread-id", lambda fx: fx["headers"].get("thread-id"), ("session-id",),
                  strip_body=("prompt_cache_key",)),
    SessionSource("prompt_cache_key", lambda fx: (fx["body"] or {}).get("prompt_cache_key"),
                  ("session-id", "thread-id")),
]
SESSION_HEADERS = ("x-claude-code-session-id", "x-session-id", "session-id", "thread-id")


def session_params() -> list[Any]:
    """One replay per (client, source): the client's first recorded model request carrying it."""
    out, seen = [], set()
    for _name, fx in FIXTURES:
        if _api(fx) is None or gap_for(fx):
            continue
        for src in SESSION_SOURCES:
            key = (fx["recorded"]["client"], src.name)
            if key in seen or not src.session(fx):
                continue
            seen.add(key)
            marks = [pytest.mark.xfail(strict=True, reason=src.gap)] if src.gap else []
            out.append(pytest.param(fx, src, id=f"{fx['recorded']['client']}-{src.name}", marks=marks))
    return out


@pytest.mark.parametrize(("fx", "src"), session_params())
def test_session_key(fx: dict[str, Any], src: SessionSource, gw, engine, client) -> None:
    """The engine sees ``<tenant>/<the client's session id>`` from each source the client sends."""
    engine.call_tool = None
    body = {k: v for k, v in (fx["body"] or {}).items() if k not in src.strip_body}
    if src.name != "metadata.user_id" and isinstance(body.get("metadata"), dict):
        body["metadata"] = {k: v for k, v in body["metadata"].items() if k != "user_id"}
    if src.name != "metadata.user_id":
        body.pop("user", None)
    body.pop("stream", None)  # the session key does not depend on streaming
    n = len(engine.requests)
    resp = replay(client, gw.url, fx, drop_headers=src.strip, body=body)
    assert resp.status_code == 200, resp.text[:1000]
    assert len(engine.requests) == n + 1
    assert engine.requests[-1].session_key == f"default/{src.session(fx)}"


# ------------------------------------------------------------------------ overflow and tools
@pytest.fixture(scope="module")
def small_gw(tmp_path_factory):
    """A fake engine with a 2048-token context behind its own gateway."""
    eng = ScriptedEngine(max_context=2048).start()
    proc = start_gateway([eng.address], str(tmp_path_factory.mktemp("small-gw")))
    yield proc
    proc.stop()
    eng.stop()


# ChatML without tools: the template ignores `tools`, like SmolLM2's (the default model's).
CHATML_NO_TOOLS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def plain_engine_gw(tmp_path_factory):
    eng = ScriptedEngine(max_context=1_000_000, chat_template=CHATML_NO_TOOLS_TEMPLATE).start()
    proc = start_gateway([eng.address], str(tmp_path_factory.mktemp("plain-gw")))
    yield eng, proc
    proc.stop()
    eng.stop()


def _first(select: Callable[[dict[str, Any]], bool]) -> list[Any]:
    for name, fx in FIXTURES:
        if select(fx) and not gap_for(fx):
            return [pytest.param(fx, id=name)]
    return []


def _first_per_client(select: Callable[[dict[str, Any]], bool]) -> list[Any]:
    """``_first`` for each recorded client (Qwen Code and OpenCode share the chat API)."""
    clients = dict.fromkeys(fx["recorded"]["client"] for _, fx in FIXTURES)
    return [p for c in clients for p in _first(lambda fx, c=c: fx["recorded"]["client"] == c and select(fx))]


@pytest.mark.parametrize("fx", _first(lambda fx: fx["recorded"]["client"] == "claude-code" and _api(fx) == ANTHROPIC
                                      and len(offered_tools(fx)) > 3))
def test_anthropic_context_overflow_is_prompt_too_long(fx: dict[str, Any], small_gw, client) -> None:
    """Claude Code compacts the conversation on a 400 ``prompt is too long: N tokens > M maximum``
    (a 413 ``request_too_large`` at b75a3f2, which it does not read that way)."""
    resp = replay(client, small_gw.url, fx)
    assert resp.status_code == 400, (resp.status_code, resp.text[:500])
    err = resp.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    # Claude Code matches the message's start (Anthropic's own is exactly this sentence); the
    # maximum may be the context or the longest prompt it leaves room for
    m = re.match(r"prompt is too long: (\d+) tokens > (\d+) maximum", err["error"]["message"])
    assert m and int(m.group(1)) > int(m.group(2)) and int(m.group(2)) in (2047, 2048), err


@pytest.mark.parametrize("fx", _first_per_client(lambda fx: _api(fx) is not None and bool(offered_tools(fx))))
def test_tools_reach_a_template_without_tools(fx: dict[str, Any], plain_engine_gw, client) -> None:
    """The generic tool format: a template that ignores ``tools`` (SmolLM2's) still gets them in
    the prompt, and a Hermes-form call comes back as a tool call (dropped at b75a3f2)."""
    eng, proc = plain_engine_gw
    tool = offered_tools(fx)[-1]
    eng.call_tool = None
    n = len(eng.requests)
    resp = replay(client, proc.url, fx)
    assert resp.status_code == 200, resp.text[:1000]
    prompt = eng.tokenizer.decode(list(eng.requests[n].prompt_token_ids), skip_special_tokens=False)
    assert re.search(rf'"name":\s*"{re.escape(tool)}"', prompt), f"tool {tool!r} is not in the prompt"
    eng.call_tool = tool  # and a call in the generic (Hermes) form comes back as a tool call
    try:
        resp = replay(client, proc.url, fx)
    finally:
        eng.call_tool = None
    check_response(fx, resp, tool=tool)
