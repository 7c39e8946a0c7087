"""Text content parts are concatenated as they are (HF chat semantics, OpenAI's reference
behaviour), for every API's input: OpenAI chat, Anthropic messages (user blocks, system
blocks, tool_result blocks, mid-conversation system messages) and Responses."""

from __future__ import annotations

from deepwell.gateway.chat_types import ChatMessage, ContentPart
from deepwell.gateway.http import anthropic_api, openai_api, responses_api
from deepwell.gateway.http import schemas_anthropic as sa
from deepwell.gateway.http import schemas_openai as so
from deepwell.gateway.http.common import RequestContext
from deepwell.gateway.prompting import message_dicts

CTX = RequestContext(request_id="r", tenant="default", headers={})
PARTS = ["Hello", " wor", "ld\n", "!"]  # parts carry their own spacing; nothing is added between them
JOINED = "".join(PARTS)


def rendered(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    return [(d["role"], d["content"]) for d in message_dicts(messages, preserve_thinking=False)]


def test_openai_chat_text_parts():
    body = so.ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": p} for p in PARTS]},
        {"role": "user", "content": [{"type": "text", "text": p} for p in PARTS]}]})
    req, _ = openai_api.to_chat_request(body, CTX)
    assert rendered(req.messages) == [("system", JOINED), ("user", JOINED)]


def test_anthropic_blocks():
    blocks = [{"type": "text", "text": p} for p in PARTS]
    body = sa.MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "system": blocks, "messages": [
        {"role": "user", "content": blocks},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": blocks}]},
        {"role": "system", "content": blocks},
        {"role": "user", "content": "next"}]})
    req, _ = anthropic_api.to_chat_request(body, CTX)
    assert rendered(req.messages) == [("system", JOINED), ("user", JOINED), ("assistant", ""), ("tool", JOINED),
                                      ("system", JOINED), ("user", "next")]


def test_responses_content_parts():
    parts = [{"type": "input_text", "text": p} for p in PARTS]
    body = responses_api.ResponsesRequest.model_validate({"model": "m", "instructions": "be brief", "input": [
        {"type": "message", "role": "user", "content": parts},
        {"type": "function_call_output", "call_id": "c", "output": parts}]})
    req = responses_api.to_chat_request(body, CTX)
    assert rendered(req.messages) == [("system", "be brief"), ("user", JOINED), ("tool", JOINED)]


def test_chat_message_text():
    assert ChatMessage("user", [ContentPart("text", p) for p in PARTS]).text() == JOINED
