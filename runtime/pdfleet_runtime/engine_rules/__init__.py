"""Rules of the inference engine a PDDeployment runs, keyed by engine kind and version.

The pdfleet capability matrix (``pdfleet_runtime.matrix``) says what the pdfleet runtime can move;
these rules say what the engine itself accepts: its flag set, the flags the operator owns, and the
start-up and transfer-time rejections of each version (``sglang.RULES``, ``vllm.RULES`` evaluated by
``vllm_eval``). Both apply to an SGLang or vLLM deployment. ``evaluate_engine`` is pure and total, like
``matrix.evaluate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import MappingProxyType

from pdfleet_runtime.engine_rules import sglang
from pdfleet_runtime.engine_rules.argv import flag_set, parse_args
from pdfleet_runtime.engine_rules.common import ENGINE_RULES
from pdfleet_runtime.engine_rules.inputs import EngineInput, EngineRoleInput, role_env, table_env
from pdfleet_runtime.matrix import Rule, Severity, Violation
from pdfleet_runtime.roles import Role

__all__ = [
    "ENGINE_RULES",
    "EngineInput",
    "EngineRoleInput",
    "engine_rule_table",
    "evaluate_engine",
    "known_versions",
    "role_env",
    "router_violation",
    "table_env",
]


def known_versions(kind: str) -> tuple[str, ...]:
    """Versions of an engine this operator has rules and a flag set for."""
    if kind == "sglang":
        return tuple(v for v in sglang.RULES if flag_set("sglang", v) is not None)
    if kind == "vllm":
        from pdfleet_runtime.engine_rules.vllm_eval import known_vllm_versions

        return known_vllm_versions()
    return ()


def _violation(rule: Rule, message: str, paths: tuple[str, ...], version: str) -> Violation:
    return Violation(rule.id, message, paths, rule.reason, rule.fix, rule.severity, version)


def _engine_rule_violation(rule: sglang.EngineRule, message: str, paths: tuple[str, ...],
                           version: str) -> Violation:
    when = "SGLang refuses it at start" if rule.when == "start-up" else "every such transfer fails"
    return Violation(rule.id, message, paths, f"{rule.reason} ({when}; {rule.source})", rule.fix,
                     Severity.ERROR, f"sglang=={version}")


def _role(inp: EngineInput, role: Role) -> Iterator[Violation]:
    r = inp.of(role)
    prefix = f"spec.{role}"
    known = known_versions(inp.kind)
    version = r.version if r.version in known else None
    fs = flag_set(inp.kind, version) if version is not None else None
    if version is None or fs is None:
        yield _violation(ENGINE_RULES["engine-version-unknown"],
                         f"{role}: {inp.kind} version {r.version!r} is unknown; known: {', '.join(known) or 'none'}",
                         (r.version_path,), f"{inp.kind}=={r.version}")
        return
    tag = f"{inp.kind}=={version}"
    parsed = parse_args(r.args, fs)
    for p in parsed.problems:
        yield _violation(ENGINE_RULES["engine-flag-unknown"], f"{role}: {p.message}", (r.arg_paths[p.index],), tag)
    for dest, (index, written, option) in parsed.where.items():
        owner = sglang.OWNED_FLAGS.get(dest)
        if owner is not None:
            alias = f" (abbreviates {option})" if written != option else ""
            yield _violation(ENGINE_RULES["engine-flag-owned"],
                             f"{role}: {written}{alias} is owned by {owner.format(role=prefix)}",
                             (r.arg_paths[index],), tag)
    effective = role_env(inp, role)
    env = {name: value for name, value, _ in effective}
    env_paths = {name: path for name, _, path in effective}
    peer = inp.decode if role is Role.PREFILL else inp.prefill
    view = sglang.RoleView(role, prefix, parsed, r.arg_paths, MappingProxyType(env), MappingProxyType(env_paths),
                           r.tensor, r.pipeline, inp.backend, inp.protocol, inp.model, inp.state_types, inp.mla,
                           peer.tensor, r.expert)
    for rule in sglang.RULES[version]:
        found = rule.check(view)
        if found is not None:
            yield _engine_rule_violation(rule, found[0], found[1], version)


def evaluate_engine(inp: EngineInput) -> tuple[tuple[Violation, ...], tuple[Violation, ...]]:
    """(errors, warnings) of an engine other than pdfleet; never raises."""
    errors: list[Violation] = []
    warnings: list[Violation] = []
    try:
        if inp.kind == "vllm":
            from pdfleet_runtime.engine_rules.vllm_eval import evaluate_vllm

            errors += evaluate_vllm(inp)
            inp = dataclasses.replace(inp, roles=())  # the version's rules ran above
        if inp.kind == "sglang" and (inp.backend, inp.protocol) not in sglang.PROTOCOLS:
            errors.append(_violation(ENGINE_RULES["engine-protocol-unsupported"],
                                     f"sglang has no settings for {inp.backend} over {inp.protocol}",
                                     ("spec.transfer.backend", "spec.transfer.protocol"), "sglang"))
        settings = sglang.PROTOCOLS.get((inp.backend, inp.protocol))
        if inp.rdma_device_map and settings is not None and not settings.per_gpu_devices:
            errors.append(_violation(ENGINE_RULES["engine-protocol-unsupported"],
                                     f"sglang's {inp.backend} connector takes one device list, not a per-GPU map",
                                     ("spec.transfer.rdmaDeviceMap",), "sglang"))
        for role in inp.roles:
            errors += _role(inp, role)
        wrong = router_violation(inp.kind, inp.router_kind)
        if wrong is not None:
            errors.append(wrong)
        if inp.downloads_model:
            warnings.append(_violation(ENGINE_RULES["warn-engine-model-download"],
                                       "model.source.huggingFace: every pod downloads the weights at start",
                                       ("spec.model.source.huggingFace",), inp.kind))
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


def router_violation(engine_kind: str, router_kind: str | None) -> Violation | None:
    """``spec.router.kind`` against the engine: vLLM needs vllm-router; SGLang and the built-in runtime
    need sglang-router (None: the engine's own router)."""
    own = "vllm" if engine_kind == "vllm" else "sglang"
    if router_kind is None or router_kind == own:
        return None
    return _violation(ENGINE_RULES["router-kind-engine"],
                      f"spec.router.kind {router_kind} on a {engine_kind} fleet: use {own} (its own router)",
                      ("spec.router.kind",), engine_kind)


def engine_rule_table(kind: str, version: str) -> list[dict[str, str]]:
    """Every rule of one engine version, for ``pdfleet matrix --engine``: general ones, then the version's."""
    rows = [{"id": r.id, "title": r.title, "when": "admission", "reason": r.reason, "fix": r.fix,
             "source": "pdfleet", "severity": str(r.severity)} for r in ENGINE_RULES.values()]
    if kind == "sglang":
        rows += [{"id": r.id, "title": r.title, "when": r.when, "reason": r.reason, "fix": r.fix,
                  "source": r.source, "severity": "error"} for r in sglang.RULES.get(version, ())]
    if kind == "vllm":
        from pdfleet_runtime.engine_rules.vllm_eval import vllm_rule_rows

        rows += vllm_rule_rows(version)
    return rows
