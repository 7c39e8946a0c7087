"""Run the gateway: the HTTP app (uvicorn) and, when configured, the gRPC Chat service,
in one asyncio loop, until SIGINT/SIGTERM.

Prints ``gateway http listening on http://HOST:PORT`` (and the gRPC line) once bound, and
writes the bound HTTP port to ``--port-file`` when given (port 0 picks a free port).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from deepwell import logs
from deepwell.configs import ConfigError
from deepwell.gateway.config import GatewayConfig
from deepwell.gateway.http.app import build_state, create_app

log = logs.get_logger("deepwell.gateway.server")


def _http_socket(host: str, port: int) -> socket.socket:
    """The HTTP listening socket (``SO_REUSEADDR``, as uvicorn makes it); ``ConfigError`` with the
    reason when the address cannot be served."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise ConfigError(f"invalid host/port {host}:{port}: cannot listen there ({exc.strerror or exc}; is the port "
                          "in use, or the host not an address of this machine?)") from None
    return sock


async def serve(config: GatewayConfig) -> int:
    state = build_state(config)
    app = create_app(config, state)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_config=None, access_log=False,
                               lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(uv_config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    grpc_handle = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sock = _http_socket(config.host, config.port)  # bound here: a refusal is a usage error, not uvicorn's exit
    http_task = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    while not server.started:
        if http_task.done():
            await http_task
            print(f"gateway: could not listen on {config.host}:{config.port}", file=sys.stderr)
            return 1
        await asyncio.sleep(0.02)
    port = sock.getsockname()[1]
    print(f"gateway http listening on http://{config.host}:{port}", flush=True)
    if config.grpc_listen:
        from deepwell.gateway.grpc_chat import start_chat_server

        try:
            grpc_handle = await start_chat_server(config.grpc_listen, state)
        except ConfigError:  # its address refused: stop serving HTTP, then say why
            server.should_exit = True
            await http_task
            raise
        print(f"gateway grpc Chat listening on {grpc_handle.address.rsplit(':', 1)[0]}:{grpc_handle.bound_port}",
              flush=True)
    if config.port_file:
        Path(config.port_file).write_text(str(port))
    log.info("gateway_started", http_port=port, engines=list(config.engines),
             grpc=grpc_handle.bound_port if grpc_handle else None)
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    if grpc_handle is not None:
        await grpc_handle.stop(2.0)
    await http_task
    stop_task.cancel()
    log.info("gateway_stopped")
    return 0
