"""Gang admission and topology packing of a replica's pods (pure): what ``spec.scheduling`` renders.

Every replica is one gang, named after its leader pod (``<deployment>-<role>-<revision[:6]>-<index>``):
the name holds the role, so prefill and decode groups are separate gangs, and the revision, so the
groups a surge creates are whole new gangs, never members joining an old revision's gang.

* Kueue (``gang: kueue``): on every pod of the replica the LocalQueue label, the group-name label and the
  group's total-count annotation (nodesPerReplica; one-node replicas are groups of one) and the serving
  annotation (a serving group never "finishes" when its pods end: the pods run until the operator
  deletes them). Kueue's webhook then gates each pod (``kueue.x-k8s.io/admission``) and its
  controller ungates all pods of a group together once the group's quota is admitted.
* A topology key: required pod affinity, on that node label, to the pods of the member's own group,
  beside the one-member-per-node anti-affinity. The first member to be placed matches its own term, so
  the scheduler lets it go to any domain; the rest follow it there, or pend when it has no room for them.
  With Kueue the key is also Kueue's required topology (TAS): Kueue picks a domain with room for the whole
  group before it ungates any member (tests/cluster/test_gang_kueue.py saw the pod affinity alone leave an
  admitted gang half placed: its first member took the emptier rack of one node).
"""

from __future__ import annotations

from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.scheduling import (
    KUEUE_ADMISSION_GATE,
    KUEUE_GATE_PREFIX,
    KUEUE_GROUP_NAME_LABEL,
    KUEUE_GROUP_SERVING_ANNOTATION,
    KUEUE_GROUP_TOTAL_COUNT_ANNOTATION,
    KUEUE_POD_INDEX_LABEL_ANNOTATION,
    KUEUE_QUEUE_LABEL,
    KUEUE_REQUIRED_TOPOLOGY_ANNOTATION,
    GangScheduler,
)
from pdfleet_operator.resources.names import LABEL_GROUP, LABEL_MEMBER

__all__ = ["KUEUE_ADMISSION_GATE", "gang_metadata", "kueue_gates", "with_topology"]


def gang_metadata(spec: PDDeploymentSpec, leader: str, nodes: int) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that make the replica led by ``leader`` (of ``nodes`` pods) one gang;
    both empty without a gang scheduler."""
    s = spec.scheduling
    if s.gang is not GangScheduler.KUEUE or s.queue_name is None:  # admission requires the queue with kueue
        return {}, {}
    labels = {KUEUE_QUEUE_LABEL: s.queue_name, KUEUE_GROUP_NAME_LABEL: leader}
    annotations = {KUEUE_GROUP_TOTAL_COUNT_ANNOTATION: str(nodes), KUEUE_GROUP_SERVING_ANNOTATION: "true"}
    if s.topology_key is not None and nodes > 1:
        # Kueue chooses the domain for the whole group before ungating it: pod affinity alone lets the first
        # member placed choose, and a domain without room for the rest leaves the group half placed.
        annotations[KUEUE_REQUIRED_TOPOLOGY_ANNOTATION] = s.topology_key
        annotations[KUEUE_POD_INDEX_LABEL_ANNOTATION] = LABEL_MEMBER
    return labels, annotations


def with_topology(pod_spec: dict, leader: str, topology_key: str | None) -> None:
    """Require every member of ``leader``'s group on nodes sharing ``topology_key`` (kept beside any
    required pod affinity of the role's own ``affinity``)."""
    if topology_key is None:
        return
    term = {"labelSelector": {"matchLabels": {LABEL_GROUP: leader}}, "topologyKey": topology_key}
    affinity = pod_spec.setdefault("affinity", {})
    pod_affinity = affinity.setdefault("podAffinity", {})
    pod_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = [
        *pod_affinity.get("requiredDuringSchedulingIgnoredDuringExecution", []), term]


def kueue_gates(pod: dict) -> tuple[str, ...]:
    """The scheduling gates Kueue holds ``pod`` (a Pod as JSON) with: non-empty while its gang waits."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or ()
    return tuple(str(g.get("name")) for g in gates if str(g.get("name", "")).startswith(KUEUE_GATE_PREFIX))
