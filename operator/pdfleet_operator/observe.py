"""Observe: read a PDDeployment's children into an ``observed.Snapshot`` (reads only).

Pods are found by the deployment label and identified by their identity annotation
(``role/revision/index``, plus ``/member/nodes`` for a pod of a multi-node group), so a pod whose role or revision labels were edited away is still
recognised and its labels restored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime

from kubernetes.client import ApiClient, AppsV1Api, CoreV1Api
from kubernetes.client.exceptions import ApiException

from pdfleet_operator.api.constants import LABEL_DEPLOYMENT, LABEL_REVISION, LABEL_ROLE, Role
from pdfleet_operator.api.scheduling import KUEUE_GROUP_NAME_LABEL
from pdfleet_operator.generations import router_state
from pdfleet_operator.observed import ObservedPod, Owner, RouterState, Snapshot
from pdfleet_operator.placement import NodeFacts, node_facts
from pdfleet_operator.resources.gang import kueue_gates
from pdfleet_operator.resources.names import (
    ANNOTATION_DRAIN,
    ANNOTATION_DRAIN_CANCELLED,
    CONDITION_DRAINED,
    LABEL_COMPAT,
    LABEL_GROUP,
    LABEL_INDEX,
    LABEL_MEMBER,
    LABEL_ROUTABLE,
    group_pod_name,
    group_secret_name,
    router_name,
    router_secret_name,
    secret_name,
    worker_secret_name,
)
from pdfleet_operator.resources.pods import ANNOTATION_IDENTITY
from pdfleet_operator.resources.revisions import parse_revisions
from pdfleet_runtime.config import READINESS_GATE, SILENT_FALLBACK_CONDITION, drain_of
from pdfleet_runtime.readiness_problems import gate_problem

__all__ = ["observe", "observe_nodes", "observed_pod", "pod_identity", "secret_exists", "snapshot_of", "with_group_secrets"]


def pod_identity(value: str) -> tuple[Role, str, int, int, int] | None:
    """(role, revision, index, member, nodes) from ``role/revision/index[/member/nodes]``."""
    parts = value.split("/")
    if len(parts) not in (3, 5) or parts[0] not in {r.value for r in Role} or not all(x.isdigit() for x in parts[2:]):
        return None
    member, nodes = (int(parts[3]), int(parts[4])) if len(parts) == 5 else (0, 1)
    if nodes < 1 or member >= nodes:
        return None
    return Role(parts[0]), parts[1], int(parts[2]), member, nodes


def observed_pod(pod: dict, owner_uid: str) -> ObservedPod | None:
    """One pod as the planner sees it; None when it is not ours or carries no identity."""
    meta = pod.get("metadata") or {}
    owner = next((ref for ref in meta.get("ownerReferences") or () if ref.get("uid") == owner_uid), None)
    if owner is None:
        return None
    identity = pod_identity((meta.get("annotations") or {}).get(ANNOTATION_IDENTITY, ""))
    if identity is None:
        return None
    role, revision, index, member, nodes = identity
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    drain_started = _epoch(annotations.get(ANNOTATION_DRAIN))
    labels_ok = (
        labels.get(LABEL_ROLE) == role.value
        and labels.get(LABEL_REVISION) == revision
        and labels.get(LABEL_INDEX) == str(index)
        and labels.get(LABEL_MEMBER) == str(member)
        and labels.get(LABEL_ROUTABLE) == ("false" if drain_started is not None else "true")
        and (nodes == 1 or labels.get(LABEL_GROUP) == group_pod_name(owner.get("name", ""), role, revision, index, 0))
    )
    conditions = (pod.get("status") or {}).get("conditions") or ()
    ready_cond = next((c for c in conditions if c.get("type") == "Ready" and c.get("status") == "True"), None)
    ready = ready_cond is not None
    # Drained only for the drain under way: the condition must carry this drain's stamp.
    drained = drain_started is not None and any(
        c.get("type") == CONDITION_DRAINED and c.get("status") == "True"
        and drain_of(c.get("message")) == annotations.get(ANNOTATION_DRAIN) for c in conditions)
    gate = next((c for c in conditions if c.get("type") == READINESS_GATE), {})
    fallback = next((c for c in conditions if c.get("type") == SILENT_FALLBACK_CONDITION
                     and c.get("status") == "True"), {})
    status = pod.get("status") or {}
    restarts = sum(int(s.get("restartCount") or 0) for s in status.get("containerStatuses") or ())
    running_since = _rfc3339(status.get("startTime")) if status.get("phase") == "Running" else None
    return ObservedPod(
        name=meta["name"],
        role=role,
        revision=revision,
        index=index,
        ready=ready,
        deleting=bool(meta.get("deletionTimestamp")),
        labels_ok=labels_ok,
        drain_started=drain_started,
        drain_cancelled=_epoch(annotations.get(ANNOTATION_DRAIN_CANCELLED)),
        drained=drained,
        gate=gate.get("status"),
        gate_problem=gate_problem(gate.get("reason")),
        gate_message=": ".join(x for x in (gate.get("reason"), gate.get("message")) if x),
        fallback=": ".join(x for x in (fallback.get("reason"), fallback.get("message")) if x),
        restarts=restarts,
        running_since=running_since,
        compat=labels.get(LABEL_COMPAT, ""),
        scheduled=bool((pod.get("spec") or {}).get("nodeName")),
        member=member,
        group_size=nodes,
        failed=status.get("phase") == "Failed",
        ip=status.get("podIP") or None,
        created=_rfc3339(meta.get("creationTimestamp")) if meta.get("creationTimestamp") else None,
        ready_since=_rfc3339(ready_cond.get("lastTransitionTime")) if ready_cond and ready_cond.get(
            "lastTransitionTime") else None,
        gates=kueue_gates(pod),
        gang=labels.get(KUEUE_GROUP_NAME_LABEL, ""),
    )


def _rfc3339(value: object) -> float | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _epoch(value: object) -> float | None:
    """The drain annotation's epoch seconds; an unreadable value counts as 'draining since 0'
    (its deadline has passed), so a mangled annotation cannot keep a pod half-drained forever."""
    if value is None:
        return None
    try:
        return float(str(value))
    except ValueError:
        return 0.0


def snapshot_of(owner: Owner, pods: Iterable[Mapping], revisions: Iterable[Mapping], *, secret_exists: bool,
                router_secret_exists: bool, worker_secret_exists: bool = True,
                deployments: Iterable[Mapping] = ()) -> Snapshot:
    """The planner's snapshot from pod, ControllerRevision and Deployment bodies (listed, or from the watched
    state); the Deployments are read for the router's (its generation, ``generations``)."""
    observed = (p for p in (observed_pod(item, owner.uid) for item in pods) if p is not None)
    owned = [r for r in revisions
             if any(ref.get("uid") == owner.uid for ref in r["metadata"].get("ownerReferences") or ())]
    return Snapshot(pods=tuple(sorted(observed, key=lambda p: p.name)), secret_exists=secret_exists,
                    revisions=parse_revisions(owned), router_secret_exists=router_secret_exists,
                    worker_secret_exists=worker_secret_exists, router=_router(owner, deployments))


def _router(owner: Owner, deployments: Iterable[Mapping]) -> RouterState | None:
    name = router_name(owner.name)
    for d in deployments:
        meta = d.get("metadata") or {}
        if meta.get("name") == name and any(ref.get("uid") == owner.uid for ref in meta.get("ownerReferences") or ()):
            return router_state(d)
    return None


def with_group_secrets(snapshot: Snapshot, owner: Owner, roles: Iterable[Role], exists) -> Snapshot:
    """The snapshot with the group key Secrets of ``roles`` (the grouped ones) looked up by ``exists(name)``:
    single-node roles cost no call."""
    found = frozenset(r for r in roles if exists(group_secret_name(owner.name, r)))
    return replace(snapshot, group_secrets=found)


def observe(api: ApiClient, owner: Owner) -> Snapshot:
    """The snapshot from fresh lists (a Reconciler without watched state: tests, tools); group key Secrets
    are looked up by ``with_group_secrets``."""
    core = CoreV1Api(api)
    selector = f"{LABEL_DEPLOYMENT}={owner.name}"
    pods = json.loads(core.list_namespaced_pod(owner.namespace, label_selector=selector,
                                               _preload_content=False).data)["items"]
    apps = AppsV1Api(api)
    revisions = json.loads(apps.list_namespaced_controller_revision(
        owner.namespace, label_selector=selector, _preload_content=False).data)["items"]
    deployments = json.loads(apps.list_namespaced_deployment(
        owner.namespace, label_selector=selector, _preload_content=False).data)["items"]
    return snapshot_of(owner, pods, revisions, deployments=deployments,
                       secret_exists=secret_exists(api, secret_name(owner.name), owner.namespace),
                       router_secret_exists=secret_exists(api, router_secret_name(owner.name), owner.namespace),
                       worker_secret_exists=secret_exists(api, worker_secret_name(owner.name), owner.namespace))


def secret_exists(api: ApiClient, name: str, namespace: str) -> bool:
    """One GET by name: the operator may read its own Secrets but not list or watch any (least privilege)."""
    try:
        CoreV1Api(api).read_namespaced_secret(name, namespace, _preload_content=False)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return False
    return True


def observe_nodes(api: ApiClient) -> tuple[NodeFacts, ...]:
    """Every node, reduced to placement facts (labels, taints, allocatable GPUs)."""
    listing = CoreV1Api(api).list_node(_preload_content=False)
    return tuple(node_facts(n) for n in json.loads(listing.data)["items"])
