"""Decode rollouts on the real control plane: an 8-pod decode fleet rolls to a new image within
maxSurge 2 / maxUnavailable 0, as seen by a watch started before the rollout; and an operator
killed mid-rollout resumes without double or lost drains.

``RuntimeStandIn`` (a stand-in for the runtime, named as such) sets each Running pod's
transfer-path gate and reports a draining pod drained shortly after its drain starts.
"""

from __future__ import annotations

import threading
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



def manifest(ns: str, image: str, replicas: int = 8) -> dict:
    return {
        "apiVersion": "pdfleet.io/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": "roll", "namespace": ns},
        "spec": {
            "model": {"layout": {"preset": "llama-dense"}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "example.invalid/rt:1"},
            "decode": {"replicas": replicas, "parallelism": {"tensor": 1}, "image": image},
            "rollout": {"maxSurge": 2, "maxUnavailable": 0, "drainTimeoutSeconds": 60},
        },
    }


@dataclass
class Watcher:
    """Records, after every decode pod event, the counts the invariants speak of."""

    core: CoreV1Api
    ns: str
    pods: dict[str, object] = field(default_factory=dict)
    min_gated: int = 10**9
    min_routable_ready: int = 10**9
    max_pods: int = 0
    drain_stamps: dict[str, set[str]] = field(default_factory=dict)
    armed: bool = False  # record minima only once the fleet is at full strength
    error: Exception | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # the watch ends when the cluster goes; before stop() it is a failure
            if not self._stop.is_set():
                self.error = exc

    def _watch(self) -> None:
        w = watch.Watch()
        for ev in w.stream(self.core.list_namespaced_pod, self.ns, label_selector="pdfleet.io/role=decode",
                           timeout_seconds=600):
            pod = ev["object"]
            if ev["type"] == "DELETED":
                self.pods.pop(pod.metadata.name, None)
            else:
                self.pods[pod.metadata.name] = pod
                stamp = (pod.metadata.annotations or {}).get(DRAIN_ANNOTATION)
                if stamp:
                    self.drain_stamps.setdefault(pod.metadata.name, set()).add(stamp)
            self._record()
            if self._stop.is_set():
                w.stop()

    def _record(self) -> None:
        gated = routable = 0
        for pod in self.pods.values():
            conds = {c.type: c.status for c in pod.status.conditions or ()}
            alive = pod.metadata.deletion_timestamp is None
            if alive and conds.get(READINESS_GATE) == "True":
                gated += 1
                if conds.get("Ready") == "True" and (pod.metadata.labels or {}).get("pdfleet.io/routable") == "true":
                    routable += 1
        self.max_pods = max(self.max_pods, len(self.pods))
        if self.armed:
            self.min_gated = min(self.min_gated, gated)
            self.min_routable_ready = min(self.min_routable_ready, routable)

    def stop(self) -> None:
        assert self.error is None, f"the watch broke during the rollout: {self.error!r}"
        self._stop.set()


@pytest.fixture
def fleet(cluster: LocalCluster, operator: OperatorProcess, namespace: str) -> Iterator[tuple[str, CoreV1Api]]:
    api = cluster.api_client()
    core = CoreV1Api(api)
    standin = RuntimeStandIn(api, namespace)
    standin.start()
    CustomObjectsApi(api).create_namespaced_custom_object(
        "pdfleet.io", "v1alpha1", namespace, "pddeployments", manifest(namespace, "example.invalid/rt:1"))
    wait_until(lambda: _available(cluster, namespace), what="8 decode pods Available", timeout=120)
    yield namespace, core
    standin.stop()


def _available(cluster: LocalCluster, ns: str) -> bool:
    import json

    obj = json.loads(cluster.kubectl("-n", ns, "get", "pdd", "roll", "-o", "json").stdout)
    conds = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or ()}
    return conds.get("Available") == "True" and conds.get("Progressing") == "False"


def _images(core: CoreV1Api, ns: str) -> set[str]:
    pods = core.list_namespaced_pod(ns, label_selector="pdfleet.io/role=decode").items
    return {p.spec.containers[0].image for p in pods}


def _roll_to(cluster: LocalCluster, ns: str, image: str) -> None:
    import json

    cluster.kubectl("-n", ns, "patch", "pdd", "roll", "--type=merge",
                    "-p", json.dumps({"spec": {"decode": {"image": image}}}))


def test_decode_rollout_keeps_capacity_and_surge(cluster: LocalCluster, fleet: tuple[str, CoreV1Api]) -> None:
    ns, core = fleet
    w = Watcher(core, ns)
    w.start()
    wait_until(lambda: len(w.pods) == 8, what="watch synced")
    w.armed = True
    _roll_to(cluster, ns, "example.invalid/rt:2")
    wait_until(lambda: _images(core, ns) == {"example.invalid/rt:2"} and len(w.pods) == 8 and _available(cluster, ns),
               what="rollout complete", timeout=240)
    w.stop()
    assert w.min_gated >= 8, w.min_gated
    assert w.min_routable_ready >= 8, w.min_routable_ready
    assert w.max_pods <= 10, w.max_pods
    assert len(w.drain_stamps) == 8  # every old pod drained before it went
    assert all(len(stamps) == 1 for stamps in w.drain_stamps.values()), w.drain_stamps


def test_operator_killed_mid_rollout_resumes_without_double_drains(
    cluster: LocalCluster, operator: OperatorProcess, fleet: tuple[str, CoreV1Api]
) -> None:
    ns, core = fleet
    w = Watcher(core, ns)
    w.start()
    wait_until(lambda: len(w.pods) == 8, what="watch synced")
    w.armed = True
    _roll_to(cluster, ns, "example.invalid/rt:3")
    # Kill it mid-scale-up (new pods exist), restart; then kill it mid-drain, restart.
    wait_until(lambda: "example.invalid/rt:3" in _images(core, ns), what="first new pods", timeout=60)
    operator.proc.kill()
    operator.proc.wait(timeout=10)
    operator.start()
    wait_until(lambda: any(len(s) for s in w.drain_stamps.values()), what="a drain started", timeout=60)
    operator.proc.kill()
    operator.proc.wait(timeout=10)
    operator.start()
    wait_until(lambda: _images(core, ns) == {"example.invalid/rt:3"} and len(w.pods) == 8 and _available(cluster, ns),
               what="rollout complete after restarts", timeout=240)
    w.stop()
    assert w.max_pods <= 10 and w.min_routable_ready >= 8
    assert len(w.drain_stamps) == 8
    assert all(len(stamps) == 1 for stamps in w.drain_stamps.values()), w.drain_stamps
