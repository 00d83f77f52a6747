"""Disposable QEMU lab hosts (placeholder until the lab lands)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("lab", help="bring disposable QEMU test hosts up and down")
    parser.set_defaults(func=lambda args: parser.print_help())
