"""The pure reconcile planner: (spec, observed snapshot) -> the actions of one pass.

Reads nothing and writes nothing: ``observe`` builds the ``Snapshot``, ``apply`` performs the
``Action`` list. Every child except pods is server-side applied on every pass (a no-op on the
server when unchanged), which is what makes an edited or deleted child come back within one
reconcile. Pods are created once under deterministic names and replaced, never patched.

Pod replacement here is the simple surge rule of a Deployment (create new-revision pods within
``replicas + maxSurge``, remove old ones while ready pods stay at or above ``replicas -
maxUnavailable``); drains and the rollout step planner refine it (rollout issues).

A replica spanning nodes is a group of pods planned as one unit (``groups``): created together,
drained through its leader, deleted together, restarted as a unit when it breaks; the budgets
count groups. A single-node replica is a group of one, planned exactly as a pod.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.scheduling import KUEUE_WORKLOAD_API_VERSION
from pdfleet_operator.generations import kept, serving
from pdfleet_operator.groups import groups_of, units
from pdfleet_operator.observed import Generation, ObservedPod, Owner, Snapshot
from pdfleet_operator.resources.compat import compat_key
from pdfleet_operator.resources.engine import group_service
from pdfleet_operator.resources.names import (
    ANNOTATION_DRAIN,
    ANNOTATION_DRAIN_CANCELLED,
    LABEL_GROUP,
    LABEL_ROUTABLE,
    group_pod_name,
    group_secret_name,
    owner_labels,
    role_selector,
    router_secret_name,
    secret_name,
    worker_secret_name,
)
from pdfleet_operator.resources.plugins.registry import engine_plugin, router_plugin
from pdfleet_operator.resources.pods import role_spec, runtime_pod
from pdfleet_operator.resources.policy import group_network_policy, network_policy, pod_disruption_budget
from pdfleet_operator.resources.rbac import runtime_role, runtime_role_binding, runtime_service_account
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.revisions import controller_revision
from pdfleet_operator.resources.router import router_children, scrape_port, worker_port
from pdfleet_operator.resources.runtime_config import runtime_configmap
from pdfleet_operator.resources.secret import auth_secret, group_secret, missing_key_in_use, worker_secret
from pdfleet_operator.resources.services import headless_service
from pdfleet_operator.rollout import PodView, StepKind, plan_steps
from pdfleet_runtime.readiness_problems import GATE_FAILURES

# ObservedPod, Owner and Snapshot live in ``observed`` (the planners' inputs); re-exported for callers of plan.
__all__ = [
    "DRAIN_CANCEL_SETTLE_S",
    "Action",
    "ActionKind",
    "ObservedPod",
    "Owner",
    "Snapshot",
    "budgets",
    "desired_children",
    "drain_metadata",
    "group_pods_running",
    "grouped_roles",
    "plan",
    "spec_targets",
]


DRAIN_CANCEL_SETTLE_S = 5.0
"""How long a pod whose drain was cancelled does not count as ready capacity. Its runtime follows the
drain annotation on its own clock (it polls it): it may still be going not ready for the drain it saw
while its Ready condition shows the state before, so a pass counting it would start another drain
below the floor. Within this time the runtime has seen the drain and the cancel, and Ready says so."""


class ActionKind(StrEnum):
    APPLY = "apply"  # server-side apply (create or restore drifted fields)
    CREATE = "create"  # create only if missing (pods, the auth secret)
    PATCH_LABELS = "patch-labels"  # restore a pod's identity labels
    PATCH_META = "patch-meta"  # merge-patch a pod's metadata (drain start and cancel)
    HOLD = "hold"  # write nothing: the role waits, and status says why
    DELETE = "delete"


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


Targets = Mapping[Role, tuple[str, PDDeploymentSpec]]


def grouped_roles(spec: PDDeploymentSpec, snapshot: Snapshot | None = None) -> set[Role]:
    """Roles whose replicas span nodes in the spec, or that still run pods of such groups (a rollout)."""
    out = {role for role in Role if role_spec(spec, role).parallelism.nodes_per_replica > 1}
    return out | {p.role for p in (snapshot.pods if snapshot else ()) if p.group_size > 1 and not p.deleting}


def spec_targets(spec: PDDeploymentSpec) -> dict[Role, tuple[str, PDDeploymentSpec]]:
    """Each role rolling towards the spec's own revision (no rollback in progress)."""
    return {role: (role_revision(spec, role), spec) for role in Role}


def desired_children(owner: Owner, spec: PDDeploymentSpec, snapshot: Snapshot | None = None,
                     targets: Targets | None = None, pod_names: Iterable[str] = (),
                     generation: Generation | None = None) -> list[dict]:
    """Every non-pod child, owned and complete (they are server-side applied each pass).

    Runtime ConfigMaps exist for each role's target revision and for every revision that still
    has pods (from its stored spec), so no pod loses its config during a rollout or a rollback.
    The runtime's Role names ``pod_names`` (the pods that exist and those this pass creates). The router's
    selectors carry ``generation`` (``generations.serving``; None: the target's, or none when pairing by
    generation is off)."""
    n, ns = owner.name, owner.namespace
    targets = targets or spec_targets(spec)
    objs = [runtime_service_account(n, ns), runtime_role(n, ns, pod_names), runtime_role_binding(n, ns)]
    grouped = grouped_roles(spec, snapshot)
    for role in Role:
        rs = role_spec(spec, role)
        ranks = rs.parallelism.tensor * rs.parallelism.pipeline // rs.parallelism.nodes_per_replica
        configs = {targets[role][0]: targets[role][1]}
        for pod in snapshot.pods if snapshot else ():
            stored = snapshot.revisions.get((role, pod.revision)) if snapshot else None
            if pod.role is role and stored is not None:
                configs.setdefault(pod.revision, stored)
        for revision, rev_spec in sorted(configs.items()):
            objs.append(_runtime_configmap(n, ns, rev_spec, role, revision))
        objs.append(headless_service(n, ns, role, ranks, leaders_only=role in grouped))
        objs.append(pod_disruption_budget(n, ns, role, budgets(spec, rs.replicas)[1]))
        if role in grouped:
            objs += _group_children(n, ns, spec, role)
    objs.append(network_policy(n, ns, worker_port(spec), groups=bool(grouped), scrape_port=scrape_port(spec)))
    objs += router_children(n, ns, spec, generation)
    return [_owned(o, owner) for o in objs]


def _group_children(name: str, namespace: str, spec: PDDeploymentSpec, role: Role) -> list[dict]:
    """A grouped role's headless group Service (members reach their leader before any is Ready) and the
    NetworkPolicy opening the group port between its pods."""
    port = engine_plugin(spec).group_port  # the engine kind's rendezvous port
    svc = group_service(name, namespace, role, role_selector(name, role), (port.name, port.port))
    svc["metadata"]["labels"] = owner_labels(name)
    return [svc, group_network_policy(name, namespace, role)]


_CONFIGMAPS: dict[tuple[str, str, str, str, str], dict] = {}
_CONFIGMAPS_MAX = 512


def _runtime_configmap(name: str, namespace: str, spec: PDDeploymentSpec, role: Role, revision: str) -> dict:
    """``runtime_configmap``, remembered by its inputs: its YAML rendering is most of a pass's CPU, and
    the same revision renders the same map on every pass. A copy down to the metadata, which callers own."""
    key = (name, namespace, role.value, revision, spec.model_dump_json())
    if key not in _CONFIGMAPS:
        if len(_CONFIGMAPS) >= _CONFIGMAPS_MAX:
            _CONFIGMAPS.clear()
        _CONFIGMAPS[key] = runtime_configmap(name, namespace, spec, role, revision)
    obj = _CONFIGMAPS[key]
    return {**obj, "metadata": {**obj["metadata"]}}


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


def drain_metadata(now: float, *, cancel: bool = False) -> dict:
    """Pod metadata of a drain started (or with ``cancel``, cancelled) at ``now``, as a merge patch."""
    if cancel:
        return {"labels": {LABEL_ROUTABLE: "true"},
                "annotations": {ANNOTATION_DRAIN: None, ANNOTATION_DRAIN_CANCELLED: f"{now:.3f}"}}
    return {"labels": {LABEL_ROUTABLE: "false"},
            "annotations": {ANNOTATION_DRAIN: f"{now:.3f}", ANNOTATION_DRAIN_CANCELLED: None}}


def _settling(p: ObservedPod, now: float) -> bool:
    """Its drain was cancelled moments ago: not ready capacity yet (``DRAIN_CANCEL_SETTLE_S``)."""
    return p.drain_cancelled is not None and now - p.drain_cancelled < DRAIN_CANCEL_SETTLE_S


def _role_pod_actions(
    owner: Owner, spec: PDDeploymentSpec, role: Role, pods: list[ObservedPod], now: float,
    target: tuple[str, PDDeploymentSpec], peers: list[ObservedPod], keep: frozenset[str] = frozenset(),
) -> list[Action]:
    """Budgets, replicas, drains and pause come from the user's spec; the pods built come from the
    target revision's spec (the spec itself, or the stable revision's while rolling back). The step
    planner sees each replica group as one unit; its steps act on every member (``groups``)."""
    rs = role_spec(spec, role)
    revision, target_spec = target
    surge, unavailable = budgets(spec, rs.replicas)
    rolling_forward = revision == role_revision(spec, role)
    actions: list[Action] = []
    for p in pods:
        if not p.labels_ok and not p.deleting:
            labels = runtime_pod(owner.name, owner.namespace, target_spec, role, p.revision, p.index,
                                 p.member)["metadata"]["labels"]
            if p.group_size > 1:
                labels[LABEL_GROUP] = group_pod_name(owner.name, role, p.revision, p.index, 0)
            if p.drain_started is not None:
                labels[LABEL_ROUTABLE] = "false"
            actions.append(Action(ActionKind.PATCH_LABELS, "v1", "Pod", p.name, body=labels, reason="labels edited"))
    groups = {g.unit.name: g for g in groups_of(pods)}
    for g in groups.values():
        if g.broken:  # a half group holds GPUs and serves nothing: restart it as a unit
            actions += [Action(ActionKind.DELETE, "v1", "Pod", m.name, reason=f"group restart: {g.broken}")
                        for m in g.live]
            actions += _end_gang(g.unit)
    views = [PodView(u.name, u.revision, u.index, u.ready and not _settling(u, now), u.deleting, u.drain_started,
                     u.drained, u.scheduled) for u in (g.unit for g in groups.values())]
    hold = _compat_hold(role, target_spec, units(pods), units(peers))
    if hold:
        return [*actions, Action(ActionKind.HOLD, "v1", "Pod", "", reason=hold)]
    steps = plan_steps(views, replicas=rs.replicas, revision=revision, surge=surge, unavailable=unavailable,
                       drain_timeout=spec.rollout.drain_timeout_seconds, now=now, paused=spec.rollout.paused,
                       canary=spec.rollout.canary_replicas if rolling_forward else None, keep=keep)
    if keep:
        actions.append(Action(ActionKind.HOLD, "v1", "Pod", "", reason=(
            f"{role.value} keeps {', '.join(sorted(keep))} serving its generation until the router has switched to "
            "the new one and rolled out (a ready prefill and decode of the new generation first)")))
    nodes = role_spec(target_spec, role).parallelism.nodes_per_replica
    for s in steps:
        if s.kind is StepKind.CREATE:
            assert s.index is not None
            for member in range(nodes):  # a group's pods are created together, in one pass
                body = _owned(runtime_pod(owner.name, owner.namespace, target_spec, role, revision, s.index, member),
                              owner)
                actions.append(Action(ActionKind.CREATE, "v1", "Pod", body["metadata"]["name"], body=body,
                                      reason=f"{role.value} {s.reason}" + (f", member {member} of {nodes}"
                                                                           if nodes > 1 else "")))
        elif s.kind is StepKind.START_DRAIN:
            actions.append(Action(ActionKind.PATCH_META, "v1", "Pod", s.pod or "", body=drain_metadata(now),
                                  reason=f"drain started ({s.reason}): unroutable, finishing in-flight transfers"))
        elif s.kind is StepKind.CANCEL_DRAIN:
            actions.append(Action(ActionKind.PATCH_META, "v1", "Pod", s.pod or "",
                                  body=drain_metadata(now, cancel=True),
                                  reason=f"drain cancelled ({s.reason}): routable again"))
        else:
            g = groups[s.pod or ""]
            why = "FORCED after the drain deadline" if s.forced else "drained"
            # The leader's drain covers the group's ranks: the group goes as a unit, leader last.
            actions += [Action(ActionKind.DELETE, "v1", "Pod", m.name, reason=why if len(g.members) == 1
                               else f"{why}: group of {g.unit.name}")
                        for m in sorted(g.live, key=lambda m: -m.member)]
            actions += _end_gang(g.unit)
    return actions


def _end_gang(unit: ObservedPod) -> list[Action]:
    """A Kueue gang deleted as a unit ends with its Workload: Kueue keeps a finalizer on every pod of a serving
    group until the group's Workload goes, so the deleted pods would stay Terminating (holding surge room)."""
    if not unit.gang:
        return []
    return [Action(ActionKind.DELETE, KUEUE_WORKLOAD_API_VERSION, "Workload", unit.gang,
                   reason="the gang's Kueue Workload: releases its quota and its pods' finalizers")]


def _compat_hold(role: Role, target_spec: PDDeploymentSpec, pods: list[ObservedPod],
                 peers: list[ObservedPod]) -> str | None:
    """A decode rollout to a key no running prefill shares holds (its pods could pair with nobody).

    Running, not ready: a prefill pod is ready only once a decode pod of its key canaried it (the handshake
    refuses a peer of another layout or model), so waiting for a ready one would wait for ever. The prefill must
    have reported its gate (its runtime runs) without a failure (``GATE_FAILURES``: it cannot move state). Only during a rollout (old decode
    pods exist): a new deployment's pods start together."""
    if role is not Role.DECODE:
        return None
    key = compat_key(target_spec, Role.DECODE)
    if not any(p.compat and p.compat != key and not p.deleting for p in pods):  # "" = unlabelled, older pod
        return None
    if any(p.compat == key and p.scheduled and not p.deleting and not p.failed and p.gate is not None
           and not (p.gate == "False" and p.gate_problem in GATE_FAILURES) for p in peers):
        return None
    return (f"decode revision holds: no running prefill shares its compatibility key {key} (protocol, layout, TP/PP) "
            "whose transfer-path gate reported without a failure")


def pods_running(snapshot: Snapshot) -> int:
    """Pods that may hold the transfer key (every observed pod not being deleted)."""
    return sum(not p.deleting for p in snapshot.pods)


def group_pods_running(snapshot: Snapshot, role: Role) -> int:
    """Pods of the role's multi-node groups that may hold its group key."""
    return sum(p.role is role and p.group_size > 1 and not p.deleting for p in snapshot.pods)


def target_generation(targets: Targets) -> Generation:
    """The compatibility keys of the pods each role's target revision makes."""
    return Generation(compat_key(targets[Role.PREFILL][1], Role.PREFILL),
                      compat_key(targets[Role.DECODE][1], Role.DECODE))


def plan(owner: Owner, spec: PDDeploymentSpec, snapshot: Snapshot, now: float = 0.0,
         targets: Targets | None = None, by_generation: bool = True) -> list[Action]:
    """All actions of one reconcile pass: children, stored revisions, the secret, then pods.

    ``by_generation``: the router pairs one generation at a time (``generations``); off, its selectors carry
    no compatibility key and both generations join it as their pods become ready (the operator's
    ``--no-router-generations``, for comparison)."""
    targets = targets or spec_targets(spec)
    target = target_generation(targets)
    router = snapshot.router if spec.router is not None and by_generation else None
    now_serving = serving(target, router, snapshot.pods)[0] if by_generation else None
    pod_actions: list[Action] = []
    for role in Role:
        surge = budgets(spec, role_spec(spec, role).replicas)[0]
        keep = kept(role, target, now_serving, router, units(snapshot.pods), surge) if now_serving else frozenset()
        pod_actions += _role_pod_actions(owner, spec, role, [p for p in snapshot.pods if p.role is role], now,
                                         targets[role], [p for p in snapshot.pods if p.role is not role], keep)
    # The Role is applied before the pods are created (actions run in order): a new pod's runtime
    # may read and patch its pod from its first request.
    pod_names = {p.name for p in snapshot.pods} | {
        a.name for a in pod_actions if a.kind is ActionKind.CREATE and a.object_kind == "Pod"}
    actions = [
        Action(ActionKind.APPLY, o["apiVersion"], o["kind"], o["metadata"]["name"], body=o)
        for o in desired_children(owner, spec, snapshot, targets, pod_names, now_serving)
    ]
    for role in Role:
        revision = role_revision(spec, role)
        if (role, revision) not in snapshot.revisions:
            number = 1 + sum(r is role for r, _ in snapshot.revisions)
            body = _owned(controller_revision(owner.name, owner.namespace, role, revision, spec, number), owner)
            actions.append(Action(ActionKind.CREATE, "apps/v1", "ControllerRevision", body["metadata"]["name"],
                                  body=body, reason=f"{role.value} revision {revision} stored"))
    if not snapshot.secret_exists and missing_key_in_use(owner.name, False, pods_running(snapshot)) is None:
        body = _owned(auth_secret(owner.name, owner.namespace), owner)
        actions.append(Action(ActionKind.CREATE, "v1", "Secret", secret_name(owner.name), body=body,
                              reason="per-deployment transfer authentication key"))
    for role in sorted(grouped_roles(spec, snapshot)):
        if role not in snapshot.group_secrets and not group_pods_running(snapshot, role):
            body = _owned(group_secret(owner.name, owner.namespace, role), owner)
            actions.append(Action(ActionKind.CREATE, "v1", "Secret", group_secret_name(owner.name, role), body=body,
                                  reason=f"{role.value} replica groups' key (rank messages between their pods)"))
    if not snapshot.worker_secret_exists:
        # Made whenever missing: its pods cannot start without it (a deployment from before the worker key
        # gets it on its first pass). A new key while routers hold the old one: restart them (docs/security.md).
        body = _owned(worker_secret(owner.name, owner.namespace), owner)
        actions.append(Action(ActionKind.CREATE, "v1", "Secret", worker_secret_name(owner.name), body=body,
                              reason="the worker key (routers to the worker API)"))
    # the router kind's admin API key, when it has an admin API
    admin = None
    if spec.router is not None and not snapshot.router_secret_exists:
        admin = router_plugin(spec).admin_secret(owner.name, owner.namespace)
    if admin is not None:
        body = _owned(admin, owner)
        actions.append(Action(ActionKind.CREATE, "v1", "Secret", router_secret_name(owner.name), body=body,
                              reason="the router's control-plane API key"))
    return actions + pod_actions
