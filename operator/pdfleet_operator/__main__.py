"""`pdfleet-operator` (also `python -m pdfleet_operator`): run the operator.

Settings are read once here and handed to kopf; nothing deeper reads the
environment.  The reconcile handlers are registered by importing
``pdfleet_operator.handlers`` once it exists (the reconcile issue); until
then the operator starts, serves its liveness probe and watches nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
from collections.abc import Sequence

from pdfleet_operator import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdfleet-operator", description="Run the pdfleet operator (kopf).")
    p.add_argument("--version", action="version", version=f"pdfleet-operator {__version__}")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch only these namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL")
    p.add_argument("--standalone", action="store_true",
                   help="single-replica mode without kopf peering (documented: run exactly one replica)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import kopf

    if importlib.util.find_spec("pdfleet_operator.handlers") is not None:
        importlib.import_module("pdfleet_operator.handlers")
    asyncio.run(
        kopf.operator(
            standalone=args.standalone,
            clusterwide=not args.namespace,
            namespaces=args.namespace or None,
            liveness_endpoint=args.liveness,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
