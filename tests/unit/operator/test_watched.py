"""Watched state: a pass sees the newer of the watched object and the operator's own last write.

The indexes here are plain dicts shaped as kopf's (key -> iterable of bodies); kopf's own index
maintenance is kopf's, exercised by the cluster tests.
"""

from __future__ import annotations

import time

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.apply import fingerprint
from pdfleet_operator.plan import ObservedPod, Snapshot
from pdfleet_operator.rollout_state import decide_rollouts, next_wake
from pdfleet_operator.watched import (
    INDEX_NODES,
    INDEX_PDDEPLOYMENTS,
    OVERLAY_MAX_AGE_S,
    WatchedState,
    index_id,
)

NS, NAME = "ns", "d"


def pod(name: str, rv: int, **meta: object) -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": NS, "resourceVersion": str(rv), **meta}}


def state(pods: list[dict], deployment: dict | None = None) -> tuple[WatchedState, dict]:
    indices = {index_id("pods"): {(NS, NAME): pods}, INDEX_NODES: {"nodes": []},
               INDEX_PDDEPLOYMENTS: {(NS, NAME): [deployment or {"metadata": {"name": NAME, "resourceVersion": "1"}}]},
               "unrelated_index": {}}
    s = WatchedState()
    s.bind(indices)
    return s, indices


def test_a_write_shadows_an_older_watched_copy_until_the_watch_catches_up() -> None:
    s, indices = state([pod("a", 10), pod("b", 11)])
    s.wrote("Pod", NS, NAME, pod("a", 20, labels={"pdfleet.io/routable": "false"}))
    seen = {p["metadata"]["name"]: p for p in s.view(NS, NAME).of("Pod")}
    assert seen["a"]["metadata"]["resourceVersion"] == "20" and seen["b"]["metadata"]["resourceVersion"] == "11"
    indices[index_id("pods")][(NS, NAME)] = [pod("a", 21), pod("b", 11)]  # the watch delivered a newer one
    seen = {p["metadata"]["name"]: p for p in s.view(NS, NAME).of("Pod")}
    assert seen["a"]["metadata"]["resourceVersion"] == "21"
    assert not s._overlay  # caught up: the overlay let go


def test_a_created_object_is_seen_before_its_watch_event() -> None:
    s, _ = state([])
    s.wrote("Pod", NS, NAME, pod("new", 5))
    assert [p["metadata"]["name"] for p in s.view(NS, NAME).of("Pod")] == ["new"]
    assert s.view("other", NAME).of("Pod") == []  # another namespace's deployment of the same name


def test_a_deleted_pod_stays_terminating_until_the_watch_sees_it_go() -> None:
    s, indices = state([pod("a", 10)])
    s.wrote("Pod", NS, NAME, pod("a", 12, deletionTimestamp="2026-01-01T00:00:00Z"), deleted=True)
    (seen,) = s.view(NS, NAME).of("Pod")
    assert seen["metadata"]["deletionTimestamp"]
    indices[index_id("pods")][(NS, NAME)] = []  # DELETED arrived
    assert s.view(NS, NAME).of("Pod") == [] and not s._overlay


def test_an_older_write_never_replaces_a_newer_one() -> None:
    s, _ = state([])
    s.wrote("Pod", NS, NAME, pod("a", 30))
    s.wrote("Pod", NS, NAME, pod("a", 29))  # a slower thread's answer
    assert s.view(NS, NAME).of("Pod")[0]["metadata"]["resourceVersion"] == "30"


def test_the_status_write_is_seen_by_the_next_pass() -> None:
    s, _ = state([], {"metadata": {"name": NAME, "resourceVersion": "3"}, "status": {"rollout": {"phase": "Old"}}})
    s.wrote("PDDeployment", NS, NAME, {"metadata": {"name": NAME, "resourceVersion": "4"},
                                        "status": {"rollout": {"phase": "New"}}})
    assert s.view(NS, NAME).body["status"]["rollout"]["phase"] == "New"


def test_an_unconfirmed_write_expires(monkeypatch) -> None:
    s, _ = state([])
    s.wrote("Pod", NS, NAME, pod("ghost", 5))
    later = time.monotonic() + OVERLAY_MAX_AGE_S + 1
    monkeypatch.setattr("pdfleet_operator.watched.time.monotonic", lambda: later)
    assert s.view(NS, NAME).of("Pod") == []


def test_answers_that_are_not_objects_are_ignored() -> None:
    s, _ = state([])
    s.wrote("Pod", NS, NAME, {"kind": "Status", "metadata": {}})
    s.wrote("Pod", NS, NAME, None)
    assert not s._overlay


def test_fingerprint_ignores_status_and_server_bookkeeping_only() -> None:
    base = {"metadata": {"name": "x", "labels": {"a": "1"}, "resourceVersion": "1", "managedFields": []},
            "spec": {"k": 1}, "status": {"ready": 0}}
    same = {**base, "metadata": {**base["metadata"], "resourceVersion": "9", "managedFields": [{}]},
            "status": {"ready": 3}}
    assert fingerprint(base) == fingerprint(same)
    assert fingerprint(base) != fingerprint({**base, "spec": {"k": 2}})  # an edit to what we apply
    assert fingerprint(base) != fingerprint({**base, "metadata": {**base["metadata"], "labels": {}}})
    assert fingerprint(base) != fingerprint(None)  # deleted


SPEC = PDDeploymentSpec.model_validate({
    "model": {"layout": {"preset": "llama-dense"}},
    "transfer": {"backend": "mooncake", "protocol": "tcp"},
    "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "i:1"},
    "decode": {"replicas": 2, "parallelism": {"tensor": 1}, "image": "i:1"},
    "rollout": {"drainTimeoutSeconds": 60, "progressDeadlineSeconds": 600},
})


def test_next_wake_is_the_earliest_time_only_decision() -> None:
    now = 1000.0
    pods = (ObservedPod("p", Role.PREFILL, "r", 0, ready=True, gate="True", running_since=now - 5),
            ObservedPod("d0", Role.DECODE, "r", 0, ready=True, drain_started=now - 50, gate="True"),
            ObservedPod("d1", Role.DECODE, "r", 1, ready=False, gate=None, running_since=now - 10))
    snap = Snapshot(pods=pods)
    wake = next_wake(SPEC, snap, decide_rollouts(SPEC, snap, None, now), now)
    assert wake is not None and 9.9 < wake < 10.2  # d0's drain deadline: 60 s after it started
    # No drain and no gate pending: the rollout's progress deadline is the next decision.
    quiet = Snapshot(pods=(pods[0],))
    wake = next_wake(SPEC, quiet, decide_rollouts(SPEC, quiet, None, now), now)
    assert wake is not None and 599.9 < wake < 600.2


def test_a_fresh_listing_drops_what_a_relist_left_behind_but_not_what_came_after_it() -> None:
    ghost = pod("ghost", 5, uid="u-ghost")
    newer_pod = pod("new", 12, uid="u-new")  # created after the listing was taken
    kept = pod("kept", 6, uid="u-kept")
    s, _ = state([ghost, newer_pod, kept])
    s.confirm(NS, NAME, "Pod", {"metadata": {"resourceVersion": "10"}, "items": [kept]})
    assert sorted(p["metadata"]["name"] for p in s.view(NS, NAME).of("Pod")) == ["kept", "new"]
