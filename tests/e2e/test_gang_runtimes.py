"""Kueue gangs of real built-in runtimes through the router (real Kueue v0.17.0 beside the local cluster, the
harness's kubelet running the pods Kueue admitted and kube-scheduler placed):

- every replica of both roles is a gang of 2 pods that Kueue admitted whole, one member per node;
- a decode group rollout (maxSurge 1: one surge gang at a time) with chat completions flowing through the
  router: zero client failures, router retries and failed transfers, every old gang drained through its
  leader and gone (Kueue's pod finalizers released), the new gangs admitted by Kueue and served.

Opt-in like every Kueue test: runs when Kueue was built already, or with ``PDFLEET_BUILD_KUEUE=1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes.client import CustomObjectsApi

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.api.scheduling import KUEUE_GROUP_NAME_LABEL
from tests.cluster.conftest import OperatorProcess
from tests.cluster.test_gang_kueue import QUEUE, kueue_queues
from tests.e2e.traffic import manifest, running_fleet

pytestmark = pytest.mark.cluster

# No topology here (no key, a flavor without a Topology): these members hold 1 GPU of an 8-GPU node, and
# Kueue's topology-aware scheduling counts GPUs, not members per node, so it would pick the one-node rack
# for a whole group (docs/parallelism.md); tests/cluster/test_gang_kueue.py checks packing with members
# sized so that GPUs decide.
SCHEDULING = {"gang": "kueue", "queueName": QUEUE}


def _gangs(pods: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in pods:
        out.setdefault(p.metadata.labels[KUEUE_GROUP_NAME_LABEL], []).append(p)
    return out


def test_kueue_gangs_of_real_runtimes_roll_through_the_router_without_a_failed_request(
        cluster: LocalCluster, operator: OperatorProcess, kueue: object, namespace: str, tmp_path: Path) -> None:
    from pdfleet_devcluster.kueue_run import NAMESPACE_LABEL

    api = cluster.api_client()
    cluster.kubectl("label", "namespace", namespace, f"{NAMESPACE_LABEL}=true")
    kueue_queues(CustomObjectsApi(api), namespace, gpus=64, racks=False)
    with running_fleet(cluster, namespace, tmp_path / "pods", nodes=2, scheduling=SCHEDULING) as fleet:
        for role, replicas in (("prefill", 1), ("decode", 2)):
            gangs = _gangs(fleet.live_pods(role))
            assert len(gangs) == replicas and all(len(ms) == 2 for ms in gangs.values()), gangs
            for name, members in gangs.items():
                assert len({p.spec.node_name for p in members}) == 2, f"gang {name}: members share a node"
                assert all(p.metadata.labels.get("kueue.x-k8s.io/managed") == "true" for p in members)
        old = set(_gangs(fleet.live_pods("decode")))
        traffic = fleet.traffic()
        traffic.wait_served(4)

        fleet.patch(manifest(namespace, "v2", nodes=2, scheduling=SCHEDULING)["spec"])
        fleet.wait(lambda: not (old & set(_gangs(fleet.live_pods("decode")))) and fleet.available()
                   and len(fleet.live_pods("decode")) == 4, 300, "decode gangs rolled")
        fleet.wait(lambda: sum(r.ok and r.pod not in old for r in traffic.results) >= 4, 90,
                   "traffic on the new gangs")
        c = traffic.assert_clean()  # zero client failures, router retries and failed transfers
        assert not fleet.forced_deletes()
        new = _gangs(fleet.live_pods("decode"))
        assert len(new) == 2 and all(len(ms) == 2 for ms in new.values()), new
        print(f"Kueue gang rollout through the router: {c}")
        traffic.stop()
