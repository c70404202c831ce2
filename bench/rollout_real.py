"""The real-runtime arm of bench/rollout.py: both fleets' decode pods run ``pdfleet-runtime serve``
through the harness's kubelet (each pod in its own network namespace at its pod IP, its own
ServiceAccount token), pair with the same real prefill pod, pass the transfer-path gate with a real
canary transfer and drain on their own (pdfleet: the drain annotation; the Deployment: the pod's
preStop hook, which the operator renders into both). Synthetic requests flow through every routable
ready decode pod during both rollouts, each answer verified byte for byte.

The Deployment's pod template is the operator's own decode pod (read back from the API), with a
ServiceAccount whose Role lets any pod of the namespace set its own gate (a Deployment's pod names
are not known beforehand, so the operator's per-pod Role cannot name them). The PDDeployment's decode
fleet is scaled to zero first; its prefill pod, config maps and secret serve both arms.

Traffic goes to the decode pods' synthetic endpoint directly, not through the router: the router
role has not yet run against the built-in runtime's worker API here (docs/router.md: stand-in workers).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_watch import PodWatch

from pdfleet_operator.devcluster import LocalCluster
from pdfleet_runtime.config import READINESS_GATE
from pdfleet_runtime.server.local import http

__all__ = ["RUNTIME_ARGS", "run_real"]

IMAGE = "example.invalid/runtime:local"
WRITE_DELAY_S = 0.2  # each transfer takes a while, so a pod whose drain starts has transfers in flight
RUNTIME_ARGS = {
    "prefill": ("--fault-write-delay", str(WRITE_DELAY_S)),
    # As the end-to-end tests: on a loaded 2-core host a canary's write is slow; its floor is not measured here.
    "decode": ("--canary-period", "2", "--retry-period", "0.5", "--floor-gbps", "0.0002", "--canary-timeout", "30"),
}
LOCAL_ARGS = ("--device", "cpu")  # kwok nodes have no GPU
DEPLOYMENT_LABELS = {"app": "plain", "app.kubernetes.io/managed-by": "pdfleet-operator",
                     "pdfleet.io/role": "decode", "pdfleet.io/deployment": "roll",
                     "pdfleet.io/revision": "plain", "pdfleet.io/routable": "true"}


def manifest(ns: str, decode: int, mark: str, surge: int, unavailable: int, drain_timeout: int) -> dict:
    role = {"parallelism": {"tensor": 1}, "image": IMAGE}
    pool = {"maxConcurrentRequests": 8, "kvTokensPerReplica": 2048}
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": "roll", "namespace": ns},
        "spec": {
            "model": {"layout": {"preset": "llama-dense"}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "prefill": {"replicas": 1, **role, "pool": {**pool, "maxConcurrentRequests": 64}},
            "decode": {"replicas": decode, **role, "pool": pool, "env": [{"name": "ROLLOUT_MARK", "value": mark}]},
            "rollout": {"maxSurge": surge, "maxUnavailable": unavailable, "drainTimeoutSeconds": drain_timeout,
                        "progressDeadlineSeconds": 900},
        },
    }


@dataclass(frozen=True)
class Answer:
    pod: str
    code: int
    body: dict

    @property
    def admitted(self) -> bool:
        """Refused because its own drain started (a router would send it elsewhere): not a failure."""
        return not (self.code == 503 and "draining" in str(self.body.get("error", "")))

    @property
    def ok(self) -> bool:
        return self.code == 200 and bool(self.body.get("ok")) and self.body.get("mismatchedBytes") == 0


class Traffic(threading.Thread):
    """One worker per routable ready decode pod, back to back, until stopped; every answer kept."""

    def __init__(self, core: Any, ns: str, runner: Any) -> None:
        super().__init__(daemon=True)
        self.core, self.ns, self.runner = core, ns, runner
        self.stop_event, self.lock = threading.Event(), threading.Lock()
        self.answers: list[Answer] = []
        self.routable: set[str] = set()
        self.workers: dict[str, threading.Thread] = {}
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
            code, body = http("POST", local.url + "/v1/synthetic",
                              {"tokens": 64, "timeoutS": 30, "requestId": f"bench-{n}", "seed": n}, 60)
            with self.lock:
                self.answers.append(Answer(name, code, body if isinstance(body, dict) else {"raw": body}))

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.routable = self._targets()
            except Exception:  # a slow answer once: ask again
                continue
            for name in self.routable - set(self.workers):
                self.workers[name] = threading.Thread(target=self._worker, args=(name,), daemon=True)
                self.workers[name].start()
            self.stop_event.wait(0.1)

    def stop(self) -> dict:
        self.stop_event.set()
        self.join(timeout=30)
        for w in self.workers.values():
            w.join(timeout=60)
        admitted = [a for a in self.answers if a.admitted]
        failed = [a for a in admitted if not a.ok]
        return {"requests": len(self.answers), "admitted": len(admitted), "ok": len(admitted) - len(failed),
                "failed": len(failed), "failures": [f"{a.pod}: {a.code} {str(a.body)[:160]}" for a in failed[:5]]}


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.3)


def _status(cluster: LocalCluster, ns: str) -> dict:
    return json.loads(cluster.kubectl("-n", ns, "get", "pdd", "roll", "-o", "json").stdout).get("status") or {}


def _pdd_done(cluster: LocalCluster, core: Any, ns: str, n: int, mark: str) -> bool:
    st = _status(cluster, ns)
    conds = {c["type"]: c["status"] for c in st.get("conditions") or ()}
    pods = [p for p in core.list_namespaced_pod(ns, label_selector="pdfleet.io/role=decode").items
            if p.metadata.deletion_timestamp is None and p.metadata.owner_references
            and p.metadata.owner_references[0].kind == "PDDeployment"]
    marks = {next((e.value for e in p.spec.containers[0].env or () if e.name == "ROLLOUT_MARK"), None) for p in pods}
    return (conds.get("Available") == "True" and (st.get("rollout") or {}).get("phase") == "Complete"
            and len(pods) == n and marks == {mark})


def _deployment_done(cluster: LocalCluster, ns: str, n: int) -> bool:
    d = json.loads(cluster.kubectl("-n", ns, "get", "deployment", "plain", "-o", "json").stdout)
    st = d.get("status") or {}
    return (st.get("observedGeneration", 0) >= d["metadata"]["generation"] and st.get("replicas") == n
            and st.get("updatedReplicas") == n and st.get("availableReplicas") == n)


def _template_from(pod: dict) -> dict:
    """The operator's decode pod as a Deployment's template: its spec, less what a pod's identity or the
    API server adds, with the bench's ServiceAccount and labels."""
    spec = json.loads(json.dumps(pod["spec"]))
    for key in ("nodeName", "hostname", "priority", "serviceAccount"):
        spec.pop(key, None)
    spec["serviceAccountName"] = "plain-runtime"
    spec["volumes"] = [v for v in spec.get("volumes") or () if not v["name"].startswith("kube-api-access-")]
    for c in spec["containers"] + spec.get("initContainers", []):
        c["volumeMounts"] = [m for m in c.get("volumeMounts") or () if not m["name"].startswith("kube-api-access-")]
        c["env"] = [e for e in c.get("env") or () if e["name"] != "ROLLOUT_MARK"] + [{"name": "ROLLOUT_MARK", "value": "p1"}]
    return {"metadata": {"labels": DEPLOYMENT_LABELS}, "spec": spec}


def _gate_rbac(ns: str) -> list[dict]:
    meta = {"namespace": ns, "labels": {"app": "plain"}}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "plain-runtime", **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "plain-runtime", **meta},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                   {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "plain-runtime", **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "plain-runtime"},
         "subjects": [{"kind": "ServiceAccount", "name": "plain-runtime", "namespace": ns}]},
    ]


def _transfer_failures(runner: Any) -> float:
    """Failed transfers the running pods count (/metrics): the prefill pod took part in every transfer of
    both arms; a decode-side failure also fails its request, counted by the traffic."""
    total = 0.0
    for pod in [*runner.running("prefill").values(), *runner.decode_pods().values()]:
        with urllib.request.urlopen(pod.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("pdfleet_transfer_failures_total") or (
                    line.startswith("pdfleet_transfers_total{") and 'outcome="failed"' in line):
                total += float(line.rsplit(" ", 1)[1])
    return total


def run_real(cluster: LocalCluster, core: Any, n: int, workdir: Path, *, surge: int, unavailable: int,
             drain_timeout: int) -> dict:
    ns = f"real-{n}"
    cluster.kubectl("create", "namespace", ns)
    _wait(lambda: cluster.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0, 60, "namespace")

    def args(pod: dict) -> tuple[str, ...]:
        return (*LOCAL_ARGS, *RUNTIME_ARGS.get(pod["metadata"]["labels"].get("pdfleet.io/role", ""), ()))

    runner = cluster.kubelet(ns, workdir, selector="app.kubernetes.io/managed-by=pdfleet-operator",
                             extra_args=args, extra_env={"MC_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"})
    runner.start()
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(ns, n, "v1", surge, unavailable, drain_timeout)))
        _wait(lambda: _pdd_done(cluster, core, ns, n, "v1"), 900, "the PDDeployment Available on real runtimes")
        # pdfleet arm
        traffic, watch = Traffic(core, ns, runner), PodWatch(core, ns, "pdfleet.io/role=decode", n, surge, unavailable)
        traffic.start()
        watch.start()
        watch.synced.wait(30)
        time.sleep(3)  # traffic on every pod before the rollout starts
        start = watch.since = time.monotonic()
        cluster.kubectl("-n", ns, "patch", "pdd", "roll", "--type=merge", "-p", json.dumps(
            {"spec": {"decode": manifest(ns, n, "v2", surge, unavailable, drain_timeout)["spec"]["decode"]}}))
        _wait(lambda: _pdd_done(cluster, core, ns, n, "v2"), 1800, "the pdfleet rollout")
        pdfleet_s = time.monotonic() - start
        ours_traffic = traffic.stop()
        time.sleep(0.5)
        watch.stop()
        ours = watch
        template = _template_from(next(p for p in json.loads(cluster.kubectl(
            "-n", ns, "get", "pods", "-l", "pdfleet.io/role=decode", "-o", "json").stdout)["items"]
            if not p["metadata"].get("deletionTimestamp")))
        forced = [e["message"] for e in json.loads(cluster.kubectl("-n", ns, "get", "events", "-o", "json").stdout)["items"]
                  if "FORCED" in e.get("message", "")]
        # Deployment arm: the PDDeployment keeps its prefill; its decode fleet leaves first.
        cluster.kubectl("-n", ns, "patch", "pdd", "roll", "--type=merge", "-p", json.dumps({"spec": {"decode": {"replicas": 0}}}))
        _wait(lambda: not [p for p in core.list_namespaced_pod(ns, label_selector="pdfleet.io/role=decode").items], 600,
              "the PDDeployment's decode pods gone")
        deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "plain", "namespace": ns},
                      "spec": {"replicas": n, "selector": {"matchLabels": {"app": "plain"}},
                               "strategy": {"type": "RollingUpdate",
                                            "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}},
                               "template": template}}
        cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in [*_gate_rbac(ns), deployment]))
        _wait(lambda: _deployment_done(cluster, ns, n), 900, "the Deployment available on real runtimes")
        traffic, watch = Traffic(core, ns, runner), PodWatch(core, ns, "app=plain", n, surge, unavailable, check=False)
        traffic.start()
        watch.start()
        watch.synced.wait(30)
        time.sleep(3)
        start = watch.since = time.monotonic()
        cluster.kubectl("-n", ns, "set", "env", "deployment/plain", "ROLLOUT_MARK=p2")
        _wait(lambda: _deployment_done(cluster, ns, n), 1800, "the Deployment rollout")
        deployment_s = time.monotonic() - start
        theirs_traffic = traffic.stop()
        time.sleep(0.5)
        watch.stop()
        failed_transfers = _transfer_failures(runner)
    finally:
        runner.shutdown()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    return {"pods": n, "runtime": "real (pdfleet-runtime serve through the harness's kubelet), both fleets",
            "pdfleet_seconds": round(pdfleet_s, 2), "deployment_seconds": round(deployment_s, 2),
            "ratio": round(pdfleet_s / deployment_s, 3),
            "budget_violations": ours.violations[:10], "budget_ok": not ours.violations,
            "max_pods": ours.max_pods, "min_routable_ready": ours.min_routable_ready,
            "deployment_max_pods_incl_terminating": watch.max_pods,
            "pdfleet_traffic": ours_traffic, "deployment_traffic": theirs_traffic,
            "failed_transfers_on_pods": failed_transfers, "forced_drains": forced,
            "pdfleet_steps": ours.breakdown(None, ours.since), "deployment_steps": watch.breakdown(None, watch.since),
            "gate": f"{READINESS_GATE}: set by each runtime after a verified canary transfer with the prefill"}
