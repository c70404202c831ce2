"""The rules every engine kind shares (version, flags, protocol, router), by id."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pdfleet_runtime.engine_rules.argv import flag_set
from pdfleet_runtime.matrix import Rule, Severity, Violation

__all__ = ["ENGINE_RULES", "general_rule_rows", "owned_flag_rows", "violation"]


def _r(id: str, title: str, reason: str, fix: str, severity: Severity = Severity.ERROR) -> tuple[str, Rule]:
    return id, Rule(id, title, reason, fix, severity)


ENGINE_RULES: Mapping[str, Rule] = MappingProxyType(dict([
    _r("engine-version-unknown", "the engine version is unknown to this operator",
       "the operator checks an engine's flags and start-up rules against that version's data; an unknown "
       "version cannot be checked", "use a version `pdfleet matrix --engine KIND==VERSION` knows"),
    _r("engine-flag-unknown", "the engine does not have this flag (or its value is not accepted)",
       "the engine's own argument parser would exit 2 at start and the pod would crash-loop",
       "remove or correct the flag; the engine's --help lists its flags"),
    _r("engine-flag-owned", "the operator renders this flag from a spec field",
       "a second value in args would contradict the field the operator renders it from",
       "remove it from args and set the field named in the message"),
    _r("engine-protocol-unsupported", "the engine cannot serve this transfer backend and protocol",
       "the protocol table (docs/sglang.md, docs/vllm.md) has no settings of this engine for the pair",
       "pick a pair of the protocol table (`pdfleet matrix --engine KIND==VERSION`)"),
    _r("router-kind-engine", "the router does not speak this engine's PD protocol",
       "sglang-router sends SGLang's bootstrap fields, which vLLM ignores, and vllm-router sends vLLM's "
       "kv_transfer_params, which SGLang ignores: both roles answer, no state moves and nothing fails (the "
       "built-in runtime speaks both)", "leave spec.router.kind unset (the engine's own router) or set a kind "
       "the engine speaks"),
    _r("vllm-router-mooncake-discovery", "vllm-router cannot pair Mooncake prefills it discovers",
       "vllm-router 0.1.17 asks a prefill's Mooncake bootstrap for its engine id only for the --prefill URLs given "
       "at its start (src/routers/http/vllm_pd_router.rs: the query runs in VllmPDRouter's constructor; "
       "add_prefill_server, which its Kubernetes discovery calls, never asks), so every request through a "
       "discovered prefill reaches the decode without kv_transfer_params: vLLM's decode recomputes the prompt, "
       "nothing moves and nothing fails (seen in the local cluster: 'No Mooncake bootstrap info for prefill')",
       "use transfer.backend nixl with vllm-router; on a built-in runtime fleet, or use router.kind sglang; or "
       "run your own router without spec.router"),
    _r("warn-engine-model-download", "the model is downloaded at start",
       "every pod downloads the weights from the Hub when it starts: slow starts and Hub rate limits",
       "put the weights on a volume (model.source.path with volume)", Severity.WARNING),
    _r("warn-engine-model-revision", "the model's revision is not pinned",
       "each pod loads whatever the Hub's default branch holds when it starts: after the model's owner pushes, a "
       "restarted pod serves other weights beside the rest of the fleet, and a prefill and a decode can pair "
       "across two commits with nothing failing", "set model.source.huggingFace.revision to a commit",
       Severity.WARNING),
]))


def violation(rule: Rule, message: str, paths: tuple[str, ...], tag: str) -> Violation:
    """A violation of one of these rules (or any ``Rule``), tagged with the engine (``kind==version``)."""
    return Violation(rule.id, message, paths, rule.reason, rule.fix, rule.severity, tag)


def general_rule_rows() -> list[dict[str, str]]:
    """The rules above as ``pdfleet matrix --engine`` rows (each engine's own rows follow them)."""
    return [{"id": r.id, "title": r.title, "when": "admission", "reason": r.reason, "fix": r.fix,
             "source": "pdfleet", "severity": str(r.severity)} for r in ENGINE_RULES.values()]


def owned_flag_rows(kind: str, version: str, owned: Mapping[str, str]) -> list[tuple[str, str]]:
    """(the option strings of each owned dest, its owner) for ``pdfleet matrix --engine``."""
    fs = flag_set(kind, version)
    assert fs is not None
    return [(", ".join(f.option for f in fs.flags.values() if f.dest == dest) or dest, owner.format(role="spec.<role>"))
            for dest, owner in owned.items()]
