"""deepwell — shared foundation of the three services.

This package holds only what every service needs and nothing that pulls in torch:

- ``deepwell.engine.v1`` / ``deepwell.kvcache.v1`` / ``deepwell.gateway.v1``: the
  generated protobuf + gRPC stubs (sources in ``protos/``; regenerate with
  ``python protos/generate.py``; never edit by hand).
- ``deepwell.logs``: the one structlog setup (JSON off a TTY, console on it).
- ``deepwell.grpcx``: gRPC server/channel helpers (health, reflection, message limits,
  request-id propagation through metadata).
- ``deepwell.configs``: frozen-dataclass configs mapped onto flags and ``DEEPWELL_*`` env.
- ``deepwell.cli``: the ``deepwell`` command (dispatches to the services' own CLIs).

Invariant: importing ``deepwell`` (or any module above except ``cli`` subcommands that
start a service) never imports torch, ``engine_service``, ``gateway`` or
``kvcache_daemon``.
"""

__version__ = "0.1.0"
