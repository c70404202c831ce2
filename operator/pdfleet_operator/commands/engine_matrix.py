"""`pdfleet matrix --engine KIND==VERSION`: an engine version's rules, protocol table and owned flags.

Each engine kind prints its own table (``EngineRules.matrix_text`` / ``matrix_json``, found by kind in
``engine_rules.registry``); this module parses the argument and says which engines are known.
"""

from __future__ import annotations

import sys

from pdfleet_runtime.engine_rules import checked_kinds, known_versions, rules_of

__all__ = ["engine_json", "engine_text", "parse_engine"]


def parse_engine(text: str) -> tuple[str, str] | None:
    """``KIND==VERSION`` -> (kind, version) when this operator knows it; else prints why and returns None."""
    kind, sep, version = text.partition("==")
    kinds = checked_kinds()
    if not sep or kind not in kinds or version not in known_versions(kind):
        known = ", ".join(f"{k}=={v}" for k in kinds for v in known_versions(k))
        print(f"error: unknown engine {text!r}; known: {known}", file=sys.stderr)
        return None
    return kind, version


def engine_json(kind: str, version: str) -> dict[str, object]:
    rules = rules_of(kind)
    assert rules is not None
    return rules.matrix_json(version)


def engine_text(kind: str, version: str) -> str:
    rules = rules_of(kind)
    assert rules is not None
    return rules.matrix_text(version)
