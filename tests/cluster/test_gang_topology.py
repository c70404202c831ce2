"""Topology packing on the real scheduler (kwok nodes in racks: ``ClusterOptions.nodes_per_rack``, racks of
2 and 1 nodes): with ``spec.scheduling.topologyKey`` the members of a decode group land one per node in one
rack, and a member whose group's rack is full pends rather than leave it, even while another rack has room;
without a gang scheduler such a group is half placed, and the rollout status names it (the case Kueue's gangs
remove: docs/parallelism.md).

Filler pods (plain pods holding GPUs) steer which rack has room at each step, so every placement the test
asserts is the only one the scheduler may make: a group's first member may otherwise pick the one-node rack
and leave its partner pending (nothing in Kubernetes' affinity prevents that; Kueue's topology-aware gangs
do), which made the first version of this test flaky.
"""

from __future__ import annotations

import json
import time

import pytest
from kubernetes.client import CoreV1Api, CustomObjectsApi, V1Pod
from kubernetes.client.exceptions import ApiException

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.cluster import RACK_LABEL
from tests.cluster.conftest import OperatorProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

NAME = "rack"
GPU = "nvidia.com/gpu"


def manifest(ns: str) -> dict:
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "engine": {"kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
            "model": {"layout": {"preset": "qwen3.8-flash-next"},
                      "source": {"huggingFace": {"id": "Qwen/Qwen3.8-Flash-Next"}}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            # the prefill pod (2 GPUs) goes to rack-1's one node
            "prefill": {"replicas": 1, "parallelism": {"tensor": 2}, "image": "example.invalid/rt:1",
                        "nodeSelector": {RACK_LABEL: "rack-1"}},
            # each decode group: 2 pods of 4 GPUs on 2 nodes of one rack
            "decode": {"replicas": 1, "parallelism": {"tensor": 8, "nodesPerReplica": 2},
                       "image": "example.invalid/rt:1"},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 30},
            "scheduling": {"topologyKey": RACK_LABEL},
        },
    }


def _decode(core: CoreV1Api, ns: str) -> list:
    selector = f"pdfleet.io/deployment={NAME},pdfleet.io/role=decode"
    return [p for p in core.list_namespaced_pod(ns, label_selector=selector).items
            if p.metadata.deletion_timestamp is None]


def _gpus(pod: V1Pod) -> int:
    return sum(int((c.resources.requests or {}).get(GPU, 0)) for c in pod.spec.containers)


def _wait_for_free_gpus(core: CoreV1Api, ns: str) -> None:
    """Earlier tests on this cluster delete their namespaces without waiting: their pods may still hold GPUs."""
    def others() -> list[str]:
        return [f"{p.metadata.namespace}/{p.metadata.name}" for p in core.list_pod_for_all_namespaces().items
                if p.metadata.namespace != ns and p.spec.node_name and _gpus(p)
                and p.status.phase not in ("Succeeded", "Failed")]
    wait_until(lambda: others() == [], what="other tests' GPU pods to go", timeout=120)


def _filler(core: CoreV1Api, ns: str, node: str, gpus: int) -> str:
    """A plain pod holding ``gpus`` GPUs on ``node``; its name, once placed."""
    name = f"filler-{node}"
    core.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "hold", "image": "example.invalid/filler:1",
                                 "resources": {"requests": {GPU: str(gpus)}, "limits": {GPU: str(gpus)}}}]},
    })
    wait_until(lambda: core.read_namespaced_pod(name, ns).spec.node_name == node, what=f"{name} placed")
    return name


def _remove(core: CoreV1Api, ns: str, name: str) -> None:
    core.delete_namespaced_pod(name, ns, grace_period_seconds=0)

    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, ns)
        except ApiException as e:
            return e.status == 404
        return False
    wait_until(gone, what=f"{name} deleted")


def _scheduling_failures(core: CoreV1Api, ns: str, pod: str) -> list[str]:
    events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod},reason=FailedScheduling")
    return [e.message or "" for e in events.items]


def test_group_members_share_a_rack_and_a_member_pends_rather_than_leave_it_named_half_placed(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str) -> None:
    api = cluster.api_client()
    core, custom = CoreV1Api(api), CustomObjectsApi(api)
    racks = {n.metadata.name: n.metadata.labels[RACK_LABEL] for n in core.list_node().items}
    rack0 = sorted(n for n, r in racks.items() if r == "rack-0")
    (single,) = [n for n, r in racks.items() if r == "rack-1"]
    _wait_for_free_gpus(core, namespace)

    # step 1: rack-1 is full (prefill 2 + filler 6), rack-0's nodes have 4 GPUs free each: the one group must
    # take one node each (members share no node), both in rack-0
    fillers = {n: _filler(core, namespace, n, 4) for n in rack0}
    single_filler = _filler(core, namespace, single, 6)
    custom.create_namespaced_custom_object("pdfleet.io", "v1alpha1", namespace, "pddeployments", manifest(namespace))
    first = wait_until(lambda: (p := _decode(core, namespace)) and len(p) == 2
                       and all(x.spec.node_name for x in p) and p, what="the first decode group placed", timeout=120)
    for p in first:
        term, = p.spec.affinity.pod_affinity.required_during_scheduling_ignored_during_execution
        assert term.topology_key == RACK_LABEL
    assert sorted(p.spec.node_name for p in first) == rack0, "the group's members share a node or left rack-0"
    group_a = first[0].metadata.labels["pdfleet.io/group"]

    # step 2: rack-1 gets room for one pod (6 GPUs free), rack-0 none: a second group's first member takes
    # rack-1 and its partner pends
    _remove(core, namespace, single_filler)
    custom.patch_namespaced_custom_object("pdfleet.io", "v1alpha1", namespace, "pddeployments", NAME,
                                          {"spec": {"decode": {"replicas": 2}}})
    second = wait_until(lambda: (p := [x for x in _decode(core, namespace)
                                       if x.metadata.labels["pdfleet.io/group"] != group_a])
                        and len(p) == 2 and sum(bool(x.spec.node_name) for x in p) == 1 and p,
                        what="the second group half placed", timeout=120)
    (placed,) = [p for p in second if p.spec.node_name]
    (pending,) = [p for p in second if not p.spec.node_name]
    assert placed.spec.node_name == single
    leader = second[0].metadata.labels["pdfleet.io/group"]

    def message() -> str:
        pdd = json.loads(cluster.kubectl("-n", namespace, "get", "pdd", NAME, "-o", "json").stdout)
        return str(((pdd.get("status") or {}).get("rollout") or {}).get("decode", {}).get("message"))

    text = wait_until(lambda: f"group {leader}: 1/2 pods placed" in (m := message()) and m,
                      what="the rollout status naming the half-placed group", timeout=60)
    assert "spec.scheduling.gang kueue" in text

    # step 3: room opens in rack-0 (4 GPUs on one node); the pending member would fit there, but its group is
    # in rack-1, so the scheduler refuses it for the rack affinity and it keeps pending
    _remove(core, namespace, fillers[rack0[0]])
    refusal = wait_until(lambda: [m for m in _scheduling_failures(core, namespace, pending.metadata.name)
                                  if "pod affinity" in m] or None,
                         what="the scheduler refusing the pending member for its group's rack", timeout=90)
    time.sleep(2)  # a scheduling pass after the refusal would have bound it by now
    assert not core.read_namespaced_pod(pending.metadata.name, namespace).spec.node_name, refusal
    assert f"group {leader}: 1/2 pods placed" in message()
