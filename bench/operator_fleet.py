"""Operator benchmark: apply -> Available for 1, 10 and 50 PDDeployments on kwok, then a fleet of 50
PDDeployments with 1,000 pods: apply -> all Available, and a decode rollout of all 50 at once.

Baseline, measured in the same run on the same cluster: applying the very objects the operator
would create (its planner's output, without owner references) directly with one `kubectl apply`,
until all their pods are Ready. In both arms a gate setter stands in for the runtime: it sets the
``pdfleet.io/transfer-path`` condition on Running pods. Also reports the operator's CPU seconds per
reconcile pass (from /proc and its Prometheus counter).

    python bench/operator_fleet.py [--sizes 1 10 50] [--fleet 50 --fleet-pods 1000] [--out bench/results/operator-<utc>.json]

Target (issue 10): operator time at most 1.5x the direct apply.

The fleet (issue 29) reports the time of each phase, the operator's peak memory (VmHWM) and CPU
seconds (and its webhook process's), its API calls per reconcile pass, watch restarts, and the admission
webhook's p99 during the rollout: AdmissionReviews sent straight to the operator's webhook (the one the
apiserver calls, served by the operator's admission process while the operator takes the thousand
pods' watch events) and,
alternating with them, to a stock kopf allow-all webhook in its own process (bench/admission.py's
server), both measured over the same window. Target: the operator's p99 at most 1.3x the allow-all's.
Each fleet pod gets the transfer-path gate from a watch-driven stand-in for the runtime (named as such).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path

import yaml

from pdfleet_devcluster import ClusterOptions, LocalCluster
from pdfleet_devcluster.local_operator import LocalOperator
from pdfleet_devcluster.standin import RuntimeStandIn
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.plan import ActionKind, Owner, Snapshot, plan

TARGET = 1.5
ADMISSION_P99_TARGET = 1.3
FLEET_POLL_S = 2.0  # kubectl of 50 objects costs a core-second: polled every 0.1 s it would load the host under test
BENCH = Path(__file__).resolve().parent
SPEC = {
    "model": {"layout": {"preset": "llama-dense"}},
    "transfer": {"backend": "mooncake", "protocol": "tcp"},
    "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "ghcr.io/pdfleet/runtime:0.1.0"},
    "decode": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "ghcr.io/pdfleet/runtime:0.1.0"},
}


def _wait(cond, timeout: float = 600.0, every: float = 0.1) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(every)
    return time.monotonic() - start


def _available(cluster: LocalCluster, ns: str, n: int) -> bool:
    items = json.loads(cluster.kubectl("-n", ns, "get", "pdd", "-o", "json").stdout)["items"]
    ok = sum(any(c["type"] == "Available" and c["status"] == "True"
                 for c in (i.get("status") or {}).get("conditions") or ()) for i in items)
    return ok == n


def _ready_pods(cluster: LocalCluster, ns: str, n: int) -> bool:
    items = json.loads(cluster.kubectl("-n", ns, "get", "pods", "-o", "json").stdout)["items"]
    ok = sum(any(c["type"] == "Ready" and c["status"] == "True" for c in i["status"].get("conditions") or ())
             for i in items)
    return ok == n


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metric(op: LocalOperator, prefix: str) -> float:
    """The sum of every sample whose line starts with ``prefix`` on the operator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _passes(op: LocalOperator) -> float:
    return _metric(op, "pdfleet_operator_reconcile_passes_total{")


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _children(pid: int) -> list[int]:
    """The operator's child processes (its admission webhook runs in one): their CPU and memory are
    the operator's too."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _namespace(cluster: LocalCluster, ns: str) -> None:
    cluster.kubectl("create", "namespace", ns)
    _wait(lambda: cluster.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0, 60)


def run_size(cluster: LocalCluster, op: LocalOperator, n: int, prefix: str = "") -> dict:
    spec = PDDeploymentSpec.model_validate(SPEC)
    # Operator arm.
    ns = f"{prefix}op-{n}"
    _namespace(cluster, ns)
    docs = [{"apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
             "metadata": {"name": f"d{i}", "namespace": ns}, "spec": SPEC} for i in range(n)]
    assert op.proc is not None
    cpu0, passes0 = _cpu_seconds(op.proc.pid), _passes(op)
    start = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs), timeout=300)
    _wait(lambda: _available(cluster, ns, n))
    operator_s = time.monotonic() - start
    cpu, passes = _cpu_seconds(op.proc.pid) - cpu0, _passes(op) - passes0
    # Direct arm: the same objects, applied by kubectl.
    ns_direct = f"{prefix}direct-{n}"
    _namespace(cluster, ns_direct)
    bodies = []
    for i in range(n):
        for a in plan(Owner(f"d{i}", ns_direct, "bench"), spec, Snapshot()):
            if a.body is not None and a.kind is not ActionKind.PATCH_LABELS:
                body = json.loads(json.dumps(a.body))
                body["metadata"].pop("ownerReferences", None)
                bodies.append(body)
    bodies.sort(key=lambda b: b["kind"] == "Pod")  # ServiceAccounts before the pods that use them
    start = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(bodies), timeout=300)
    _wait(lambda: _ready_pods(cluster, ns_direct, 2 * n))
    direct_s = time.monotonic() - start
    return {
        "deployments": n,
        "objects_per_deployment": len(bodies) // n,
        "operator_seconds": round(operator_s, 3),
        "direct_apply_seconds": round(direct_s, 3),
        "ratio": round(operator_s / direct_s, 3),
        "operator_cpu_seconds": round(cpu, 3),
        "reconcile_passes": int(passes),
        "cpu_seconds_per_pass": round(cpu / passes, 4) if passes else None,
    }


def _fleet_doc(ns: str, i: int, decode: int, image: str) -> dict:
    spec = json.loads(json.dumps(SPEC))
    spec["prefill"]["replicas"], spec["decode"]["replicas"], spec["decode"]["image"] = 2, decode, image
    spec["rollout"] = {"maxSurge": "25%", "maxUnavailable": 0}
    return {"apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
            "metadata": {"name": f"f{i}", "namespace": ns}, "spec": spec}


def _fleet_done(cluster: LocalCluster, ns: str, n: int, image: str) -> bool:
    items = json.loads(cluster.kubectl("-n", ns, "get", "pdd", "-o", "json", timeout=120).stdout)["items"]
    def done(i: dict) -> bool:
        st = i.get("status") or {}
        conds = {c["type"]: c["status"] for c in st.get("conditions") or ()}
        return (conds.get("Available") == "True" and (st.get("rollout") or {}).get("phase") == "Complete"
                and i["spec"]["decode"]["image"] == image
                and (st.get("observedGeneration") or 0) >= i["metadata"]["generation"])
    return len(items) == n and all(done(i) for i in items)


class AdmissionProbe(threading.Thread):
    """AdmissionReviews to two webhooks in turn, one at a time, until stopped: latency of each."""

    def __init__(self, targets: dict[str, tuple[str, str]]) -> None:
        super().__init__(daemon=True)
        self.targets, self.stop_event = targets, threading.Event()
        self.latencies: dict[str, list[float]] = {k: [] for k in targets}
        self.errors: list[str] = []
        self.measuring = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        import aiohttp
        from admission import _bodies  # bench/admission.py: the same request mix as the webhook benchmark

        bodies = _bodies()
        sessions = {}
        for name, (_, ca) in self.targets.items():
            sessions[name] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                ssl=ssl.create_default_context(cafile=ca), limit=2))
        try:
            i = 0
            while not self.stop_event.is_set():
                for name, (url, _) in self.targets.items():
                    body = bodies[i % len(bodies)].replace(b"UID-PLACEHOLDER-0000-0000-000000000000",
                                                           str(uuid.uuid4()).encode())
                    t0 = time.perf_counter()
                    try:
                        async with sessions[name].post(url, data=body, headers={"Content-Type": "application/json"},
                                                       timeout=aiohttp.ClientTimeout(total=30)) as resp:
                            data = await resp.read()
                        ok = resp.status == 200 and b'"allowed"' in data
                    except Exception as exc:  # counted: a webhook that fails here fails the apiserver too
                        ok, data = False, repr(exc).encode()
                    if self.measuring.is_set():
                        self.latencies[name].append(time.perf_counter() - t0)
                        if not ok:
                            self.errors.append(f"{name}: {data[:200]!r}")
                i += 1
                await asyncio.sleep(0.01)
        finally:
            for sess in sessions.values():
                await sess.close()

    def summary(self) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else None
        return {name: {"requests": len(xs), "p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99)}
                for name, xs in self.latencies.items()}


def run_fleet(cluster: LocalCluster, op: LocalOperator, deployments: int, pods: int) -> dict:
    """50 PDDeployments, ``pods`` pods in all (2 prefill each, the rest decode): apply -> Available, then
    all decode fleets rolled at once, with the admission probe running through the rollout."""
    from pdfleet_operator.admission import VALIDATE_WEBHOOK_ID

    ns, decode = "fleet", max(1, pods // deployments - 2)
    _namespace(cluster, ns)
    assert op.proc is not None
    pid = op.proc.pid
    v1, v2 = "ghcr.io/pdfleet/runtime:0.1.0", "ghcr.io/pdfleet/runtime:0.1.1"
    calls0, passes0, restarts0 = (_metric(op, "pdfleet_operator_api_calls_total"), _passes(op),
                                  _metric(op, "pdfleet_operator_watch_restarts_total"))
    cpu0, start = _cpu_seconds(pid), time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(
        [_fleet_doc(ns, i, decode, v1) for i in range(deployments)]), timeout=300)
    _wait(lambda: _fleet_done(cluster, ns, deployments, v1), timeout=1800, every=FLEET_POLL_S)
    apply_s, apply_cpu = time.monotonic() - start, _cpu_seconds(pid) - cpu0
    print(f"fleet: {deployments} deployments, {deployments * (decode + 2)} pods Available in {apply_s:.1f}s "
          f"(operator CPU {apply_cpu:.1f}s)", flush=True)
    # The allow-all webhook in its own process: bench/admission.py's server, as in the webhook benchmark.
    serve_dir = Path(tempfile.mkdtemp(prefix="pdfleet-bench-allow-"))
    child = subprocess.Popen([sys.executable, str(BENCH / "admission.py"), "--serve", str(serve_dir)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ready = json.loads(child.stdout.readline())
        probe = AdmissionProbe({
            "operator": (f"{op.url}/{VALIDATE_WEBHOOK_ID}", str(op.ca_file)),
            "allow-all": (f"{ready['urls']['allow-all']}/{VALIDATE_WEBHOOK_ID}", ready["ca"]),
        })
        probe.start()
        time.sleep(2)  # connections up, imports done
        probe.measuring.set()
        kids = _children(pid)
        kids_cpu0 = sum(map(_cpu_seconds, kids))
        cpu0, calls1, passes1, start = _cpu_seconds(pid), _metric(op, "pdfleet_operator_api_calls_total"), _passes(op), time.monotonic()
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(
            [_fleet_doc(ns, i, decode, v2) for i in range(deployments)]), timeout=300)
        _wait(lambda: _fleet_done(cluster, ns, deployments, v2), timeout=1800, every=FLEET_POLL_S)
        roll_s, roll_cpu = time.monotonic() - start, _cpu_seconds(pid) - cpu0
        kids_cpu, kids_rss = sum(map(_cpu_seconds, kids)) - kids_cpu0, sum(map(_peak_rss_mib, kids))
        probe.measuring.clear()
        probe.stop_event.set()
        probe.join(timeout=60)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=30)
    calls2, passes2 = _metric(op, "pdfleet_operator_api_calls_total"), _passes(op)
    adm = probe.summary()
    ratio = (adm["operator"]["p99_ms"] / adm["allow-all"]["p99_ms"]
             if adm["operator"]["p99_ms"] and adm["allow-all"]["p99_ms"] else None)
    row = {
        "deployments": deployments, "pods": deployments * (decode + 2), "decode_per_deployment": decode,
        "max_surge": "25%", "max_unavailable": 0,
        "apply_to_available_seconds": round(apply_s, 2), "apply_operator_cpu_seconds": round(apply_cpu, 2),
        "rollout_seconds": round(roll_s, 2), "rollout_operator_cpu_seconds": round(roll_cpu, 2),
        "operator_peak_rss_mib": round(_peak_rss_mib(pid), 1),
        "webhook_processes": len(kids), "rollout_webhook_cpu_seconds": round(kids_cpu, 2),
        "webhook_peak_rss_mib": round(kids_rss, 1),
        "api_calls_per_pass_apply": round((calls1 - calls0) / max(1.0, passes1 - passes0), 2),
        "api_calls_per_pass_rollout": round((calls2 - calls1) / max(1.0, passes2 - passes1), 2),
        "reconcile_passes_rollout": int(passes2 - passes1),
        "watch_restarts": int(_metric(op, "pdfleet_operator_watch_restarts_total") - restarts0),
        "admission_during_rollout": adm, "admission_errors": probe.errors[:5],
        "admission_p99_ratio": round(ratio, 3) if ratio else None,
        "admission_met": ratio is not None and ratio <= ADMISSION_P99_TARGET and not probe.errors,
    }
    print(f"fleet rollout of all {deployments}: {roll_s:.1f}s (operator CPU {roll_cpu:.1f}s, peak RSS "
          f"{row['operator_peak_rss_mib']} MiB, {row['api_calls_per_pass_rollout']} API calls/pass over "
          f"{row['reconcile_passes_rollout']} passes; webhook process CPU {kids_cpu:.1f}s, peak RSS {kids_rss:.1f} MiB); admission p99 operator {adm['operator']['p99_ms']} ms vs "
          f"allow-all {adm['allow-all']['p99_ms']} ms: {row['admission_p99_ratio']}x (target <= "
          f"{ADMISSION_P99_TARGET})", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 10, 50])
    ap.add_argument("--fleet", type=int, default=50, help="PDDeployments of the fleet run (0 skips it)")
    ap.add_argument("--fleet-pods", type=int, default=1000, help="pods of the fleet, all deployments together")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gpus_per_node = 64  # fewer, larger kwok nodes: each node costs the apiserver heartbeats
    fleet_gpus = math.ceil(args.fleet_pods * 1.3) if args.fleet else 0  # 25% surge, rounded up per deployment
    nodes = max(3, math.ceil((2 * sum(args.sizes) * 2 + fleet_gpus) / gpus_per_node) + 1)
    state = Path(tempfile.mkdtemp(prefix="pdfleet-bench-operator-"))
    cluster = LocalCluster(state / "cluster", ClusterOptions(nodes=nodes, gpus_per_node=gpus_per_node),
                           die_with_parent=True, progress=lambda m: None)
    op = LocalOperator(cluster, state / "operator")
    rows: list[dict] = []
    warm: dict = {}
    fleet: dict | None = None
    try:
        cluster.start()
        cluster.install_crd()
        op.start("--resync-seconds", "30")
        gates = RuntimeStandIn(cluster.api_client(), reason="BenchStandIn", watch=True)
        gates.start()
        # One unmeasured deployment first: the operator's first pass discovers the API (about a
        # second, once per process); reported, but kept out of the per-size rows.
        warm = run_size(cluster, op, 1, prefix="warm")
        print(f"warm-up (first deployment after start, includes API discovery): {warm['operator_seconds']:.2f}s",
              flush=True)
        for n in args.sizes:
            rows.append(run_size(cluster, op, n))
            r = rows[-1]
            print(f"{n:4d} deployments: operator {r['operator_seconds']:7.2f}s  direct kubectl "
                  f"{r['direct_apply_seconds']:7.2f}s  ratio {r['ratio']:.2f} (target <= {TARGET})  "
                  f"cpu/pass {r['cpu_seconds_per_pass']}s over {r['reconcile_passes']} passes", flush=True)
        if args.fleet:
            fleet = run_fleet(cluster, op, args.fleet, args.fleet_pods)
        gates.stop()
    finally:
        op.stop()
        cluster.stop()
    result = {
        "benchmark": "operator",
        "date": datetime.now(UTC).isoformat(),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "baseline": "the same child objects applied directly with one kubectl apply",
        "target_ratio": TARGET,
        "warm_up": warm,
        "rows": rows,
        "fleet": fleet,
        "met": all(r["ratio"] <= TARGET for r in rows) and (fleet is None or fleet["admission_met"]),
    }
    out = args.out or Path("bench/results") / f"operator-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}; target {'met' if result['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
