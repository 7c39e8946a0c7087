"""The ``deepwell`` command: one entry point, one subcommand per working component.

Each component owns its subcommand in ``<package>/cli.py``, which exposes

    HELP: str                                   # one line for ``deepwell --help``
    def configure(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int

and must import nothing heavy (torch, model code) at module level, so ``--help`` is fast
and ``deepwell kvcache`` never loads torch. A component appears in ``COMMANDS`` only once
it does real work.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from deepwell import __version__

# (subcommand, module implementing it). Order is the order shown in --help.
COMMANDS: list[tuple[str, str]] = [
    ("up", "deepwell.up"),
    ("kvcache", "deepwell.kvcache_daemon.cli"),
    ("engine", "deepwell.engine_service.cli"),
    ("gateway", "deepwell.gateway.cli"),
    ("internal-token", "deepwell.auth"),
    ("sessions", "deepwell.sessions_cli"),
    ("stats", "deepwell.stats_cli"),
    ("log", "deepwell.log_cli"),
]


def available_commands() -> list[tuple[str, str]]:
    """The subcommands whose module exists in this installation."""
    found = []
    for name, module in COMMANDS:
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            found.append((name, module))
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepwell",
        description="deepwell: long-context serving for agentic use of open LLMs "
        "(gateway -> engine -> KV-cache daemon).",
        epilog="Run 'deepwell <command> --help' for a command's flags. Every flag also reads "
        "a DEEPWELL_* environment variable (named in each flag's help).",
    )
    parser.add_argument("--version", action="version", version=f"deepwell {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, module_name in available_commands():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP))
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from deepwell.configs import ConfigError

    try:
        return int(args._run(args) or 0)
    except ConfigError as exc:
        print(f"deepwell {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
