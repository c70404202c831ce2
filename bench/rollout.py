"""Rollout benchmark: a decode rollout of 8, 32 and 128 pods, against a plain Deployment rolling
update of the same size, surge and readiness gate, in the same run on the same cluster.

Pods here are kwok pods whose runtime is a STAND-IN (``devcluster.standin.RuntimeStandIn``, named
in the output): it sets the ``pdfleet.io/transfer-path`` gate on every Running pod of either fleet
and reports pdfleet's draining pods drained after ``--drain-delay``, so the ratio measures the
control plane's own cost: the operator's passes and the drain/delete steps its safety rules add.
maxSurge 2, maxUnavailable 0 for both.

What it reports per size (JSON rows, and a line each): both times and their ratio; from a watch of
the pods, the budgets (pods, terminating ones included, at most replicas + maxSurge; routable ready
pods never below replicas - maxUnavailable once whole); the operator's CPU seconds and its API calls
per reconcile pass over the rollout (from /proc and its /metrics); and where the time went, by named
phase for both sides (``rollout_watch.PodWatch.breakdown``): for a new pod created -> scheduled ->
Running -> runtime up (its first gate write) -> gate passed -> Ready -> in the router; for an old
pod drain requested (pdfleet's annotation; a Deployment's delete, which runs the preStop drain) ->
drain started -> router dropped -> admission stopped -> drain finished -> drained reported ->
deleted -> gone; and the controller's reactions (a new pod Ready -> the next drain request; an old
pod gone -> the next create). The medians are printed; the JSON has every pod's stamps.

    python bench/rollout.py [--sizes 8 32 128] [--drain-delay 0] [--real 8 16] [--out bench/results/rollout-<utc>.json]

``--real N``: N decode pods on real runtimes on both sides (bench/rollout_real.py), client traffic
through the deployment's sglang-router (the same router pod for both arms), failed requests, router
retries and failed transfers counted; the gate, drain and router settings (the router's drop bound
included) are printed first. The JSON is rewritten after every size.

What it measured, run by run, and where the time went: docs/design-operator.md ("Wake-ups and
parallelism"); every run's JSON is in bench/results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from rollout_watch import PodWatch

from pdfleet_devcluster import ClusterOptions, LocalCluster
from pdfleet_devcluster.local_operator import LocalOperator
from pdfleet_devcluster.standin import RuntimeStandIn
from pdfleet_operator.resources.router import (
    HEALTH_FAILURES,
    HEALTH_INTERVAL_S,
    HEALTH_TIMEOUT_S,
    ROUTER_DROP_BOUND_S,
)
from pdfleet_runtime.config import READINESS_GATE
from pdfleet_runtime.pod.drain import ROUTER_GRACE_S

SURGE, UNAVAILABLE, DRAIN_TIMEOUT_S = 2, 0, 60
V1, V2 = "example.invalid/rt:1", "example.invalid/rt:2"


def pdd(ns: str, replicas: int, image: str) -> dict:
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": "roll", "namespace": ns},
        "spec": {
            "model": {"layout": {"preset": "llama-dense"}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "example.invalid/rt:1"},
            "decode": {"replicas": replicas, "parallelism": {"tensor": 1}, "image": image},
            "rollout": {"maxSurge": SURGE, "maxUnavailable": UNAVAILABLE, "drainTimeoutSeconds": DRAIN_TIMEOUT_S},
        },
    }


def deployment(ns: str, replicas: int, image: str) -> dict:
    labels = {"app": "plain", "app.kubernetes.io/managed-by": "pdfleet-operator"}  # the stand-in's selector
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "plain", "namespace": ns},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "plain"}},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": SURGE, "maxUnavailable": UNAVAILABLE}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "readinessGates": [{"conditionType": READINESS_GATE}],
                    "containers": [{"name": "runtime", "image": image,
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                },
            },
        },
    }


def _wait(cond, timeout: float = 1800.0) -> None:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(0.2)


def _pods(cluster: LocalCluster, ns: str, selector: str) -> list[dict]:
    return json.loads(cluster.kubectl("-n", ns, "get", "pods", "-l", selector, "-o", "json").stdout)["items"]


def _settled(cluster: LocalCluster, ns: str, selector: str, n: int, image: str) -> bool:
    pods = [p for p in _pods(cluster, ns, selector) if "deletionTimestamp" not in p["metadata"]]
    ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in p["status"].get("conditions") or ())]
    return len(pods) == n and len(ready) == n and {p["spec"]["containers"][0]["image"] for p in pods} == {image}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metric(op: LocalOperator, prefix: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _timed_rollout(cluster: LocalCluster, core, ns: str, selector: str, n: int, start_roll, check: bool) -> tuple[float, PodWatch]:
    watch = PodWatch(core, ns, selector, n, SURGE, UNAVAILABLE, check=check)
    watch.start()
    watch.synced.wait(30)
    start = time.monotonic()
    start_roll()
    _wait(lambda: watch.settled(n, V2))  # from the watch: polling lists would load the host during the rollout
    took = time.monotonic() - start
    time.sleep(0.5)  # the last deletions reach the watch
    watch.stop()
    watch.since = start
    return took, watch


def run_size(cluster: LocalCluster, op: LocalOperator, core, n: int) -> dict:
    ns = f"roll-{n}"
    cluster.kubectl("create", "namespace", ns)
    _wait(lambda: cluster.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0, 60)
    decode = "pdfleet.io/role=decode"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pdd(ns, n, V1)))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(deployment(ns, n, V1)))
    _wait(lambda: _settled(cluster, ns, decode, n, V1) and _settled(cluster, ns, "app=plain", n, V1))
    assert op.proc is not None
    cpu0, calls0, passes0 = (_cpu_seconds(op.proc.pid), _metric(op, "pdfleet_operator_api_calls_total"),
                             _metric(op, "pdfleet_operator_reconcile_passes_total{"))
    pdfleet_s, ours = _timed_rollout(cluster, core, ns, decode, n, lambda: cluster.kubectl(
        "-n", ns, "patch", "pdd", "roll", "--type=merge", "-p", json.dumps({"spec": {"decode": {"image": V2}}})), True)
    cpu, calls, passes = (_cpu_seconds(op.proc.pid) - cpu0, _metric(op, "pdfleet_operator_api_calls_total") - calls0,
                          _metric(op, "pdfleet_operator_reconcile_passes_total{") - passes0)
    deployment_s, theirs = _timed_rollout(cluster, core, ns, "app=plain", n, lambda: cluster.kubectl(
        "-n", ns, "set", "image", "deployment/plain", f"runtime={V2}"), False)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    return {"pods": n, "runtime": "STAND-IN (devcluster.standin.RuntimeStandIn) on kwok pods, both fleets",
            "load_average_after": os.getloadavg(),
            "pdfleet_seconds": round(pdfleet_s, 2), "deployment_seconds": round(deployment_s, 2),
            "ratio": round(pdfleet_s / deployment_s, 3),
            "budget_violations": ours.violations[:10], "budget_ok": not ours.violations,
            "floor_breaks_by_removal": ours.floor_breaks_by_removal[:10],
            "max_pods": ours.max_pods, "min_routable_ready": ours.min_routable_ready, "watch_restarts": ours.restarts,
            "deployment_max_pods_incl_terminating": theirs.max_pods,
            "operator_cpu_seconds": round(cpu, 2), "reconcile_passes": int(passes),
            "api_calls_per_pass": round(calls / passes, 2) if passes else None,
            "pdfleet_steps": ours.breakdown(V2, ours.since), "deployment_steps": theirs.breakdown(V2, theirs.since)}


def _print_steps(row: dict) -> None:
    """The median seconds of each named phase, both sides (the JSON has every pod's stamps)."""
    for side in ("pdfleet", "deployment"):
        steps = row[f"{side}_steps"]
        phases = {k: v for k, v in steps.items() if k != "pods"}
        print(f"      {side} steps (median s): {json.dumps(phases)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[8, 32, 128])
    ap.add_argument("--drain-delay", type=float, default=0.0, help="seconds the stand-in takes to report drained")
    ap.add_argument("--real", type=int, nargs="*", default=[],
                    help="sizes to run with real runtime pods on both sides (bench/rollout_real.py), after the stand-in sizes")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    biggest = max([*args.sizes, *args.real])
    nodes = math.ceil((2 * (biggest + SURGE) + 1) / 8) + 1
    state = Path(tempfile.mkdtemp(prefix="pdfleet-bench-rollout-"))
    cluster = LocalCluster(state / "cluster", ClusterOptions(nodes=nodes), die_with_parent=True,
                           progress=lambda m: None)
    op = LocalOperator(cluster, state / "operator")
    settings = {"runtime": "STAND-IN (devcluster.standin.RuntimeStandIn, watch-driven) on kwok pods, both fleets",
                "gate": f"{READINESS_GATE} set True by the stand-in once a pod is Running",
                "drain": f"the stand-in reports pdfleet's draining pods drained after {args.drain_delay}s; "
                         f"drainTimeoutSeconds {DRAIN_TIMEOUT_S}",
                "max_surge": SURGE, "max_unavailable": UNAVAILABLE}
    if args.sizes:
        print("; ".join(f"{k}: {v}" for k, v in settings.items()), flush=True)
    rows: list[dict] = []
    out = args.out or Path("bench/results") / f"rollout-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"

    def write() -> None:
        """After every size, so a later size that fails (a host out of memory) keeps the earlier ones."""
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "benchmark": "rollout",
            "date": datetime.now(UTC).isoformat(),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                        "load_average_at_write": os.getloadavg()},
            "baseline": "a Deployment rolling update of the same size, surge and readiness gate",
            "settings": settings,
            "rows": rows,
        }, indent=2))

    try:
        cluster.start()
        cluster.install_crd()
        op.start("--resync-seconds", "30")
        from kubernetes.client import CoreV1Api

        core = CoreV1Api(cluster.api_client())
        standin = RuntimeStandIn(cluster.api_client(), drain_delay=args.drain_delay, reason="BenchStandIn", watch=True)
        standin.start()
        for n in args.sizes:
            rows.append(run_size(cluster, op, core, n))
            write()
            r = rows[-1]
            print(f"{n:4d} decode pods (stand-in): pdfleet {r['pdfleet_seconds']:7.2f}s  Deployment "
                  f"{r['deployment_seconds']:7.2f}s  ratio {r['ratio']:.2f}  budgets {'ok' if r['budget_ok'] else 'BROKEN'} "
                  f"(max {r['max_pods']} pods, min {r['min_routable_ready']} routable ready)  operator CPU "
                  f"{r['operator_cpu_seconds']}s, {r['api_calls_per_pass']} API calls/pass over {r['reconcile_passes']} passes",
                  flush=True)
            _print_steps(r)
        standin.stop()
        if args.real:
            # The real arm drives the e2e suite's traffic and scrape helpers (tests/e2e): the repo
            # root must be importable when run as `python bench/rollout.py`.
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from rollout_real import (
                BENCH_LAYOUT,
                ROUTER,
                RUNTIME_ARGS,
                WRITE_DELAY_S,
                concurrency,
                manifest,
                run_real,
            )

            spec = manifest("", 0, "", SURGE, UNAVAILABLE, DRAIN_TIMEOUT_S)["spec"]
            settings["real_runtime"] = {
                "max_surge": SURGE, "max_unavailable": UNAVAILABLE, "args": RUNTIME_ARGS, "prefill_write_delay_s": WRITE_DELAY_S,
                "layout": BENCH_LAYOUT, "pools": {role: spec[role]["pool"] for role in ("prefill", "decode")},
                "gate": f"{READINESS_GATE}: set by each runtime after a verified canary transfer with the prefill",
                "drain": f"pdfleet: the drain annotation, then delete once drained; Deployment: the preStop hook on "
                         f"delete (the same rendered pod); both answer /health 503 and admit until the router has "
                         f"failed {HEALTH_FAILURES} health checks of the pod (then a {ROUTER_GRACE_S:g}s grace), at "
                         f"most the router's drop bound ({ROUTER_DROP_BOUND_S}s); drainTimeoutSeconds {DRAIN_TIMEOUT_S}",
                "router": {**ROUTER, "drop_bound_s": ROUTER_DROP_BOUND_S,
                           "health_check": f"every {HEALTH_INTERVAL_S}s, {HEALTH_FAILURES} failures, "
                                           f"{HEALTH_TIMEOUT_S}s timeout",
                           "both arms": "the PDDeployment's own router pod (rendered command, run by the harness); "
                                        "its decode selector matches the Deployment's pods too"},
                "traffic": {"client": "openai chat completions through the router's Service, max_retries 0, "
                                      "every answer verified",
                            "in_flight": {n: concurrency(n) for n in args.real}},
            }
            print(f"real runtime: {settings['real_runtime']}", flush=True)

        def meter() -> tuple[float, float, float]:
            assert op.proc is not None
            return (_cpu_seconds(op.proc.pid), _metric(op, "pdfleet_operator_api_calls_total"),
                    _metric(op, "pdfleet_operator_reconcile_passes_total{"))

        for n in args.real:
            try:
                r = run_real(cluster, core, n, state / f"pods-{n}", surge=SURGE, unavailable=UNAVAILABLE,
                             drain_timeout=DRAIN_TIMEOUT_S, meter=meter)
            except (RuntimeError, TimeoutError) as e:  # a failed rollout or a step past its time: said, kept
                rows.append({"pods": n, "runtime": "real", "error": str(e)[:2000], "load_average": os.getloadavg()})
                write()
                print(f"{n:4d} decode pods (REAL runtimes): FAILED: {str(e)[:500]}", flush=True)
                continue
            rows.append(r)
            write()
            ours, theirs = r["pdfleet_traffic"], r["deployment_traffic"]
            print(f"{n:4d} decode pods (REAL runtimes, through the router): pdfleet {r['pdfleet_seconds']:7.2f}s  "
                  f"Deployment {r['deployment_seconds']:7.2f}s  ratio {r['ratio']:.2f}  budgets "
                  f"{'ok' if r['budget_ok'] else 'BROKEN'} (max {r['max_pods']} pods, min {r['min_routable_ready']} "
                  f"routable ready, {len(r['floor_breaks_by_removal'])} by a removal)  failed requests {ours['failed']}+{theirs['failed']} of "
                  f"{ours['requests']}+{theirs['requests']}, router retries {ours['router_retries']}+"
                  f"{theirs['router_retries']}, failed transfers {r['failed_transfers_on_pods']}, forced drains "
                  f"{len(r['forced_drains'])}  operator CPU {r['operator_cpu_seconds']}s, "
                  f"{r['api_calls_per_pass']} API calls/pass over {r['reconcile_passes']} passes", flush=True)
            for side in ("pdfleet", "deployment"):
                mem = r[f"{side}_traffic"]["pod_memory"]
                print(f"      {side} pod memory (MiB, per pod median/max; all pods at once at peak): "
                      f"{json.dumps(mem['per_role'])}; {json.dumps(mem['peak_all_pods_at_once'])}", flush=True)
            _print_steps(r)
    finally:
        op.stop()
        cluster.stop()
    write()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
