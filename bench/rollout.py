"""Rollout benchmark: a decode rollout of 8, 32 and 128 pods on kwok, against a plain Deployment
rolling update of the same size and surge, in the same run on the same cluster.

Both fleets' pods carry the ``pdfleet.io/transfer-path`` readiness gate, set by the same stand-in
for the runtime (named as such); pdfleet's old pods are also drained (the stand-in reports them
drained at once, so the difference is control-plane overhead, not drain time). maxSurge 2,
maxUnavailable 0 for both.

    python bench/rollout.py [--sizes 8 32 128] [--out bench/results/rollout-<utc>.json]
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
from datetime import UTC, datetime
from pathlib import Path

from pdfleet_operator.devcluster import ClusterOptions, LocalCluster
from pdfleet_operator.devcluster.local_operator import LocalOperator
from pdfleet_operator.devcluster.standin import RuntimeStandIn
from pdfleet_runtime.config import READINESS_GATE

SURGE, UNAVAILABLE = 2, 0


def pdd(ns: str, replicas: int, image: str) -> dict:
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": "roll", "namespace": ns},
        "spec": {
            "model": {"layout": {"preset": "llama-dense"}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "example.invalid/rt:1"},
            "decode": {"replicas": replicas, "parallelism": {"tensor": 1}, "image": image},
            "rollout": {"maxSurge": SURGE, "maxUnavailable": UNAVAILABLE, "drainTimeoutSeconds": 60},
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


def run_size(cluster: LocalCluster, n: int) -> dict:
    ns = f"roll-{n}"
    cluster.kubectl("create", "namespace", ns)
    _wait(lambda: cluster.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0, 60)
    decode = "pdfleet.io/role=decode"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pdd(ns, n, "example.invalid/rt:1")))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(deployment(ns, n, "example.invalid/rt:1")))
    _wait(lambda: _settled(cluster, ns, decode, n, "example.invalid/rt:1")
          and _settled(cluster, ns, "app=plain", n, "example.invalid/rt:1"))
    start = time.monotonic()
    cluster.kubectl("-n", ns, "patch", "pdd", "roll", "--type=merge",
                    "-p", json.dumps({"spec": {"decode": {"image": "example.invalid/rt:2"}}}))
    _wait(lambda: _settled(cluster, ns, decode, n, "example.invalid/rt:2"))
    pdfleet_s = time.monotonic() - start
    start = time.monotonic()
    cluster.kubectl("-n", ns, "set", "image", "deployment/plain", "runtime=example.invalid/rt:2")
    _wait(lambda: _settled(cluster, ns, "app=plain", n, "example.invalid/rt:2"))
    deployment_s = time.monotonic() - start
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    return {"pods": n, "pdfleet_seconds": round(pdfleet_s, 2), "deployment_seconds": round(deployment_s, 2),
            "ratio": round(pdfleet_s / deployment_s, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    biggest = max(args.sizes)
    nodes = math.ceil((2 * (biggest + SURGE) + 1) / 8) + 1
    state = Path(tempfile.mkdtemp(prefix="pdfleet-bench-rollout-"))
    cluster = LocalCluster(state / "cluster", ClusterOptions(nodes=nodes), die_with_parent=True,
                           progress=lambda m: None)
    op = LocalOperator(cluster, state / "operator")
    rows = []
    try:
        cluster.start()
        cluster.install_crd()
        op.start("--resync-seconds", "30")
        standin = RuntimeStandIn(cluster.api_client(), drain_delay=0.0, reason="BenchStandIn")
        standin.start()
        for n in args.sizes:
            rows.append(run_size(cluster, n))
            r = rows[-1]
            print(f"{n:4d} decode pods: pdfleet {r['pdfleet_seconds']:7.2f}s  Deployment {r['deployment_seconds']:7.2f}s"
                  f"  ratio {r['ratio']:.2f}", flush=True)
        standin.stop()
    finally:
        op.stop()
        cluster.stop()
    result = {
        "benchmark": "rollout",
        "date": datetime.now(UTC).isoformat(),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "baseline": "a Deployment rolling update of the same size, surge and readiness gate",
        "max_surge": SURGE, "max_unavailable": UNAVAILABLE,
        "rows": rows,
    }
    out = args.out or Path("bench/results") / f"rollout-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
