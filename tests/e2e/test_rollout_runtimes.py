"""A decode rollout with real runtime processes (1 prefill, 2 decode, tp 1) on kwok pods, driven by
the harness's kubelet (devcluster.kubelet: each pod in its own network namespace), with synthetic requests flowing.

The prefill is started with a write delay so every transfer takes a while: each old decode pod
then has a transfer in flight when its drain starts. The rollout must end with zero failed or lost
transfers, and every admitted request's state verified byte for byte on decode.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pdfleet_operator.devcluster import LocalCluster
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import manifest, running_fleet
from tests.helpers import IDENTITY

pytestmark = pytest.mark.cluster


def test_decode_rollout_with_traffic_loses_nothing(cluster: LocalCluster, operator: OperatorProcess,
                                                    namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods") as fleet:
        runner = fleet.runner
        gates = {p.metadata.name: {c.type: (c.status, c.reason) for c in p.status.conditions or ()}
                 for p in fleet.core.list_namespaced_pod(namespace).items}
        assert all(g["pdfleet.io/transfer-path"][0] == "True" for g in gates.values()), gates
        # Each runtime wrote its gate with its own pod's token: the Role's reach, no more.
        pod = next(iter(runner.decode_pods().values()))
        assert "--kubeconfig" not in pod.containers[0].proc.args
        out = pod.exec(sys.executable, "-c", IDENTITY)
        assert json.loads(out.stdout or "{}") == {"get own pod": 200, "list secrets": 403}, out.stderr[-2000:]
        old = set(runner.decode_pods())
        traffic = fleet.traffic()
        traffic.wait_served(4)
        fleet.patch(manifest(namespace, "v2")["spec"])
        fleet.wait(lambda: not (old & set(runner.decode_pods())) and fleet.available(), 240, "rollout complete")
        fleet.wait(lambda: sum(r.ok and r.pod not in old for r in traffic.results) >= 4, 60, "traffic on the new pods")
        traffic.stop()

        assert not traffic.failures(), traffic.failures()[:5]  # every admitted request ok, every byte verified
        for name in old:
            in_flight, finished = fleet.drain_log(name)
            assert in_flight >= 1, f"{name} had no transfer in flight when its drain started"
            assert finished, runner.log_of(name)[-2000:]
        assert not fleet.forced_deletes()
