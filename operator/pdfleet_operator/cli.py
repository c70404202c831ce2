"""`pdfleet`: the user's command line.

Each sub-command lives in its own module under ``pdfleet_operator.commands``
and registers itself with ``register(subparsers)``; this module only wires
them up and turns expected errors into a message and an exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdfleet_operator import __version__
from pdfleet_operator.commands import COMMANDS
from pdfleet_runtime.source import describe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdfleet",
        description="pdfleet: prefill/decode disaggregated serving on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"pdfleet {describe(__version__)}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(handler(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
