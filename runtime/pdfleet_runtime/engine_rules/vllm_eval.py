"""Evaluate a vLLM PDDeployment's engine: version, flags (unknown, owned), protocol, and vllm==VERSION's rules.

Called through the vLLM plug-in (``vllm_plugin.VLLM.evaluate``). Both roles are read first (each
role's args as vLLM's parser reads them), then every rule runs on each role with the other role beside it
(the pair rules compare the two), so every violation of every role is reported. Pure.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import MappingProxyType

from pdfleet_runtime.engine_rules import vllm
from pdfleet_runtime.engine_rules.argv import flag_set
from pdfleet_runtime.engine_rules.common import ENGINE_RULES
from pdfleet_runtime.engine_rules.common import violation as _v
from pdfleet_runtime.engine_rules.inputs import EngineInput, role_env
from pdfleet_runtime.engine_rules.vllm_argv import VllmArgs, read_vllm_args
from pdfleet_runtime.engine_rules.vllm_render import transfer_env
from pdfleet_runtime.matrix import Severity, Violation
from pdfleet_runtime.roles import Role

__all__ = ["evaluate_vllm", "known_vllm_versions", "vllm_rule_rows", "vllm_table_env"]


def known_vllm_versions() -> tuple[str, ...]:
    return tuple(v for v in vllm.RULES if flag_set("vllm", v) is not None)


def vllm_table_env(inp: EngineInput) -> list[tuple[str, str, str]]:
    """(name, value, field path) the spec renders: the transfer's fixed environment (the pod-IP variables,
    from the downward API, are not values the rules can read)."""
    return [(k, v, "spec.transfer") for k, v in transfer_env(inp.backend, inp.protocol, None)]


def _rule_violation(rule: vllm.VllmRule, message: str, paths: tuple[str, ...], version: str) -> Violation:
    when = {"config": "vllm serve refuses it at start", "silent": "vLLM accepts it and PD is lost or the "
            "engine fails at start", "gpu-worker": "the GPU worker refuses it at start",
            "pair": "every handshake or transfer between the roles fails"}[rule.when]
    how = "confirmed by running vLLM's code" if rule.confirmed == "run" else "read from vLLM's source"
    return Violation(rule.id, message, paths, f"{rule.reason} ({when}; vllm/{rule.source}, {how})", rule.fix,
                     Severity.ERROR, f"vllm=={version}")


def _view(inp: EngineInput, role: str, args: VllmArgs) -> vllm.RoleView:
    r = getattr(inp, role)
    effective = role_env(vllm_table_env(inp), inp, Role(role))
    return vllm.RoleView(
        role, f"spec.{role}", args, r.arg_paths,
        MappingProxyType({n: v for n, v, _ in effective}), MappingProxyType({n: p for n, _, p in effective}),
        r.tensor, r.pipeline, r.data, r.expert, r.nodes, inp.backend, inp.protocol, r.version, inp.model,
        inp.state_types, inp.mla, inp.kv_heads, inp.model_path)


def _flags(inp: EngineInput, role: str, args: VllmArgs, tag: str) -> Iterator[Violation]:
    r = getattr(inp, role)
    for p in args.parsed.problems:
        yield _v(ENGINE_RULES["engine-flag-unknown"], f"{role}: {p.message}", (r.arg_paths[args.origin[p.index]],),
                 tag)
    for dest, (index, _written, option) in args.parsed.where.items():
        owner = vllm.OWNED_FLAGS.get(dest)
        if owner is not None:
            text = args.written[args.origin[index]]
            alias = f" ({option})" if text.split("=", 1)[0] != option else ""
            yield _v(ENGINE_RULES["engine-flag-owned"],
                     f"{role}: {text}{alias} is owned by {owner.format(role=f'spec.{role}')}",
                     (r.arg_paths[args.origin[index]],), tag)


def evaluate_vllm(inp: EngineInput) -> list[Violation]:
    out: list[Violation] = []
    if (inp.backend, inp.protocol) not in vllm.PROTOCOLS:
        out.append(_v(ENGINE_RULES["engine-protocol-unsupported"],
                      f"vllm has no PD connector settings for {inp.backend} over {inp.protocol} (pairs: "
                      + ", ".join(f"{b}/{p}" for b, p in vllm.PROTOCOLS) + ")",
                      ("spec.transfer.backend", "spec.transfer.protocol"), "vllm"))
    if inp.rdma_device_map:
        out.append(_v(ENGINE_RULES["engine-protocol-unsupported"],
                      "vllm's connectors take one device list for every rank (UCX_NET_DEVICES, Mooncake's "
                      "device_name), not a per-GPU map: use spec.transfer.rdmaDevices",
                      ("spec.transfer.rdmaDeviceMap",), "vllm"))
    known = known_vllm_versions()
    views: dict[str, vllm.RoleView] = {}
    for role in ("prefill", "decode"):
        r = getattr(inp, role)
        fs = flag_set("vllm", r.version) if r.version in known else None
        if fs is None:
            if role in inp.roles:
                out.append(_v(ENGINE_RULES["engine-version-unknown"],
                              f"{role}: vllm version {r.version!r} is unknown; known: {', '.join(known) or 'none'}",
                              (r.version_path,), f"vllm=={r.version}"))
            if not known:
                continue
            # read with a known version's flags so the pair rules still see this role (a version mismatch
            # is itself a pair violation); its own flags are not judged against a version it does not run
            views[role] = _view(inp, role, read_vllm_args(r.args, flag_set("vllm", known[-1])))  # type: ignore[arg-type]
            continue
        args = read_vllm_args(r.args, fs)
        if role in inp.roles:
            out += _flags(inp, role, args, f"vllm=={r.version}")
        views[role] = _view(inp, role, args)
    if (inp.backend, inp.protocol) not in vllm.PROTOCOLS:
        return out  # no connector is rendered: the connector rules have nothing to read
    for role in inp.roles:
        view = views.get(role)
        if view is None:
            continue
        peer = views.get("decode" if role == "prefill" else "prefill", view)
        version = view.version if view.version in known else None
        rules_of = version or (peer.version if peer.version in known else known[-1])
        for rule in vllm.RULES[rules_of]:
            if (version is None and rule.when != "pair") or (rule.when == "pair" and peer is view):
                continue  # an unknown version's own rules are unknown; the pair rules still compare it
            for message, paths in rule.check(view, peer):
                out.append(_rule_violation(rule, message, paths, rules_of))
    return out


def vllm_rule_rows(version: str) -> list[dict[str, str]]:
    return [{"id": r.id, "title": r.title, "when": r.when, "reason": r.reason, "fix": r.fix,
             "source": f"vllm/{r.source}", "confirmed": r.confirmed, "severity": "error"}
            for r in vllm.RULES.get(version, ())]
