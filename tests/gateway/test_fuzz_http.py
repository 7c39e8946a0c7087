"""Fuzz: hypothesis-generated malformed bodies to every endpoint of a live gateway.

Property: no 5xx for any body (the scripted engine never fails here), every error has the
API's error shape, and the process stays up.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.fake_engine import FakeEngine, start_gateway

ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/responses"]
VALID = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 4},
}
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream", "tools",
          "tool_choice", "n", "seed", "system", "thinking", "metadata", "stop_sequences", "stream_options",
          "response_format", "chat_template_kwargs", "input", "instructions", "max_output_tokens", "user",
          "parallel_tool_calls", "logprobs", "min_p", "repetition_penalty", "content", "role"]

json_scalars = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | \
    st.floats(allow_nan=False) | st.text(max_size=30)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
message_like = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x", 3]),
                                      "content": json_values})


@st.composite
def mutated(draw, endpoint):
    body = json.loads(json.dumps(VALID[endpoint]))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(json_values | st.lists(message_like, max_size=3))
    return body


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    engine = FakeEngine(max_context=512).start()
    proc = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")), "--max-body-bytes", "100000")
    yield proc
    proc.stop()
    engine.stop()


@pytest.fixture(scope="module")
def client(gw):
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        yield c


def check(client, endpoint, content: bytes):
    r = client.post(endpoint, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (endpoint, content[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        if endpoint.startswith("/v1/messages"):
            assert body["type"] == "error" and isinstance(body["error"]["message"], str)
        else:
            assert isinstance(body["error"]["message"], str)
    elif "text/event-stream" not in r.headers.get("content-type", ""):
        r.json()


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@FUZZ
@given(data=st.data())
def test_mutated_bodies(gw, client, endpoint, data):
    body = data.draw(mutated(endpoint))
    check(client, endpoint, json.dumps(body).encode())


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@FUZZ
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bytes_and_json(gw, client, endpoint, raw):
    check(client, endpoint, raw)


def test_process_survived(gw, client):
    assert gw.alive()
    assert client.get("/health").status_code == 200
    r = client.post("/v1/chat/completions", json=VALID["/v1/chat/completions"])
    assert r.status_code == 200
