"""Structural rules enforced by the apiserver itself: CEL ``x-kubernetes-validations``.

Each rule is written twice, side by side: the CEL expression the CRD carries and a Python predicate
that ``pdfleet validate`` runs on the same (defaulted) object, so the offline verdict matches
``kubectl apply --dry-run=server`` even with the webhook absent. Rules that are also matrix rules
use the matrix rule's id, so a user sees one id wherever the check runs. Messages start with the
rule id because the apiserver prints only the message.

These rules read only the object, never the layout presets or the matrix: the apiserver cannot.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdfleet_operator.api.autoscaling import AUTOSCALING_RULES
from pdfleet_operator.api.scheduling import SCHEDULING_RULES

__all__ = ["CEL_RULES", "CelRule"]

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry, attached at each schema path in ``at``.

    ``check(obj) -> bool`` is the Python twin of ``rule`` (True: valid). It sees the defaulted
    object at that path; a KeyError/TypeError there means the schema already rejected the object.
    """

    id: str
    at: tuple[str, ...]
    rule: str
    message: str
    check: Callable[[Obj], bool]
    field_path: str | None = None
    reason: str = ""  # why the rule exists, for rules that are not matrix rules (shown by `pdfleet validate`)
    fix: str = ""  # how to fix a violation, likewise

    def to_schema(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": f"{self.id}: {self.message}", "reason": "FieldValueInvalid"}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def _is_zero(v: object) -> bool:
    return v == "0%" if isinstance(v, str) else v == 0


def _zero_cel(f: str) -> str:
    return f"(type(self.{f}) == string ? self.{f} == '0%' : self.{f} == 0)"


_ROLES = ("spec.prefill.parallelism", "spec.decode.parallelism")
_LAYER_SETS = (
    "spec.model.layout.inline.fullAttentionLayers",
    "spec.model.layout.inline.swa.layers",
    "spec.model.layout.inline.ple.shortConvLayers",
)
_INLINE = ("spec.model.layout.inline",)


def _ids_below(obj: Obj) -> bool:
    n = obj["numLayers"]
    sets = [
        obj["fullAttentionLayers"],
        obj.get("swa", {}).get("layers", {}),
        obj.get("ple", {}).get("shortConvLayers", {}),
    ]
    return all(i < n for s in sets for i in s.get("ids", ()))


def _attention_fields(o: Obj) -> bool:
    if o.get("attentionKind", "MHA") == "MLA":
        return "mla" in o and "headDim" not in o and o["kvHeads"] == 1 and "swa" not in o
    return "headDim" in o and "mla" not in o


_LAYER_IDS_CEL = (
    "(!has(self.fullAttentionLayers.ids) || self.fullAttentionLayers.ids.all(i, i < self.numLayers)) && "
    "(!has(self.swa) || !has(self.swa.layers.ids) || self.swa.layers.ids.all(i, i < self.numLayers)) && "
    "(!has(self.ple) || !has(self.ple.shortConvLayers.ids) || "
    "self.ple.shortConvLayers.ids.all(i, i < self.numLayers))"
)

def _engine_kind(o: Obj) -> str:
    kind: str = (o.get("engine") or {}).get("kind", "pdfleet")  # the schema's enum, checked before any rule
    return kind


def _role_override_ok(o: Obj) -> bool:
    return _engine_kind(o) != "pdfleet" or not any((o.get(r) or {}).get("engine") for r in ("prefill", "decode"))


def _builtin_ok(o: Obj, field: str) -> bool:
    """The built-in runtime has no attention DP or EP: ``field`` > 1 only with another engine."""
    return _engine_kind(o) != "pdfleet" or all(o[r]["parallelism"][field] == 1 for r in ("prefill", "decode"))


def _device_map_ok(o: Obj) -> bool:
    m = o.get("rdmaDeviceMap")
    return m is None or all(re.fullmatch(_GPU_KEY, k) and v for k, v in m.items())


_GPU_KEY = "[0-9]|[1-5][0-9]|6[0-3]"


# -- spec.autoscaling (api/autoscaling.py; the loop-needing checks run beside the matrix) -------------

_AS = "spec.autoscaling"
_AS_ROLES = (f"{_AS}.prefill", f"{_AS}.decode")
_SIGNALS = {"prefill": ("backlog", "ttft"), "decode": ("kvCache", "runningRequests", "itl")}


def _as_rule(rule_id: str, at: tuple[str, ...], rule: str, message: str, check: Callable[[Obj], bool],
             field_path: str | None = None) -> CelRule:
    r = AUTOSCALING_RULES[rule_id]
    return CelRule(rule_id, at, rule, message, check, field_path, r.reason, r.fix)


def _replicas_in_range(o: Obj, role: str) -> bool:
    a = o.get("autoscaling")
    if a is None:
        return True
    bounds = a[role]
    if bounds["minReplicas"] > bounds["maxReplicas"]:
        return True  # autoscaling-min-max reports it
    return bool(bounds["minReplicas"] <= o[role]["replicas"] <= bounds["maxReplicas"])


def _has_signal(o: Obj, names: tuple[str, ...]) -> bool:
    return any(s in o for s in names)


def _gpus_cel(role: str) -> str:
    return (f"self.autoscaling.{role}.minReplicas * self.{role}.parallelism.tensor * "
            f"self.{role}.parallelism.pipeline")


def _minimum_gpus(o: Obj) -> int:
    return sum(o["autoscaling"][r]["minReplicas"] * o[r]["parallelism"]["tensor"] * o[r]["parallelism"]["pipeline"]
               for r in ("prefill", "decode"))


def _budget_ok(o: Obj) -> bool:
    a = o.get("autoscaling")
    return a is None or "gpuBudget" not in a or _minimum_gpus(o) <= a["gpuBudget"]


def _ratio_relaxed(o: Obj) -> bool:
    """The band meets the bounds' box over the reals (the exact integer check runs beside the matrix)."""
    band, p, d = o.get("prefillDecodeRatio"), o["prefill"], o["decode"]
    if band is None or band["min"] > band["max"] or p["minReplicas"] > p["maxReplicas"] or (
            d["minReplicas"] > d["maxReplicas"]):
        return True
    return bool(band["min"] * float(d["minReplicas"]) <= float(p["maxReplicas"])
                and band["max"] * float(d["maxReplicas"]) >= float(p["minReplicas"]))


def _single_control(o: Obj) -> bool:
    return "autoscaling" not in o or not any(o[r].get("scalingAdapter") for r in ("prefill", "decode"))


_AUTOSCALING_RULES: tuple[CelRule, ...] = (
    _as_rule(
        "autoscaling-double-control",
        ("spec",),
        "!has(self.autoscaling) || !((has(self.prefill.scalingAdapter) && self.prefill.scalingAdapter) || "
        "(has(self.decode.scalingAdapter) && self.decode.scalingAdapter))",
        "spec.autoscaling and scalingAdapter (an outside autoscaler through a PDRoleScale) cannot drive the same "
        "role: remove one",
        _single_control,
        ".autoscaling",
    ),
    *(
        _as_rule(
            "autoscaling-replicas-in-range",
            ("spec",),
            f"!has(self.autoscaling) || self.autoscaling.{role}.minReplicas > self.autoscaling.{role}.maxReplicas || "
            f"(self.{role}.replicas >= self.autoscaling.{role}.minReplicas && "
            f"self.{role}.replicas <= self.autoscaling.{role}.maxReplicas)",
            f"{role}.replicas must lie within autoscaling.{role}.minReplicas..maxReplicas: it is the count the "
            "fleet starts from",
            functools.partial(_replicas_in_range, role=role),
            f".{role}.replicas",
        )
        for role in ("prefill", "decode")
    ),
    _as_rule(
        "autoscaling-budget-minimums",
        ("spec",),
        f"!has(self.autoscaling) || !has(self.autoscaling.gpuBudget) || "
        f"{_gpus_cel('prefill')} + {_gpus_cel('decode')} <= self.autoscaling.gpuBudget",
        "autoscaling.gpuBudget is below the GPUs of both roles' minReplicas (each replica holds tensor x "
        "pipeline GPUs): raise the budget or lower minReplicas",
        _budget_ok,
        ".autoscaling.gpuBudget",
    ),
    _as_rule(
        "autoscaling-min-max",
        _AS_ROLES,
        "self.minReplicas <= self.maxReplicas",
        "minReplicas must not exceed maxReplicas",
        lambda o: o["minReplicas"] <= o["maxReplicas"],
        ".minReplicas",
    ),
    *(
        _as_rule(
            "autoscaling-signal",
            (f"{_AS}.{role}.signals",),
            " || ".join(f"has(self.{s})" for s in names),
            f"set at least one {role} signal: {', '.join(names)}",
            functools.partial(_has_signal, names=names),
        )
        for role, names in _SIGNALS.items()
    ),
    _as_rule(
        "autoscaling-ratio-order",
        (f"{_AS}.prefillDecodeRatio",),
        "self.min <= self.max",
        "prefillDecodeRatio.min must not exceed prefillDecodeRatio.max",
        lambda o: o["min"] <= o["max"],
        ".max",
    ),
    _as_rule(
        "autoscaling-ratio-feasible",
        (_AS,),
        "!has(self.prefillDecodeRatio) || self.prefillDecodeRatio.min > self.prefillDecodeRatio.max || "
        "self.prefill.minReplicas > self.prefill.maxReplicas || self.decode.minReplicas > self.decode.maxReplicas || "
        "(self.prefillDecodeRatio.min * double(self.decode.minReplicas) <= double(self.prefill.maxReplicas) && "
        "self.prefillDecodeRatio.max * double(self.decode.maxReplicas) >= double(self.prefill.minReplicas))",
        "no prefill and decode replica counts inside their min/max have a ratio inside prefillDecodeRatio: widen "
        "the band or move the bounds",
        _ratio_relaxed,
        ".prefillDecodeRatio",
    ),
)

# -- spec.scheduling (api/scheduling.py) ----------------------------------------------------------------

_MULTI_NODE_CEL = "self.prefill.parallelism.nodesPerReplica > 1 || self.decode.parallelism.nodesPerReplica > 1"


def _sched_rule(rule_id: str, at: tuple[str, ...], rule: str, message: str, check: Callable[[Obj], bool],
                field_path: str | None = None) -> CelRule:
    r = SCHEDULING_RULES[rule_id]
    return CelRule(rule_id, at, rule, message, check, field_path, r.reason, r.fix)


def _multi_node(o: Obj) -> bool:
    return any(o[r]["parallelism"]["nodesPerReplica"] > 1 for r in ("prefill", "decode"))


_SCHEDULING_RULES: tuple[CelRule, ...] = (
    _sched_rule(
        "scheduling-queue-needs-kueue",
        ("spec.scheduling",),
        "!has(self.queueName) || self.gang == 'kueue'",
        "scheduling.queueName is read only by Kueue: set scheduling.gang: kueue, or remove queueName",
        lambda o: "queueName" not in o or o["gang"] == "kueue",
        ".queueName",
    ),
    _sched_rule(
        "scheduling-kueue-queue",
        ("spec.scheduling",),
        "self.gang != 'kueue' || has(self.queueName)",
        "scheduling.gang kueue needs scheduling.queueName: the LocalQueue the replica groups queue in",
        lambda o: o["gang"] != "kueue" or "queueName" in o,
        ".queueName",
    ),
    _sched_rule(
        "scheduling-topology-multi-node",
        ("spec",),
        f"!has(self.scheduling.topologyKey) || {_MULTI_NODE_CEL}",
        "scheduling.topologyKey packs the members of a multi-node replica into one domain, but both roles have "
        "nodesPerReplica 1: remove topologyKey or set a role's nodesPerReplica > 1",
        lambda o: "topologyKey" not in o["scheduling"] or _multi_node(o),
        ".scheduling.topologyKey",
    ),
    _sched_rule(
        "scheduling-topology-hostname",
        ("spec.scheduling",),
        "!has(self.topologyKey) || self.topologyKey != 'kubernetes.io/hostname'",
        "scheduling.topologyKey kubernetes.io/hostname contradicts one member per node: use a label several "
        "nodes share (rack, zone, NVLink domain)",
        lambda o: o.get("topologyKey") != "kubernetes.io/hostname",
        ".topologyKey",
    ),
)

CEL_RULES: tuple[CelRule, ...] = (
    CelRule(
        "tp-divisible",
        ("spec",),
        "self.prefill.parallelism.tensor % self.decode.parallelism.tensor == 0 || "
        "self.decode.parallelism.tensor % self.prefill.parallelism.tensor == 0",
        "prefill and decode parallelism.tensor must divide one another (e.g. 8/4, 4/4, 2/8)",
        lambda o: (
            o["prefill"]["parallelism"]["tensor"] % o["decode"]["parallelism"]["tensor"] == 0
            or o["decode"]["parallelism"]["tensor"] % o["prefill"]["parallelism"]["tensor"] == 0
        ),
        ".decode.parallelism.tensor",
    ),
    CelRule(
        "pp-match",
        ("spec",),
        "self.decode.parallelism.pipeline == self.prefill.parallelism.pipeline || "
        "self.decode.parallelism.pipeline == 1",
        "decode parallelism.pipeline must equal the prefill's or be 1",
        lambda o: o["decode"]["parallelism"]["pipeline"] in (o["prefill"]["parallelism"]["pipeline"], 1),
        ".decode.parallelism.pipeline",
    ),
    CelRule(
        "attn-dp-divides-tp",
        _ROLES,
        "self.tensor % self.data == 0",
        "parallelism.data (attention data parallelism) must divide parallelism.tensor: SGLang splits the "
        "TP ranks into data groups of tensor/data ranks each",
        lambda o: o["tensor"] % o["data"] == 0,
        ".data",
    ),
    CelRule(
        "ep-divides-tp",
        _ROLES,
        "self.tensor % self.expert == 0",
        "parallelism.expert must divide parallelism.tensor: the MoE layers run expert x (tensor/expert) "
        "ranks inside the TP group",
        lambda o: o["tensor"] % o["expert"] == 0,
        ".expert",
    ),
    CelRule(
        "nodes-divide-gpus",
        _ROLES,
        "(self.tensor * self.pipeline) % self.nodesPerReplica == 0",
        "nodesPerReplica must divide tensor x pipeline: every node of a replica holds the same number of GPUs",
        lambda o: (o["tensor"] * o["pipeline"]) % o["nodesPerReplica"] == 0,
        ".nodesPerReplica",
    ),
    CelRule(
        "builtin-no-attention-dp",
        ("spec",),
        "(has(self.engine) && self.engine.kind != 'pdfleet') || "
        "(self.prefill.parallelism.data == 1 && self.decode.parallelism.data == 1)",
        "parallelism.data > 1 needs spec.engine.kind sglang or vllm: the built-in runtime has no attention data "
        "parallelism",
        lambda o: _builtin_ok(o, "data"),
        ".prefill.parallelism.data",
    ),
    CelRule(
        "builtin-no-expert-parallel",
        ("spec",),
        "(has(self.engine) && self.engine.kind != 'pdfleet') || "
        "(self.prefill.parallelism.expert == 1 && self.decode.parallelism.expert == 1)",
        "parallelism.expert > 1 needs spec.engine.kind sglang or vllm: the built-in runtime has no expert parallelism",
        lambda o: _builtin_ok(o, "expert"),
        ".prefill.parallelism.expert",
    ),
    CelRule(
        "rollout-surge-range",
        ("spec.rollout",),
        "type(self.maxSurge) == string || self.maxSurge >= 0",
        "maxSurge must be >= 0 or a percentage",
        lambda o: isinstance(o["maxSurge"], str) or o["maxSurge"] >= 0,
        ".maxSurge",
    ),
    CelRule(
        "rollout-unavailable-range",
        ("spec.rollout",),
        "type(self.maxUnavailable) == string || self.maxUnavailable >= 0",
        "maxUnavailable must be >= 0 or a percentage",
        lambda o: isinstance(o["maxUnavailable"], str) or o["maxUnavailable"] >= 0,
        ".maxUnavailable",
    ),
    CelRule(
        "rollout-progress",
        ("spec.rollout",),
        f"!({_zero_cel('maxSurge')} && {_zero_cel('maxUnavailable')})",
        "maxSurge and maxUnavailable may not both be 0: a rollout could never replace a pod",
        lambda o: not (_is_zero(o["maxSurge"]) and _is_zero(o["maxUnavailable"])),
        ".maxUnavailable",
    ),
    CelRule(
        "rollout-deadline-after-drain",
        ("spec.rollout",),
        "self.progressDeadlineSeconds > self.drainTimeoutSeconds",
        "progressDeadlineSeconds must exceed drainTimeoutSeconds, or one slow drain fails every rollout",
        lambda o: o["progressDeadlineSeconds"] > o["drainTimeoutSeconds"],
        ".progressDeadlineSeconds",
    ),
    CelRule(
        "layout-one-form",
        ("spec.model.layout",),
        "has(self.preset) != has(self.inline)",
        "set exactly one of layout.preset and layout.inline",
        lambda o: ("preset" in o) != ("inline" in o),
    ),
    CelRule(
        "qsa-page-ratio",
        _INLINE,
        "!has(self.qsa) || self.pageSize % self.qsa.compressRatio == 0",
        "pageSize must be a multiple of qsa.compressRatio",
        lambda o: "qsa" not in o or o["pageSize"] % o["qsa"]["compressRatio"] == 0,
        ".pageSize",
    ),
    CelRule(
        "layout-attention-fields",
        _INLINE,
        "self.attentionKind == 'MLA' ? (has(self.mla) && !has(self.headDim) && self.kvHeads == 1 && "
        "!has(self.swa)) : (has(self.headDim) && !has(self.mla))",
        "MHA needs headDim and no mla; MLA needs mla, kvHeads 1, no headDim and no swa",
        _attention_fields,
    ),
    CelRule("layer-ids-range", _INLINE, _LAYER_IDS_CEL, "every layer id must be below numLayers", _ids_below),
    CelRule(
        "layer-set-one-form",
        _LAYER_SETS,
        "has(self.ids) != has(self.interval)",
        "set exactly one of ids and interval",
        lambda o: ("ids" in o) != ("interval" in o),
    ),
    CelRule(
        "layer-set-offset",
        _LAYER_SETS,
        "!has(self.interval) || self.offset < self.interval",
        "offset must be below interval",
        lambda o: "interval" not in o or o["offset"] < o["interval"],
        ".offset",
    ),
    CelRule(
        "engine-fields",
        ("spec.engine",),
        "self.kind == 'pdfleet' || (has(self.version) && has(self.image))",
        "an engine other than pdfleet needs engine.version and engine.image",
        lambda o: o["kind"] == "pdfleet" or ("version" in o and "image" in o),
    ),
    CelRule(
        "engine-model-source",
        ("spec",),
        "!has(self.engine) || self.engine.kind == 'pdfleet' || has(self.model.source)",
        "an engine other than pdfleet needs model.source (path, with its volume, or huggingFace)",
        lambda o: _engine_kind(o) == "pdfleet" or "source" in o["model"],
        ".model",
    ),
    CelRule(
        "builtin-hub-source",
        ("spec",),
        "(has(self.engine) && self.engine.kind != 'pdfleet') || !has(self.model.source) || "
        "!has(self.model.source.huggingFace) || (has(self.model.source.huggingFace.revision) && "
        "has(self.model.source.huggingFace.cache))",
        "the built-in runtime fetches a Hub model at one commit, once per node, into a weights cache: set "
        "model.source.huggingFace.revision (a commit, or a branch or tag the operator resolves once) and "
        "huggingFace.cache (a volume the node's pods share, e.g. {hostPath: {path: /var/lib/pdfleet/weights, "
        "type: DirectoryOrCreate}})",
        lambda o: _engine_kind(o) != "pdfleet" or "huggingFace" not in (o["model"].get("source") or {}) or (
            {"revision", "cache"} <= set(o["model"]["source"]["huggingFace"])),
        ".model.source.huggingFace",
    ),
    CelRule(
        "engine-role-override",
        ("spec",),
        "(has(self.engine) && self.engine.kind != 'pdfleet') || (!has(self.prefill.engine) && "
        "!has(self.decode.engine))",
        "prefill.engine and decode.engine override spec.engine: set spec.engine.kind first",
        _role_override_ok,
    ),
    CelRule(
        "model-source-one-form",
        ("spec.model.source",),
        "has(self.path) != has(self.huggingFace) && (!has(self.volume) || has(self.path))",
        "set exactly one of source.path and source.huggingFace; source.volume goes with path",
        lambda o: ("path" in o) != ("huggingFace" in o) and ("volume" not in o or "path" in o),
    ),
    CelRule(
        "model-digest-builtin",
        ("spec",),
        "!has(self.model.source) || !has(self.model.source.digest) || (has(self.model.source.path) && "
        "(!has(self.engine) || self.engine.kind == 'pdfleet'))",
        "model.source.digest goes with model.source.path and is checked by the built-in runtime at start; SGLang "
        "and vLLM pods do not check it (pin a Hub model with huggingFace.revision instead)",
        lambda o: "digest" not in (o["model"].get("source") or {}) or (
            "path" in o["model"]["source"] and _engine_kind(o) == "pdfleet"),
        ".model.source.digest",
    ),
    CelRule(
        "rdma-device-map",
        ("spec.transfer",),
        "!has(self.rdmaDeviceMap) || (!has(self.rdmaDevices) && self.rdmaDeviceMap.all(k, "
        f"k.matches('^({_GPU_KEY})$') && size(self.rdmaDeviceMap[k]) > 0))",
        "rdmaDeviceMap keys are GPU indexes 0-63 with at least one device each, and it excludes rdmaDevices",
        lambda o: "rdmaDevices" not in o and _device_map_ok(o) if "rdmaDeviceMap" in o else True,
        ".rdmaDeviceMap",
    ),
    CelRule(
        "router-ports-distinct",
        ("spec.router",),
        "self.port != self.metricsPort",
        "router.port and router.metricsPort must differ: both listen in the router pod",
        lambda o: o["port"] != o["metricsPort"],
        ".metricsPort",
    ),
    *_AUTOSCALING_RULES,
    *_SCHEDULING_RULES,
)
