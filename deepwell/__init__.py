"""deepwell — shared foundation of the three services.

This package holds only what every service needs and nothing that pulls in torch:

- ``deepwell.engine.v1`` / ``deepwell.kvcache.v1`` / ``deepwell.gateway.v1``: the
  generated protobuf + gRPC stubs (sources in ``protos/``; regenerate with
  ``python protos/generate.py``; never edit by hand).
- The services and kernels are subpackages of this namespace once installed:
  ``deepwell.engine_service``, ``deepwell.kvcache_daemon``, ``deepwell.gateway``,
  ``deepwell.kernels`` (the repository keeps them as top-level folders; ``setup.py`` maps
  them), so nothing generic such as ``kernels`` or ``gateway`` lands in site-packages. In a
  source checkout run without installing (the GPU machine, ``python benchmarks/...``) a small
  import finder (``_CheckoutFinder``) maps the same names onto those folders.
- ``deepwell.logs``: the one structlog setup (JSON off a TTY, console on it).
- ``deepwell.grpcx``: gRPC server/channel helpers (health, reflection, message limits,
  request-id propagation through metadata).
- ``deepwell.configs``: frozen-dataclass configs mapped onto flags and ``DEEPWELL_*`` env.
- ``deepwell.cli``: the ``deepwell`` command (dispatches to the services' own CLIs).

Invariant: importing ``deepwell`` (or any module above except ``cli`` subcommands that
start a service) never imports torch, ``engine_service``, ``gateway`` or
``kvcache_daemon``.
"""

import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"

_CHECKOUT = _Path(__file__).resolve().parent.parent
_FOLDERS = ("kernels", "engine_service", "gateway", "kvcache_daemon")


class _CheckoutFinder:
    """In a source checkout run without installing: ``deepwell.<folder>`` is the checkout's
    top-level ``<folder>/`` (its submodules then resolve through that package's own path)."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        head, _, name = fullname.partition(".")
        init = _CHECKOUT / name / "__init__.py"
        if head != "deepwell" or name not in _FOLDERS or not init.is_file():
            return None
        return _util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


if (_CHECKOUT / "protos").is_dir() and not any(isinstance(f, type) and f.__name__ == "_CheckoutFinder"
                                                for f in _sys.meta_path):
    _sys.meta_path.append(_CheckoutFinder)
