"""Fuzz the gateway's POST endpoints over HTTP and report what came back.

    python benchmarks/fuzz_http.py [--requests 2000] [--seed 0] [--deadline-s 20]
        [--endpoint /v1/messages ...] [--url http://127.0.0.1:8000] [--show 10]

Each request is a hypothesis-generated body (``tests/gateway/fuzz_bodies.py``: mutated valid
bodies with lone surrogates, huge / null / non-finite numbers, wrong types and broken tool
schemas; bodies that reach the engine with tool-call and multi-byte outputs; raw bytes with
deep nesting, edge number literals, invalid UTF-8) sent to one of the five POST endpoints
(``--endpoint`` to choose; repeatable). A request *hangs* when no answer (a stream: its end)
arrives within ``--deadline-s``.

Targets: ``--url`` fuzzes a running gateway (whatever engine it has; errors a real engine
reports count as what they are). Without it everything runs in this process: the scripted
``FakeEngine`` of the gateway tests (gRPC on a free port) and the gateway app under uvicorn
on a free loopback port, with ``--tolerant-tool-calls --max-output-tokens 64``.

Prints ``tried N / 2xx / 4xx / 5xx / hangs / bad answers`` (a bad answer: a 5xx, a hang, or
an error body not in the API's shape) and the first ``--show`` bad answers; exits 1 when
there is any.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # the fuzz strategies and the fake engine live with the gateway tests


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tests.gateway.fuzz_bodies import ENDPOINTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--requests", type=int, default=2000, help="requests to send in all (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (same seed, same bodies)")
    p.add_argument("--deadline-s", type=float, default=20.0, help="per-request deadline; later = a hang")
    p.add_argument("--endpoint", action="append", choices=ENDPOINTS, help="endpoint(s) to fuzz (default: all five)")
    p.add_argument("--url", default="", help="a running gateway (default: fake engine + gateway in this process)")
    p.add_argument("--show", type=int, default=10, help="bad answers to print")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be >= 1")
    return args


@contextmanager
def in_process_gateway() -> Iterator[str]:
    """The fake engine and the gateway app (uvicorn on a thread of its own); yields the URL."""
    import asyncio

    import httpx
    import uvicorn

    from deepwell.logs import setup_logging
    from deepwell.gateway.config import GatewayConfig
    from deepwell.gateway.http.app import create_app
    from tests.gateway.fake_engine import free_port
    from tests.gateway.test_fuzz_http_props import fake_engine

    setup_logging("fuzz", "error")  # the gateway logs every refused body as a warning
    engine = fake_engine().start()
    port = free_port()
    config = GatewayConfig(engines=(engine.address,), port=port, grpc_listen="", tolerant_tool_calls=True,
                           max_output_tokens=64, health_interval_s=0.2, log_level="error")
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name="gateway", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the in-process gateway did not become healthy within 60 s")
            time.sleep(0.1)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()


def run(url: str, args: argparse.Namespace) -> int:
    import httpx
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis import strategies as st

    from tests.gateway.fuzz_bodies import ENDPOINTS, bodies
    from tests.gateway.fuzz_client import Tally, send

    endpoints = tuple(args.endpoint or ENDPOINTS)
    tally = Tally()
    started = time.monotonic()
    with httpx.Client(base_url=url) as client:

        @seed(args.seed)
        @settings(max_examples=args.requests, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def one(data: st.DataObject) -> None:
            endpoint = data.draw(st.sampled_from(endpoints))
            body = data.draw(bodies(endpoint))
            tally.add(send(client, endpoint, body, args.deadline_s), endpoint, body)

        one()
    elapsed = time.monotonic() - started
    print(f"{tally.line()}  ({elapsed:.1f} s, {url})")
    for line in tally.problems[: args.show]:
        print("  " + line)
    return 1 if tally.problems or tally.hangs else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        return run(args.url.rstrip("/"), args)
    with in_process_gateway() as url:
        return run(url, args)


if __name__ == "__main__":
    sys.exit(main())
