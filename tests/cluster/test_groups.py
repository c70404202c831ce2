"""Replica groups on the real control plane: an SGLang PDDeployment whose replicas span 2 nodes each
(kwok nodes: nothing runs in the pods, the test or ``RuntimeStandIn`` sets their transfer-path gates).

* complete groups are created, one member per node (the scheduler's required anti-affinity);
* the deployment is Available only once every member of every group passed its gate;
* deleting one member restarts its whole group (the survivor is deleted, a new group made);
* a decode group rollout (maxSurge 1, maxUnavailable 0), read from a watch started before it: never
  more than replicas + 1 groups, never fewer than ``replicas`` ready groups, every old group drained
  through its leader once and deleted as a whole.

The orchestration is the same for both engines; tests/e2e/test_groups_runtimes.py runs real built-in
runtime groups through the router.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from kubernetes import watch
from kubernetes.client import CoreV1Api, CustomObjectsApi

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.standin import DRAIN_ANNOTATION, RuntimeStandIn
from pdfleet_runtime.config import READINESS_GATE
from tests.cluster.conftest import OperatorProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

NAME = "grp"
REPLICAS = 2
GROUP = "pdfleet.io/group"


def manifest(ns: str) -> dict:
    role = {"parallelism": {"tensor": 2, "nodesPerReplica": 2}, "image": "example.invalid/rt:1"}
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "engine": {"kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
            "model": {"layout": {"preset": "qwen3.8-flash-next"},
                      "source": {"huggingFace": {"id": "Qwen/Qwen3.8-Flash-Next"}}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "prefill": {"replicas": 1, **role},
            "decode": {"replicas": REPLICAS, **role},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 30},
        },
    }


def _pdd(cluster: LocalCluster, ns: str) -> dict:
    return json.loads(cluster.kubectl("-n", ns, "get", "pdd", NAME, "-o", "json").stdout)


def _conditions(cluster: LocalCluster, ns: str) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (_pdd(cluster, ns).get("status") or {}).get("conditions") or ()}


def _live(core: CoreV1Api, ns: str, role: str | None = None) -> list:
    selector = f"pdfleet.io/deployment={NAME}" + (f",pdfleet.io/role={role}" if role else "")
    return [p for p in core.list_namespaced_pod(ns, label_selector=selector).items
            if p.metadata.deletion_timestamp is None]


def _groups(pods: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in pods:
        out.setdefault(p.metadata.labels[GROUP], []).append(p)
    return out


def _gate(core: CoreV1Api, ns: str, pod: str) -> None:
    body = {"status": {"conditions": [{"type": READINESS_GATE, "status": "True", "reason": "TestSetsIt",
                                       "message": "set by the test (nothing runs in a kwok pod)"}]}}
    core.patch_namespaced_pod_status(pod, ns, body)


def _running(pods: list) -> bool:
    return all(p.status.phase == "Running" and p.spec.node_name for p in pods)


@pytest.fixture
def deployment(cluster: LocalCluster, operator: OperatorProcess, namespace: str) -> Iterator[tuple[str, CoreV1Api]]:
    api = cluster.api_client()
    CustomObjectsApi(api).create_namespaced_custom_object(
        "pdfleet.io", "v1alpha1", namespace, "pddeployments", manifest(namespace))
    yield namespace, CoreV1Api(api)


def test_groups_spread_over_nodes_are_available_only_when_complete_and_restart_as_a_unit(
        cluster: LocalCluster, deployment: tuple[str, CoreV1Api]) -> None:
    ns, core = deployment
    pods = wait_until(lambda: (p := _live(core, ns)) and len(p) == 6 and _running(p) and p,
                      what="3 groups of 2 pods running", timeout=90)
    groups = _groups(pods)
    assert len(groups) == 3
    for leader, members in groups.items():
        assert sorted(p.metadata.labels["pdfleet.io/group-member"] for p in members) == ["0", "1"]
        assert len({p.spec.node_name for p in members}) == 2, f"group {leader} shares a node"
        assert {p.metadata.name for p in members} == {leader, f"{leader}-m1"}
        for p in members:
            assert p.spec.subdomain == f"{NAME}-{p.metadata.labels['pdfleet.io/role']}-group"
    svc = core.read_namespaced_service(f"{NAME}-decode-group", ns)
    assert svc.spec.publish_not_ready_addresses is True and svc.spec.cluster_ip == "None"
    assert core.read_namespaced_service(f"{NAME}-decode", ns).spec.selector["pdfleet.io/group-member"] == "0"

    # every member but one passes its gate: that one's group, and so the deployment, is not ready
    held = next(p for p in pods if p.metadata.labels["pdfleet.io/role"] == "decode"
                and p.metadata.labels["pdfleet.io/group-member"] == "1")
    for p in pods:
        if p.metadata.name != held.metadata.name:
            _gate(core, ns, p.metadata.name)
    wait_until(lambda: (_pdd(cluster, ns).get("status") or {}).get("decodeReady") == f"1/{REPLICAS}"
               and (_pdd(cluster, ns).get("status") or {}).get("prefillReady") == "1/1",
               what="decode 1/2 groups ready", timeout=60)
    assert _conditions(cluster, ns).get("Available") == "False"
    _gate(core, ns, held.metadata.name)
    wait_until(lambda: _conditions(cluster, ns).get("Available") == "True", what="Available", timeout=60)
    assert (_pdd(cluster, ns).get("status") or {}).get("decodeReady") == f"{REPLICAS}/{REPLICAS}"

    # deleting one member restarts its group: the survivor goes, a complete group comes back
    victim_group = held.metadata.labels[GROUP]
    core.delete_namespaced_pod(held.metadata.name, ns)
    wait_until(lambda: victim_group not in _groups(_live(core, ns, "decode")), what="the survivor deleted",
               timeout=60)
    fresh = wait_until(lambda: (g := _groups(_live(core, ns, "decode"))) and len(g) == REPLICAS
                       and all(len(ms) == 2 and _running(ms) for ms in g.values()) and g,
                       what="a new complete group", timeout=90)
    (new_group,) = set(fresh) - set(groups)
    assert len({p.spec.node_name for p in fresh[new_group]}) == 2
    assert _conditions(cluster, ns).get("Available") == "False"  # its members have not passed their gates
    for p in fresh[new_group]:
        _gate(core, ns, p.metadata.name)
    wait_until(lambda: _conditions(cluster, ns).get("Available") == "True", what="Available again", timeout=60)


@dataclass
class GroupWatcher:
    """Records, after every decode pod event, the groups and ready groups the budgets speak of."""

    core: CoreV1Api
    ns: str
    pods: dict[str, object] = field(default_factory=dict)
    max_groups: int = 0
    min_ready_groups: int = 10**9
    drains: dict[str, set[str]] = field(default_factory=dict)  # pod -> drain stamps seen
    deleted_at: dict[str, list[float]] = field(default_factory=dict)  # group -> its members' deletion times
    armed: bool = False
    error: Exception | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            w = watch.Watch()
            for ev in w.stream(self.core.list_namespaced_pod, self.ns, label_selector="pdfleet.io/role=decode",
                               timeout_seconds=600):
                self._record(ev["type"], ev["object"])
                if self._stop.is_set():
                    w.stop()
        except Exception as exc:  # the watch ends with the cluster; before stop() it is a failure
            if not self._stop.is_set():
                self.error = exc

    def _record(self, kind: str, pod) -> None:
        name, group = pod.metadata.name, pod.metadata.labels[GROUP]
        stamp = (pod.metadata.annotations or {}).get(DRAIN_ANNOTATION)
        if stamp:
            self.drains.setdefault(name, set()).add(stamp)
        if kind == "DELETED" or pod.metadata.deletion_timestamp is not None:
            if name in self.pods:  # first seen going (deletion stamped, or gone at once)
                self.deleted_at.setdefault(group, []).append(time.monotonic())
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod
        groups: dict[str, list] = {}
        for p in self.pods.values():
            groups.setdefault(p.metadata.labels[GROUP], []).append(p)
        ready = sum(len(ms) == 2 and all(
            {c.type: c.status for c in p.status.conditions or ()}.get("Ready") == "True"
            and (p.metadata.labels or {}).get("pdfleet.io/routable") == "true"
            and not (p.metadata.annotations or {}).get(DRAIN_ANNOTATION) for p in ms) for ms in groups.values())
        self.max_groups = max(self.max_groups, len(groups))
        if self.armed:
            self.min_ready_groups = min(self.min_ready_groups, ready)

    def stop(self) -> None:
        assert self.error is None, f"the watch broke during the rollout: {self.error!r}"
        self._stop.set()


def test_decode_group_rollout_keeps_the_budgets_and_deletes_whole_groups(
        cluster: LocalCluster, deployment: tuple[str, CoreV1Api]) -> None:
    ns, core = deployment
    standin = RuntimeStandIn(cluster.api_client(), ns)
    standin.start()
    try:
        wait_until(lambda: _conditions(cluster, ns).get("Available") == "True"
                   and _conditions(cluster, ns).get("Progressing") == "False", what="Available", timeout=120)
        old = set(_groups(_live(core, ns, "decode")))
        w = GroupWatcher(core, ns)
        w.start()
        wait_until(lambda: len(w.pods) == 2 * REPLICAS, what="watch synced")
        w.armed = True
        cluster.kubectl("-n", ns, "patch", "pdd", NAME, "--type=merge",
                        "-p", json.dumps({"spec": {"decode": {"image": "example.invalid/rt:2"}}}))

        def done() -> bool:
            pods = _live(core, ns, "decode")
            return (len(pods) == 2 * REPLICAS and {p.spec.containers[1].image for p in pods} == {"example.invalid/rt:2"}
                    and (_pdd(cluster, ns).get("status") or {}).get("rollout", {}).get("phase") == "Complete")

        wait_until(done, what="decode groups rolled", timeout=240)
        w.stop()
    finally:
        standin.stop()
    print(f"group rollout: at most {w.max_groups} groups, at least {w.min_ready_groups} ready groups, "
          f"{len(w.drains)} drains, deletion spread per old group "
          f"{[round(max(t) - min(t), 2) for t in (w.deleted_at.get(g, [0.0]) for g in sorted(old))]} s")
    assert w.max_groups <= REPLICAS + 1, w.max_groups  # maxSurge 1 group (terminating groups count)
    assert w.min_ready_groups >= REPLICAS, w.min_ready_groups  # maxUnavailable 0 groups
    assert set(w.drains) == old, (w.drains, old)  # the group label is the leader's name  # drained through each old leader only
    assert all(len(stamps) == 1 for stamps in w.drains.values()), w.drains
    for g in old:
        times = w.deleted_at.get(g, [])
        assert len(times) >= 2 and max(times) - min(times) < 5.0, (g, times)  # the group went as a unit
