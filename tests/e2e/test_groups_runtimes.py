"""Replica groups of real built-in runtimes: every replica of both roles is a group of 2 pods (tensor 2,
one rank per pod), run by the harness's kubelet on kwok nodes behind the deployment's router, with chat
completions flowing through the router's Service (tests/e2e/traffic.py):

- complete groups, one member per node; Available only once every member of every group passed its own
  gate (the leader's only once its members joined), status counting groups;
- state moves byte-exactly between groups: every answer's bytes verified by the decode group's leader;
- a decode group rollout: zero client failures, zero router retries, zero failed transfers; every old
  group drained through its leader and deleted as a unit;
- a decode member deleted: its leader is deleted too (restart as a unit), a complete group comes back,
  and traffic is served by it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import manifest, running_fleet

pytestmark = pytest.mark.cluster

GROUP, MEMBER = "pdfleet.io/group", "pdfleet.io/group-member"


def _groups(pods: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in pods:
        out.setdefault(p.metadata.labels[GROUP], []).append(p)
    return out


def _gates(pods: list) -> dict[str, tuple[str, str]]:
    return {p.metadata.name: next(((c.status, c.reason) for c in p.status.conditions or ()
                                   if c.type == "pdfleet.io/transfer-path"), ("", "")) for p in pods}


def test_groups_of_real_runtimes_roll_and_restart_through_the_router(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods", nodes=2) as fleet:
        for role, replicas in (("prefill", 1), ("decode", 2)):
            groups = _groups(fleet.live_pods(role))
            assert len(groups) == replicas and all(len(ms) == 2 for ms in groups.values()), groups
            for leader, members in groups.items():
                assert len({p.spec.node_name for p in members}) == 2, f"{leader}: members share a node"
                gates = _gates(members)
                assert all(s == "True" for s, _ in gates.values()), gates  # each member set its own gate
        st = fleet.status()
        assert st["prefillReady"] == "1/1" and st["decodeReady"] == "2/2", st  # groups, not pods
        # only leaders are the router's and the peers' workers
        svc = fleet.core.read_namespaced_service("live-decode", namespace)
        assert svc.spec.selector[MEMBER] == "0"

        old = set(_groups(fleet.live_pods("decode")))
        traffic = fleet.traffic()
        traffic.wait_served(4)
        served = {r.pod for r in traffic.results if r.ok}
        assert served <= old, served  # answered (and its bytes verified: Answer.ok) by leaders only

        # -- a decode group rollout ---------------------------------------------------------------
        fleet.patch(manifest(namespace, "v2", nodes=2)["spec"])
        fleet.wait(lambda: not (old & set(_groups(fleet.live_pods("decode")))) and fleet.available()
                   and len(fleet.live_pods("decode")) == 4, 300, "decode groups rolled")
        fleet.wait(lambda: sum(r.ok and r.pod not in old for r in traffic.results) >= 4, 90,
                   "traffic on the new groups")
        c = traffic.assert_clean()  # zero client failures, router retries and failed transfers
        for leader in old:
            in_flight, finished = fleet.drain_log(leader)
            assert in_flight >= 0 and finished, fleet.runner.log_of(leader)[-2000:]  # its drain ran, unforced
        assert not fleet.forced_deletes()
        print(f"group rollout through the router: {c}")

        # -- a member deleted: its group restarts as a unit ---------------------------------------
        groups = _groups(fleet.live_pods("decode"))
        victim_group = sorted(groups)[0]
        victim = next(p.metadata.name for p in groups[victim_group] if p.metadata.labels[MEMBER] == "1")
        fleet.core.delete_namespaced_pod(victim, namespace)
        fleet.wait(lambda: victim_group not in _groups(fleet.live_pods("decode")), 60, "the leader deleted too")
        fleet.wait(lambda: len(_groups(fleet.live_pods("decode"))) == 2
                   and all(len(ms) == 2 for ms in _groups(fleet.live_pods("decode")).values())
                   and fleet.available(), 240, "a complete group again, Available")
        (fresh,) = set(_groups(fleet.live_pods("decode"))) - set(groups)
        fleet.wait(lambda: sum(r.ok and r.pod == fresh for r in traffic.results) >= 2, 90,
                   "traffic on the restarted group")
        answers = traffic.stop()
        failed = [r for r in answers if not r.ok]
        print(f"member {victim} deleted: {len(failed)} of {len(answers)} client requests failed "
              f"({sorted({str(r.answer.problem)[:120] for r in failed})[:3]})")
