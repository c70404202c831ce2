"""Pure status: pod counts, printer columns and the Progressing/Available conditions, as the typed
status models (``api.models.PDDeploymentStatus``) that also give the CRD its schema.

``Admitted`` and ``Degraded`` come from admission's re-check of the stored spec and are passed
in; this module merges them (``conditions``), keeping ``lastTransitionTime`` when a condition's
status did not change (so watchers see real transitions only). ``status_document`` is the one
place the status becomes the JSON of the merge patch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pdfleet_operator.api.constants import ConditionStatus, ConditionType, Role
from pdfleet_operator.api.models import (
    Condition,
    PDDeploymentSpec,
    PDDeploymentStatus,
    RoleStatus,
    shapes_text,
)
from pdfleet_operator.conditions import condition, merge_conditions, with_degraded
from pdfleet_operator.generations import mixed
from pdfleet_operator.groups import units
from pdfleet_operator.observed import ObservedPod, RouterState
from pdfleet_operator.placement import PlacementProblem
from pdfleet_operator.plan import budgets
from pdfleet_operator.resources.names import role_selector
from pdfleet_operator.resources.pods import role_spec
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.router import endpoint_url
from pdfleet_operator.rollout_state import RoleDecision, rollout_status
from pdfleet_runtime.readiness_problems import GATE_FAILURES, PATH_BROKEN

__all__ = [
    "BROKEN_AFTER_S",
    "GENERATIONS_MIXED",
    "SILENT_FALLBACK",
    "TRANSFER_PATH_BROKEN",
    "RoleCounts",
    "broken_paths",
    "broken_wake",
    "compute_status",
    "merge_conditions",
    "pass_status",
    "role_counts",
    "spec_unreadable_status",
    "status_document",
    "with_degraded",
    "with_mixed_generations",
    "with_placement",
    "with_silent_fallbacks",
    "with_transfer_health",
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


def with_placement(admission: Sequence[Condition], problems: Sequence[PlacementProblem],
                   generation: int) -> list[Condition]:
    """Fold placement problems into ``Degraded``: a matrix rejection keeps its reason and gains the
    placement text; otherwise the first problem's kind is the reason."""
    if not problems:
        return list(admission)
    text = "; ".join(f"{p.role.value}: {p.message}" for p in problems)
    return with_degraded(admission, problems[0].problem.value, text, generation)


BROKEN_AFTER_S = 30.0
"""A pod's gate closed for an unreachable peer or held pools counts as a broken path once the pod has run this long
(a peer still starting is unreachable too); the other ``PATH_BROKEN`` reasons count at once."""
TRANSFER_PATH_BROKEN = "TransferPathBroken"
SILENT_FALLBACK = "SilentFallback"
GENERATIONS_MIXED = "GenerationsMixed"


def _counts_from(p: ObservedPod) -> float | None:
    """When ``p``'s closed gate counts as a broken path (epoch seconds; 0: at once), or None: it never does (an open
    or "not yet" gate, a pod draining or deleted, or one whose running start is unknown)."""
    if p.deleting or p.drain_started is not None or p.gate != "False" or p.gate_problem not in PATH_BROKEN:
        return None
    if p.gate_problem in GATE_FAILURES:
        return 0.0
    return None if p.running_since is None else p.running_since + BROKEN_AFTER_S


def broken_paths(pods: Iterable[ObservedPod], now: float) -> list[ObservedPod]:
    """Pods whose transfer-path gate names a broken path now (``PATH_BROKEN``), draining and deleted pods aside."""
    out = [p for p in pods if (at := _counts_from(p)) is not None and at <= now]
    return sorted(out, key=lambda p: (p.role.value, p.name))


def broken_wake(pods: Iterable[ObservedPod], now: float) -> float | None:
    """Seconds until a pod's closed gate starts to count as broken (no event brings that); None: none due."""
    due = [at - now for p in pods if (at := _counts_from(p)) is not None and at > now]
    return min(due) + 0.05 if due else None


def with_transfer_health(conditions: Sequence[Condition], pods: Iterable[ObservedPod], now: float,
                         generation: int) -> list[Condition]:
    """Fold pods whose transfer path is broken into ``Degraded`` (reason ``TransferPathBroken`` unless an earlier
    reason holds it), each named with its role and its gate's reason and message: routers pair pods, so a pod is
    what leaves them, and the deployment says which and why (``kubectl get pdd``; an event on the transition)."""
    broken = broken_paths(pods, now)
    if not broken:
        return list(conditions)
    text = "; ".join(f"{p.role.value} pod {p.name}: {p.gate_message or p.gate_problem}" for p in broken)
    return with_degraded(conditions, TRANSFER_PATH_BROKEN, f"transfer path broken: {text}", generation)


def with_silent_fallbacks(conditions: Sequence[Condition], pods: Iterable[ObservedPod],
                          generation: int) -> list[Condition]:
    """Fold pods whose ``pdfleet.io/silent-fallback`` condition is True into ``Degraded`` (reason ``SilentFallback``
    unless an earlier reason holds it), each named with its role and the pod's counts: every answer still comes,
    so nothing else would say that PD stopped happening (a decode recomputing prompts, state never claimed)."""
    hit = sorted((p for p in pods if p.fallback and not p.deleting), key=lambda p: (p.role.value, p.name))
    if not hit:
        return list(conditions)
    text = "; ".join(f"{p.role.value} pod {p.name}: {p.fallback}" for p in hit)
    return with_degraded(conditions, SILENT_FALLBACK, f"silent fallback: {text}", generation)


def with_mixed_generations(conditions: Sequence[Condition], pods: Iterable[ObservedPod], router: RouterState | None,
                           generation: int) -> list[Condition]:
    """``Degraded`` (``GenerationsMixed``) while the router can pair pods of two generations: the routable, ready
    pods its selectors select (those of its generation, or every one when they carry none) hold more than one
    compatibility key in a role. The engines refuse such pairs, or worse, accept them."""
    said = mixed(pods, router)
    if not said:
        return list(conditions)
    return with_degraded(conditions, GENERATIONS_MIXED, f"generations mixed: the router pairs {said}", generation)


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


def _progress(counts: Mapping[Role, RoleCounts], gated: Sequence[str]) -> tuple[bool, str, str]:
    moving = [
        f"{role.value}: {c.updated_ready}/{c.desired} updated and ready, {c.replicas} pods"
        for role, c in counts.items()
        if c.updated_ready != c.desired or c.replicas != c.desired
    ]
    if moving and gated:
        return True, "GangNotAdmitted", "; ".join(moving) + f"; Kueue has not admitted {', '.join(gated)}: " \
            "their pods carry its scheduling gate and hold no GPU until the whole group is admitted"
    if moving:
        return True, "Reconciling", "; ".join(moving)
    return False, "Complete", "every pod is on the current revision and ready"


def compute_status(
    spec: PDDeploymentSpec,
    name: str,
    generation: int,
    pods: Sequence[ObservedPod],
    old_status: PDDeploymentStatus | None,
    admission_conditions: Iterable[Condition],
    now: datetime,
    namespace: str | None = None,
) -> PDDeploymentStatus:
    """The whole status but the rollout; ``endpoint`` (the router Service's URL) needs the namespace."""
    counts = {role: role_counts(spec, role, pods) for role in Role}
    available, a_reason, a_msg = _availability(spec, counts)
    gated = [u.name for u in units(pods) if u.gates and not u.deleting]
    progressing, p_reason, p_msg = _progress(counts, gated)
    conditions = merge_conditions(
        (old_status.conditions if old_status is not None else None) or [],
        [
            *admission_conditions,
            condition(ConditionType.AVAILABLE, available, a_reason, a_msg, generation),
            condition(ConditionType.PROGRESSING, progressing, p_reason, p_msg, generation),
        ],
        now,
    )

    def role_status(role: Role) -> RoleStatus:
        c = counts[role]
        selector = ",".join(f"{k}={v}" for k, v in role_selector(name, role).items())
        return RoleStatus(replicas=c.replicas, ready=c.ready, updated=c.updated, selector=selector)

    endpoint: dict[str, str | None] = {}
    if spec.router is not None and namespace is not None:
        endpoint["endpoint"] = endpoint_url(name, namespace, spec.router)
    elif old_status is not None and old_status.endpoint:
        endpoint["endpoint"] = None  # spec.router removed: the merge patch's null clears the column
    return PDDeploymentStatus(
        observed_generation=generation,
        conditions=conditions,
        prefill=role_status(Role.PREFILL),
        decode=role_status(Role.DECODE),
        prefill_ready=f"{counts[Role.PREFILL].ready}/{counts[Role.PREFILL].desired}",
        decode_ready=f"{counts[Role.DECODE].ready}/{counts[Role.DECODE].desired}",
        shapes=shapes_text(spec),
        **endpoint,
    )


def pass_status(
    spec: PDDeploymentSpec,
    name: str,
    generation: int,
    pods: Sequence[ObservedPod],
    old_status: PDDeploymentStatus | None,
    admission_conditions: Iterable[Condition],
    decisions: Mapping[Role, RoleDecision],
    holds: Sequence[str],
    now: datetime,
    namespace: str | None = None,
    matrix_version: str | None = None,
) -> PDDeploymentStatus:
    """The status one reconcile pass writes: counts and conditions, the rollout (``holds`` first in its
    message), and the matrix version admission judged the spec with (when it names one)."""
    status = compute_status(spec, name, generation, pods, old_status, admission_conditions, now, namespace=namespace)
    rollout = rollout_status(spec, decisions)
    if holds:
        rollout = rollout.model_copy(update={"message": "; ".join([*holds, rollout.message or ""])})
    update: dict[str, Any] = {"rollout": rollout}
    if matrix_version:
        update["matrix_version"] = matrix_version
    return status.model_copy(update=update)


def spec_unreadable_status(admission_conditions: Sequence[Condition], message: str,
                           generation: int) -> PDDeploymentStatus:
    """The status of a pass whose stored spec does not parse: the admission conditions and ``Degraded``."""
    unreadable = Condition(type=ConditionType.DEGRADED, status=ConditionStatus.TRUE, reason="SpecUnreadable",
                           message=message, observed_generation=generation)
    return PDDeploymentStatus(conditions=[*admission_conditions, unreadable])


def status_document(status: PDDeploymentStatus) -> dict[str, Any]:
    """The status as the merge patch sends it: every field the pass set (a None clears the field on the
    server, as a merge patch's null does); conditions without their unset parts."""
    doc = status.model_dump(by_alias=True, mode="json", exclude_unset=True)
    if status.conditions is not None:
        doc["conditions"] = [c.model_dump(by_alias=True, mode="json", exclude_none=True) for c in status.conditions]
    return doc
