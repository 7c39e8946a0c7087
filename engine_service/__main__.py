"""``python -m deepwell.engine_service``: the same as ``deepwell engine``."""

from __future__ import annotations

import argparse
import sys

from deepwell.configs import ConfigError
from deepwell.engine_service import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepwell.engine_service", description=cli.DESCRIPTION)
    cli.configure(parser)
    args = parser.parse_args(argv)
    try:
        return cli.run(args)
    except ConfigError as exc:
        print(f"engine: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
