"""Fixtures of the KV-cache daemon tests: an in-memory core and real daemon processes."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kvtest_helpers for the test modules

from kvtest_helpers import Daemon, make_core  # noqa: E402

from deepwell.kvcache_daemon.core import Core


@pytest.fixture
def core() -> Core:
    return make_core()


@pytest.fixture
def daemon_factory():
    made: list[Daemon] = []

    def make(**kw) -> Daemon:
        d = Daemon(**kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()
