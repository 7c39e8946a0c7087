"""Property-based HTTP fuzzing of a live gateway (FakeEngine behind it), bounded for CI.

Property, for every generated request to each of the five POST endpoints: an answer
below 500 (the scripted engine never fails, so any 5xx is a gateway bug), within a
per-request deadline (no hang; streams end), and errors in the API's own shape. Bodies
(``fuzz_bodies.py``): mutated valid bodies (lone surrogates, huge / null / non-finite
numbers, wrong types, broken tool schemas), bodies that reach the engine (tool-call and
multi-byte outputs, hostile limits, streaming or not) and raw bytes (deep nesting, number
literals at the decoder's edges, invalid UTF-8). At least 2,000 requests in all;
derandomized, so CI runs are reproducible. Manual runs: ``benchmarks/fuzz_http.py``.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.fake_engine import FakeEngine, Script, start_gateway
from tests.gateway.fuzz_bodies import ENDPOINTS, FAKE_OUTPUTS, generating, mutated, raw
from tests.gateway.fuzz_client import Tally, send

EXAMPLES = {"mutated": 250, "generating": 90, "raw": 80}  # per endpoint: 420 x 5 = 2,100 requests
DEADLINE_S = 20.0
TALLY = Tally()
RAN: set[tuple[str, str]] = set()


def fake_engine() -> FakeEngine:
    """The engine the fuzzed gateway talks to: the trigger words' outputs, in chunks that
    split multi-byte characters (37 ids per push)."""
    scripts = [Script(trigger=t, text=text, chunk=37 if t == "FUZZ_EMOJI" else 3) for t, text in FAKE_OUTPUTS.items()]
    return FakeEngine(scripts=scripts, max_context=2048)


GATEWAY_FLAGS = ("--tolerant-tool-calls", "--max-output-tokens", "64", "--max-body-bytes", "4000000")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    engine = fake_engine().start()
    gw = start_gateway([engine.address], str(tmp_path_factory.mktemp("gw")), *GATEWAY_FLAGS)
    with httpx.Client(base_url=gw.url) as c:
        c.gw = gw  # type: ignore[attr-defined]
        yield c
    gw.stop()
    engine.stop()


def fuzz(kind: str):
    return settings(max_examples=EXAMPLES[kind], deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def check(client: httpx.Client, endpoint: str, body: bytes) -> None:
    outcome = send(client, endpoint, body, DEADLINE_S)
    TALLY.add(outcome, endpoint, body)
    assert not outcome.problem, (endpoint, outcome.status, outcome.problem, body[:500])


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@fuzz("mutated")
@given(data=st.data())
def test_mutated_bodies(client, endpoint, data):
    RAN.add(("mutated", endpoint))
    check(client, endpoint, data.draw(mutated(endpoint)))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@fuzz("generating")
@given(data=st.data())
def test_generating_bodies(client, endpoint, data):
    RAN.add(("generating", endpoint))
    check(client, endpoint, data.draw(generating(endpoint)))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@fuzz("raw")
@given(data=st.data())
def test_raw_bodies(client, endpoint, data):
    RAN.add(("raw", endpoint))
    check(client, endpoint, data.draw(raw(endpoint)))


def test_totals_and_survival(client):
    """Runs last (file order): the whole run's figures, and the gateway is still up."""
    assert client.gw.alive()  # type: ignore[attr-defined]
    assert client.get("/health").status_code == 200
    if len(RAN) < 3 * len(ENDPOINTS):
        pytest.skip("only part of the fuzz run was selected; totals are checked on a full run")
    print("\nfuzz:", TALLY.line())
    assert TALLY.tried >= 2000, TALLY.line()
    assert TALLY.by_class["5xx"] == 0 and TALLY.hangs == 0 and not TALLY.problems, TALLY.problems[:5]
    assert TALLY.by_class["2xx"] > 200 and TALLY.by_class["4xx"] > 200, TALLY.line()  # both paths exercised
