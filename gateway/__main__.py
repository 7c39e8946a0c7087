"""``python -m deepwell.gateway``: the same as ``deepwell gateway``."""

from __future__ import annotations

import argparse
import sys

from deepwell.configs import ConfigError
from deepwell.gateway import cli


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m deepwell.gateway", description=cli.DESCRIPTION)
    cli.configure(parser)
    args = parser.parse_args()
    try:
        return cli.run(args)
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
