"""Rules of the inference engine a PDDeployment runs, keyed by engine kind and version.

The pdfleet capability matrix (``pdfleet_runtime.matrix``) says what the pdfleet runtime can move;
these rules say what the engine itself accepts: its flag set, the flags the operator owns, and the
start-up and transfer-time rejections of each version (``sglang.RULES``). Both apply to an SGLang
deployment. ``evaluate_engine`` is pure and total, like ``matrix.evaluate``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pdfleet_runtime.engine_rules import sglang
from pdfleet_runtime.engine_rules.argv import flag_set, parse_args
from pdfleet_runtime.links import Backend, LinkProtocol
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
    "table_env",
]


def known_versions(kind: str) -> tuple[str, ...]:
    """Versions of an engine this operator has rules and a flag set for."""
    if kind == "sglang":
        return tuple(v for v in sglang.RULES if flag_set("sglang", v) is not None)
    return ()


def _r(id: str, title: str, reason: str, fix: str, severity: Severity = Severity.ERROR) -> tuple[str, Rule]:
    return id, Rule(id, title, reason, fix, severity)


ENGINE_RULES: Mapping[str, Rule] = MappingProxyType(dict([
    _r("engine-version-unknown", "the engine version is unknown to this operator",
       "the operator checks an engine's flags and start-up rules against that version's data; an unknown "
       "version cannot be checked", "use a version `pdfleet matrix --engine sglang==VERSION` knows"),
    _r("engine-flag-unknown", "the engine does not have this flag (or its value is not accepted)",
       "the engine's own argument parser would exit 2 at start and the pod would crash-loop",
       "remove or correct the flag; the engine's --help lists its flags"),
    _r("engine-flag-owned", "the operator renders this flag from a spec field",
       "a second value in args would contradict the field the operator renders it from",
       "remove it from args and set the field named in the message"),
    _r("engine-protocol-unsupported", "the engine cannot serve this transfer backend and protocol",
       "the protocol table (docs/sglang.md) has no SGLang settings for the pair",
       "pick a pair of the protocol table (`pdfleet matrix --engine sglang==VERSION`)"),
    _r("warn-engine-model-download", "the model is downloaded at start",
       "every pod downloads the weights from the Hub when it starts: slow starts and Hub rate limits",
       "put the weights on a volume (model.source.path with volume)", Severity.WARNING),
]))


@dataclass(frozen=True)
class EngineRoleInput:
    """One role's engine as written in the spec (shared settings already merged with the role's)."""

    version: str | None
    version_path: str
    args: tuple[str, ...] = ()
    arg_paths: tuple[str, ...] = ()
    env: tuple[tuple[str, str | None, str], ...] = ()  # (name, value or None for valueFrom, field path)
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1


@dataclass(frozen=True)
class EngineInput:
    kind: str
    backend: Backend
    protocol: LinkProtocol
    prefill: EngineRoleInput
    decode: EngineRoleInput
    model: str | None = None  # layout preset
    state_types: frozenset[str] = frozenset()
    mla: bool = False
    staging_buffer: bool = False
    downloads_model: bool = False
    rdma_device_map: bool = False  # spec.transfer.rdmaDeviceMap is set
    roles: tuple[Role, ...] = field(default=(Role.PREFILL, Role.DECODE))

    def of(self, role: Role) -> EngineRoleInput:
        """The engine of one role."""
        return self.prefill if role is Role.PREFILL else self.decode


def table_env(inp: EngineInput) -> list[tuple[str, str, str]]:
    """(name, value, field path) the spec renders: the protocol table's, then the staging buffer's."""
    out: list[tuple[str, str, str]] = []
    settings = sglang.PROTOCOLS.get((inp.backend, inp.protocol))
    if settings is not None:
        out += [(k, v, "spec.transfer.protocol") for k, v in settings.env.items()]
    if inp.staging_buffer:
        out.append((sglang.STAGING_BUFFER_ENV, "1", "spec.engine.stagingBuffer"))
    return out


def role_env(inp: EngineInput, role: Role) -> list[tuple[str, str | None, str]]:
    """The engine container's environment from the spec, in order (later entries win in a pod):
    ``table_env``, then the user's (shared, then the role's)."""
    return [*table_env(inp), *inp.of(role).env]


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


def engine_rule_table(kind: str, version: str) -> list[dict[str, str]]:
    """Every rule of one engine version, for ``pdfleet matrix --engine``: general ones, then the version's."""
    rows = [{"id": r.id, "title": r.title, "when": "admission", "reason": r.reason, "fix": r.fix,
             "source": "pdfleet", "severity": str(r.severity)} for r in ENGINE_RULES.values()]
    if kind == "sglang":
        rows += [{"id": r.id, "title": r.title, "when": r.when, "reason": r.reason, "fix": r.fix,
                  "source": r.source, "severity": "error"} for r in sglang.RULES.get(version, ())]
    return rows
