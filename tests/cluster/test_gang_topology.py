"""Topology packing on the real scheduler (kwok nodes in racks: ``ClusterOptions.nodes_per_rack``, racks of
2 and 1 nodes): with ``spec.scheduling.topologyKey`` every member of a decode group lands in the one rack
that holds a whole group, one member per node; a third group finds no rack with room for both members,
so without a gang scheduler its first member is placed and the other pends, and the rollout status names
that half-placed group (the case Kueue's gangs remove: docs/parallelism.md).
"""

from __future__ import annotations

import json

import pytest
from kubernetes.client import CoreV1Api, CustomObjectsApi

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.cluster import RACK_LABEL
from tests.cluster.conftest import OperatorProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

NAME = "rack"


def manifest(ns: str) -> dict:
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "engine": {"kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
            "model": {"layout": {"preset": "qwen3.8-flash-next"},
                      "source": {"huggingFace": {"id": "Qwen/Qwen3.8-Flash-Next"}}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            # the prefill pod (2 GPUs) goes to rack-1, leaving rack-0's 2 x 8 GPUs to the decode groups
            "prefill": {"replicas": 1, "parallelism": {"tensor": 2}, "image": "example.invalid/rt:1",
                        "nodeSelector": {RACK_LABEL: "rack-1"}},
            # each decode group: 2 pods of 4 GPUs on 2 nodes of one rack
            "decode": {"replicas": 2, "parallelism": {"tensor": 8, "nodesPerReplica": 2},
                       "image": "example.invalid/rt:1"},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 30},
            "scheduling": {"topologyKey": RACK_LABEL},
        },
    }


def _decode(core: CoreV1Api, ns: str) -> list:
    selector = f"pdfleet.io/deployment={NAME},pdfleet.io/role=decode"
    return [p for p in core.list_namespaced_pod(ns, label_selector=selector).items
            if p.metadata.deletion_timestamp is None]


def test_group_members_share_a_rack_and_a_group_with_no_rack_left_is_named_half_placed(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str) -> None:
    api = cluster.api_client()
    core, custom = CoreV1Api(api), CustomObjectsApi(api)
    racks = {n.metadata.name: n.metadata.labels[RACK_LABEL] for n in core.list_node().items}
    custom.create_namespaced_custom_object("pdfleet.io", "v1alpha1", namespace, "pddeployments", manifest(namespace))
    pods = wait_until(lambda: (p := _decode(core, namespace)) and len(p) == 4
                      and all(x.spec.node_name for x in p) and p, what="2 decode groups placed", timeout=120)
    groups: dict[str, list] = {}
    for p in pods:
        groups.setdefault(p.metadata.labels["pdfleet.io/group"], []).append(p)
        term, = p.spec.affinity.pod_affinity.required_during_scheduling_ignored_during_execution
        assert term.topology_key == RACK_LABEL
    for leader, members in groups.items():
        assert len({p.spec.node_name for p in members}) == 2, f"group {leader} shares a node"
        assert {racks[p.spec.node_name] for p in members} == {"rack-0"}, f"group {leader} left its rack"

    # a third group: rack-0 is full, rack-1 has one node, so one member is placed and the other pends
    custom.patch_namespaced_custom_object("pdfleet.io", "v1alpha1", namespace, "pddeployments", NAME,
                                          {"spec": {"decode": {"replicas": 3}}})
    third = wait_until(lambda: (p := [x for x in _decode(core, namespace)
                                      if x.metadata.labels["pdfleet.io/group"] not in groups])
                       and len(p) == 2 and sum(bool(x.spec.node_name) for x in p) == 1 and p,
                       what="the third group half placed", timeout=120)
    (placed,) = [p for p in third if p.spec.node_name]
    assert racks[placed.spec.node_name] == "rack-1"
    leader = third[0].metadata.labels["pdfleet.io/group"]

    def message() -> str:
        pdd = json.loads(cluster.kubectl("-n", namespace, "get", "pdd", NAME, "-o", "json").stdout)
        return str(((pdd.get("status") or {}).get("rollout") or {}).get("decode", {}).get("message"))

    text = wait_until(lambda: f"group {leader}: 1/2 pods placed" in (m := message()) and m,
                      what="the rollout status naming the half-placed group", timeout=60)
    assert "spec.scheduling.gang kueue" in text
