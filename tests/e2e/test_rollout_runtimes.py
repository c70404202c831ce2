"""A decode rollout with real runtime processes (1 prefill, 2 decode, tp 1) on kwok pods, driven by
the kwok pod runner (a test harness, see pod_runner.py), with synthetic requests flowing.

The prefill is started with a write delay so every transfer takes a while: each old decode pod
then has a transfer in flight when its drain starts. The rollout must end with zero failed or lost
transfers, and every admitted request's state verified byte for byte on decode.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client import CoreV1Api

from pdfleet_operator.devcluster import LocalCluster
from tests.cluster.conftest import OperatorProcess
from tests.e2e.pod_runner import PodRunner, wait

pytestmark = pytest.mark.cluster

WRITE_DELAY_S = 0.4


def manifest(ns: str, env_value: str) -> dict:
    role = {"parallelism": {"tensor": 1}, "image": "example.invalid/runtime:local",
            "pool": {"maxConcurrentRequests": 8, "kvTokensPerReplica": 2048}}
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": "live", "namespace": ns},
        "spec": {
            "model": {"layout": {"preset": "llama-dense"}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "prefill": {"replicas": 1, **role},
            "decode": {"replicas": 2, **role, "env": [{"name": "ROLLOUT_MARK", "value": env_value}]},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 60,
                        "progressDeadlineSeconds": 300},
        },
    }


class Traffic(threading.Thread):
    """Synthetic requests, back to back, two workers per routable ready decode pod, until stopped.

    A worker sends its next request as soon as the last one answers, so with each transfer taking
    ``WRITE_DELAY_S`` a pod always has transfers in flight; workers of a pod that turned unroutable
    (its drain started) stop sending, and their last requests finish during the drain."""

    def __init__(self, core: CoreV1Api, runner: PodRunner, ns: str) -> None:
        super().__init__(daemon=True)
        self.core, self.runner, self.ns = core, runner, ns
        self.stop_event = threading.Event()
        self.results: list[tuple[str, int, dict]] = []
        self.lock = threading.Lock()
        self.routable: set[str] = set()
        self.workers: dict[str, list[threading.Thread]] = {}
        self.sent = 0

    def _targets(self) -> set[str]:
        pods = self.core.list_namespaced_pod(self.ns, label_selector="pdfleet.io/role=decode,pdfleet.io/routable=true")
        return {p.metadata.name for p in pods.items if p.metadata.deletion_timestamp is None
                and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())}

    def _worker(self, name: str) -> None:
        while not self.stop_event.is_set() and name in self.routable:
            local = self.runner.decode_pods().get(name)
            if local is None:
                return
            with self.lock:
                self.sent += 1
                n = self.sent
            code, body = local.synthetic(tokens=64, timeout_s=30, requestId=f"e2e-{name[-12:]}-{n}", seed=n)
            with self.lock:
                self.results.append((name, code, body if isinstance(body, dict) else {"raw": body}))

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.routable = self._targets()
            for name in self.routable - set(self.workers):
                self.workers[name] = [threading.Thread(target=self._worker, args=(name,), daemon=True)
                                      for _ in range(2)]
                for w in self.workers[name]:
                    w.start()
            self.stop_event.wait(0.1)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)
        for ws in self.workers.values():
            for w in ws:
                w.join(timeout=60)


@pytest.fixture
def live(cluster: LocalCluster, operator: OperatorProcess, namespace: str,
         tmp_path: Path) -> Iterator[tuple[str, CoreV1Api, PodRunner]]:
    api = cluster.api_client()
    core = CoreV1Api(api)
    runner = PodRunner(api, namespace, cluster.kubeconfig, tmp_path / "pods",
                       extra_args={"prefill": ("--fault-write-delay", str(WRITE_DELAY_S)),
                                   # the write delay slows every transfer on purpose: lower the floor to match
                                   "decode": ("--canary-period", "2", "--retry-period", "0.5",
                                              "--floor-gbps", "0.001")})
    runner.start()
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(namespace, "v1")))
    try:
        try:
            wait(lambda: _available(cluster, namespace), 180, "Available through real runtimes' gates")
        except AssertionError:
            keep = ("readiness", "gate", "drain", "ERROR", "WARNING", "Traceback")
            logs = "\n".join(f"--- {n}\n" + "\n".join([ln for ln in t.splitlines() if any(k in ln for k in keep)][-15:])
                             for n, t in runner.all_logs().items())
            pods = cluster.kubectl("-n", namespace, "get", "pods", "-o", "wide").stdout
            pods += cluster.kubectl("-n", namespace, "get", "pdd", "live", "-o", "jsonpath={.status}").stdout
            raise AssertionError(f"not Available; runner errors {runner.errors[-3:]}\n{pods}\n{logs}") from None
        yield namespace, core, runner
    finally:
        runner.shutdown()


def _available(cluster: LocalCluster, ns: str) -> bool:
    obj = json.loads(cluster.kubectl("-n", ns, "get", "pdd", "live", "-o", "json").stdout)
    st = obj.get("status") or {}
    conds = {c["type"]: c["status"] for c in st.get("conditions") or ()}
    return conds.get("Available") == "True" and (st.get("rollout") or {}).get("phase") == "Complete"


def test_decode_rollout_with_traffic_loses_nothing(cluster: LocalCluster,
                                                    live: tuple[str, CoreV1Api, PodRunner]) -> None:
    ns, core, runner = live
    gates = {p.metadata.name: {c.type: (c.status, c.reason) for c in p.status.conditions or ()}
             for p in core.list_namespaced_pod(ns).items}
    assert all(g["pdfleet.io/transfer-path"][0] == "True" for g in gates.values()), gates
    old = set(runner.decode_pods())
    traffic = Traffic(core, runner, ns)
    traffic.start()
    wait(lambda: sum(code == 200 for _, code, _ in traffic.results) >= 4, 60, "traffic flowing")
    cluster.kubectl("-n", ns, "patch", "pdd", "live", "--type=merge",
                    "-p", json.dumps({"spec": manifest(ns, "v2")["spec"]}))
    wait(lambda: not (old & set(runner.decode_pods())) and _available(cluster, ns), 240, "rollout complete")
    wait(lambda: sum(code == 200 and name not in old for name, code, _ in traffic.results) >= 4, 60,
         "traffic on the new pods")
    traffic.stop()

    admitted = [(n, c, b) for n, c, b in traffic.results if not (c == 503 and "draining" in json.dumps(b))]
    failed = [(n, c, b) for n, c, b in admitted if c != 200 or not b.get("ok")]
    assert not failed, failed[:5]
    assert all(b.get("mismatchedBytes") == 0 for _, _, b in admitted), admitted[:3]  # verified, no byte differs
    logs = runner.all_logs()
    for name in old:
        m = re.search(r"drain started: (\d+) transfers in flight", logs[name])
        assert m and int(m.group(1)) >= 1, f"{name} had no transfer in flight when its drain started"
        assert "drain finished" in logs[name], logs[name][-2000:]
    events = json.loads(cluster.kubectl("-n", ns, "get", "events", "-o", "json").stdout)["items"]
    assert not [e for e in events if "FORCED" in e.get("message", "")]
