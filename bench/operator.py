"""Operator benchmark: apply -> Available for 1, 10 and 50 PDDeployments on kwok.

Baseline, measured in the same run on the same cluster: applying the very objects the operator
would create (its planner's output, without owner references) directly with one `kubectl apply`,
until all their pods are Ready. In both arms a gate setter stands in for the runtime: it sets the
``pdfleet.io/transfer-path`` condition on Running pods. Also reports the operator's CPU seconds per
reconcile pass (from /proc and its Prometheus counter).

    python bench/operator.py [--sizes 1 10 50] [--out bench/results/operator-<utc>.json]

Target (issue 10): operator time at most 1.5x the direct apply.
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

import yaml

from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.devcluster import ClusterOptions, LocalCluster
from pdfleet_operator.devcluster.local_operator import LocalOperator
from pdfleet_operator.devcluster.standin import RuntimeStandIn
from pdfleet_operator.plan import ActionKind, Owner, Snapshot, plan

TARGET = 1.5
SPEC = {
    "model": {"layout": {"preset": "llama-dense"}},
    "transfer": {"backend": "mooncake", "protocol": "tcp"},
    "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "ghcr.io/pdfleet/runtime:0.1.0"},
    "decode": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "ghcr.io/pdfleet/runtime:0.1.0"},
}


def _wait(cond, timeout: float = 600.0) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(0.1)
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


def _passes(op: LocalOperator) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdfleet_operator_reconcile_passes_total{"))


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 50])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    nodes = max(3, math.ceil(2 * sum(args.sizes) * 2 / 8) + 1)
    state = Path(tempfile.mkdtemp(prefix="pdfleet-bench-operator-"))
    cluster = LocalCluster(state / "cluster", ClusterOptions(nodes=nodes), die_with_parent=True,
                           progress=lambda m: None)
    op = LocalOperator(cluster, state / "operator")
    rows: list[dict] = []
    warm: dict = {}
    try:
        cluster.start()
        cluster.install_crd()
        op.start("--resync-seconds", "30")
        gates = RuntimeStandIn(cluster.api_client(), reason="BenchStandIn")
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
        "met": all(r["ratio"] <= TARGET for r in rows),
    }
    out = args.out or Path("bench/results") / f"operator-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}; target {'met' if result['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
