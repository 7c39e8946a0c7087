"""Probe a deepwell service's health (used by compose healthchecks and ``deepwell up``).

    python -m deepwell.healthcheck --grpc unix:///run/deepwell/kvcache.sock
    python -m deepwell.healthcheck --grpc 127.0.0.1:50051 --service deepwell.engine.v1.Engine
    python -m deepwell.healthcheck --http http://127.0.0.1:8000/health

Exit status 0 when healthy, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.error
import urllib.request


def http_healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (loopback probe)
            return 200 <= reply.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def grpc_healthy(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    from deepwell.grpcx import wait_healthy

    return asyncio.run(wait_healthy(address, service, timeout_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepwell.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="ADDRESS", help="gRPC address (host:port or unix:///path)")
    target.add_argument("--http", metavar="URL", help="HTTP URL answering 2xx when healthy")
    parser.add_argument("--service", default="", help="gRPC health service name ('' = the server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait")
    args = parser.parse_args(argv)
    ok = http_healthy(args.http, args.timeout) if args.http else grpc_healthy(args.grpc, args.service, args.timeout)
    print("healthy" if ok else "unhealthy")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
