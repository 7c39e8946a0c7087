"""Session keys: which conversation a request continues, so it lands on the engine (and
cache entries) that hold it.

Sources, first present wins:

1. headers ``X-Session-Id`` (deepwell's own), ``X-Claude-Code-Session-Id`` (Claude Code),
   ``Session-Id`` / ``Session_Id``, ``Thread-Id`` / ``Thread_Id`` and ``Conversation-Id`` /
   ``Conversation_Id`` (Codex);
2. Anthropic ``metadata.user_id``: its ``session_id`` when it is a JSON object (current
   Claude Code), else the whole string (older Claude Code: ``user_<hex>_account_<uuid>_session_<uuid>``);
3. OpenAI ``prompt_cache_key`` (the field OpenAI itself routes cache hits by);
4. OpenAI ``user``.

The key is always namespaced by tenant (``"<tenant>/<session>"``) before it reaches the
engine, so two tenants never share one. No source -> ``None`` (routing then hashes the
tenant alone).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

MAX_SESSION_CHARS = 256
HEADER_SOURCES = ("x-session-id", "x-claude-code-session-id", "session-id", "session_id", "thread-id", "thread_id",
                  "conversation-id", "conversation_id")


def _clean(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value[:MAX_SESSION_CHARS] if value else None


def _anthropic_session(user_id: object) -> str | None:
    if isinstance(user_id, str) and user_id.lstrip().startswith("{"):
        try:
            obj = json.loads(user_id)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and _clean(obj.get("session_id")):
            return _clean(obj.get("session_id"))
    return _clean(user_id)


def raw_session_id(headers: Mapping[str, str], anthropic_user_id: object = None, openai_user: object = None,
                   prompt_cache_key: object = None) -> str | None:
    """The un-namespaced session id from the first source present (see module doc)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    for name in HEADER_SOURCES:
        found = _clean(lowered.get(name))
        if found:
            return found
    return _anthropic_session(anthropic_user_id) or _clean(prompt_cache_key) or _clean(openai_user)


def namespaced(tenant: str, session_id: str | None) -> str | None:
    return f"{tenant}/{session_id}" if session_id else None


def session_key(headers: Mapping[str, str], tenant: str, anthropic_user_id: object = None, openai_user: object = None,
                prompt_cache_key: object = None) -> str | None:
    return namespaced(tenant, raw_session_id(headers, anthropic_user_id, openai_user, prompt_cache_key))
