"""``deepwell gateway`` / ``python -m deepwell.gateway``: OpenAI + Anthropic HTTP and gRPC Chat."""

from __future__ import annotations

import argparse

HELP = "run the gateway (OpenAI/Anthropic HTTP APIs + gRPC Chat) in front of one or more engines"
DESCRIPTION = (
    "Serves /v1/chat/completions, /v1/completions, /v1/messages (+count_tokens), /v1/models, /health and "
    "/metrics over HTTP, and deepwell.gateway.v1.Chat over gRPC, routing each session to one of the engines."
)


def configure(parser: argparse.ArgumentParser) -> None:
    from deepwell.configs import add_arguments
    from deepwell.gateway.config import GatewayConfig

    add_arguments(parser, GatewayConfig, "GATEWAY")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from deepwell.configs import from_args
    from deepwell.logs import setup_logging
    from deepwell.gateway.config import GatewayConfig

    config = from_args(GatewayConfig, args, "GATEWAY")
    setup_logging("gateway", config.log_level)
    from deepwell.gateway.server import serve

    return asyncio.run(serve(config))
