"""`pdfleet digest DIR`: a model directory's content digest, for ``spec.model.source.digest``.

The built-in runtime computes the same digest at start and refuses other content (model/digest.py), so every
pod of both roles serves the same weights; printed as the field's value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdfleet_runtime.model.config_values import ModelConfigError
from pdfleet_runtime.model.digest import directory_digest

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("digest", help="a model directory's content digest (spec.model.source.digest)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("directory", metavar="DIR", help="the model directory (every file under it counts)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        print(directory_digest(Path(args.directory)))
    except (ModelConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
