"""The readiness-gate writer against the real test apiserver: the condition lands on pods/status, merged by
type (other conditions kept), and flips when the verdict does."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_runtime.config import READINESS_GATE
from pdfleet_runtime.pod.gate import KubeGate

pytestmark = pytest.mark.cluster


def test_gate_condition_is_patched_and_flips(cluster: LocalCluster, namespace: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gate-0", "namespace": namespace},
           "spec": {"readinessGates": [{"conditionType": READINESS_GATE}],
                    "containers": [{"name": "c", "image": "example.invalid/runtime:0"}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    gate = KubeGate.from_kubeconfig(cluster.kubeconfig, namespace, "gate-0", READINESS_GATE)

    def conditions() -> dict[str, dict[str, str]]:
        out = cluster.kubectl("-n", namespace, "get", "pod", "gate-0", "-o", "json")
        return {c["type"]: c for c in json.loads(out.stdout)["status"].get("conditions", [])}

    asyncio.run(gate.set(False, "BelowThroughputFloor", "canary 0.01 GB/s below the floor 0.05"))
    cond = conditions()[READINESS_GATE]
    assert cond["status"] == "False" and cond["reason"] == "BelowThroughputFloor" and "0.01" in cond["message"]
    others = set(conditions()) - {READINESS_GATE}
    asyncio.run(gate.set(True, "TransferPathVerified", "canary verified"))
    now = conditions()
    assert now[READINESS_GATE]["status"] == "True" and others <= set(now)
