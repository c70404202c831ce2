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


def test_the_bench_manifest_is_admitted_with_small_pools_on_both_roles() -> None:
    from rollout_real import manifest

    from pdfleet_operator.api.models import PDDeploymentSpec
    from pdfleet_operator.validation import validate_object
    from pdfleet_runtime.layouts import rank_state_bytes, resolve_layout

    m = manifest("ns", 32, "v1", 2, 0, 60)
    verdict = validate_object(m)
    assert verdict.admitted, verdict.violations
    spec = PDDeploymentSpec.model_validate(m["spec"])
    layout = resolve_layout(spec.model.layout)
    mib = {role: rank_state_bytes(layout, 1, 1, 0, r.pool.max_concurrent_requests, r.pool.kv_tokens_per_replica) / 2**20
           for role, r in (("prefill", spec.prefill), ("decode", spec.decode))}
    assert mib == {"prefill": 24.0, "decode": 17.0}  # llama-dense's pages on 2 layers: 128 KiB a page
    assert rank_state_bytes(resolve_layout("llama-dense"), 1, 1, 0, 8, 2048) / 2**20 == 272.0  # the bench before


ROLLUP = """55d0c0000000-7ffc00000000 ---p 00000000 00:00 0                          [rollup]
Rss:              614400 kB
Pss:              402000 kB
Shared_Clean:     204800 kB
Private_Clean:      1024 kB
Private_Dirty:    399360 kB
Swap:                  0 kB
"""


def test_pod_memory_sums_a_process_tree_from_smaps_rollup() -> None:
    from pod_memory import descendants, parse_rollup, summarize

    r = parse_rollup(ROLLUP)
    assert r["Rss"] == 614400 and r["Private_Dirty"] == 399360 and "[rollup]" not in "".join(r)
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 13: 11, 20: 1, 14: 12}  # 10 -> sh 11 -> serve's ranks 12, 13 -> 14
    assert descendants(11, parents) == [11, 12, 13, 14]
    pod = summarize([{"pid": 11, "rss_mib": 90.0, "pss_mib": 60.5, "private_mib": 50.0},
                     {"pid": 12, "rss_mib": 600.0, "pss_mib": 392.6, "private_mib": 391.0}])
    assert (pod["rss_mib"], pod["pss_mib"], pod["private_mib"]) == (690.0, 453.1, 441.0)


def test_memory_sampler_reads_the_runtime_pods_of_a_kubelet_and_skips_the_rest() -> None:
    import os

    from pod_memory import MemorySampler

    def pod(name: str, role: str | None, pid: int) -> _Obj:
        return _Obj(name=name, started=True, proc=_Obj(pid=pid),
                    pod={"metadata": {"labels": {"pdfleet.io/role": role} if role else {}}})

    runner = _Obj(pods={"u1": pod("decode-a", "decode", os.getpid()), "u2": pod("router", None, os.getpid())})
    sampler = MemorySampler(runner, period_s=60)
    sampler.sample()
    out = sampler.stop()  # never started: stop joins nothing
    assert list(out["per_pod"]) == ["decode-a"] and out["samples"] == 1
    me = out["per_pod"]["decode-a"]
    assert me["processes"][0]["pid"] == os.getpid() and me["rss_mib"] >= me["private_mib"] > 0
    assert out["peak_all_pods_at_once"]["pods"] == 1 and out["per_role"]["decode"]["pods"] == 1
