"""`pdfleet matrix` and `pdfleet explain-rule ID`: the capability matrix, printed from its data.

The text is the same the webhook returns on a denial, so the table is the documentation.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_runtime.engine_rules.registry import PARALLEL_CELLS
from pdfleet_runtime.links import ENGINE_SETTINGS, Backend, LinkProtocol
from pdfleet_runtime.matrix import (
    FEATURE_TITLES,
    GENERAL_RULES,
    LATEST_MATRIX_VERSION,
    MATRICES,
    Feature,
    Matrix,
    Rule,
    all_rules,
)
from pdfleet_runtime.versions import RUNTIME_RELEASES

__all__ = ["matrix_json", "matrix_text", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matrix", help="print the capability matrix with the reason for each no")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--matrix-version", default=LATEST_MATRIX_VERSION, help=f"default {LATEST_MATRIX_VERSION}")
    p.add_argument("--engine", metavar="KIND==VERSION", help="print an engine's rules instead, e.g. sglang==0.5.23")
    p.set_defaults(handler=run_matrix)
    e = sub.add_parser("explain-rule", help="print one rule: what it checks, why, and how to fix it")
    e.add_argument("rule", metavar="ID", help="a rule id, e.g. tp-divisible or nixl.replicated-hetero-tp")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(handler=run_explain)


def _rule_dict(r: Rule) -> dict[str, object]:
    return {
        "id": r.id,
        "title": r.title,
        "severity": str(r.severity),
        "backend": str(r.backend) if r.backend else None,
        "reason": r.reason,
        "fix": r.fix,
    }


def matrix_json(m: Matrix) -> dict[str, object]:
    return {
        "matrixVersion": m.version,
        "gpuMemoryFraction": m.gpu_memory_fraction,
        "runtimeReleases": [
            {"version": r.version, "matrixVersion": r.matrix_version, "wireProtocol": str(r.wire)}
            for r in RUNTIME_RELEASES.values()
        ],
        "cells": [
            {
                "backend": str(c.backend),
                "feature": str(c.feature),
                "supported": c.supported,
                "reason": c.reason,
                "rule": c.rule_id,
            }
            for c in m.cells.values()
        ],
        "rules": [_rule_dict(r) for r in m.rules.values()],
        "parallelCells": [
            {"engine": c.engine, "feature": c.feature, "backend": str(c.backend) if c.backend else None,
             "supported": c.supported, "reason": c.reason, "rule": c.rule}
            for c in PARALLEL_CELLS
        ],
        "engineSettings": [
            {
                "backend": str(s.backend),
                "protocol": str(s.protocol),
                "engineProtocol": s.engine_protocol,
                "env": dict(s.env),
                "acceptedTransports": sorted(s.accepted_transports),
                "sameHostOnly": s.same_host_only,
                "hostIPC": s.needs_host_ipc,
            }
            for s in ENGINE_SETTINGS.values()
        ],
    }


def matrix_text(m: Matrix) -> str:
    backends = list(Backend)
    width = max(len(t) for t in FEATURE_TITLES.values())
    lines = [
        f"capability matrix {m.version}",
        "",
        f"{'':{width}}  " + "  ".join(f"{b.value:<10}" for b in backends),
    ]
    for f in Feature:
        cells = ["yes" if m.supports(b, f).supported else "no" for b in backends]
        lines.append(f"{FEATURE_TITLES[f]:{width}}  " + "  ".join(f"{c:<10}" for c in cells))
    lines += ["", "why each no:"]
    for c in m.cells.values():
        if not c.supported:
            lines.append(f"  {c.rule_id}: {c.reason}")
    lines += ["", "rules for every backend:"]
    for r in GENERAL_RULES.values():
        tag = " (warning)" if r.severity.value == "warning" else ""
        lines.append(f"  {r.id}{tag}: {r.title}")
    lines += ["", "attention DP, expert parallelism and replicas across nodes (engine, backend):"]
    for c in PARALLEL_CELLS:
        where = c.backend.value if c.backend else "every backend"
        verdict = "yes" if c.supported else f"no [{c.rule}]"
        lines.append(f"  {c.feature:<15} {c.engine:<15} {where:<13} {verdict}: {c.reason}")
    lines += ["", "protocol -> engine settings:"]
    for p in LinkProtocol:
        for b in backends:
            s = ENGINE_SETTINGS.get((b, p))
            if s is not None:
                env = " ".join(f"{k}={v}" for k, v in s.env.items())
                lines.append(f"  {p.value:<7} {b.value:<9} {s.engine_protocol:<13} {env}".rstrip())
    lines += ["", "runtime releases:"]
    for r in RUNTIME_RELEASES.values():
        lines.append(f"  {r.version}: matrix {r.matrix_version}, wire protocol {r.wire}")
    lines.append("\n`pdfleet explain-rule ID` prints one rule with its fix.")
    return "\n".join(lines)


def run_matrix(args: argparse.Namespace) -> int:
    if getattr(args, "engine", None):
        from pdfleet_operator.commands.engine_matrix import engine_json, engine_text, parse_engine

        engine = parse_engine(args.engine)
        if engine is None:
            return 1
        print(json.dumps(engine_json(*engine), indent=2) if args.json else engine_text(*engine))
        return 0
    m = MATRICES.get(args.matrix_version)
    if m is None:
        print(
            f"error: unknown matrix version {args.matrix_version!r}; known: {', '.join(MATRICES)}",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(matrix_json(m), indent=2) if args.json else matrix_text(m))
    return 0


def _explained_rules() -> dict[str, Rule]:
    """The matrix's rules, and the CEL-only rules of the CRD that carry their own reason and fix
    (spec.autoscaling's and spec.scheduling's): every rule id a denial can name."""
    rules = dict(all_rules())
    for c in CEL_RULES:
        if c.id not in rules and c.reason:
            rules[c.id] = Rule(c.id, c.message, c.reason, c.fix)
    return rules


def run_explain(args: argparse.Namespace) -> int:
    rules = _explained_rules()
    rule = rules.get(args.rule)
    if rule is None:
        near = [r for r in rules if args.rule in r or r in args.rule]
        hint = f"; did you mean {', '.join(near)}?" if near else "; `pdfleet matrix` lists them"
        print(f"error: unknown rule {args.rule!r}{hint}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_rule_dict(rule), indent=2))
    else:
        scope = f"backend {rule.backend}" if rule.backend else "every backend"
        print(
            f"{rule.id} ({rule.severity.value}, {scope}): {rule.title}\n  why: {rule.reason}\n  fix: {rule.fix}"
        )
    return 0
