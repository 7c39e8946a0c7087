"""One structlog setup for every deepwell process.

JSON lines when stderr is not a TTY (containers, CI, log shippers); coloured console
output on a TTY. Context variables (``request_id``, ``component``) bound with
``bind_context`` appear on every line logged while they are bound.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

from deepwell.progress import clear_bars

_configured = False

LEVELS = ("debug", "info", "warning", "error", "critical")


def setup_logging(component: str, level: str = "info", json: bool | None = None) -> None:
    """Configure structlog + stdlib logging once per process.

    ``json=None`` picks JSON unless stderr is a TTY; ``DEEPWELL_LOG_JSON=1/0`` overrides.
    """
    global _configured
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    if json is None:
        env = os.environ.get("DEEPWELL_LOG_JSON")
        json = (env == "1") if env in ("0", "1") else not sys.stderr.isatty()
    numeric = getattr(logging, level.upper())
    shared: list[Any] = [
        clear_bars,  # a progress bar on the terminal (deepwell.progress) gives its line to the log line
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Route stdlib logging (grpc, uvicorn, ...) through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(component=component)
    _configured = True


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    log = structlog.get_logger(name) if name else structlog.get_logger()
    return log.bind(**initial) if initial else log


def bind_context(**values: Any) -> Any:
    """Bind context variables (e.g. request_id) for the current task; returns tokens."""
    return structlog.contextvars.bind_contextvars(**values)


def unbind_context(*keys: str) -> None:
    structlog.contextvars.unbind_contextvars(*keys)
