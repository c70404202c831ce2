"""The real-runtime arm of bench/rollout.py: both fleets' decode pods run ``pdfleet-runtime serve``
through the harness's kubelet (each pod in its own network namespace at its pod IP, its own
ServiceAccount token), pair with the same real prefill pod, pass the transfer-path gate with a real
canary transfer and drain on their own (pdfleet: the drain annotation; the Deployment: the pod's
preStop hook, which the operator renders into both). Each drain first answers ``/health`` 503 and
keeps admitting for the router's drop bound (``routerDropSeconds``), as rendered with ``spec.router``.

Client traffic goes through a real sglang-router (0.3.2): the PDDeployment's own router pod, run by
the harness from the operator's rendered command, reached through its Service: chat completions
from an ``openai`` client (``pdfleet_runtime.testing.chat.ChatTraffic``, no client retries), every answer verified.
The Deployment's arm uses that same router pod: its decode discovery selects
``pdfleet.io/deployment=roll pdfleet.io/role=decode``, which the Deployment's template carries (the
PDDeployment's own decode fleet is at zero by then), so both arms go through one router with the same
settings. Counted per arm: failed client requests, the router's retries, failed request transfers and
unclaimed rooms on every pod (scraped while the pods run); the router's worker set is polled to stamp
when it added and dropped each pod (``rollout_router``); every runtime pod's memory (its pod and rank
processes' RSS, PSS and private bytes) is sampled every 10 s (``pod_memory``). The pods' layout is the
bench's own small one (``BENCH_LAYOUT``), so 32 pods and their surge fit the host.

The Deployment's pod template is the operator's own decode pod (read back from the API), with a
ServiceAccount whose Role lets any pod of the namespace set its own gate (a Deployment's pod names
are not known beforehand, so the operator's per-pod Role cannot name them). The PDDeployment's decode
fleet is scaled to zero first; its prefill pod, router, config maps and secret serve both arms.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pod_memory import MemorySampler
from rollout_router import PodScraper, RouterWatch, admin_key, drain_stamps, router_retries, workers
from rollout_watch import PodWatch

from pdfleet_devcluster import LocalCluster
from pdfleet_operator.api.models import RouterSpec
from pdfleet_operator.resources.plugins.front import upstream_port
from pdfleet_operator.resources.router import ROUTER_DROP_BOUND_S
from pdfleet_runtime.config import READINESS_GATE
from pdfleet_runtime.testing.chat import ChatTraffic

__all__ = ["BENCH_LAYOUT", "LOCAL_ARGS", "ROUTER", "RUNTIME_ARGS", "concurrency", "manifest", "run_real"]

IMAGE = "example.invalid/runtime:local"
WRITE_DELAY_S = 0.2  # each transfer takes a while, so a pod whose drain starts has transfers in flight
RUNTIME_ARGS = {
    "prefill": ("--fault-write-delay", str(WRITE_DELAY_S)),
    # As the end-to-end tests (a canary's write is slow on a loaded 2-core host; its floor is not measured
    # here), but a ready pod re-checks every 10 s, not 2: 16 pods' 8 MiB canaries every 2 s through the one
    # prefill starved it (a gate failed and the rollout was rolled back). A new pod's first canary and a
    # failed one's retry (0.5 s) are as before, so the gate passes as soon.
    "decode": ("--canary-period", "10", "--retry-period", "0.5", "--floor-gbps", "0.0002", "--canary-timeout", "30"),
}
LOCAL_ARGS = ("--device", "cpu")  # kwok nodes have no GPU
NAME = "roll"
ROUTER = {"image": "example.invalid/runtime:local", "prefillPolicy": "round_robin", "decodePolicy": "round_robin"}
ROUTER_PORT = 30000  # spec.router's default
DEPLOYMENT_LABELS = {"app": "plain", "app.kubernetes.io/managed-by": "pdfleet-operator",
                     "pdfleet.io/role": "decode", "pdfleet.io/deployment": "roll",
                     "pdfleet.io/revision": "plain", "pdfleet.io/routable": "true"}


BENCH_LAYOUT = {"inline": {"numLayers": 2, "fullAttentionLayers": {"interval": 1}, "kvHeads": 8, "headDim": 128,
                           "pageSize": 16}}
"""Llama-3-8B's KV shape (8 KV heads of 128, pages of 16 bf16 tokens, K and V) on 2 layers, not 32: a
pool page is 128 KiB, not 2 MiB, so a decode pod's pools (8 requests, 2048 tokens: 136 pages) are 17 MiB,
not 272, and 34 runtime pods fit the 2-core host's memory. Every request still moves its pages through
the real engine, planned per layer and field, and every byte is verified; only the bytes per token
shrink. The same manifest serves both arms (the Deployment's template is the operator's decode pod)."""


def manifest(ns: str, decode: int, mark: str, surge: int, unavailable: int, drain_timeout: int) -> dict:
    role = {"parallelism": {"tensor": 1}, "image": IMAGE}
    pool = {"maxConcurrentRequests": 8, "kvTokensPerReplica": 2048}
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": "roll", "namespace": ns},
        "spec": {
            "model": {"layout": BENCH_LAYOUT},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "prefill": {"replicas": 1, **role, "pool": {**pool, "maxConcurrentRequests": 64}},
            "decode": {"replicas": decode, **role, "pool": pool, "env": [{"name": "ROLLOUT_MARK", "value": mark}]},
            "rollout": {"maxSurge": surge, "maxUnavailable": unavailable, "drainTimeoutSeconds": drain_timeout,
                        "progressDeadlineSeconds": 900},
            "router": ROUTER,
        },
    }


def concurrency(n: int) -> int:
    """Client requests in flight through the router: one per decode pod, at most 8. The one prefill pod
    writes every request's state (``WRITE_DELAY_S`` each) and every new pod's canary: at 16 in flight on a
    host at load average ~40 a canary missed its deadline, the gate failed and the operator rolled back."""
    return max(4, min(n, 8))


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


def _mem_available_gib() -> float:
    line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable:"))
    return int(line.split()[1]) / 2**20


def _router_url(core: Any, ns: str) -> str:
    """The router's Service (its ClusterIP: this process is in the cluster's network namespace)."""
    return f"http://{core.read_namespaced_service(f'{NAME}-router', ns).spec.cluster_ip}:{ROUTER_PORT}"


def _router_pod(runner: Any) -> tuple[str, Any]:
    """A router pod's control URL (the router on its loopback, behind the front) and the pod to reach it from."""
    pod = next(p for p in list(runner.pods.values()) if p.name.startswith(f"{NAME}-router-") and p.started)
    return f"http://127.0.0.1:{upstream_port(RouterSpec(image='x', port=ROUTER_PORT))}", pod  # the spec's ports


def _router_serves(core: Any, ns: str, runner: Any, key: str, selector: str, n: int) -> bool:
    """The router lists every live pod of ``selector`` healthy, and one chat completion through its Service
    was answered and verified."""
    ips = {p.status.pod_ip for p in core.list_namespaced_pod(ns, label_selector=selector).items
           if p.metadata.deletion_timestamp is None and p.status.pod_ip}
    try:
        url, pod = _router_pod(runner)
        healthy = {u for u, ok in workers(url, key, pod).items() if ok}
    except (OSError, ValueError, StopIteration):
        return False
    if len(ips) != n or not all(any(f"//{ip}:" in u for u in healthy) for ip in ips):
        return False
    return ChatTraffic(_router_url(core, ns), NAME, timeout_s=10).once(0).ok


def _rollout_failure(core: Any, ns: str) -> str | None:
    """The PDDeployment's rollout message once it failed a revision (a gate failed on an overloaded host,
    say): the arm stops at once with it instead of waiting for a revision that is being rolled back."""
    from kubernetes.client import CustomObjectsApi

    obj = CustomObjectsApi(core.api_client).get_namespaced_custom_object(
        "pdfleet.io", "v1alpha1", ns, "pddeployments", NAME, _request_timeout=10)
    decode = ((obj.get("status") or {}).get("rollout") or {}).get("decode") or {}
    return decode.get("message") if decode.get("failedRevisions") else None


def _timed_arm(core: Any, ns: str, runner: Any, key: str, selector: str, n: int, mark: str, start_roll: Any,
               *, surge: int, unavailable: int, check: bool,
               failure: Callable[[], str | None] = lambda: None) -> tuple[float, dict, PodWatch]:
    """One rollout under client traffic through the router: its time (until the watch shows ``n`` live
    Ready pods of ``mark``), what the traffic, the router and the pods counted, and the watch."""
    retries0 = router_retries(runner, NAME)
    url, pod = _router_pod(runner)
    scraper, router = PodScraper(runner), RouterWatch(url, key, pod)
    traffic = ChatTraffic(_router_url(core, ns), NAME, concurrency=concurrency(n))
    watch = PodWatch(core, ns, selector, n, surge, unavailable, check=check)
    memory = MemorySampler(runner)
    for t in (scraper, router, watch, memory):
        t.start()
    watch.synced.wait(30)
    traffic.start()
    time.sleep(3)  # traffic on every pod before the rollout starts
    load0, mem = os.getloadavg(), [_mem_available_gib()]
    start = watch.since = time.monotonic()
    start_roll()

    def done() -> bool:
        mem.append(_mem_available_gib())
        if len(mem) % 10 == 0 and (why := failure()):
            raise RuntimeError(f"the rollout to {mark} failed: {why}")
        return watch.settled(n, mark=mark)

    _wait(done, 1800 + 60 * n, f"the rollout to {mark}")
    took = time.monotonic() - start
    answers = traffic.stop()
    time.sleep(0.5)  # the last deletions reach the watch
    for t in (router, watch):
        t.stop()
    failed = [a for a in answers if not a.ok]
    counts = {"requests": len(answers), "ok": len(answers) - len(failed), "failed": len(failed),
              "failures": [f"{a.status} {a.problem}"[:200] for a in failed[:5]],
              "router_retries": router_retries(runner, NAME) - retries0, "router_poll_errors": router.errors,
              "concurrency": traffic.concurrency, "load_average_start_end": [load0, os.getloadavg()],
              "host_mem_available_gib_min": round(min(mem), 2), **scraper.stop(), "pod_memory": memory.stop()}
    extra = router.stamps(watch.pods)
    for name in watch.pods:
        with contextlib.suppress(StopIteration, OSError):  # never started here
            extra.setdefault(name, {}).update(drain_stamps(runner.log_of(name)))
    counts["steps"] = watch.breakdown(None, start, extra)
    return took, counts, watch


def run_real(cluster: LocalCluster, core: Any, n: int, workdir: Path, *, surge: int, unavailable: int,
             drain_timeout: int, meter: Callable[[], tuple[float, float, float]]) -> dict:
    """Both arms at ``n`` decode pods; ``meter`` reads the operator's (CPU seconds, API calls, passes),
    taken around the pdfleet rollout."""
    ns = f"real-{n}"
    cluster.kubectl("create", "namespace", ns)
    _wait(lambda: cluster.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0, 60, "namespace")

    def args(pod: dict) -> tuple[str, ...]:
        role = pod["metadata"]["labels"].get("pdfleet.io/role", "")
        return (*LOCAL_ARGS, *RUNTIME_ARGS.get(role, ())) if role else ()  # a router pod: its command verbatim

    runner = cluster.kubelet(ns, workdir, selector="app.kubernetes.io/managed-by=pdfleet-operator",
                             extra_args=args, extra_env={"MC_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"})
    runner.start()
    decode = "pdfleet.io/role=decode"
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(ns, n, "v1", surge, unavailable, drain_timeout)))
        _wait(lambda: _pdd_done(cluster, core, ns, n, "v1"), 900 + 60 * n, "the PDDeployment Available on real runtimes")
        key = admin_key(core, ns, NAME)
        # sglang-router 0.3.2 re-checks a discovered worker that did not answer yet only every 30 s
        _wait(lambda: _router_serves(core, ns, runner, key, decode, n), 300, "the router serving every decode pod")
        before = meter()
        pdfleet_s, ours, watch = _timed_arm(core, ns, runner, key, decode, n, "v2", lambda: cluster.kubectl(
            "-n", ns, "patch", "pdd", NAME, "--type=merge", "-p", json.dumps(
                {"spec": {"decode": manifest(ns, n, "v2", surge, unavailable, drain_timeout)["spec"]["decode"]}})),
            surge=surge, unavailable=unavailable, check=True, failure=lambda: _rollout_failure(core, ns))
        cpu, calls, passes = (b - a for a, b in zip(before, meter(), strict=True))
        _wait(lambda: _pdd_done(cluster, core, ns, n, "v2"), 300, "the PDDeployment's status Complete")
        template = _template_from(next(p for p in json.loads(cluster.kubectl(
            "-n", ns, "get", "pods", "-l", decode, "-o", "json").stdout)["items"]
            if not p["metadata"].get("deletionTimestamp")))
        forced = [e["message"] for e in json.loads(cluster.kubectl("-n", ns, "get", "events", "-o", "json").stdout)["items"]
                  if "FORCED" in e.get("message", "")]
        # Deployment arm: the PDDeployment keeps its prefill and router; its decode fleet leaves first.
        cluster.kubectl("-n", ns, "patch", "pdd", NAME, "--type=merge", "-p", json.dumps({"spec": {"decode": {"replicas": 0}}}))
        _wait(lambda: not [p for p in core.list_namespaced_pod(ns, label_selector=decode).items], 600,
              "the PDDeployment's decode pods gone")
        deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "plain", "namespace": ns},
                      "spec": {"replicas": n, "selector": {"matchLabels": {"app": "plain"}},
                               "strategy": {"type": "RollingUpdate",
                                            "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}},
                               "template": template}}
        cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in [*_gate_rbac(ns), deployment]))
        _wait(lambda: _deployment_done(cluster, ns, n), 900 + 60 * n, "the Deployment available on real runtimes")
        _wait(lambda: _router_serves(core, ns, runner, key, "app=plain", n), 300, "the router serving the Deployment")
        deployment_s, theirs, theirs_watch = _timed_arm(core, ns, runner, key, "app=plain", n, "p2", lambda: cluster.kubectl(
            "-n", ns, "set", "env", "deployment/plain", "ROLLOUT_MARK=p2"), surge=surge, unavailable=unavailable, check=False)
    finally:
        runner.shutdown()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    return {"pods": n, "runtime": "real (pdfleet-runtime serve through the harness's kubelet), both fleets",
            "pdfleet_seconds": round(pdfleet_s, 2), "deployment_seconds": round(deployment_s, 2),
            "ratio": round(pdfleet_s / deployment_s, 3),
            "budget_violations": watch.violations[:10], "budget_ok": not watch.violations,
            "floor_breaks_by_removal": watch.floor_breaks_by_removal[:10],
            "max_pods": watch.max_pods, "min_routable_ready": watch.min_routable_ready, "watch_restarts": watch.restarts,
            "deployment_max_pods_incl_terminating": theirs_watch.max_pods,
            "operator_cpu_seconds": round(cpu, 2), "reconcile_passes": int(passes),
            "api_calls_per_pass": round(calls / passes, 2) if passes else None,
            "pdfleet_steps": ours.pop("steps"), "deployment_steps": theirs.pop("steps"),
            "pdfleet_traffic": ours, "deployment_traffic": theirs, "forced_drains": forced,
            "failed_transfers_on_pods": ours["failed_transfers"] + theirs["failed_transfers"],
            "gate": f"{READINESS_GATE}: set by each runtime after a verified canary transfer with the prefill",
            "router": {**ROUTER, "drop_bound_s": ROUTER_DROP_BOUND_S, "same router pod for both arms": True}}
