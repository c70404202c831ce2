"""`pdfleet demo`: the README's main job, end to end on a real local control plane.

1. build (if needed) and start etcd, kube-apiserver, controller-manager, scheduler and kwok
   with fake 8-GPU H200 nodes;
2. install the CRD and run the operator with its validating webhook;
3. show a manifest the capability matrix rejects, with the rule and the reason;
4. apply a valid ``qwen3.8-flash-next`` deployment and follow it to ``Available``;
5. delete it (children go by garbage collection), stop everything.

Without the runtime pod runner, nothing on the fake nodes runs the runtime, so the demo sets each
pod's ``pdfleet.io/transfer-path`` condition in the runtime's place, and says so on screen.
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
from pdfleet_operator.devcluster.local_operator import LocalOperator
from pdfleet_runtime.config import READINESS_GATE

NAMESPACE = "demo"
IMAGE = "ghcr.io/pdfleet/runtime:0.1.0"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a local cluster, the operator, a rejected and an Available PDDeployment")
    p.add_argument("--keep", action="store_true", help="leave the cluster and operator running at the end")
    p.add_argument("--state-dir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for Available (default 120)")
    p.set_defaults(handler=run)


def _step(n: int, msg: str) -> None:
    print(f"\n[{n}/5] {msg}", flush=True)


def _manifest(name: str, backend: str, prefill_tp: int, decode_tp: int, preset: str = "qwen3.8-flash-next") -> dict:
    return {
        "apiVersion": "pdfleet.io/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"layout": {"preset": preset}},
            "transfer": {"backend": backend, "protocol": "rdma"},
            "prefill": {"replicas": 1, "parallelism": {"tensor": prefill_tp}, "image": IMAGE},
            "decode": {"replicas": 2, "parallelism": {"tensor": decode_tp}, "image": IMAGE},
        },
    }


def _conditions(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}


def run(args: argparse.Namespace) -> int:
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="pdfleet-demo-"))
    cluster = LocalCluster(state / "cluster", ClusterOptions(nodes=3, gpus_per_node=8), die_with_parent=not args.keep)
    op = LocalOperator(cluster, state / "operator")
    try:
        return _run(args, cluster, op)
    except (ClusterError, ToolchainError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            print("\ncleaning up: stopping the operator and the control plane", flush=True)
            op.stop()
            stopped = cluster.stop()
            print(f"stopped {len(stopped)} control-plane processes; state was in {state}")


def _run(args: argparse.Namespace, cluster: LocalCluster, op: LocalOperator) -> int:
    _step(1, "a real control plane from Go modules, with fake GPU nodes (kwok)")
    cluster.start()
    print(cluster.kubectl("version").stdout.strip())
    print(cluster.kubectl("get", "nodes", "-o", "custom-columns=NODE:.metadata.name,"
                          "GPUS:.status.allocatable.nvidia\\.com/gpu,"
                          "GPU:.metadata.labels.nvidia\\.com/gpu\\.product").stdout.rstrip())

    _step(2, "the PDDeployment CRD and the operator (kopf) with its validating webhook over TLS")
    cluster.install_crd()
    cluster.kubectl("create", "namespace", NAMESPACE)
    op.start()
    print(f"operator running (log: {op.log}); webhook at {op.url}")

    _step(3, "a manifest the capability matrix rejects: PLE state across TP 4 -> 2 on NIXL")
    bad = _manifest("rejected", backend="nixl", prefill_tp=4, decode_tp=2)
    print(yaml.safe_dump(bad["spec"]["transfer"], default_flow_style=True).strip(), "| prefill tp4 -> decode tp2")
    out = cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    if out.returncode == 0:
        print("unexpected: the rejected manifest was admitted", file=sys.stderr)
        return 1
    print("kubectl apply said:\n  " + out.stderr.strip().replace("\n", "\n  "))

    _step(4, "a valid qwen3.8-flash-next deployment on Mooncake (prefill tp4 x1, decode tp2 x2)")
    good = _manifest("qwen-flash", backend="mooncake", prefill_tp=4, decode_tp=2)
    print(cluster.kubectl("apply", "-f", "-", input=json.dumps(good)).stdout.strip())
    if not _follow(cluster, "qwen-flash", args.timeout):
        print(f"not Available within {args.timeout:.0f}s; operator log: {op.log}", file=sys.stderr)
        return 1
    print(cluster.kubectl("-n", NAMESPACE, "get", "pdd").stdout.rstrip())
    print(cluster.kubectl("-n", NAMESPACE, "get", "pods,svc,networkpolicy,pdb").stdout.rstrip())

    if args.keep:
        print(f"\nleft running: export KUBECONFIG={cluster.kubeconfig}; "
              f"stop with `pdfleet dev down --state-dir {cluster.state_dir}` and kill {op.proc.pid if op.proc else '?'}")
        return 0
    _step(5, "delete it: every child goes by garbage collection")
    cluster.kubectl("-n", NAMESPACE, "delete", "pdd", "qwen-flash", "--wait=true", timeout=90)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pods,svc,configmaps,secrets", "-l",
                                          "pdfleet.io/deployment=qwen-flash", "-o", "json").stdout)["items"]
        if not left:
            print("all children gone")
            return 0
        time.sleep(0.5)
    print(f"children left after 60s: {[o['metadata']['name'] for o in left]}", file=sys.stderr)
    return 1


def _follow(cluster: LocalCluster, name: str, timeout: float) -> bool:
    """Print each change of the deployment's status until Available; set gates in the runtime's place."""
    deadline, last, gated = time.monotonic() + timeout, "", set()
    while time.monotonic() < deadline:
        obj = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pdd", name, "-o", "json").stdout)
        conds = _conditions(obj)
        status = obj.get("status") or {}
        line = (f"  prefill {status.get('prefillReady', '-')}  decode {status.get('decodeReady', '-')}  "
                + "  ".join(f"{k}={v['status']}" for k, v in conds.items()))
        if line != last:
            print(line, flush=True)
            last = line
        if conds.get("Available", {}).get("status") == "True":
            return True
        pods = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pods", "-l", f"pdfleet.io/deployment={name}",
                                          "-o", "json").stdout)["items"]
        for pod in pods:
            pname = pod["metadata"]["name"]
            if pod["status"].get("phase") == "Running" and pname not in gated:
                print(f"  (demo, in the runtime's place) {pname}: {READINESS_GATE}=True", flush=True)
                patch = {"status": {"conditions": [{"type": READINESS_GATE, "status": "True",
                                                    "reason": "DemoStandIn",
                                                    "message": "set by pdfleet demo, not by a runtime canary"}]}}
                cluster.kubectl("-n", NAMESPACE, "patch", "pod", pname, "--subresource=status",
                                "--type=strategic", "-p", json.dumps(patch))
                gated.add(pname)
        time.sleep(0.5)
    return False
