"""``python -m deepwell.kvcache_daemon``: same as ``deepwell kvcache``."""

from __future__ import annotations

import argparse
import sys

from deepwell.configs import ConfigError

from . import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepwell.kvcache_daemon", description=cli.DESCRIPTION)
    cli.configure(parser)
    args = parser.parse_args(argv)
    try:
        return cli.run(args)
    except ConfigError as exc:
        print(f"kvcache_daemon: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
