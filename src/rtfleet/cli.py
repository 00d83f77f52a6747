"""The `rtfleet` command line: topology, plan and the lab."""

from __future__ import annotations

import argparse
import sys

from rtfleet import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtfleet", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rtfleet {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from rtfleet import lab

    lab.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
