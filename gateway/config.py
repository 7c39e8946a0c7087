"""Gateway configuration (env prefix ``GATEWAY``: ``DEEPWELL_GATEWAY_<FIELD>``).

One frozen dataclass; every field maps to a ``--flag`` and an environment variable via
``deepwell.configs``. Validation happens in ``__post_init__`` and raises ``ConfigError``
naming the field and its value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepwell.configs import check

TOOL_PARSERS = ("", "qwen_xml", "hermes_json")
U32 = 2**32 - 1  # the engine's max_tokens is a uint32


def split_addresses(raw: tuple[str, ...]) -> tuple[str, ...]:
    """Flatten repeated and comma-separated address values; drop blanks and duplicates."""
    out: list[str] = []
    for item in raw:
        for part in item.split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return tuple(out)


@dataclass(frozen=True)
class GatewayConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP listen host"})
    port: int = field(default=8000, metadata={"help": "HTTP listen port (0 = pick a free port)"})
    engines: tuple[str, ...] = field(
        default=("127.0.0.1:50051",),
        metadata={"help": "engine gRPC addresses, comma separated (host:port or unix:/path)", "metavar": "ADDR,..."},
    )
    grpc_listen: str = field(
        default="127.0.0.1:50061",
        metadata={"help": "listen address of the deepwell.gateway.v1.Chat gRPC service ('' = off)"},
    )
    api_keys_file: str = field(
        default="",
        metadata={"help": "file of API keys, one 'key_id:secret' per line (# comments); empty = no auth"},
    )
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata={"help": "API keys as 'key_id:secret', comma separated (added to --api-keys-file)"},
    )
    admin_keys: tuple[str, ...] = field(
        default=(),
        metadata={"help": "API key ids (not secrets), comma separated, allowed on the operator endpoints "
                          "(GET /v1/deepwell/sessions) when API keys are on; with keys on and none listed those "
                          "endpoints answer 403; without API keys they are open", "metavar": "KEY_ID,..."},
    )
    request_log: str = field(
        default="", metadata={"help": "append one JSON line per request to this file (no prompt text); empty = off"}
    )
    request_log_session_keys: bool = field(
        default=False,
        metadata={"help": "also write each request's session key in clear to the request log ('session'); by "
                          "default only its hash ('session_hash') is written"},
    )
    internal_token_file: str = field(
        default="",
        metadata={"help": "file holding the internal token (mode 0600) the engines require on every call "
                          "(deepwell up makes one); empty = none"},
    )
    tolerant_tool_calls: bool = field(
        default=False,
        metadata={"help": "recover tool calls with a missing <tool_call> wrapper, stray closers or trailing text"},
    )
    tool_parser: str = field(
        default="",
        metadata={"help": "tool-call parser override (qwen_xml | hermes_json); empty = chosen from the template"},
    )
    default_max_tokens: int = field(
        default=0, metadata={"help": "output cap of requests that set none (Codex sends none); 0 = up to the context"}
    )
    max_output_tokens: int = field(
        default=32768,
        metadata={"help": "operator cap on every request's output tokens (max_tokens / max_completion_tokens / "
                          "max_output_tokens, missing, null and huge values included); the response then ends "
                          "with finish reason length / max_tokens / incomplete; 0 = no cap but the context"},
    )
    max_body_bytes: int = field(default=64 * 1024 * 1024, metadata={"help": "largest accepted request body in bytes"})
    max_messages: int = field(default=10_000, metadata={"help": "most messages accepted in one request"})
    keepalive_s: float = field(
        default=5.0, metadata={"help": "seconds between SSE keep-alive comments while the engine prefills (<= 5)"}
    )
    health_interval_s: float = field(default=2.0, metadata={"help": "seconds between engine health checks"})
    retry_after_s: int = field(default=2, metadata={"help": "Retry-After seconds sent with 429/503/529 answers"})
    log_level: str = field(default="info", metadata={"help": "log level (debug|info|warning|error)"})
    port_file: str = field(default="", metadata={"help": "write the bound HTTP port to this file once listening"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "engines", split_addresses(tuple(self.engines)))
        object.__setattr__(self, "api_keys", split_addresses(tuple(self.api_keys)))
        object.__setattr__(self, "admin_keys", split_addresses(tuple(self.admin_keys)))
        check(0 <= self.port <= 65535, "port", self.port, "must be in [0, 65535]")
        check(len(self.engines) >= 1, "engines", self.engines, "needs at least one engine address")
        check(self.tool_parser in TOOL_PARSERS, "tool_parser", self.tool_parser, f"must be one of {TOOL_PARSERS}")
        check(self.max_body_bytes >= 1024, "max_body_bytes", self.max_body_bytes, "must be >= 1024")
        check(self.max_messages >= 1, "max_messages", self.max_messages, "must be >= 1")
        check(self.default_max_tokens >= 0, "default_max_tokens", self.default_max_tokens,
              "must be >= 0 (0 = up to the context)")
        check(0 <= self.max_output_tokens <= U32, "max_output_tokens", self.max_output_tokens,
              f"must be in [0, {U32}] (0 = no cap but the context)")
        check(not self.max_output_tokens or self.default_max_tokens <= self.max_output_tokens, "default_max_tokens",
              self.default_max_tokens, f"must be <= max_output_tokens ({self.max_output_tokens}); raise "
              f"--max-output-tokens or lower --default-max-tokens")
        check(0 < self.keepalive_s <= 5.0, "keepalive_s", self.keepalive_s, "must be in (0, 5]")
        check(self.health_interval_s > 0, "health_interval_s", self.health_interval_s, "must be > 0")
        check(self.retry_after_s >= 0, "retry_after_s", self.retry_after_s, "must be >= 0")
        check(self.log_level in ("debug", "info", "warning", "error"), "log_level", self.log_level,
              "must be debug|info|warning|error")
        for key in self.api_keys:
            check(":" in key and all(key.split(":", 1)), "api_keys", key, "each key must be 'key_id:secret'")
        for key_id in self.admin_keys:
            check(":" not in key_id and "/" not in key_id, "admin_keys", "<hidden>" if ":" in key_id else key_id,
                  "takes API key ids (the part before ':' in --api-keys), never secrets")
