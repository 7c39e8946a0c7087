"""Optional API-key authentication; the tenant of a request is its key id.

Keys come as ``key_id:secret`` (flag list or a file, one per line, ``#`` comments). With no
keys configured every request is the ``default`` tenant. With keys, a request must send
``Authorization: Bearer <secret>`` or ``x-api-key: <secret>``; otherwise ``AuthError``
(HTTP 401 / gRPC UNAUTHENTICATED). Secrets are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from deepwell.configs import ConfigError

DEFAULT_TENANT = "default"


class AuthError(Exception):
    """Missing or wrong API key; the message is safe to return to the client."""


def parse_key_lines(lines: Iterable[str], origin: str) -> dict[str, str]:
    """``key_id:secret`` lines -> {secret: key_id}; raises ConfigError on a bad line."""
    keys: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key_id, sep, secret = line.partition(":")
        key_id, secret = key_id.strip(), secret.strip()
        if not sep or not key_id or not secret or "/" in key_id:
            raise ConfigError(f"invalid API key at {origin}:{n}: expected 'key_id:secret' (key id without '/')")
        keys[secret] = key_id
    return keys


@dataclass(frozen=True)
class ApiKeys:
    by_secret: Mapping[str, str]

    @classmethod
    def load(cls, keys: Iterable[str] = (), keys_file: str = "") -> ApiKeys:
        found = parse_key_lines(keys, "--api-keys")
        if keys_file:
            try:
                text = Path(keys_file).read_text()
            except OSError as exc:
                raise ConfigError(f"invalid api_keys_file={keys_file!r}: {exc.strerror}") from None
            found.update(parse_key_lines(text.splitlines(), keys_file))
        return cls(by_secret=found)

    @property
    def enabled(self) -> bool:
        return bool(self.by_secret)

    def tenant_for(self, headers: Mapping[str, str]) -> str:
        """The tenant (key id) of a request, or raise ``AuthError``."""
        if not self.enabled:
            return DEFAULT_TENANT
        lowered = {k.lower(): v for k, v in headers.items()}
        secret = lowered.get("x-api-key")
        if not secret:
            auth = lowered.get("authorization", "")
            scheme, _, value = auth.partition(" ")
            secret = value.strip() if scheme.lower() == "bearer" else ""
        if not secret:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        for known, key_id in self.by_secret.items():
            if hmac.compare_digest(known.encode(), secret.encode()):
                return key_id
        raise AuthError("invalid API key")
