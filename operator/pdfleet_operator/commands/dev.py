"""`pdfleet dev up|down|status|shell|build`: a real local control plane with fake GPU nodes.

The cluster lives in a private network namespace (``devcluster.sandbox``) that outlives ``dev up``;
``dev shell`` runs a shell (or a command) inside it, with kubectl on PATH and KUBECONFIG set.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pdfleet_operator.devcluster import (
    ClusterError,
    ClusterOptions,
    LocalCluster,
    ToolchainError,
    cache_root,
    ensure_toolchain,
)


def default_state_dir() -> Path:
    return cache_root() / "dev-cluster"


def register(sub: argparse._SubParsersAction) -> None:
    dev = sub.add_parser("dev", help="run a local Kubernetes control plane with fake GPU nodes")
    dev.add_argument("--state-dir", type=Path, default=None, help="where certificates, logs and pids live")
    dev.set_defaults(handler=lambda a: (dev.print_help(sys.stderr), 2)[1])
    verbs = dev.add_subparsers(dest="verb", metavar="VERB")

    up = verbs.add_parser("up", help="build (if needed) and start the control plane")
    up.add_argument("--nodes", type=int, default=3, help="fake GPU nodes (default 3)")
    up.add_argument("--gpus-per-node", type=int, default=8, help="allocatable nvidia.com/gpu per node (default 8)")
    up.set_defaults(handler=_up)
    verbs.add_parser("down", help="stop every process `dev up` started").set_defaults(handler=_down)
    verbs.add_parser("status", help="say whether the cluster runs, and where").set_defaults(handler=_status)
    shell = verbs.add_parser("shell", help="a shell (or COMMAND) in the cluster's namespace, kubectl configured")
    shell.add_argument("command", nargs=argparse.REMAINDER, help="run this instead of $SHELL")
    shell.set_defaults(handler=_shell)
    kl = verbs.add_parser("kubelet", help="run the harness's kubelet for a namespace's pods (foreground, Ctrl-C stops)")
    kl.add_argument("-n", "--namespace", default="default", help="whose pods (default: default)")
    kl.add_argument("-l", "--selector", default="", help="only the pods matching this label selector")
    kl.add_argument("--arg", dest="extra", action="append", default=[],
                    help="append this to every container's command (repeat; e.g. --arg=--device --arg=cpu)")
    kl.add_argument("--workdir", type=Path, default=None, help="pod volumes and logs (default: STATE/pods/NS)")
    kl.set_defaults(handler=_kubelet)
    verbs.add_parser("build", help="only build the toolchain from Go modules").set_defaults(handler=_build)


def _cluster(args: argparse.Namespace, **opts: int) -> LocalCluster:
    return LocalCluster(args.state_dir or default_state_dir(), ClusterOptions(**opts))


def _up(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.gpus_per_node < 0:
        print("error: --nodes must be >= 1 and --gpus-per-node >= 0", file=sys.stderr)
        return 2
    cluster = _cluster(args, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    try:
        cluster.start()
    except (ClusterError, ToolchainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"kubeconfig: {cluster.kubeconfig} (the cluster is in a private network namespace)")
    print("try:        pdfleet dev shell -- kubectl get nodes")
    print("stop with:  pdfleet dev down")
    return 0


def _down(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    stopped = cluster.stop()
    print(f"stopped {len(stopped)} processes" + (f" ({', '.join(map(str, stopped))})" if stopped else ""))
    return 0


def _status(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if cluster.is_running():
        print(f"running; kubeconfig: {cluster.kubeconfig}")
        return 0
    print("not running")
    return 1


def _shell(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    pid = cluster.namespace_pid()
    if pid is None:
        print("error: the cluster is not running; start it with `pdfleet dev up`", file=sys.stderr)
        return 1
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    cmd = cmd or [os.environ.get("SHELL", "/bin/sh")]
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
           "PATH": f"{cluster.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    os.execvpe("nsenter", ["nsenter", f"--target={pid}", "--net", "--mount", "--", *cmd], env)


def _kubelet(args: argparse.Namespace) -> int:
    from pdfleet_operator.devcluster import sandbox

    cluster = _cluster(args)
    index = sandbox.current_index()
    if index is None:  # not inside yet: run this same command in the cluster's namespaces
        pid = cluster.namespace_pid()
        if pid is None:
            print("error: the cluster is not running; start it with `pdfleet dev up`", file=sys.stderr)
            return 1
        argv = [sys.executable, "-m", "pdfleet_operator.cli", *sys.argv[1:]]
        os.execvp("nsenter", ["nsenter", f"--target={pid}", "--net", "--mount", "--", *argv])
    cluster = LocalCluster(cluster.state_dir, ClusterOptions(sandbox_index=index))
    workdir = args.workdir or cluster.state_dir / "pods" / args.namespace
    extra = tuple(args.extra)
    kubelet = cluster.kubelet(args.namespace, workdir, selector=args.selector, extra_args=lambda pod: extra)
    print(f"kubelet for pods of {args.namespace} ({args.selector or 'all'}); logs under {workdir}", flush=True)
    kubelet.start()
    try:
        while kubelet.is_alive():
            kubelet.join(1.0)
    except KeyboardInterrupt:
        print("stopping: preStop hooks, SIGTERM, then SIGKILL after each pod's grace period", flush=True)
    kubelet.shutdown()
    return 0


def _build(args: argparse.Namespace) -> int:
    try:
        print(ensure_toolchain())
    except ToolchainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
