"""The pure reconcile planner: (spec, observed snapshot) -> the actions of one pass.

Reads nothing and writes nothing: ``observe`` builds the ``Snapshot``, ``apply`` performs the
``Action`` list. Every child except pods is server-side applied on every pass (a no-op on the
server when unchanged), which is what makes an edited or deleted child come back within one
reconcile. Pods are created once under deterministic names and replaced, never patched.

Pod replacement here is the simple surge rule of a Deployment (create new-revision pods within
``replicas + maxSurge``, remove old ones while ready pods stay at or above ``replicas -
maxUnavailable``); drains and the rollout step planner refine it (rollout issues).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from pdfleet_operator.api.constants import API_VERSION, KIND, Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.names import secret_name
from pdfleet_operator.resources.pods import role_spec, runtime_pod
from pdfleet_operator.resources.policy import network_policy, pod_disruption_budget
from pdfleet_operator.resources.rbac import runtime_role, runtime_role_binding, runtime_service_account
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.runtime_config import runtime_configmap
from pdfleet_operator.resources.secret import auth_secret
from pdfleet_operator.resources.services import headless_service

__all__ = [
    "Action",
    "ActionKind",
    "ObservedPod",
    "Owner",
    "Snapshot",
    "budgets",
    "desired_children",
    "plan",
]


class ActionKind(StrEnum):
    APPLY = "apply"  # server-side apply (create or restore drifted fields)
    CREATE = "create"  # create only if missing (pods, the auth secret)
    PATCH_LABELS = "patch-labels"  # restore a pod's identity labels
    DELETE = "delete"


@dataclass(frozen=True)
class Owner:
    """The PDDeployment that owns the children."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class ObservedPod:
    name: str
    role: Role
    revision: str
    index: int
    ready: bool
    deleting: bool = False
    labels_ok: bool = True  # False when a user edited the identity labels away


@dataclass(frozen=True)
class Snapshot:
    """What observe saw: owned pods and whether the auth secret exists."""

    pods: tuple[ObservedPod, ...] = ()
    secret_exists: bool = False


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    api_version: str
    object_kind: str
    name: str
    body: dict | None = field(default=None, compare=False)
    reason: str = ""


def _owned(obj: dict, owner: Owner) -> dict:
    obj["metadata"]["ownerReferences"] = [owner.reference()]
    return obj


def desired_children(owner: Owner, spec: PDDeploymentSpec) -> list[dict]:
    """Every non-pod child, owned and complete (they are server-side applied each pass)."""
    n, ns = owner.name, owner.namespace
    objs = [runtime_service_account(n, ns), runtime_role(n, ns), runtime_role_binding(n, ns)]
    max_ranks = 1
    for role in Role:
        rs = role_spec(spec, role)
        ranks = rs.parallelism.tensor * rs.parallelism.pipeline
        max_ranks = max(max_ranks, ranks)
        objs.append(runtime_configmap(n, ns, spec, role))
        objs.append(headless_service(n, ns, role, ranks))
        objs.append(pod_disruption_budget(n, ns, role, budgets(spec, rs.replicas)[1]))
    objs.append(network_policy(n, ns, max_ranks))
    return [_owned(o, owner) for o in objs]


def _resolve(value: int | str, replicas: int, round_up: bool) -> int:
    if isinstance(value, int):
        return value
    pct = int(value.rstrip("%"))
    exact = pct * replicas / 100
    return math.ceil(exact) if round_up else math.floor(exact)


def budgets(spec: PDDeploymentSpec, replicas: int) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) in pods, rounded as a Deployment does; both 0 -> unavailable 1."""
    surge = _resolve(spec.rollout.max_surge, replicas, round_up=True)
    unavailable = _resolve(spec.rollout.max_unavailable, replicas, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def _removal_order(pods: Iterable[ObservedPod]) -> list[ObservedPod]:
    """Not-ready pods first, then the highest index: the cheapest pods to lose."""
    return sorted(pods, key=lambda p: (p.ready, -p.index, p.name))


def _role_pod_actions(owner: Owner, spec: PDDeploymentSpec, role: Role, pods: list[ObservedPod]) -> list[Action]:
    replicas = role_spec(spec, role).replicas
    revision = role_revision(spec, role)
    surge, unavailable = budgets(spec, replicas)
    live = [p for p in pods if not p.deleting]
    current = [p for p in live if p.revision == revision]
    old = [p for p in live if p.revision != revision]
    actions: list[Action] = []

    def delete(p: ObservedPod, why: str) -> None:
        actions.append(Action(ActionKind.DELETE, "v1", "Pod", p.name, reason=why))

    for p in live:
        if not p.labels_ok:
            body = runtime_pod(owner.name, owner.namespace, spec, role, p.revision, p.index)["metadata"]["labels"]
            actions.append(Action(ActionKind.PATCH_LABELS, "v1", "Pod", p.name, body=body, reason="labels edited"))

    surplus = len(current) - replicas
    for p in _removal_order(current)[: max(0, surplus)]:
        delete(p, f"scale down {role.value} to {replicas}")

    missing = replicas - len(current)
    room = replicas + surge - len(pods)  # terminating pods still hold GPUs
    if missing > 0 and room > 0:
        used = {p.index for p in pods}
        free = (i for i in range(len(pods) + replicas + 1) if i not in used)
        for _ in range(min(missing, room)):
            idx = next(free)
            body = _owned(runtime_pod(owner.name, owner.namespace, spec, role, revision, idx), owner)
            actions.append(Action(ActionKind.CREATE, "v1", "Pod", body["metadata"]["name"], body=body,
                                  reason=f"{role.value} replica {idx} of revision {revision}"))

    ready = sum(p.ready for p in current) + sum(p.ready for p in old)
    removable_ready = ready - (replicas - unavailable)
    for p in _removal_order(old):
        if not p.ready:
            delete(p, f"outdated revision {p.revision} (not ready)")
        elif removable_ready > 0:
            removable_ready -= 1
            delete(p, f"outdated revision {p.revision}")
    return actions


def plan(owner: Owner, spec: PDDeploymentSpec, snapshot: Snapshot) -> list[Action]:
    """All actions of one reconcile pass, children first, then the secret, then pods."""
    actions = [
        Action(ActionKind.APPLY, o["apiVersion"], o["kind"], o["metadata"]["name"], body=o)
        for o in desired_children(owner, spec)
    ]
    if not snapshot.secret_exists:
        body = _owned(auth_secret(owner.name, owner.namespace), owner)
        actions.append(Action(ActionKind.CREATE, "v1", "Secret", secret_name(owner.name), body=body,
                              reason="per-deployment transfer authentication key"))
    for role in Role:
        actions += _role_pod_actions(owner, spec, role, [p for p in snapshot.pods if p.role is role])
    return actions
