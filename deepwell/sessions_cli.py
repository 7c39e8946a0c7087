"""``deepwell sessions``: the live sessions of a running stack (``deepwell.ops_cli``)."""

from __future__ import annotations

from deepwell.ops_cli import _sessions_configure as configure
from deepwell.ops_cli import _sessions_run as run

HELP = "show the live sessions: cached tokens and where, last turn's cache share and TTFT, age, idle, bytes"
DESCRIPTION = (
    "Print the sessions the engines know (the gateway's GET /v1/deepwell/sessions, every engine's list "
    "merged): session, tenant, where its cache lives (GPU / host / both), cached tokens, the last turn's "
    "cached share and engine-side TTFT, age, idle time and bytes held. With API keys on, use an admin key "
    "(the gateway's --admin-keys). --watch refreshes it; --json prints the endpoint's JSON."
)

__all__ = ["DESCRIPTION", "HELP", "configure", "run"]
