"""Pure status: pod counts, printer columns and the Progressing/Available conditions.

``Admitted`` and ``Degraded`` come from admission's re-check of the stored spec and are passed
in; this module merges them, keeping ``lastTransitionTime`` when a condition's status did not
change (so watchers see real transitions only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from pdfleet_operator.api.constants import ConditionStatus, ConditionType, Role
from pdfleet_operator.api.models import PDDeploymentSpec, shapes_text
from pdfleet_operator.groups import units
from pdfleet_operator.placement import PlacementProblem
from pdfleet_operator.plan import ObservedPod, budgets
from pdfleet_operator.resources.names import role_selector
from pdfleet_operator.resources.pods import role_spec
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.router import endpoint_url
from pdfleet_operator.rollout_state import RoleDecision, rollout_status

__all__ = [
    "RoleCounts",
    "compute_status",
    "merge_conditions",
    "pass_status",
    "role_counts",
    "spec_unreadable_status",
    "with_degraded",
    "with_placement",
]


@dataclass(frozen=True)
class RoleCounts:
    desired: int
    replicas: int  # live replicas (pods, or groups of pods), all revisions
    ready: int
    updated: int  # live replicas on the current revision
    updated_ready: int


def role_counts(spec: PDDeploymentSpec, role: Role, pods: Iterable[ObservedPod]) -> RoleCounts:
    """Replicas, not pods: a group spanning nodes counts once, ready only when every member is."""
    revision = role_revision(spec, role)
    live = [p for p in units(p for p in pods if p.role is role) if not p.deleting]
    return RoleCounts(
        desired=role_spec(spec, role).replicas,
        replicas=len(live),
        ready=sum(p.ready for p in live),
        updated=sum(p.revision == revision for p in live),
        updated_ready=sum(p.ready and p.revision == revision for p in live),
    )


def _condition(kind: ConditionType, ok: bool, reason: str, message: str, generation: int) -> dict:
    return {
        "type": kind.value,
        "status": ConditionStatus.TRUE.value if ok else ConditionStatus.FALSE.value,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def merge_conditions(old: Sequence[Mapping] | None, new: Iterable[dict], now: datetime) -> list[dict]:
    """New conditions replace old ones of the same type; unchanged statuses keep their time."""
    previous = {c.get("type"): c for c in old or ()}
    merged = {t: dict(c) for t, c in previous.items() if t}
    for cond in new:
        before = previous.get(cond["type"])
        stamp = before.get("lastTransitionTime") if before and before.get("status") == cond["status"] else None
        merged[cond["type"]] = {**cond, "lastTransitionTime": stamp or now.isoformat().replace("+00:00", "Z")}
    order = [t.value for t in ConditionType]
    return sorted(merged.values(), key=lambda c: order.index(c["type"]) if c["type"] in order else len(order))


def with_placement(admission: Sequence[dict], problems: Sequence[PlacementProblem], generation: int) -> list[dict]:
    """Fold placement problems into ``Degraded``: a matrix rejection keeps its reason and gains the
    placement text; otherwise the first problem's kind is the reason."""
    if not problems:
        return list(admission)
    text = "; ".join(f"{p.role.value}: {p.message}" for p in problems)
    return with_degraded(admission, problems[0].problem.value, text, generation)


def with_degraded(admission: Sequence[dict], reason: str, message: str, generation: int) -> list[dict]:
    """``Degraded`` True with ``reason``; an earlier Degraded reason is kept and gains the message."""
    out, found = [], False
    for cond in admission:
        if cond.get("type") == ConditionType.DEGRADED.value:
            found = True
            if cond.get("status") == ConditionStatus.TRUE.value:
                cond = {**cond, "message": f"{cond.get('message', '')}\n{message}"}
            else:
                cond = {**cond, "status": ConditionStatus.TRUE.value, "reason": reason, "message": message}
        out.append(cond)
    if not found:
        out.append(_condition(ConditionType.DEGRADED, True, reason, message, generation))
    return out


def _availability(spec: PDDeploymentSpec, counts: Mapping[Role, RoleCounts]) -> tuple[bool, str, str]:
    short = []
    for role, c in counts.items():
        _, unavailable = budgets(spec, c.desired)
        need = max(1, c.desired - unavailable) if c.desired > 0 else 0
        if c.ready < need:
            short.append(f"{role.value} {c.ready}/{c.desired} ready (need {need})")
    if short:
        return False, "TransferPathNotReady", "; ".join(short) + ": pods are ready only after a verified " \
            "handshake and canary transfer with a compatible peer"
    return True, "MinimumReplicasReady", "enough pods of both roles passed the transfer-path gate"


def _progress(counts: Mapping[Role, RoleCounts]) -> tuple[bool, str, str]:
    moving = [
        f"{role.value}: {c.updated_ready}/{c.desired} updated and ready, {c.replicas} pods"
        for role, c in counts.items()
        if c.updated_ready != c.desired or c.replicas != c.desired
    ]
    if moving:
        return True, "Reconciling", "; ".join(moving)
    return False, "Complete", "every pod is on the current revision and ready"


def compute_status(
    spec: PDDeploymentSpec,
    name: str,
    generation: int,
    pods: Sequence[ObservedPod],
    old_status: Mapping | None,
    admission_conditions: Iterable[dict],
    now: datetime,
    namespace: str | None = None,
) -> dict:
    """The whole status; ``endpoint`` (the router Service's URL) needs the namespace."""
    counts = {role: role_counts(spec, role, pods) for role in Role}
    available, a_reason, a_msg = _availability(spec, counts)
    progressing, p_reason, p_msg = _progress(counts)
    conditions = merge_conditions(
        (old_status or {}).get("conditions"),
        [
            *admission_conditions,
            _condition(ConditionType.AVAILABLE, available, a_reason, a_msg, generation),
            _condition(ConditionType.PROGRESSING, progressing, p_reason, p_msg, generation),
        ],
        now,
    )

    def role_status(role: Role) -> dict:
        c = counts[role]
        selector = ",".join(f"{k}={v}" for k, v in role_selector(name, role).items())
        return {"replicas": c.replicas, "ready": c.ready, "updated": c.updated, "selector": selector}

    out = {
        "observedGeneration": generation,
        "conditions": conditions,
        "prefill": role_status(Role.PREFILL),
        "decode": role_status(Role.DECODE),
        "prefillReady": f"{counts[Role.PREFILL].ready}/{counts[Role.PREFILL].desired}",
        "decodeReady": f"{counts[Role.DECODE].ready}/{counts[Role.DECODE].desired}",
        "shapes": shapes_text(spec),
    }
    if spec.router is not None and namespace is not None:
        out["endpoint"] = endpoint_url(name, namespace, spec.router)
    elif (old_status or {}).get("endpoint"):
        out["endpoint"] = None  # spec.router removed: a merge patch clears the column
    return out


def pass_status(
    spec: PDDeploymentSpec,
    name: str,
    generation: int,
    pods: Sequence[ObservedPod],
    old_status: Mapping | None,
    admission_conditions: Iterable[dict],
    decisions: Mapping[Role, RoleDecision],
    holds: Sequence[str],
    now: datetime,
    namespace: str | None = None,
    extra: Mapping | None = None,
) -> dict:
    """The status one reconcile pass writes: counts and conditions, the rollout (``holds`` first in its
    message), and the admission's extra fields (``matrixVersion``)."""
    status = compute_status(spec, name, generation, pods, old_status, admission_conditions, now, namespace=namespace)
    status["rollout"] = rollout_status(spec, decisions)
    if holds:
        status["rollout"]["message"] = "; ".join([*holds, status["rollout"]["message"]])
    return {**status, **(extra or {})}


def spec_unreadable_status(admission_conditions: Sequence[dict], message: str, generation: int) -> dict:
    """The status of a pass whose stored spec does not parse: the admission conditions and ``Degraded``."""
    return {"conditions": [*admission_conditions, {"type": ConditionType.DEGRADED.value, "status": "True",
                                                   "reason": "SpecUnreadable", "message": message,
                                                   "observedGeneration": generation}]}
