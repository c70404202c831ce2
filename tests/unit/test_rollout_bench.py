"""What bench/rollout.py reads, checked on recorded stamps: the per-phase breakdown of a rollout (a
pdfleet pod's drain before its delete, a Deployment's delete as its drain), the router's drop of a
pod attributed by IP even when a later pod reuses it, and the drain steps parsed from a runtime log."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rollout_router import ABSENT, HEALTHY, UNHEALTHY, RouterWatch, drain_stamps
from rollout_watch import PodWatch, Stamps


def _watch(pods: dict[str, Stamps]) -> PodWatch:
    w = PodWatch(core=None, namespace="ns", selector="x", replicas=1, surge=1, unavailable=0)
    w.pods.update(pods)
    return w


def test_breakdown_names_each_phase_of_a_pdfleet_step() -> None:
    old = Stamps(seen=0.0, ready=1.0, drain_requested=10.0, drained=15.0, deleting=15.2, gone=15.3, image="v1")
    new = Stamps(seen=2.0, scheduled=2.1, running=2.3, runtime_up=6.3, gate=9.3, ready=9.4, image="v2")
    steps = _watch({"old": old, "new": new}).breakdown("v2", since=1.5, extra={
        "old": {"drain_started": 10.5, "router_dropped": 12.0, "admission_stopped": 14.5, "drain_finished": 14.6},
        "new": {"router_added": 9.6}})
    assert steps["new_pods"] == 1 and steps["old_pods_gone"] == 1
    assert steps["new_pod"] == {"seen_to_scheduled_s": 0.1, "scheduled_to_running_s": 0.2, "running_to_runtime_up_s": 4.0,
                                "runtime_up_to_gate_s": 3.0, "gate_to_ready_s": 0.1, "ready_to_router_added_s": 0.2}
    assert steps["old_pod"] == {"drain_requested_to_drain_started_s": 0.5, "drain_started_to_router_dropped_s": 1.5,
                                "router_dropped_to_admission_stopped_s": 2.5, "admission_stopped_to_drain_finished_s": 0.1,
                                "drain_finished_to_drained_s": 0.4, "drained_to_deleting_s": 0.2,
                                "deleting_to_gone_s": 0.1}
    assert steps["old_pod_request_to_gone_s"] == 5.3
    assert steps["ready_to_next_drain_request_s"] == 0.6  # the new pod Ready at 9.4, the drain at 10.0
    assert steps["pods"]["old"]["gone"] == 13.8  # seconds from the rollout's start


def test_a_deployments_delete_is_its_drain_request_and_an_earlier_step_reads_negative() -> None:
    old = Stamps(seen=0.0, ready=1.0, deleting=10.0, gone=10.2, image="v1")
    steps = _watch({"old": old}).breakdown(None, since=5.0, extra={
        "old": {"router_dropped": 10.1, "drain_started": 12.0, "drain_finished": 18.0}})
    assert steps["old_pod"] == {"drain_requested_to_drain_started_s": 2.0, "drain_started_to_router_dropped_s": -1.9,
                                "router_dropped_to_drain_finished_s": 7.9, "drain_finished_to_gone_s": -7.8}
    assert steps["old_pod_request_to_gone_s"] == 0.2  # the API let it go while its preStop drain still ran


def test_router_drop_is_read_after_the_drain_request_and_not_from_the_pod_that_reuses_the_ip() -> None:
    rw = RouterWatch("http://router", "key")
    rw.transitions = {"http://10.0.0.5:8080": [(1.0, HEALTHY), (12.0, UNHEALTHY), (14.0, ABSENT), (20.0, HEALTHY),
                                               (40.0, UNHEALTHY)]}
    old = Stamps(seen=0.0, drain_requested=10.0, ip="10.0.0.5")
    reuse = Stamps(seen=18.0, drain_requested=35.0, ip="10.0.0.5")
    stamps = rw.stamps({"old": old, "new": reuse})
    assert stamps["old"] == {"router_added": 1.0, "router_dropped": 12.0}
    assert stamps["new"] == {"router_added": 20.0, "router_dropped": 40.0}


def test_drain_stamps_from_a_runtime_log() -> None:
    t0 = time.time()
    def at(dt: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0 + dt)) + f",{int((t0 + dt) % 1 * 1000):03d}"
    log = "\n".join([
        f"{at(0)} INFO pod pdfleet_runtime.server.app: drain started: 2 transfers in flight; /health 503, admitting for 4s more",
        f"{at(4)} INFO pod pdfleet_runtime.server.app: admission stopped: 1 transfers in flight",
        f"{at(4.5)} INFO pod pdfleet_runtime.server.drain: drain finished after 4.50s",
        "a line without a stamp: drain started: ignored",
    ])
    got = drain_stamps(log)
    offset = time.time() - time.monotonic()
    assert set(got) == {"drain_started", "admission_stopped", "drain_finished"}
    assert abs(got["drain_started"] + offset - t0) < 0.01
    assert abs(got["drain_finished"] - got["drain_started"] - 4.5) < 0.01


class _Obj:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


def _pod(name: str, *, ready: bool, routable: bool = True, deleting: bool = False) -> _Obj:
    cond = _Obj(type="Ready", status="True" if ready else "False")
    return _Obj(metadata=_Obj(name=name, labels={"pdfleet.io/routable": "true" if routable else "false"},
                              annotations={}, deletion_timestamp="now" if deleting else None, resource_version="1"),
                spec=_Obj(containers=[_Obj(image="v1", env=[])]),
                status=_Obj(conditions=[cond], pod_ip="10.0.0.1", phase="Running"))


def test_a_floor_broken_by_pods_failing_is_told_apart_from_one_broken_by_a_drain() -> None:
    w = PodWatch(core=None, namespace="ns", selector="x", replicas=2, surge=1, unavailable=0)
    w._saw("ADDED", _pod("a", ready=True))
    w._saw("ADDED", _pod("b", ready=True))
    w._saw("MODIFIED", _pod("a", ready=False))  # its gate went false on its own: an outage
    assert len(w.violations) == 1 and w.floor_breaks_by_removal == []
    w._saw("MODIFIED", _pod("a", ready=True))
    w._saw("MODIFIED", _pod("b", ready=True, routable=False))  # made unroutable: a drain below the floor
    assert w.floor_breaks_by_removal == ["b taken out leaving 1 routable ready"]
