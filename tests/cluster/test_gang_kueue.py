"""Gang admission with real Kueue (v0.17.0, built from Go modules: ``pdfleet_devcluster.kueue_run``) on the
local cluster, kwok nodes in racks of 2 (the test adds a fourth node for the test's length, so both racks
hold 2 nodes of 8 GPUs), decode groups of 2 whole-node members (8 GPUs each):

* a ClusterQueue with GPUs for one group, two groups requested at once: one gang is admitted whole and
  placed in one rack (Kueue's topology-aware scheduling picks it), the other waits whole (every member
  gated by Kueue, none on a node, so none holds a GPU), and the status names it;
* once capacity frees (the quota raised) the waiting gang is admitted and placed whole, in the other rack.

Opt-in like every Kueue test (it builds Kueue on first use, minutes cold): runs when Kueue was built
already, or with ``PDFLEET_BUILD_KUEUE=1``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import yaml
from kubernetes.client import CoreV1Api, CustomObjectsApi

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.cluster import RACK_LABEL, gpu_node_manifest
from pdfleet_operator.api.scheduling import KUEUE_ADMISSION_GATE, KUEUE_GROUP_NAME_LABEL
from tests.cluster.conftest import OperatorProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

NAME = "gang"
QUEUE = "gpu-serving"
KUEUE_API = ("kueue.x-k8s.io", "v1beta2")
GROUP_GPUS = 16  # 2 members x 8 GPUs: whole nodes, so a rack with room for the GPUs has room for the members


@pytest.fixture
def fourth_node(cluster: LocalCluster) -> Iterator[str]:
    """kwok-gpu-3, in rack-1 beside kwok-gpu-2, for this test only."""
    name = f"{cluster.options.node_prefix}-3"
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(gpu_node_manifest(name, cluster.options, 3)))
    try:
        yield name
    finally:
        cluster.kubectl("delete", "node", name, "--timeout=60s", check=False, timeout=90)


def kueue_queues(custom: CustomObjectsApi, ns: str, gpus: int, *, racks: bool = True) -> None:
    """A flavor, a ClusterQueue with ``gpus`` and the LocalQueue; with ``racks`` the flavor is on a rack
    Topology (its lowest level the rack, so kube-scheduler still spreads a group's members over the rack's
    nodes), and Kueue then places every workload of the queue by topology, the unannotated ones too."""
    group, version = KUEUE_API
    flavor: dict = {"nodeLabels": {"type": "kwok"}}
    if racks:
        custom.create_cluster_custom_object(group, version, "topologies", {
            "apiVersion": f"{group}/{version}", "kind": "Topology", "metadata": {"name": f"{ns}-racks"},
            "spec": {"levels": [{"nodeLabel": RACK_LABEL}]}})
        flavor["topologyName"] = f"{ns}-racks"
    custom.create_cluster_custom_object(group, version, "resourceflavors",
                                        {"apiVersion": f"{group}/{version}", "kind": "ResourceFlavor",
                                         "metadata": {"name": f"{ns}-gpu"}, "spec": flavor})
    custom.create_cluster_custom_object(group, version, "clusterqueues", {
        "apiVersion": f"{group}/{version}", "kind": "ClusterQueue", "metadata": {"name": ns},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["nvidia.com/gpu"],
            "flavors": [{"name": f"{ns}-gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}})
    custom.create_namespaced_custom_object(group, version, ns, "localqueues", {
        "apiVersion": f"{group}/{version}", "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": ns},
        "spec": {"clusterQueue": ns}})


def manifest(ns: str) -> dict:
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "engine": {"kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
            "model": {"layout": {"preset": "qwen3.8-flash-next"},
                      "source": {"huggingFace": {"id": "Qwen/Qwen3.8-Flash-Next"}}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            # no prefill pods: the decode gangs alone decide where GPUs go
            "prefill": {"replicas": 0, "parallelism": {"tensor": 8}, "image": "example.invalid/rt:1"},
            "decode": {"replicas": 2, "parallelism": {"tensor": 16, "nodesPerReplica": 2},
                       "image": "example.invalid/rt:1"},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 30},
            "scheduling": {"gang": "kueue", "queueName": QUEUE, "topologyKey": RACK_LABEL},
        },
    }


def _gangs(core: CoreV1Api, ns: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in core.list_namespaced_pod(ns, label_selector=f"pdfleet.io/deployment={NAME},pdfleet.io/role=decode").items:
        if p.metadata.deletion_timestamp is None:
            out.setdefault(p.metadata.labels[KUEUE_GROUP_NAME_LABEL], []).append(p)
    return out


def _gated(pod) -> bool:
    return any(g.name == KUEUE_ADMISSION_GATE for g in pod.spec.scheduling_gates or ())


def test_one_gang_runs_whole_the_other_waits_whole_and_starts_once_capacity_frees(
        cluster: LocalCluster, operator: OperatorProcess, kueue: object, namespace: str, fourth_node: str) -> None:
    from pdfleet_devcluster.kueue_run import NAMESPACE_LABEL

    api = cluster.api_client()
    core, custom = CoreV1Api(api), CustomObjectsApi(api)
    racks = wait_until(lambda: (r := {n.metadata.name: n.metadata.labels[RACK_LABEL] for n in core.list_node().items
                                      if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or ())})
                       and fourth_node in r and r, what="the fourth node Ready", timeout=60)
    cluster.kubectl("label", "namespace", namespace, f"{NAMESPACE_LABEL}=true")
    kueue_queues(custom, namespace, gpus=GROUP_GPUS)  # one decode group
    custom.create_namespaced_custom_object("pdfleet.io", "v1alpha1", namespace, "pddeployments", manifest(namespace))

    def split() -> tuple[list, list] | None:
        gangs = _gangs(core, namespace)
        if len(gangs) != 2 or any(len(ms) != 2 for ms in gangs.values()):
            return None
        placed = [ms for ms in gangs.values() if all(p.spec.node_name for p in ms)]
        waiting = [ms for ms in gangs.values() if all(_gated(p) for p in ms)]
        return (placed[0], waiting[0]) if len(placed) == 1 and len(waiting) == 1 else None

    try:
        placed, waiting = wait_until(split, what="one gang placed whole, the other gated whole", timeout=120)
    except AssertionError as exc:
        pods = [(p.metadata.name, p.spec.node_name, [g.name for g in p.spec.scheduling_gates or ()],
                 p.metadata.deletion_timestamp) for p in core.list_namespaced_pod(namespace).items]
        wls = custom.list_namespaced_custom_object(*KUEUE_API, namespace, "workloads")["items"]
        raise AssertionError(f"{exc}; pods {pods}; workloads {[(w['metadata']['name'], w.get('status')) for w in wls]}"
                             f"; kueue log:\n{kueue.tail(30)}") from None  # type: ignore[attr-defined]
    (first_rack,) = {racks[p.spec.node_name] for p in placed}
    assert len({p.spec.node_name for p in placed}) == 2
    assert not any(p.spec.node_name for p in waiting)  # no member of the waiting gang holds a GPU
    gang = waiting[0].metadata.labels[KUEUE_GROUP_NAME_LABEL]

    def pdd() -> dict:
        return json.loads(cluster.kubectl("-n", namespace, "get", "pdd", NAME, "-o", "json").stdout)

    status = wait_until(lambda: (s := pdd().get("status") or {}) and f"gang {gang}" in str(
        (s.get("rollout") or {}).get("decode", {}).get("message")) and s, what="the status naming the gang", timeout=60)
    assert f"LocalQueue {QUEUE}" in status["rollout"]["decode"]["message"]
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Progressing"] == "GangNotAdmitted"
    workload = custom.get_namespaced_custom_object(*KUEUE_API, namespace, "workloads", gang)
    assert [ps["count"] for ps in workload["spec"]["podSets"]] == [2]  # Kueue sees one gang of 2

    # capacity frees: the waiting gang is admitted whole and placed in one rack
    custom.patch_cluster_custom_object(*KUEUE_API, "clusterqueues", namespace, {"spec": {"resourceGroups": [{
        "coveredResources": ["nvidia.com/gpu"],
        "flavors": [{"name": f"{namespace}-gpu", "resources": [{"name": "nvidia.com/gpu",
                                                            "nominalQuota": 2 * GROUP_GPUS}]}]}]}})
    try:
        started = wait_until(lambda: (ms := _gangs(core, namespace).get(gang)) and all(
            p.spec.node_name and not _gated(p) for p in ms) and ms, what="the waiting gang placed", timeout=120)
    except AssertionError as exc:
        wl = custom.get_namespaced_custom_object(*KUEUE_API, namespace, "workloads", gang)
        pods = [(p.metadata.name, p.spec.node_name, [g.name for g in p.spec.scheduling_gates or ()],
                 [(c.type, c.reason, c.message) for c in p.status.conditions or ()])
                for p in _gangs(core, namespace).get(gang, [])]
        raise AssertionError(f"{exc}; workload status {wl.get('status')}; pods {pods}; kueue log:\n"
                             f"{kueue.tail(40)}") from None  # type: ignore[attr-defined]
    assert {racks[p.spec.node_name] for p in started} == {"rack-0", "rack-1"} - {first_rack}
    assert len({p.spec.node_name for p in started}) == 2
