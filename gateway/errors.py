"""API-neutral gateway errors; each front end maps them to its own wire form.

``kind`` decides the status: ``invalid_request`` 400, ``authentication`` 401,
``not_found`` 404, ``too_large`` 413, ``context_length`` (400; OpenAI
``context_length_exceeded``, Anthropic ``invalid_request_error`` whose message starts
"prompt is too long: N tokens > M maximum" as Anthropic's does; carries both numbers), ``overloaded`` (429 OpenAI / 529 Anthropic, ``Retry-After``), ``unavailable``
(503, ``Retry-After``), ``internal`` 500 (a gateway bug only — never a client error).
"""

from __future__ import annotations


class GatewayError(Exception):
    STATUS = {"invalid_request": 400, "authentication": 401, "not_found": 404, "too_large": 413,
              "context_length": 400, "overloaded": 429, "unavailable": 503, "internal": 500}

    def __init__(self, kind: str, message: str, retry_after_s: int | None = None, param: str | None = None) -> None:
        if kind not in self.STATUS:
            raise ValueError(f"unknown gateway error kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param

    @property
    def status(self) -> int:
        return self.STATUS[self.kind]


class ContextLengthError(GatewayError):
    def __init__(self, prompt_tokens: int, max_context: int) -> None:
        super().__init__(
            "context_length",
            f"This model's maximum context length is {max_context} tokens, but the prompt is "
            f"{prompt_tokens} tokens (it must be at most {max_context - 1} to leave room for one "
            f"generated token). Reduce the length of the messages.",
        )
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError("invalid_request", message, param=param)
