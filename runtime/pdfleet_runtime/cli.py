"""`pdfleet-runtime`: the command the operator runs in each pod, plus offline tools."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pdfleet_runtime import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdfleet-runtime", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pdfleet-runtime {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0
