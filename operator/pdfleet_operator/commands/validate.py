"""`pdfleet validate -f FILE...`: the apiserver's verdict on manifests, offline.

Runs the CRD's schema, its CEL rules and the capability matrix (what the webhook adds) on every
document, prints each verdict with every reason, and exits 0 only when all are admitted. Bad YAML,
wrong types and unreadable files are verdicts, never tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdfleet_operator.validation import ObjectVerdict, validate_text
from pdfleet_runtime.matrix import Violation

__all__ = ["format_verdict", "register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check PDDeployment manifests offline (schema, CEL and the matrix)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "-f",
        "--filename",
        dest="files",
        action="extend",
        nargs="+",
        required=True,
        metavar="FILE",
        help="YAML file(s) with one or more documents; - reads stdin",
    )
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    p.add_argument("--no-warnings", action="store_true", help="do not print warnings")
    p.set_defaults(handler=run)


def _read(name: str) -> tuple[str | None, str]:
    if name == "-":
        return sys.stdin.read(), "<stdin>"
    try:
        return Path(name).read_text(encoding="utf-8"), name
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"cannot read {name}: {exc.strerror if isinstance(exc, OSError) else exc}"


def _line(v: Violation, indent: str = "  ") -> str:
    where = ", ".join(p for p in v.paths if p) or "(document)"
    text = f"{indent}{v.severity.value} {v.rule} at {where}: {v.message}"
    if v.reason:
        text += f"\n{indent}    why: {v.reason}"
    if v.fix:
        text += f"\n{indent}    fix: {v.fix}"
    return text


def format_verdict(verdict: ObjectVerdict, warnings: bool = True) -> str:
    state = "admitted" if verdict.admitted else "DENIED"
    matrix = f" (matrix {', '.join(verdict.matrix_versions)})" if verdict.matrix_versions else ""
    lines = [f"{verdict.source} pdd/{verdict.name}: {state}{matrix}"]
    lines += [_line(v) for v in verdict.violations]
    if warnings:
        lines += [_line(v) for v in verdict.warnings]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    verdicts: list[ObjectVerdict] = []
    unreadable: list[str] = []
    for name in args.files:
        text, source = _read(name)
        if text is None:
            unreadable.append(source)
            continue
        found = validate_text(text, source)
        if not found:
            unreadable.append(f"{source}: no documents")
        verdicts += found
    if args.output == "json":
        print(
            json.dumps(
                {
                    "admitted": not unreadable and all(v.admitted for v in verdicts),
                    "errors": unreadable,
                    "verdicts": [v.as_dict() for v in verdicts],
                },
                indent=2,
            )
        )
    else:
        for problem in unreadable:
            print(f"error: {problem}", file=sys.stderr)
        for v in verdicts:
            print(format_verdict(v, warnings=not args.no_warnings))
        denied = sum(not v.admitted for v in verdicts)
        print(f"{len(verdicts)} object(s): {len(verdicts) - denied} admitted, {denied} denied")
    return 0 if not unreadable and verdicts and all(v.admitted for v in verdicts) else 1
