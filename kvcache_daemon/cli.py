"""``deepwell kvcache``: run the KV-cache daemon; ``deepwell kvcache stats`` prints its Stats.

Imports nothing heavy at module level (never torch): the server is imported in ``run``.
"""

from __future__ import annotations

import argparse

HELP = "run the KV-cache daemon (shared host arena for KV and recurrent state)"
DESCRIPTION = (
    "Run the KV-cache daemon: a gRPC service (deepwell.kvcache.v1.KVCache, unix socket by default) "
    "owning a shared host arena that engines mmap. 'deepwell kvcache stats' prints a running daemon's Stats."
)


def configure(parser: argparse.ArgumentParser) -> None:
    from deepwell import configs

    from .config import ENV_PREFIX, DaemonConfig

    configs.add_arguments(parser, DaemonConfig, ENV_PREFIX)
    sub = parser.add_subparsers(dest="action", metavar="[serve|stats]", required=False)
    sub.add_parser("serve", help="run the daemon (the default)")
    stats = sub.add_parser("stats", help="print a running daemon's Stats")
    stats.add_argument("--address", dest="stats_address", default=None,
                       help="daemon address (default: --address / DEEPWELL_KVCACHE_ADDRESS / the default socket)")
    stats.add_argument("--json", action="store_true", help="print JSON instead of text")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the reply")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "action", None) == "stats":
        return _stats(args)
    import asyncio

    from deepwell import configs, logs

    from .config import ENV_PREFIX, DaemonConfig
    from .server import serve

    import sys

    from .arena import ArenaError

    cfg = configs.from_args(DaemonConfig, args, ENV_PREFIX)
    logs.setup_logging("kvcache", cfg.log_level)
    try:
        return asyncio.run(serve(cfg))
    except configs.ConfigError:  # e.g. an address it cannot serve on: a usage error (exit 2)
        raise
    except (ArenaError, OSError, ValueError) as exc:  # ValueError: a bad internal token file
        print(f"deepwell kvcache: {exc}", file=sys.stderr)
        return 1


def _stats(args: argparse.Namespace) -> int:
    import json
    import os
    import sys

    import grpc
    from google.protobuf import json_format

    from deepwell import grpcx
    from deepwell.auth import TokenError, read_token_file
    from deepwell.kvcache.v1 import kvcache_pb2 as pb
    from deepwell.kvcache.v1 import kvcache_pb2_grpc as pbg

    from .config import DEFAULT_ADDRESS

    address = (args.stats_address or getattr(args, "address", None)
               or os.environ.get("DEEPWELL_KVCACHE_ADDRESS") or DEFAULT_ADDRESS)
    token_file = getattr(args, "internal_token_file", "") or os.environ.get("DEEPWELL_KVCACHE_INTERNAL_TOKEN_FILE", "")
    try:
        token = read_token_file(token_file) if token_file else ""
        with grpcx.sync_channel(address, token) as ch:
            reply = pbg.KVCacheStub(ch).Stats(pb.StatsRequest(), timeout=args.timeout)
    except TokenError as exc:
        print(f"deepwell kvcache stats: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"deepwell kvcache stats: cannot reach {address}: {exc.code().name} {exc.details()}", file=sys.stderr)
        return 1
    data = json_format.MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    clients = data.pop("clients", [])
    for key, value in data.items():
        print(f"{key:>24}: {value}")
    for c in clients:
        print("client " + " ".join(f"{k}={v}" for k, v in c.items()))
    return 0
