"""`pdfleet dev up|down|status|shell|build`: a real local control plane with fake GPU nodes.

The cluster lives in a private network namespace (``devcluster.sandbox``) that outlives ``dev up``;
``dev shell`` runs a shell (or a command) inside it, with kubectl on PATH and KUBECONFIG set, and
``dev chat`` curls a PDDeployment's endpoint (its router's Service) from inside it with an OpenAI
chat body, printing the command and the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from pdfleet_devcluster import (
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
    verbs.add_parser("down", help="stop every process `dev up` started, and whatever else runs in the cluster's "
                     "namespaces (pods, routers, kubelets)").set_defaults(handler=_down)
    verbs.add_parser("status", help="say whether the cluster runs, and where").set_defaults(handler=_status)
    shell = verbs.add_parser("shell", help="a shell (or COMMAND) in the cluster's namespace, kubectl configured")
    shell.add_argument("command", nargs=argparse.REMAINDER, help="run this instead of $SHELL")
    shell.set_defaults(handler=_shell)
    chat = verbs.add_parser("chat", help="curl a PDDeployment's endpoint (its router's Service) with an OpenAI chat "
                            "body, from inside the cluster's network namespace")
    chat.add_argument("name", help="the PDDeployment")
    chat.add_argument("-n", "--namespace", default="default")
    chat.add_argument("-m", "--message", default="Hello from pdfleet", help="the user message")
    chat.add_argument("--max-tokens", type=int, default=8)
    chat.set_defaults(handler=_chat)
    kl = verbs.add_parser("kubelet", help="run the harness's kubelet for a namespace's pods (foreground, Ctrl-C stops)")
    kl.add_argument("-n", "--namespace", default="default", help="whose pods (default: default)")
    kl.add_argument("-l", "--selector", default="", help="only the pods matching this label selector")
    kl.add_argument("--arg", dest="extra", action="append", default=[],
                    help="append this to every runtime pod's container command (repeat; e.g. --arg=--device "
                    "--arg=cpu); router pods run their rendered command as it is")
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
    report = cluster.stop()
    print(report)
    return 1 if report.left else 0


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


def chat_curl(cluster: LocalCluster, namespace: str, name: str, message: str,
              max_tokens: int = 8) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """``curl`` of the deployment's endpoint with an OpenAI chat body, run inside the cluster's network
    namespace (the only place its Service addresses exist): the command and what it printed.

    The endpoint's DNS name resolves only in pods (CoreDNS), so the command names the Service's ClusterIP."""
    pid = cluster.namespace_pid()
    if pid is None:
        raise ClusterError("the cluster is not running; start it with `pdfleet dev up`")
    pdd = json.loads(cluster.kubectl("-n", namespace, "get", "pdd", name, "-o", "json").stdout)
    endpoint = (pdd.get("status") or {}).get("endpoint")
    if not endpoint:
        raise ClusterError(f"PDDeployment {namespace}/{name} has no status.endpoint: give it spec.router")
    service, _, port = endpoint.removeprefix("http://").partition(":")
    ip = cluster.kubectl("-n", namespace, "get", "svc", service.split(".")[0], "-o",
                         "jsonpath={.spec.clusterIP}").stdout.strip()
    body = {"model": (pdd["spec"].get("model") or {}).get("servedName") or name,
            "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens}
    cmd = ["curl", "-sS", "--max-time", "60", f"http://{ip}:{port.rstrip('/')}/v1/chat/completions",
           "-H", "Content-Type: application/json", "-d", json.dumps(body)]
    out = subprocess.run(["nsenter", f"--target={pid}", "--net", "--", *cmd], capture_output=True, text=True,
                         timeout=90)
    return cmd, out


def _chat(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    try:
        cmd, out = chat_curl(cluster, args.namespace, args.name, args.message, args.max_tokens)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"$ pdfleet dev shell -- {shlex.join(cmd)}", flush=True)
    print(out.stdout.rstrip() or out.stderr.rstrip())
    return out.returncode


def _kubelet(args: argparse.Namespace) -> int:
    from pdfleet_devcluster import sandbox

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
    kubelet = cluster.kubelet(args.namespace, workdir, selector=args.selector,
                              extra_args=lambda pod: extra if "pdfleet.io/role" in pod["metadata"].get("labels", {})
                              else ())
    print(f"kubelet for pods of {args.namespace} ({args.selector or 'all'}); logs under {workdir}", flush=True)
    # SIGINT (Ctrl-C) and SIGTERM stop it the same way, once: a second signal while its pods stop is
    # said and ignored, so it never leaves a pod half-terminated (issue 38: a second SIGINT, the demo's
    # after the terminal's Ctrl-C, raised KeyboardInterrupt inside the shutdown, and its pods outlived it).
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if stopping.is_set():
            print(f"{signal.Signals(signum).name}: already stopping the pods (preStop, SIGTERM, SIGKILL after "
                  "each pod's grace period)", flush=True)
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    kubelet.start()
    while kubelet.is_alive() and not stopping.wait(1.0):
        pass
    print("stopping: preStop hooks, SIGTERM, then SIGKILL after each pod's grace period", flush=True)
    kubelet.shutdown()
    left = kubelet.left_running()
    if left:
        print(f"could not stop every process of these pods (their network namespaces stay; `pdfleet dev down` "
              f"tries again): {left}", file=sys.stderr, flush=True)
        return 1
    print("every pod's processes stopped", flush=True)
    return 0


def _build(args: argparse.Namespace) -> int:
    try:
        print(ensure_toolchain())
    except ToolchainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
