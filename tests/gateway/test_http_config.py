"""Unit tests of the gateway's config, API keys, accounting and engine-bundle building."""

from __future__ import annotations

import json

import pytest

from deepwell.configs import ConfigError, from_args
from deepwell.gateway.accounting import RequestLog, RequestRecord
from deepwell.gateway.auth import ApiKeys, AuthError
from deepwell.gateway.config import GatewayConfig
from deepwell.gateway.engine_client import build_bundle
from tests.gateway.fake_engine import FakeEngine


def test_config_env_and_lists():
    env = {"DEEPWELL_GATEWAY_ENGINES": "a:1, b:2,a:1", "DEEPWELL_GATEWAY_PORT": "0",
           "DEEPWELL_GATEWAY_TOLERANT_TOOL_CALLS": "true"}
    cfg = from_args(GatewayConfig, None, "GATEWAY", environ=env)
    assert cfg.engines == ("a:1", "b:2") and cfg.port == 0 and cfg.tolerant_tool_calls is True


@pytest.mark.parametrize("field,value", [("port", 70000), ("engines", ("",)), ("tool_parser", "nope"),
                                         ("keepalive_s", 6.0), ("max_messages", 0), ("api_keys", ("nocolon",))])
def test_config_validation(field, value):
    with pytest.raises(ConfigError) as e:
        GatewayConfig(**{field: value})
    assert field in str(e.value)


def test_api_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n\nteam1:sk-1\n")
    keys = ApiKeys.load(["team2:sk-2"], str(f))
    assert keys.tenant_for({"Authorization": "Bearer sk-1"}) == "team1"
    assert keys.tenant_for({"x-api-key": "sk-2"}) == "team2"
    for headers in ({}, {"authorization": "Basic sk-1"}, {"x-api-key": "sk-3"}):
        with pytest.raises(AuthError):
            keys.tenant_for(headers)
    assert ApiKeys.load().tenant_for({}) == "default"
    f.write_text("bad line\n")
    with pytest.raises(ConfigError):
        ApiKeys.load([], str(f))
    with pytest.raises(ConfigError):
        ApiKeys.load([], str(tmp_path / "missing"))


def test_request_log_lines(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    log = RequestLog(str(path))
    log.write(RequestRecord(request_id="r1", tenant="t", endpoint="messages", prompt_tokens=3))
    log.write(RequestRecord(request_id="r2", tenant="t", endpoint="chat.completions"))
    log.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["request_id"] for r in rows] == ["r1", "r2"] and rows[0]["prompt_tokens"] == 3
    assert not RequestLog("").enabled


def test_build_bundle_from_model_info():
    fake = FakeEngine()
    bundle = build_bundle(fake.info(), fake.files())
    assert bundle.model_id == "fake-model" and bundle.max_context == 4096
    assert bundle.tool_parser == "hermes_json"
    assert bundle.tokenizer.encode("hello").ids == fake.tokenizer.encode("hello").ids
    assert build_bundle(fake.info(), fake.files(), tool_parser_override="qwen_xml").tool_parser == "qwen_xml"
    info = fake.info()
    info.chat_template = ""
    assert build_bundle(info, fake.files()).template is not None  # from tokenizer_config.json
