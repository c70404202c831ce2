"""Issue 12's acceptance with real runtimes: rollouts of a fleet whose pods run the real ``pdfleet-runtime
serve`` (kwok pods run by the harness's kubelet, devcluster.kubelet) behind the deployment's router, with an
``openai`` client's chat completions flowing through the router's Service throughout (``traffic.Traffic``):
each test prints the client failures, router retries and failed transfers, and checks all three are zero.

- a canary holds at its count with traffic on both revisions; raised, paused mid-rollout (committed
  drains finish, nothing new starts), resumed, it completes;
- an image whose pods fail their canary transfer for real (``--fault-corrupt-received``: the state
  arrives, the byte check fails) is rolled back automatically, with zero failed transfers on the old
  revision;
- new pods stuck Pending (a nodeSelector no node has) hit the progress deadline and roll back;
- spec changes A->B->C end on C, and C->D reverted to C mid-rollout ends on C, within the budgets;
- a prefill rollout completes with zero lost transfers: decode pods find the new prefill pod through
  CoreDNS (from the Service's EndpointSlices), the old one drains its transfers first.

Budgets are read from a watch of every pod (``PodTimeline``): maxSurge 1 and maxUnavailable 0, so a
role never has more than replicas + 1 pods (draining and terminating ones included) and never fewer
than ``replicas`` routable ready pods. Each test runs its own small fleet (tp 1) in its own namespace.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from pdfleet_devcluster import LocalCluster
from tests.cluster.conftest import OperatorProcess
from tests.e2e.traffic import NAME, Fleet, PodTimeline, running_fleet

pytestmark = pytest.mark.cluster

BAD = "example.invalid/runtime:bad"


def mark(value: str) -> dict:
    return {"env": [{"name": "ROLLOUT_MARK", "value": value}]}


def _decode_status(fleet: Fleet) -> dict:
    return (fleet.status().get("rollout") or {}).get("decode") or {}


def _phase(fleet: Fleet) -> str:
    return (fleet.status().get("rollout") or {}).get("phase", "")


def _settled(fleet: Fleet, revision: str, n: int, role: str = "decode") -> bool:
    st = (fleet.status().get("rollout") or {}).get(role) or {}
    return (fleet.settled_on(revision, n, role)
            and st.get("currentRevision") == st.get("targetRevision") == st.get("stableRevision") == revision)


def _mid_rollout(timeline: PodTimeline, new: str, old: str, replicas: int = 2) -> bool:
    """A pod of ``new`` is routable ready and the old revision is going but not gone: one of its pods is
    draining, or fewer than ``replicas`` are left."""
    pods = list(timeline.now().values())
    olds = [s for s in pods if s.revision == old]
    return (any(s.revision == new and s.routable_ready for s in pods) and bool(olds)
            and (any(s.draining for s in olds) or len(olds) < replicas))


def test_canary_holds_with_traffic_then_pause_and_resume(cluster: LocalCluster, operator: OperatorProcess,
                                                         namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods", decode=3) as fleet:
        [old] = set(fleet.revisions())
        timeline = fleet.timeline(synced=4)
        traffic = fleet.traffic()
        traffic.wait_served(4, old)
        fleet.patch({"decode": mark("v2"), "rollout": {"canaryReplicas": 1}})

        def held() -> str | None:
            st = fleet.status()["rollout"]
            new = st["decode"]["targetRevision"]
            live = fleet.live_pods()
            ok = (st["phase"] == "CanaryHold" and Counter(fleet.revisions()) == Counter({old: 2, new: 1})
                  and not any("pdfleet.io/drain-started" in (p.metadata.annotations or {}) for p in live))
            return new if ok and new != old else None

        new = fleet.wait(held, 120, "canary hold: 1 new pod, 2 old, no drain in flight")
        traffic.wait_served(4, new)  # the canary takes traffic ...
        traffic.wait_served(4, old)  # ... and so do the old pods
        hold_start = time.monotonic()
        while time.monotonic() - hold_start < 5:  # it holds: passes keep coming (events, 10 s resync)
            assert Counter(fleet.revisions()) == Counter({old: 2, new: 1}), fleet.revisions()
            assert _phase(fleet) == "CanaryHold"
            time.sleep(0.5)
        assert timeline.max_alive_on(new) == 1  # never more than the canary on the new revision
        assert "canary" in fleet.status()["rollout"]["message"]

        # Canary cleared, paused as soon as an old pod's drain started: that committed drain finishes,
        # nothing new starts.
        fleet.patch({"rollout": {"canaryReplicas": None}})
        fleet.wait(lambda: any(s.revision == old and s.draining for s in timeline.now().values()), 90,
                   "the drain of an old pod started")
        fleet.patch({"rollout": {"paused": True}})
        fleet.wait(lambda: _phase(fleet) == "Paused", 30, "phase Paused")
        time.sleep(1.0)  # the watch has seen every action of the passes before the pause
        at_pause = timeline.snapshots[-1]
        draining = {n for n, s in at_pause[1].items() if s.role == "decode" and s.draining}
        fleet.wait(lambda: not (draining & {p.metadata.name for p in fleet.live_pods()}), 60,
                   "committed drains finished")
        time.sleep(4)
        assert _phase(fleet) == "Paused"
        after = [snap for t, snap in timeline.snapshots if t > at_pause[0]]
        created = {n for snap in after for n, s in snap.items() if s.role == "decode"} - set(at_pause[1])
        drains = {n for snap in after for n, s in snap.items() if s.role == "decode" and s.draining} - draining
        assert not created and not drains, (created, drains)
        assert Counter(fleet.revisions())[old] >= 1  # still mid-rollout

        fleet.patch({"rollout": {"paused": False}})
        fleet.wait(lambda: _settled(fleet, new, 3), 180, "rollout resumed and complete")
        traffic.wait_served(4, new)
        traffic.stop()
        timeline.stop()
        traffic.assert_clean()  # zero client failures, router retries and failed transfers, every answer verified
        assert timeline.max_pods() <= 4, timeline.max_pods()
        assert timeline.min_routable_ready() >= 3, timeline.lowest()
        assert not fleet.forced_deletes()


def test_an_image_failing_its_canary_transfer_is_rolled_back(cluster: LocalCluster, operator: OperatorProcess,
                                                             namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods", image_args={BAD: ("--fault-corrupt-received",)}) as fleet:
        [stable] = set(fleet.revisions())
        timeline = fleet.timeline(synced=3)
        traffic = fleet.traffic()
        traffic.wait_served(4)
        fleet.patch({"decode": {"image": BAD}})

        def rolled_back() -> dict | None:
            st = fleet.status()
            conds = {c["type"]: c for c in st["conditions"]}
            d = st["rollout"]["decode"]
            ok = (conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "RolloutFailed"
                  and d["targetRevision"] == d["stableRevision"] == stable and d["failedRevisions"]
                  and fleet.revisions() == [stable] * 2 and fleet.available())
            return st if ok else None

        st = fleet.wait(rolled_back, 120, "automatic rollback to the stable revision")
        decode = st["rollout"]["decode"]
        bad = decode["currentRevision"]
        assert bad != stable and decode["failedRevisions"] == [bad]
        assert "failed its transfer-path gate" in decode["failureReason"], decode
        assert "BytesMismatched" in decode["failureReason"], decode  # the canary's byte check, for real
        assert fleet.pdd()["spec"]["decode"]["image"] == BAD  # the user's spec is never edited
        bad_pods = [s.name for s in fleet.runner.started.values() if s.image == BAD]
        assert bad_pods and all("bytes differ" in fleet.runner.log_of(n) for n in bad_pods)

        time.sleep(3)  # not tried again while the spec names it
        assert fleet.revisions() == [stable] * 2
        traffic.wait_served(4, stable)
        results = traffic.stop()
        timeline.stop()
        # Zero failed transfers on the old revision during the whole episode; the bad pods served nothing.
        traffic.assert_clean()
        assert {r.revision for r in results} == {stable}
        assert not any(s.routable_ready for n, s in timeline.ever().items() if s.revision == bad)
        assert timeline.max_pods() <= 3, timeline.max_pods()
        assert timeline.min_routable_ready() >= 2, timeline.lowest()


def test_pods_stuck_pending_hit_the_deadline_and_roll_back(cluster: LocalCluster, operator: OperatorProcess,
                                                           namespace: str, tmp_path: Path) -> None:
    # drainTimeoutSeconds must stay under progressDeadlineSeconds (admission); real drains here take ~1 s.
    with running_fleet(cluster, namespace, tmp_path / "pods", drainTimeoutSeconds=8) as fleet:
        [stable] = set(fleet.revisions())
        timeline = fleet.timeline(synced=3)
        traffic = fleet.traffic()
        traffic.wait_served(4)
        fleet.patch({"decode": {"nodeSelector": {"pdfleet.io/no-such-node": "x"}},
                     "rollout": {"progressDeadlineSeconds": 10}})

        def rolled_back() -> dict | None:
            st = fleet.status()
            d = st["rollout"]["decode"]
            conds = {c["type"]: c for c in st["conditions"]}
            # Degraded names the deadline (its reason may be the placement check's: no node matches)
            ok = (conds["Degraded"]["status"] == "True" and "no progress" in conds["Degraded"]["message"]
                  and "no progress" in (d.get("failureReason") or "")
                  and d["targetRevision"] == d["stableRevision"] == stable and fleet.settled_on(stable, 2))
            return st if ok else None

        st = fleet.wait(rolled_back, 90, "progress deadline, then back on the stable revision")
        decode = st["rollout"]["decode"]
        assert decode["failedRevisions"] == [decode["currentRevision"]] != [stable]
        assert "progressDeadlineSeconds 10" in decode["failureReason"]
        pending = [n for n, s in timeline.ever().items() if s.revision != stable]
        assert pending and not {s.name for s in fleet.runner.started.values()} & set(pending)  # they never ran
        assert all(p.spec.node_selector is None for p in fleet.live_pods())
        traffic.wait_served(4, stable)
        traffic.stop()
        timeline.stop()
        traffic.assert_clean()
        assert timeline.max_pods() <= 3, timeline.max_pods()
        assert timeline.min_routable_ready() >= 2, timeline.lowest()
        # A pod that was never scheduled has nothing in flight: it goes at once, not forced after the drain
        # deadline (with the default 600 s, a rollback would wait that long for a pod that never ran).
        assert not fleet.forced_deletes()


def test_spec_changes_and_a_revert_mid_rollout_end_on_the_right_revision(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods") as fleet:
        [a] = set(fleet.revisions())
        timeline = fleet.timeline(synced=3)
        traffic = fleet.traffic()
        traffic.wait_served(4)

        def target() -> str:
            return fleet.wait(lambda: (r := _decode_status(fleet).get("currentRevision")) not in seen and r, 30,
                              "the new spec observed")

        seen = {a}
        fleet.patch({"decode": mark("B")})
        b = target()
        seen.add(b)
        fleet.wait(lambda: _mid_rollout(timeline, b, a), 90, "B serving, an A pod going")
        fleet.patch({"decode": mark("C")})  # A -> B -> C while B is mid-rollout
        c = target()
        seen.add(c)
        fleet.wait(lambda: _settled(fleet, c, 2), 180, "ends on C")
        traffic.wait_served(4, c)

        fleet.patch({"decode": mark("D")})
        d = target()
        fleet.wait(lambda: _mid_rollout(timeline, d, c), 90, "D serving, a C pod going")
        fleet.patch({"decode": mark("C")})  # revert mid-rollout
        fleet.wait(lambda: _settled(fleet, c, 2), 180, "reverted: back on C")
        traffic.wait_served(4, c)
        results = traffic.stop()
        timeline.stop()

        traffic.assert_clean()
        assert {b, d} <= {r.revision for r in results}  # both intermediate revisions served before they went
        assert timeline.max_pods() <= 3, timeline.max_pods()
        assert timeline.min_routable_ready() >= 2, timeline.lowest()
        assert not _decode_status(fleet).get("failedRevisions")
        assert not fleet.forced_deletes()


def test_a_prefill_rollout_loses_no_transfer(cluster: LocalCluster, operator: OperatorProcess, namespace: str,
                                             tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods") as fleet:
        [old] = set(fleet.revisions("prefill"))
        [decode] = set(fleet.revisions())
        [old_pod] = fleet.runner.running("prefill").values()
        service = f"{NAME}-prefill"
        assert fleet.resolve(service) == [old_pod.ip]
        timeline = fleet.timeline(synced=3)
        traffic = fleet.traffic()
        traffic.wait_served(4)
        fleet.patch({"prefill": mark("p2")})
        new = fleet.wait(lambda: (r := (fleet.status()["rollout"]["prefill"]).get("targetRevision")) != old and r,
                         30, "the new prefill revision")
        fleet.wait(lambda: _settled(fleet, new, 1, "prefill"), 180, "prefill rolled")
        [new_pod] = fleet.runner.running("prefill").values()
        fleet.wait(lambda: fleet.resolve(service) == [new_pod.ip], 30, "DNS: the new pod only")
        traffic.wait_served(6)
        results = traffic.stop()
        timeline.stop()

        traffic.assert_clean()
        via = Counter(r.answer.prefill for r in results if r.ok)
        assert via[old_pod.bootstrap] >= 1 and via[new_pod.bootstrap] >= 1, via
        in_flight, finished = fleet.drain_log(old_pod.name)
        assert in_flight >= 1, "the old prefill pod had no transfer in flight when its drain started"
        assert finished, fleet.runner.log_of(old_pod.name)[-2000:]
        assert not fleet.forced_deletes()
        assert timeline.max_pods("prefill") <= 2, timeline.max_pods("prefill")
        assert timeline.min_routable_ready("prefill") >= 1, timeline.lowest("prefill")
        assert {s.revision for s in timeline.ever().values()} == {decode}  # decode did not roll
