"""Rules of the inference engine a PDDeployment runs, keyed by engine kind and version.

The pdfleet capability matrix (``pdfleet_runtime.matrix``) says what the pdfleet runtime can move;
these rules say what the engine itself accepts: its flag set, the flags the operator owns, and the
start-up and transfer-time rejections of each version. Each engine kind is a plug-in (``contract.
EngineRules``: ``sglang_plugin``, ``vllm_plugin``, ``builtin``) found by kind in ``registry``; this entry
is generic. ``evaluate_engine`` is pure and total, like ``matrix.evaluate``.
"""

from __future__ import annotations

from pdfleet_runtime.engine_rules.common import ENGINE_RULES, general_rule_rows, violation
from pdfleet_runtime.engine_rules.contract import CheckHarness, EngineRules
from pdfleet_runtime.engine_rules.inputs import EngineInput, EngineRoleInput, role_env
from pdfleet_runtime.engine_rules.registry import checked_kinds, own_router, routers_of, rules_of
from pdfleet_runtime.links import Backend
from pdfleet_runtime.matrix import Violation

__all__ = [
    "ENGINE_RULES",
    "CheckHarness",
    "EngineInput",
    "EngineRoleInput",
    "EngineRules",
    "checked_kinds",
    "engine_rule_table",
    "evaluate_engine",
    "known_versions",
    "role_env",
    "router_violations",
    "rules_of",
    "table_env",
]


def known_versions(kind: str) -> tuple[str, ...]:
    """Versions of an engine this operator has rules and a flag set for."""
    rules = rules_of(kind)
    return () if rules is None else rules.known_versions()


def table_env(inp: EngineInput) -> list[tuple[str, str, str]]:
    """(name, value, field path) the spec renders into the engine container, before the user's env."""
    rules = rules_of(inp.kind)
    return [] if rules is None else rules.table_env(inp)


def evaluate_engine(inp: EngineInput) -> tuple[tuple[Violation, ...], tuple[Violation, ...]]:
    """(errors, warnings) of an engine other than pdfleet; never raises."""
    errors: list[Violation] = []
    warnings: list[Violation] = []
    try:
        rules = rules_of(inp.kind)
        if rules is not None:
            errors += rules.evaluate(inp)
        errors += router_violations(inp.kind, inp.router_kind, inp.backend if inp.routed else None)
        if inp.downloads_model:
            warnings.append(violation(ENGINE_RULES["warn-engine-model-download"],
                                      "model.source.huggingFace: every pod downloads the weights at start",
                                      ("spec.model.source.huggingFace",), inp.kind))
            if inp.model_revision is None:
                warnings.append(violation(ENGINE_RULES["warn-engine-model-revision"],
                                          "model.source.huggingFace.revision is unset: pods may load different "
                                          "commits", ("spec.model.source.huggingFace.revision",), inp.kind))
    except Exception as exc:  # totality, as matrix.evaluate: a bug must be a verdict, not a crash
        errors.append(Violation("matrix-internal-error", f"engine rules failed: {type(exc).__name__}: {exc}",
                                ("spec.engine",), "a bug in the engine rules", "report it with the manifest"))
    seen: set[tuple[str, tuple[str, ...], str]] = set()
    unique = []
    for v in errors:
        key = (v.rule, v.paths, v.message.split(": ", 1)[-1])
        if key not in seen:
            seen.add(key)
            unique.append(v)
    return tuple(unique), tuple(warnings)


def router_violations(engine_kind: str, router_kind: str | None, backend: Backend | None) -> list[Violation]:
    """``spec.router`` against the engine: each engine kind speaks its routers' PD protocols
    (``EngineRules.routers``; ``router_kind`` None: the engine's own router), and vllm-router pairs no Mooncake
    prefill it discovers. ``backend``: spec.transfer.backend when the operator renders a router, else None."""
    own, spoken = own_router(engine_kind), routers_of(engine_kind)
    if router_kind is not None and router_kind not in spoken:
        return [violation(ENGINE_RULES["router-kind-engine"],
                          f"spec.router.kind {router_kind} on a {engine_kind} fleet: use {own} (its own router)",
                          ("spec.router.kind",), engine_kind)]
    if backend is Backend.MOONCAKE and (router_kind or own) == "vllm":
        return [violation(ENGINE_RULES["vllm-router-mooncake-discovery"],
                          f"spec.router renders vllm-router with Kubernetes discovery on a {engine_kind} fleet whose "
                          "transfer.backend is mooncake: requests would reach the decode without kv_transfer_params",
                          ("spec.router", "spec.transfer.backend"), engine_kind)]
    return []


def engine_rule_table(kind: str, version: str) -> list[dict[str, str]]:
    """Every rule of one engine version, for ``pdfleet matrix --engine``: general ones, then the version's."""
    rules = rules_of(kind)
    return general_rule_rows() + ([] if rules is None else rules.rule_rows(version))
