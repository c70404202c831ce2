"""`pdfleet demo`: the README's main job.

Today it brings up the local control plane, shows the fake GPU nodes and the
real server version, schedules a small GPU workload onto them, and cleans up
(``--keep`` leaves the cluster running).  Later steps add the operator and a
PDDeployment going Available.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pdfleet_operator.devcluster import ClusterError, ClusterOptions, LocalCluster, ToolchainError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="bring up a local cluster with fake GPU nodes and show it working")
    p.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    p.add_argument("--state-dir", type=Path, default=None, help="default: a temporary directory")
    p.set_defaults(handler=run)


def _step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def run(args: argparse.Namespace) -> int:
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="pdfleet-demo-"))
    cluster = LocalCluster(state, ClusterOptions(nodes=3, gpus_per_node=8), die_with_parent=not args.keep)
    try:
        _step("building (if needed) and starting a real control plane: etcd, kube-apiserver, "
              "kube-controller-manager, kube-scheduler, kwok")
        cluster.start()
        _step("kubectl version")
        print(cluster.kubectl("version").stdout)
        _step("kubectl get nodes -L nvidia.com/gpu.product  (fake H200 nodes managed by kwok)")
        print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product",
                              "-o", "custom-columns=NAME:.metadata.name,READY:.status.conditions[-1:].status,"
                              "GPUS:.status.allocatable.nvidia\\.com/gpu,VERSION:.status.nodeInfo.kubeletVersion").stdout)
        _step("a 3-replica Deployment asking for 2 GPUs per pod")
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(_deployment()))
        out = cluster.kubectl("rollout", "status", "deployment/demo-gpu", "--timeout=120s", timeout=130)
        print(out.stdout.strip())
        print(cluster.kubectl("get", "pods", "-o", "wide").stdout)
        used = _gpus_in_use(cluster)
        print(f"GPUs requested by running pods: {used} of {3 * 8}")
    except (ClusterError, ToolchainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    if args.keep:
        _step("cluster left running")
        print(f"export KUBECONFIG={cluster.kubeconfig}\nkubectl: {cluster.bin_dir / 'kubectl'}\n"
              f"stop with: pdfleet dev down --state-dir {state}")
        return 0
    _step("cleaning up")
    started = time.monotonic()
    stopped = cluster.stop()
    print(f"stopped {len(stopped)} processes in {time.monotonic() - started:.1f}s")
    return 0


def _deployment() -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "demo-gpu", "namespace": "default"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "demo-gpu"}},
            "template": {
                "metadata": {"labels": {"app": "demo-gpu"}},
                "spec": {"containers": [{"name": "main", "image": "example.invalid/demo:v1",
                                         "resources": {"limits": {"nvidia.com/gpu": "2"}}}]},
            },
        },
    }


def _gpus_in_use(cluster: LocalCluster) -> int:
    pods = json.loads(cluster.kubectl("get", "pods", "-A", "-o", "json").stdout)["items"]
    return sum(
        int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        for p in pods if p["status"].get("phase") == "Running"
        for c in p["spec"]["containers"]
    )
