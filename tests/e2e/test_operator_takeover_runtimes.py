"""The active operator replica killed mid-rollout, with transfers in flight (issue 26, fault tests).

Two operator processes peer through a ClusterKopfPeering (the chart's two replicas, as local
processes): the one with the higher priority reconciles, the other pauses. Both serve the dev webhook
(kopf's managed configuration points at the one started last, the standby, so admission survives the
kill; the chart serves both through a Service). The active one is SIGKILLed while an old decode pod
drains; the standby resumes once the dead peer's keep-alive expires (peering lifetime 20 s), and the
rollout completes with no admitted request failed or lost and no forced deletion.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.local_operator import LocalOperator
from tests.e2e.test_faults_runtimes import _roll_and_check
from tests.e2e.traffic import running_fleet
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

PEERING_CRDS = Path(__file__).resolve().parents[2] / "charts" / "pdfleet" / "crds" / "kopf.dev_peerings.yaml"
PEERING = "pdfleet-takeover"


@pytest.fixture
def replicas(cluster: LocalCluster, crd: str, tmp_path: Path) -> Iterator[tuple[LocalOperator, LocalOperator]]:
    cluster.kubectl("apply", "--server-side", "-f", str(PEERING_CRDS))
    cluster.wait_established("clusterkopfpeerings.kopf.dev")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": PEERING}}))
    active = LocalOperator(cluster, tmp_path / "active", standalone=False)
    standby = LocalOperator(cluster, tmp_path / "standby", standalone=False)
    try:
        active.start("--peering", PEERING, "--priority", "100")
        standby.start("--peering", PEERING, "--priority", "10")

        def both_peered() -> bool:
            out = cluster.kubectl("get", "clusterkopfpeering", PEERING, "-o", "json").stdout
            return len(json.loads(out).get("status") or {}) == 2

        wait_until(both_peered, what="both replicas in the peering", timeout=60)
        yield active, standby
    finally:
        active.stop()
        standby.stop()
        cluster.kubectl("delete", "clusterkopfpeering", PEERING, "--ignore-not-found")


def test_the_active_operator_killed_mid_rollout(cluster: LocalCluster, replicas: tuple[LocalOperator, LocalOperator],
                                                namespace: str, tmp_path: Path) -> None:
    active, standby = replicas
    with running_fleet(cluster, namespace, tmp_path / "pods") as fleet:
        assert "Pausing operations" not in active.log_text()

        def kill_active() -> None:
            # kopf starts a peered operator paused; the standby has stayed so (the active one reconciled).
            assert "Resuming operations" not in standby.log_text(), standby.log_text()[-2000:]
            assert active.proc is not None
            active.proc.kill()
            active.proc.wait(10)

        _roll_and_check(fleet, kill_active)
    assert "Resuming operations after the pause" in standby.log_text(), standby.log_text()[-3000:]
