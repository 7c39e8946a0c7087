"""Session keys: which conversation a request continues, so it lands on the engine (and
cache entries) that hold it.

Sources, first present wins: ``X-Claude-Code-Session-Id`` header, ``X-Session-Id`` header,
Anthropic ``metadata.user_id``, OpenAI ``user``. The key is always namespaced by tenant
(``"<tenant>/<session>"``) before it reaches the engine, so two tenants never share one.
No source -> ``None`` (routing then hashes the tenant alone).
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_SESSION_CHARS = 256
HEADER_SOURCES = ("x-claude-code-session-id", "x-session-id")


def _clean(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value[:MAX_SESSION_CHARS] if value else None


def raw_session_id(
    headers: Mapping[str, str], anthropic_user_id: object = None, openai_user: object = None
) -> str | None:
    """The un-namespaced session id from the first source present (see module doc)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    for name in HEADER_SOURCES:
        found = _clean(lowered.get(name))
        if found:
            return found
    return _clean(anthropic_user_id) or _clean(openai_user)


def namespaced(tenant: str, session_id: str | None) -> str | None:
    return f"{tenant}/{session_id}" if session_id else None


def session_key(
    headers: Mapping[str, str], tenant: str, anthropic_user_id: object = None, openai_user: object = None
) -> str | None:
    return namespaced(tenant, raw_session_id(headers, anthropic_user_id, openai_user))
