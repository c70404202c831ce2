"""``spec.scheduling``: how replica groups are placed: as gangs, and packed into one topology domain.

A replica of ``nodesPerReplica`` N is N pods the operator creates in one pass, but kube-scheduler
places them one by one: on a busy cluster half a group can hold its GPUs while the other half
waits. A gang scheduler admits a group whole or not at all; this names the one to use (Kueue's
plain-pod groups, with the LocalQueue) and a node label every member of a group must share (a rack
or NVLink-domain label), rendered as required pod affinity. docs/parallelism.md describes both and
what happens without Kueue.

Kept apart from ``models.py`` (which only names the field) so the API, its admission rules (CEL,
``rules.py``, with the reasons and fixes here) and the rendering constants move together. The
rendering itself is ``resources.gang``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from pydantic import Field

from pdfleet_operator.api.kube import ApiModel

__all__ = [
    "KUEUE_ADMISSION_GATE",
    "KUEUE_GATE_PREFIX",
    "KUEUE_GROUP_NAME_LABEL",
    "KUEUE_GROUP_SERVING_ANNOTATION",
    "KUEUE_GROUP_TOTAL_COUNT_ANNOTATION",
    "KUEUE_POD_INDEX_LABEL_ANNOTATION",
    "KUEUE_QUEUE_LABEL",
    "KUEUE_REQUIRED_TOPOLOGY_ANNOTATION",
    "KUEUE_WORKLOAD_API_VERSION",
    "SCHEDULING_RULES",
    "GangScheduler",
    "SchedulingSpec",
]

# Kueue v0.17's names for plain pods (pkg/controller/constants, pkg/controller/jobs/pod/constants):
# tests/unit/operator/test_gang.py checks them against Kueue's source when a fetched copy is at hand.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_NAME_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_TOTAL_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
# A serving group never "finishes" when its pods end, and its pods' quota is not reclaimed one by one.
KUEUE_GROUP_SERVING_ANNOTATION = "kueue.x-k8s.io/pod-group-serving"
# Topology-aware scheduling (TAS): Kueue picks one domain of this node label with room for the whole group
# before it ungates any member, and pins the members there (a nodeSelector); it needs a ResourceFlavor with a
# Topology that has the label as a level. The index label tells it each pod's rank in the group.
KUEUE_REQUIRED_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-required-topology"
KUEUE_POD_INDEX_LABEL_ANNOTATION = "kueue.x-k8s.io/pod-group-pod-index-label"
# Kueue's webhook adds this scheduling gate to the pods it manages and removes it from every pod of a
# group at once, when the group's quota is admitted; TAS adds ``kueue.x-k8s.io/topology`` beside it.
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"
KUEUE_GATE_PREFIX = "kueue.x-k8s.io/"
# Kueue names a group's Workload after the group. Deleting it is Kueue's documented way to end a plain-pod
# group: Kueue then removes its finalizer from the group's pods (which it keeps until the group ends; a
# serving group never ends by itself) and releases the quota.
KUEUE_WORKLOAD_API_VERSION = "kueue.x-k8s.io/v1beta2"

# A label key: an optional DNS-subdomain prefix and a name of at most 63 characters.
LABEL_KEY_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
QUEUE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class GangScheduler(StrEnum):
    """Who admits a replica group whole."""

    NONE = "none"  # kube-scheduler places members one by one (docs/parallelism.md: what bounds the damage)
    KUEUE = "kueue"  # Kueue's plain-pod groups (its "pod" integration, listed in Kueue's shipped configuration)


class SchedulingSpec(ApiModel):
    """How replica groups are placed: as gangs, and inside one topology domain (docs/parallelism.md)."""

    gang: GangScheduler = Field(
        GangScheduler.NONE,
        description="none (default: the scheduler places a group's pods one by one, so part of a group can "
        "hold GPUs while the rest pends) or kueue (every replica is a Kueue plain-pod group of its "
        "nodesPerReplica pods, admitted whole: no member is ungated until the whole group's quota is; "
        "needs Kueue with the pod integration and queueName).",
    )
    queue_name: str | None = Field(
        None, min_length=1, max_length=63, pattern=QUEUE_NAME_PATTERN,
        description="The Kueue LocalQueue in the deployment's namespace the groups queue in (the "
        "kueue.x-k8s.io/queue-name label). Required with gang kueue, refused without it.",
    )
    topology_key: str | None = Field(
        None, min_length=1, max_length=317, pattern=LABEL_KEY_PATTERN,
        description="A node label every member of a replica group must share, e.g. a rack or NVLink-domain "
        "label: required pod affinity within the group, beside the one-member-per-node anti-affinity; with gang "
        "kueue also Kueue's topology-aware scheduling (podset-required-topology: the LocalQueue's ResourceFlavor "
        "needs a Topology with this label as a level). Needs a role with nodesPerReplica > 1; not "
        "kubernetes.io/hostname (members sit on distinct nodes).",
    )


class _Rule(NamedTuple):
    """Why a rule exists and how to fix a violation (the CEL rules of ``rules.py`` use these)."""

    reason: str
    fix: str


SCHEDULING_RULES: dict[str, _Rule] = {
    "scheduling-queue-needs-kueue": _Rule(
        "queueName names a Kueue LocalQueue, read only by Kueue's gang admission: without gang kueue the pods "
        "carry no Kueue labels and the queue would silently do nothing",
        "set spec.scheduling.gang: kueue, or remove spec.scheduling.queueName",
    ),
    "scheduling-kueue-queue": _Rule(
        "Kueue manages a pod only when it names a LocalQueue (or its namespace has one named default and "
        "Kueue is set to use it); an unmanaged group is placed pod by pod, with no gang",
        "set spec.scheduling.queueName to a LocalQueue of the deployment's namespace",
    ),
    "scheduling-topology-multi-node": _Rule(
        "the topology key packs the members of a replica group into one domain; a one-node replica (both "
        "roles at nodesPerReplica 1) has no members to pack, so the key would do nothing",
        "remove spec.scheduling.topologyKey, or set parallelism.nodesPerReplica > 1 on a role (use the role's "
        "nodeSelector or affinity to choose where one-node replicas go)",
    ),
    "scheduling-topology-hostname": _Rule(
        "members of a replica group sit on distinct nodes (required anti-affinity on kubernetes.io/hostname), "
        "so requiring them to share a hostname could never be met: every group would pend",
        "set spec.scheduling.topologyKey to a label shared by several nodes (a rack, zone or NVLink-domain label)",
    ),
}
