"""Evaluate an SGLang PDDeployment's engine: protocol table, version, flags (unknown, owned), sglang==VERSION's rules.

Called through the SGLang plug-in (``sglang_plugin.SGLANG.evaluate``). Each role's args are read as SGLang's
argparse parser reads them (``argv.parse_args``), then every rule of the version runs on the role. Pure.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import MappingProxyType

from pdfleet_runtime.engine_rules import sglang
from pdfleet_runtime.engine_rules.argv import flag_set, parse_args
from pdfleet_runtime.engine_rules.common import ENGINE_RULES, violation
from pdfleet_runtime.engine_rules.inputs import EngineInput, role_env
from pdfleet_runtime.matrix import Severity, Violation
from pdfleet_runtime.roles import Role

__all__ = ["evaluate_sglang", "known_sglang_versions", "sglang_rule_rows", "sglang_table_env"]


def known_sglang_versions() -> tuple[str, ...]:
    return tuple(v for v in sglang.RULES if flag_set("sglang", v) is not None)


def sglang_table_env(inp: EngineInput) -> list[tuple[str, str, str]]:
    """(name, value, field path) the spec renders: the protocol table's, then the staging buffer's."""
    out: list[tuple[str, str, str]] = []
    settings = sglang.PROTOCOLS.get((inp.backend, inp.protocol))
    if settings is not None:
        out += [(k, v, "spec.transfer.protocol") for k, v in settings.env.items()]
    if inp.staging_buffer:
        out.append((sglang.STAGING_BUFFER_ENV, "1", "spec.engine.stagingBuffer"))
    return out


def _rule_violation(rule: sglang.EngineRule, message: str, paths: tuple[str, ...], version: str) -> Violation:
    when = "SGLang refuses it at start" if rule.when == "start-up" else "every such transfer fails"
    return Violation(rule.id, message, paths, f"{rule.reason} ({when}; {rule.source})", rule.fix,
                     Severity.ERROR, f"sglang=={version}")


def _role(inp: EngineInput, role: Role) -> Iterator[Violation]:
    r = inp.of(role)
    prefix = f"spec.{role}"
    known = known_sglang_versions()
    version = r.version if r.version in known else None
    fs = flag_set(inp.kind, version) if version is not None else None
    if version is None or fs is None:
        yield violation(ENGINE_RULES["engine-version-unknown"],
                        f"{role}: {inp.kind} version {r.version!r} is unknown; known: {', '.join(known) or 'none'}",
                        (r.version_path,), f"{inp.kind}=={r.version}")
        return
    tag = f"{inp.kind}=={version}"
    parsed = parse_args(r.args, fs)
    for p in parsed.problems:
        yield violation(ENGINE_RULES["engine-flag-unknown"], f"{role}: {p.message}", (r.arg_paths[p.index],), tag)
    for dest, (index, written, option) in parsed.where.items():
        owner = sglang.OWNED_FLAGS.get(dest)
        if owner is not None:
            alias = f" (abbreviates {option})" if written != option else ""
            yield violation(ENGINE_RULES["engine-flag-owned"],
                            f"{role}: {written}{alias} is owned by {owner.format(role=prefix)}",
                            (r.arg_paths[index],), tag)
    effective = role_env(sglang_table_env(inp), inp, role)
    env = {name: value for name, value, _ in effective}
    env_paths = {name: path for name, _, path in effective}
    peer = inp.decode if role is Role.PREFILL else inp.prefill
    view = sglang.RoleView(role, prefix, parsed, r.arg_paths, MappingProxyType(env), MappingProxyType(env_paths),
                           r.tensor, r.pipeline, inp.backend, inp.protocol, inp.model, inp.state_types, inp.mla,
                           peer.tensor, r.expert)
    for rule in sglang.RULES[version]:
        found = rule.check(view)
        if found is not None:
            yield _rule_violation(rule, found[0], found[1], version)


def evaluate_sglang(inp: EngineInput) -> list[Violation]:
    errors: list[Violation] = []
    if (inp.backend, inp.protocol) not in sglang.PROTOCOLS:
        errors.append(violation(ENGINE_RULES["engine-protocol-unsupported"],
                                f"sglang has no settings for {inp.backend} over {inp.protocol}",
                                ("spec.transfer.backend", "spec.transfer.protocol"), "sglang"))
    settings = sglang.PROTOCOLS.get((inp.backend, inp.protocol))
    if inp.rdma_device_map and settings is not None and not settings.per_gpu_devices:
        errors.append(violation(ENGINE_RULES["engine-protocol-unsupported"],
                                f"sglang's {inp.backend} connector takes one device list, not a per-GPU map",
                                ("spec.transfer.rdmaDeviceMap",), "sglang"))
    for role in inp.roles:
        errors += _role(inp, role)
    return errors


def sglang_rule_rows(version: str) -> list[dict[str, str]]:
    return [{"id": r.id, "title": r.title, "when": r.when, "reason": r.reason, "fix": r.fix,
             "source": r.source, "severity": "error"} for r in sglang.RULES.get(version, ())]
