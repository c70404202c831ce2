"""`pdfleet demo`: the README's main job, end to end on a real local control plane.

1. build (if needed) and start etcd, kube-apiserver, controller-manager, scheduler and kwok
   with fake 8-GPU H200 nodes;
2. install the CRD and run the operator with its validating webhook;
3. show a manifest the capability matrix rejects, with the rule and the reason;
4. apply a valid ``qwen3.8-flash-next`` deployment and follow it to ``Available``;
5. a vLLM deployment (``spec.engine.kind: vllm``) rendered and checked (``demo_vllm``): each role's ``vllm
   serve`` command line as ``pdfleet render`` prints it, and the webhook's admission on a server-side dry run.
   vLLM cannot run here (no GPU), and the demo says so;
6. a small deployment with a router whose pods really run (the harness's kubelet, ``pdfleet dev
   kubelet``, runs the runtime and sglang-router pods in their own network namespaces, pools on the
   CPU), and a chat request through the router's Service: the answer, the bytes moved and the pods that
   served it. With ``--model DIR`` (``scripts/demo.sh`` passes the project's Zen model) the pods compute
   that model (``demo_model``) and the answer's tokens are compared with aggregate generation; without it
   they fill seeded state and the decode verifies every byte;
7. its twin behind vllm-router on NIXL, the built-in runtime standing in for vLLM in its pods: the same
   question, its lines prefixed ``vllm-router``, checked the same way (aggregate's answer of step 6 reused);
8. delete the first one (children go by garbage collection), stop everything.

Nothing runs the qwen deployment's pods (they ask for 4 and 2 GPUs of fake nodes), so the demo sets
each of its pods' ``pdfleet.io/transfer-path`` condition in the runtime's place, and says so on screen.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdfleet_devcluster import ClusterError, ClusterOptions, LocalCluster, ToolchainError
from pdfleet_devcluster.local_operator import LocalOperator
from pdfleet_operator.commands.demo_model import (
    MAX_TOKENS,
    QUESTION,
    AggregateCheck,
    DemoModelError,
    aggregate_check,
    model_spec,
)
from pdfleet_operator.commands.demo_vllm import STAND_IN, VllmSpecError, show_vllm_spec, vllm_chat_manifest
from pdfleet_operator.commands.dev import chat_curl
from pdfleet_runtime.config import READINESS_GATE

NAMESPACE = "demo"
CHAT_NAMESPACE = "demo-chat"
CHAT = "chat"
IMAGE = "ghcr.io/pdfleet/runtime:0.1.0"
STEPS = 8
KUBELET_STOP_S = 90.0
"""How long the clean-up waits for the kubelet to stop its pods: their grace periods (30 s at most here),
the preStop hooks inside them, and each pod's network teardown, on a loaded host."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a local cluster, the operator, a rejected and an Available PDDeployment")
    p.add_argument("--keep", action="store_true", help="leave the cluster and operator running at the end")
    p.add_argument("--state-dir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for Available (default 120)")
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="a model directory (Hugging Face layout) the chat deployment's pods compute, its answer "
                   "checked against aggregate generation (scripts/demo.sh: the project's Zen model); default: "
                   "seeded state, every byte verified")
    p.add_argument("--runtime-arg", action="append", default=[], metavar="ARG",
                   help="append ARG to the chat deployment's runtime pods' command (repeat), as `pdfleet dev kubelet "
                   "--arg` does")
    p.set_defaults(handler=run)


def _term_with_parent() -> None:
    """preexec_fn: SIGTERM (not SIGKILL: it then stops its pods) when the demo's process dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _step(n: int, msg: str) -> None:
    print(f"\n[{n}/{STEPS}] {msg}", flush=True)


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


def _chat_manifest(model: Path | None) -> dict:
    """tp 1, one prefill and one decode pod on Mooncake over TCP, and one router: ``model`` computed by the
    reference engine, or llama-dense's seeded state."""
    role = {"replicas": 1, "parallelism": {"tensor": 1}, "image": IMAGE,
            "pool": {"maxConcurrentRequests": 4, "kvTokensPerReplica": 2048}}
    spec_model = model_spec(model) if model is not None else {"layout": {"preset": "llama-dense"}}
    return {"apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
            "metadata": {"name": CHAT, "namespace": CHAT_NAMESPACE},
            "spec": {"model": spec_model, "transfer": {"backend": "mooncake", "protocol": "tcp"},
                     "prefill": role, "decode": role, "router": {"image": IMAGE},
                     "rollout": {"drainTimeoutSeconds": 20, "progressDeadlineSeconds": 120}}}


def _conditions(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}


def run(args: argparse.Namespace) -> int:
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="pdfleet-demo-"))
    cluster = LocalCluster(state / "cluster", ClusterOptions(nodes=3, gpus_per_node=8), die_with_parent=not args.keep)
    op = LocalOperator(cluster, state / "operator")
    kubelet: list[subprocess.Popen[bytes]] = []
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as Ctrl-C: the clean-up below runs
    try:
        return _run(args, cluster, op, state, kubelet)
    except (ClusterError, ToolchainError, DemoModelError, VllmSpecError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        if not args.keep:
            with _shielded():
                _clean_up(cluster, op, kubelet, state)


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """While the clean-up runs, a second Ctrl-C or SIGTERM is said and ignored: stopping half-way is what
    left pods and routers running before (issue 38)."""
    def said(signum: int, _frame: object) -> None:
        print(f"\n{signal.Signals(signum).name}: still cleaning up (the pods, the operator, the control plane); "
              "nothing is left running once this is done", file=sys.stderr, flush=True)

    before = {sig: signal.signal(sig, said) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _clean_up(cluster: LocalCluster, op: LocalOperator, kubelet: list[subprocess.Popen[bytes]], state: Path) -> None:
    """The kubelet stops its pods as a kubelet does (preStop, SIGTERM, SIGKILL after the grace period), then
    the operator and the control plane; ``LocalCluster.stop`` also stops whatever is left in the cluster's
    namespaces (a pod's process re-parented to PID 1, a router) and names what it could not stop."""
    print("\ncleaning up: stopping the pods, the operator and the control plane", flush=True)
    for k in kubelet:
        if k.poll() is None:
            k.send_signal(signal.SIGTERM)
        try:
            k.wait(KUBELET_STOP_S)
        except subprocess.TimeoutExpired:
            print(f"the kubelet did not stop its pods within {KUBELET_STOP_S:.0f}s: killing it (its pods' processes "
                  "are stopped below)", file=sys.stderr, flush=True)
            k.kill()
            k.wait()
        if k.returncode not in (0, None):
            print(f"the kubelet ended with {k.returncode}; its log: {state / 'kubelet.log'}", file=sys.stderr)
    op.stop()
    report = cluster.stop()
    print(f"{report}; state was in {state}", flush=True)


def _run(args: argparse.Namespace, cluster: LocalCluster, op: LocalOperator, state: Path,
         kubelet: list[subprocess.Popen[bytes]]) -> int:
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

    _step(5, "a vLLM deployment rendered and checked: each role's `vllm serve` command, admitted by the webhook")
    show_vllm_spec(cluster.kubectl, NAMESPACE)

    chat = ChatFleet(_chat_manifest(args.model), "sglang-router")
    computing = (f"runtime pods computing the model in {args.model} (transformers, CPU)" if args.model is not None
                 else "real runtime pods (seeded state, pools on the CPU)")
    _step(6, f"a chat request through a router: {computing} and sglang-router")
    _start_kubelet(cluster, state, kubelet, args.runtime_arg)
    print(cluster.kubectl("apply", "-f", "-", input=json.dumps(chat.manifest)).stdout.strip())
    first = _chat(cluster, state, chat, args.timeout, args.model)
    if not first.ok:
        return 1

    vllm = ChatFleet(vllm_chat_manifest(chat.manifest), "vllm-router", prefix="vllm-router ")
    _step(7, "the same chat through vllm-router on NIXL, to built-in runtime pods standing in for vLLM")
    print(STAND_IN)
    print(cluster.kubectl("apply", "-f", "-", input=json.dumps(vllm.manifest)).stdout.strip())
    if not _chat(cluster, state, vllm, args.timeout, args.model, first.aggregate).ok:
        return 1

    if args.keep:
        print(f"\nleft running: export KUBECONFIG={cluster.kubeconfig}; "
              f"stop with `pdfleet dev down --state-dir {cluster.state_dir}` and kill {op.proc.pid if op.proc else '?'}")
        return 0
    _step(8, "delete the qwen deployment: every child goes by garbage collection")
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


@dataclass(frozen=True)
class ChatFleet:
    """One chat deployment of the demo: its manifest, the router in front, and the prefix of its summary lines
    (empty for the sglang-router one, whose lines tests and readers grep as they were)."""

    manifest: dict
    router: str
    prefix: str = ""

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


def _start_kubelet(cluster: LocalCluster, state: Path, kubelet: list[subprocess.Popen[bytes]],
                   runtime_args: Sequence[str]) -> None:
    """The harness's kubelet for every pod of the chat namespace (both chat deployments'), in a session of its own."""
    cluster.kubectl("create", "namespace", CHAT_NAMESPACE)
    cmd = [sys.executable, "-m", "pdfleet_operator.cli", "dev", "--state-dir", str(cluster.state_dir), "kubelet",
           "-n", CHAT_NAMESPACE, "--arg=--device", "--arg=cpu", *(f"--arg={a}" for a in runtime_args),
           "--workdir", str(state / "pods")]
    print(f"$ {shlex.join(['pdfleet', *cmd[3:]])}   # the harness's kubelet for {CHAT_NAMESPACE}'s pods")
    # Its own session: a Ctrl-C in the terminal reaches the demo, which stops the kubelet once (_clean_up);
    # SIGTERM if the demo dies, so it still stops its pods.
    kubelet.append(subprocess.Popen(cmd, stdout=(state / "kubelet.log").open("wb"), stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_term_with_parent))


@dataclass(frozen=True)
class ChatOutcome:
    """Whether a chat held (an answer, every byte moved, and verified or equal to aggregate), and the aggregate
    check it ran (model pods only), for the next chat to reuse."""

    ok: bool
    aggregate: AggregateCheck | None = None


def _chat(cluster: LocalCluster, state: Path, fleet: ChatFleet, timeout: float, model: Path | None = None,
          aggregate: AggregateCheck | None = None) -> ChatOutcome:
    """Curl the fleet's endpoint with an OpenAI chat body once it is Available, and say what came back and
    whether it holds: every byte verified (seeded state), or the tokens equal aggregate generation (``model``;
    ``aggregate``: an earlier chat's, reused: the same model and question)."""
    question, max_tokens = (QUESTION, MAX_TOKENS) if model is not None else ("What moves from prefill to decode?", 8)
    curl, answer = _ask(cluster, fleet.name, question, max_tokens, timeout)
    if not answer.get("choices"):
        print(f"no answer through the router within {timeout:.0f}s ({fleet.router}, {fleet.name}); kubelet log: "
              f"{state / 'kubelet.log'}", file=sys.stderr)
        return ChatOutcome(False)
    p = _show_answer(cluster, fleet, question, curl, answer, verified=model is None)
    moved = p.get("transferBytes") == p.get("layoutBytes")
    if model is None:
        return ChatOutcome(bool(p.get("verified")) and moved)
    if aggregate is None:
        check = aggregate_check(model, p)
        print(f"$ {shlex.join(check.command)}   # without PD, in a process of its own")
    else:
        check = aggregate.against(p)
        print(f"$ {shlex.join(check.command)}   # its answer above, reused: the same model and question")
    pre = fleet.prefix
    print(f"{pre}aggregate: {check.answer.text!r} ({check.answer.finish_reason})")
    print(f"{pre}tokens equal aggregate: {check.equal} ({len(check.answer.prompt_ids)} prompt tokens, "
          f"{len(check.answer.output_ids)} generated)")
    return ChatOutcome(check.equal and moved, check)


def _show_answer(cluster: LocalCluster, fleet: ChatFleet, question: str, curl: list[str], answer: dict,
                 verified: bool) -> dict:
    """Print the command, the whole answer and its summary lines (the question, the answer, the bytes moved, the
    pods that served it), each with the fleet's prefix; return the answer's ``pdfleet`` extension."""
    print(cluster.kubectl("-n", CHAT_NAMESPACE, "get", "pdd", fleet.name).stdout.rstrip())
    print(f"$ pdfleet dev chat -n {CHAT_NAMESPACE} {fleet.name}   # runs, inside the cluster's network namespace:")
    print(f"  {shlex.join(curl)}")
    print(_ids_on_one_line(json.dumps(answer, indent=1)))
    p, pre = answer.get("pdfleet") or {}, fleet.prefix
    # Every pod of the namespace: the router pods carry no deployment label, and the names tell the fleets apart.
    pods = json.loads(cluster.kubectl("-n", CHAT_NAMESPACE, "get", "pods", "-o", "json").stdout)["items"]
    by_ip = {pod["status"].get("podIP"): pod["metadata"]["name"] for pod in pods}
    prefill_ip = str(p.get("prefill", "")).rpartition(":")[0]
    print(f"{pre}question: {question!r}")
    print(f"{pre}answer: {answer['choices'][0]['message']['content']!r} ({answer['choices'][0]['finish_reason']})")
    every = f", every byte verified by the decode: {p.get('verified')}" if verified else ""
    print(f"{pre}bytes: {p.get('transferBytes')} of request state moved prefill -> decode{every} (the layout's "
          f"count: {p.get('layoutBytes')})")
    router = next((n for n in by_ip.values() if n.startswith(fleet.name + "-router")), "?")
    print(f"{pre}served by: prefill {by_ip.get(prefill_ip, prefill_ip)} ({p.get('prefill')}), decode {p.get('decode')}, "
          f"room {p.get('room')}, routed by {router} ({fleet.router})")
    return p


def _ask(cluster: LocalCluster, name: str, question: str, max_tokens: int, timeout: float) -> tuple[list[str], dict]:
    """Once the deployment is Available, curl it until an answer with choices comes back or ``timeout`` passes
    (the router may still be discovering its workers): the last command and answer."""
    deadline = time.monotonic() + timeout
    curl: list[str] = []
    answer: dict = {}
    while time.monotonic() < deadline:
        obj = json.loads(cluster.kubectl("-n", CHAT_NAMESPACE, "get", "pdd", name, "-o", "json").stdout)
        if _conditions(obj).get("Available", {}).get("status") == "True":
            curl, out = chat_curl(cluster, CHAT_NAMESPACE, name, question, max_tokens)
            try:
                answer = json.loads(out.stdout)
            except ValueError:
                answer = {}
            if answer.get("choices"):
                break
        time.sleep(1.0)
    return curl, answer


def _ids_on_one_line(text: str) -> str:
    """An indented JSON text with each list of numbers (a model answer's token ids) on one line."""
    return re.sub(r"\[(\s*\d+,?)+\s*\]", lambda m: "[" + ", ".join(re.findall(r"\d+", m.group(0))) + "]", text)


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
