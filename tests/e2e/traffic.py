"""What the end-to-end rollout tests share: a fleet of real runtimes on kwok pods (``running_fleet``, each
in its pod sandbox, run by the harness's kubelet, ``devcluster.kubelet``) behind the deployment's router
(sglang-router, run from its rendered command), client traffic through the router's Service
(``Traffic``: chat completions from an ``openai`` client, ``chat.ChatTraffic``), and a record of every
pod state the API showed during a rollout (``PodTimeline``), from which the tests read the budgets.

Every prefill pod runs with a write delay, so each transfer takes a while and a pod whose drain starts
has transfers in flight; the decode pods' canary floor is lowered to match.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import watch
from kubernetes.client import CoreV1Api

from pdfleet_devcluster import LocalCluster
from pdfleet_devcluster.kubelet import Kubelet, wait
from pdfleet_operator.resources.router import LABEL_ROUTER
from pdfleet_runtime.config import READINESS_GATE
from pdfleet_runtime.testing.chat import Answer, ChatTraffic
from pdfleet_runtime.testing.scrape import scrape
from tests.e2e.model_traffic import DIFFERS, ModelCheck

__all__ = ["NAME", "WRITE_DELAY_S", "Counts", "Fleet", "PodTimeline", "Result", "Traffic", "manifest", "running_fleet"]

NAME = "live"
WRITE_DELAY_S = 0.4
IMAGE = "example.invalid/runtime:local"
RUNTIME_ARGS = {
    "prefill": ("--fault-write-delay", str(WRITE_DELAY_S)),
    # The write delay slows every transfer on purpose, and on a loaded 2-core host (two test workers) a
    # canary's 8 MiB write was measured at 8.8 s: the floor and the canary's budget are not under test
    # here (the unit and server tests cover them), so they leave room for that.
    "decode": ("--canary-period", "2", "--retry-period", "0.5", "--floor-gbps", "0.0002", "--canary-timeout", "30"),
}
# The one local-run difference: kwok nodes have no GPU, so the pools live on the CPU (runtime pods only).
LOCAL_ARGS = ("--device", "cpu")
CONCURRENCY = 4  # client requests in flight at once: every decode pod has transfers in flight
ROUTER_PORT, ROUTER_METRICS_PORT = 30000, 29000  # spec.router's defaults
RETRY_METRICS = ("smg_worker_retries_total", "vllm_router_retries_total")  # sglang-router's, vllm-router's


def manifest(ns: str, mark: str = "v1", *, prefill: int = 1, decode: int = 2, nodes: int = 1,
             scheduling: dict | None = None, model: dict | None = None, prefill_tp: int = 1,
             router_kind: str | None = None, backend: str = "mooncake", canary_period: int | None = None,
             **rollout: Any) -> dict:
    """``decode`` pods carry ``ROLLOUT_MARK=mark`` (change it to roll them); ``rollout`` overrides the budgets;
    ``nodes`` > 1: every replica is a group of that many pods (tensor ``nodes``, one rank per pod);
    ``scheduling``: spec.scheduling (gangs, topology key); ``model``: spec.model of a model the pods compute
    (default: llama-dense's seeded state), with ``prefill_tp`` ranks in each prefill pod; ``router_kind``:
    spec.router.kind (default: the engine's own, sglang-router); ``backend``: spec.transfer.backend;
    ``canary_period``: spec.transfer.canaryPeriodSeconds (default: unset, the runtime's 10 s)."""
    parallelism = {"tensor": 1} if nodes == 1 else {"tensor": nodes, "nodesPerReplica": nodes}
    role = {"parallelism": parallelism, "image": IMAGE}
    pre_role = {**role, "parallelism": {"tensor": prefill_tp}} if prefill_tp != 1 else role
    pool = {"maxConcurrentRequests": 8, "kvTokensPerReplica": 2048}
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "model": model or {"layout": {"preset": "llama-dense"}},
            "transfer": {"backend": backend, "protocol": "tcp",
                         **({"canaryPeriodSeconds": canary_period} if canary_period else {})},
            # A prefill pod serves every decode pod's traffic and canaries (two requests in flight per
            # decode pod, surge pods included): room for all of them, so no request is shed for load.
            "prefill": {"replicas": prefill, **pre_role, "pool": {**pool, "maxConcurrentRequests": 16}},
            "decode": {"replicas": decode, **role, "pool": pool, "env": [{"name": "ROLLOUT_MARK", "value": mark}]},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 60,
                        "progressDeadlineSeconds": 300, **rollout},
            "router": {"image": IMAGE, "prefillPolicy": "round_robin", "decodePolicy": "round_robin",
                       **({"kind": router_kind} if router_kind else {})},
            **({"scheduling": scheduling} if scheduling else {}),
        },
    }


@dataclass
class Fleet:
    cluster: LocalCluster
    ns: str
    core: CoreV1Api
    runner: Kubelet
    _threads: list[Any] = field(default_factory=list)  # Traffic and PodTimeline, stopped at the end
    last_problem: str | None = None  # of the last request ``router_ready`` sent
    check: ModelCheck | None = None  # model pods: real prompts, answers checked against aggregate

    def traffic(self) -> Traffic:
        """Client traffic through the router, started; stopped at the end of the fleet if the test did not."""
        t = Traffic(self)
        self._threads.append(t)
        return t.start()

    def router_url(self) -> str:
        """The router's Service (its ClusterIP: this process is in the cluster's network namespace)."""
        svc = self.core.read_namespaced_service(f"{NAME}-router", self.ns)
        return f"http://{svc.spec.cluster_ip}:{ROUTER_PORT}"

    def timeline(self, synced: int) -> PodTimeline:
        """A watch of every pod of the namespace, started once it saw ``synced`` pods."""
        t = PodTimeline(self.core, self.ns)
        self._threads.append(t)
        return t.start(synced)

    def wait(self, cond: Any, timeout: float, what: str) -> Any:
        """``kubelet.wait``, and on timeout the pods, the status and the runtimes' logs."""
        try:
            return wait(cond, timeout, what)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnose()}") from None

    def pdd(self) -> dict:
        return json.loads(self.cluster.kubectl("-n", self.ns, "get", "pdd", NAME, "-o", "json").stdout)

    def status(self) -> dict:
        return self.pdd().get("status") or {}

    def patch(self, spec: dict) -> None:
        self.cluster.kubectl("-n", self.ns, "patch", "pdd", NAME, "--type=merge", "-p", json.dumps({"spec": spec}))

    def conditions(self) -> dict[str, dict]:
        return {c["type"]: c for c in self.status().get("conditions") or ()}

    def available(self) -> bool:
        st = self.status()
        conds = {c["type"]: c["status"] for c in st.get("conditions") or ()}
        return conds.get("Available") == "True" and (st.get("rollout") or {}).get("phase") == "Complete"

    def live_pods(self, role: str = "decode") -> list[Any]:
        pods = self.core.list_namespaced_pod(self.ns, label_selector=f"pdfleet.io/role={role}").items
        return [p for p in pods if p.metadata.deletion_timestamp is None]

    def revisions(self, role: str = "decode") -> list[str]:
        """The revision of each live pod of ``role``, sorted."""
        return sorted(p.metadata.labels["pdfleet.io/revision"] for p in self.live_pods(role))

    def settled_on(self, revision: str, n: int, role: str = "decode") -> bool:
        return self.revisions(role) == [revision] * n and self.available()

    def scale_decode_out_and_in(self, traffic: Traffic, *, timeout: float = 120, answer_timeout: float = 60) -> (
            set[str]):
        """Decode 2 -> 3 (the added pod answers twice through the router) -> 2, Available each time; the pods
        the scale-in removed."""
        runner = self.runner
        before = set(runner.decode_pods())
        self.patch({"decode": {"replicas": 3}})
        self.wait(lambda: len(runner.decode_pods()) == 3 and self.available(), timeout, "3 decode pods")
        [added] = set(runner.decode_pods()) - before
        self.wait(lambda: sum(r.ok and r.pod == added for r in traffic.results) >= 2, answer_timeout,
                  "the added pod answering through the router")
        three = set(runner.decode_pods())
        self.patch({"decode": {"replicas": 2}})
        self.wait(lambda: len(self.live_pods()) == 2 and len(runner.decode_pods()) == 2 and self.available(),
                  timeout, "scaled in to 2")
        return three - set(runner.decode_pods())

    def router_ready(self) -> bool:
        """One chat completion through the router answered and verified (its workers registered)."""
        try:
            answer = self.chat_traffic(timeout_s=30 if self.check else 10).once(0)
        except Exception as e:
            self.last_problem = repr(e)
            return False
        self.last_problem = answer.problem
        return answer.ok

    def routers_ready(self) -> bool:
        """Every router pod of the deployment Ready, and a fresh connection through the Service answered: a router
        left without workers answers its readiness probe 503, and the Service refuses new connections (kube-proxy
        rejects a ClusterIP without ready endpoints) until a probe passes and kube-proxy syncs again, while a
        kept-alive client goes on being served."""
        pods = self.core.list_namespaced_pod(self.ns, label_selector=f"{LABEL_ROUTER}={NAME}").items
        if not pods or not all(any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))
                               and p.metadata.deletion_timestamp is None for p in pods):
            self.last_problem = f"router pods not all Ready: {[p.metadata.name for p in pods]}"
            return False
        return self.router_ready()

    def chat_traffic(self, **kw: Any) -> ChatTraffic:
        """A client of the router's Service: seeded bodies, or the model check's prompts and verifier."""
        model = {"body_of": self.check.body, "verify": self.check.verify} if self.check else {}
        chat = ChatTraffic(self.router_url(), NAME, **{**model, **kw})
        self._threads.append(chat)  # halted at the fleet's end if the test did not stop it
        return chat

    def events(self) -> list[dict]:
        return json.loads(self.cluster.kubectl("-n", self.ns, "get", "events", "-o", "json").stdout)["items"]

    def forced_deletes(self) -> list[str]:
        return [e["message"] for e in self.events() if "FORCED" in e.get("message", "")]

    def drain_log(self, pod: str) -> tuple[int, bool]:
        """(transfers in flight when the pod's drain started, whether the drain finished unforced)."""
        log = self.runner.log_of(pod)
        m = re.search(r"drain started: (\d+) transfers in flight", log)
        return (int(m.group(1)) if m else -1), "drain finished" in log

    def resolve(self, name: str) -> list[str]:
        """What ``name`` resolves to inside a decode pod (CoreDNS, through the pod's resolv.conf), sorted."""
        pod = next(iter(self.runner.decode_pods().values()))
        out = pod.exec("getent", "ahostsv4", name)
        return sorted({line.split()[0] for line in out.stdout.splitlines() if line.strip()})

    def diagnose(self) -> str:
        keep = ("readiness", "drain", "ERROR", "WARNING", "Traceback", "failed")
        def tail(name: str, text: str) -> list[str]:
            if name.startswith(f"{NAME}-router-"):  # the router's own words on workers and circuits
                return text.splitlines()[-40:]
            return [ln for ln in text.splitlines() if any(k in ln for k in keep)][-15:]
        logs = "\n".join(f"--- {n}\n" + "\n".join(tail(n, t)) for n, t in self.runner.all_logs().items())
        pods = self.cluster.kubectl("-n", self.ns, "get", "pods", "-o", "wide", "-L", "pdfleet.io/revision").stdout
        return f"runner errors {self.runner.errors[-3:]}; last answer: {self.last_problem}\n{pods}\nstatus {json.dumps(self.status())}\n{logs}"


@contextmanager
def running_fleet(cluster: LocalCluster, ns: str, workdir: Path, *, image_args: dict[str, tuple[str, ...]] | None = None,
                  check: ModelCheck | None = None, **manifest_kw: Any) -> Iterator[Fleet]:
    """A PDDeployment of real runtimes, Available through their own gates; the runner stops at the end. With
    ``check`` (give ``model=`` too) the pods compute a model and every answer is checked against aggregate."""
    api = cluster.api_client()
    more = image_args or {}

    def args(pod: dict) -> tuple[str, ...]:
        role = pod["metadata"]["labels"].get("pdfleet.io/role", "")
        if not role:  # a router pod: its rendered command, verbatim
            return ()
        # A model's state is a few kilobytes: behind the write delay its canary's rate is far below any floor.
        floor = ("--floor-gbps", "0.00001") if check is not None and role == "decode" else ()
        return (*LOCAL_ARGS, *RUNTIME_ARGS.get(role, ()), *floor, *more.get(pod["spec"]["containers"][0]["image"], ()))

    runner = cluster.kubelet(ns, workdir, selector="app.kubernetes.io/managed-by=pdfleet-operator",
                             extra_args=args, extra_env={"MC_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"})
    fleet = Fleet(cluster, ns, CoreV1Api(api), runner, check=check)
    runner.start()
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(ns, **manifest_kw)))
        fleet.wait(fleet.available, 180, "Available through real runtimes' gates")
        fleet.wait(fleet.router_ready, 120, "the router serving requests")
        yield fleet
    finally:
        for t in fleet._threads:
            t.halt()
        runner.shutdown()


@dataclass(frozen=True)
class Result:
    """One chat completion through the router: the decode pod that answered it and that pod's revision."""

    answer: Answer
    revision: str

    @property
    def ok(self) -> bool:
        return self.answer.ok

    @property
    def pod(self) -> str | None:
        return self.answer.pod

    @property
    def body(self) -> dict:
        """What the runtime says of it (``pdfleet``: room, bytes, verified, prefill, decode)."""
        return self.answer.pdfleet


@dataclass(frozen=True)
class Counts:
    client_failures: int
    router_retries: int
    transfer_failures: int  # request transfers failed and rooms expired, summed over every pod seen
    per_pod: dict[str, int]
    rooms_expired: int = 0  # of transfer_failures: rooms no decode claimed (its decode died before it asked)
    checked: int | None = None  # model pods: answers checked against aggregate (None: seeded answers)
    differ: int = 0  # of those, answers that differ from aggregate (also client failures)

    def __str__(self) -> str:
        bad = {k: v for k, v in self.per_pod.items() if v}
        model = "" if self.checked is None else (f", answers checked against aggregate {self.checked}, "
                                                 f"answers that differ {self.differ}")
        return (f"client failures {self.client_failures}, router retries {self.router_retries}, transfer failures "
                f"{self.transfer_failures}{f' {bad}' if bad else ''}{model}")


class Traffic:
    """Client traffic through the router's Service (``chat.ChatTraffic``, ``CONCURRENCY`` requests at once),
    and the counters the tests check: the router's retries (its ``smg_worker_retries_total``) and the pods'
    failed request transfers and expired rooms (their ``/metrics``, scraped every second while they run, so
    a pod's last figures stay after it went)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.runner = fleet, fleet.runner
        self.chat = fleet.chat_traffic(concurrency=CONCURRENCY, **({"timeout_s": 120} if fleet.check else {}))
        self.pod_failures: dict[str, int] = {}
        self.pod_expired: dict[str, int] = {}
        self.pod_refused: dict[str, int] = {}  # vLLM-contract handshakes a decode refused (another generation)
        self._stop = threading.Event()
        self._scraper = threading.Thread(target=self._scrape_loop, daemon=True)

    def start(self) -> Traffic:
        self.chat.start()
        self._scraper.start()
        return self

    @property
    def results(self) -> list[Result]:
        return [Result(a, self._revision(a.pod)) for a in list(self.chat.answers)]

    def _revision(self, pod: str | None) -> str:
        return next((s.revision for s in list(self.runner.started.values()) if s.name == pod), "")

    def _scrape_loop(self) -> None:
        while not self._stop.wait(1.0):
            self.scrape()

    def scrape(self) -> None:
        for pod in list(self.runner.pods.values()):
            role = (pod.pod["metadata"].get("labels") or {}).get("pdfleet.io/role")
            if role not in ("prefill", "decode") or not pod.started:
                continue
            try:
                m = scrape(pod.url + "/metrics")
            except OSError:
                continue  # stopping, or killed: its last figures stay
            failed = sum(v for k, v in m.items() if k.startswith("pdfleet_transfers_total{")
                         and 'kind="request"' in k and 'outcome="failed"' in k)
            expired = int(m.get("pdfleet_rooms_expired_total{}", 0))
            refused = sum(v for k, v in m.items() if k.startswith("pdfleet_vllm_handshake_refusals_total{"))
            self.pod_failures[pod.name] = int(failed) + expired + int(refused)
            self.pod_expired[pod.name] = expired
            self.pod_refused[pod.name] = int(refused)

    def router_retries(self) -> int:
        total = 0
        for pod in list(self.runner.pods.values()):
            if pod.name.startswith(f"{NAME}-router-") and pod.started:
                m = scrape(f"http://{pod.ip}:{ROUTER_METRICS_PORT}/metrics")
                total += int(sum(v for k, v in m.items() if k.startswith(RETRY_METRICS)))
        return total

    def counts(self) -> Counts:
        """The three counts, printed (they are in the test's output)."""
        self.scrape()
        answers = list(self.chat.answers)
        differ = sum(bool(a.problem and a.problem.startswith(DIFFERS)) for a in answers)
        checked = None if self.fleet.check is None else sum(a.ok for a in answers) + differ
        c = Counts(len(self.chat.failures()), self.router_retries(), sum(self.pod_failures.values()),
                   dict(self.pod_failures), sum(self.pod_expired.values()), checked, differ)
        print(f"traffic through the router: {len(self.chat.answers)} requests, {c}", flush=True)
        return c

    def halt(self) -> None:
        self._stop.set()
        self.chat.halt()

    def stop(self) -> list[Result]:
        self.chat.stop()
        out = self.results
        self.scrape()
        self._stop.set()
        return out

    def assert_clean(self, pods: Callable[[str], bool] = lambda name: True) -> Counts:
        """Zero client failures, zero router retries, zero transfer failures (on the pods ``pods`` keeps)."""
        c = self.counts()
        fails = self.chat.failures()
        assert not fails, [(a.status, a.problem) for a in fails[:5]]
        assert c.router_retries == 0, c
        assert not any(v for k, v in c.per_pod.items() if pods(k)), c
        return c

    # ---- reading the results -------------------------------------------------
    def served(self, revision: str | None = None) -> int:
        """Requests answered and verified by decode pods of ``revision`` (any revision: None)."""
        return sum(r.ok and (revision is None or r.revision == revision) for r in self.results)

    def wait_served(self, n: int, revision: str | None = None, timeout: float = 60) -> None:
        start = self.served(revision)
        self.fleet.wait(lambda: self.served(revision) >= start + n, timeout,
                        f"{n} more requests served on {revision or 'any revision'}")

    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]


@dataclass(frozen=True)
class PodState:
    role: str
    revision: str
    image: str
    alive: bool  # not marked for deletion
    ready: bool  # the Ready condition (kwok sets it from the readiness gate)
    gate: bool  # the transfer-path gate condition the runtime writes
    routable: bool  # the routable label the operator writes
    draining: bool

    @property
    def routable_ready(self) -> bool:
        return self.alive and self.ready and self.gate and self.routable

    def __str__(self) -> str:
        flags = "".join(c for c, on in zip("RGrD", (self.ready, self.gate, self.routable, self.draining), strict=True)
                        if on)
        return f"{self.revision[:6]}:{flags}{'' if self.alive else ':deleting'}"


@dataclass
class PodTimeline:
    """Every pod state of the namespace, after each watch event: the budgets are read from these snapshots."""

    core: CoreV1Api
    ns: str
    snapshots: list[tuple[float, dict[str, PodState]]] = field(default_factory=list)
    error: Exception | None = None
    _first: int = 0
    _pods: dict[str, PodState] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self, synced: int) -> PodTimeline:
        """Watch; return once ``synced`` pods were seen (the watch's initial listing, one event per pod:
        the snapshots before it are partial and are left out of what the budgets read)."""
        threading.Thread(target=self._run, daemon=True).start()
        wait(lambda: len(self._pods) >= synced, 30, "pod watch synced")
        self._first = next(i for i, (_, snap) in enumerate(self.snapshots) if len(snap) >= synced)
        return self

    def _run(self) -> None:
        try:
            w = watch.Watch()
            for ev in w.stream(self.core.list_namespaced_pod, self.ns, timeout_seconds=900):
                pod = ev["object"]
                if ev["type"] == "DELETED":
                    self._pods.pop(pod.metadata.name, None)
                else:
                    self._pods[pod.metadata.name] = _state(pod)
                self.snapshots.append((time.monotonic(), dict(self._pods)))
                if self._stop.is_set():
                    w.stop()
        except Exception as exc:  # the watch ends when the cluster goes; before stop() it is a failure
            if not self._stop.is_set():
                self.error = exc

    def halt(self) -> None:
        self._stop.set()

    def stop(self) -> PodTimeline:
        assert self.error is None, f"the pod watch broke: {self.error!r}"
        self._stop.set()
        return self

    def _of(self, role: str, since: float = 0.0) -> list[dict[str, PodState]]:
        return [{n: s for n, s in snap.items() if s.role == role} for t, snap in self.snapshots[self._first:]
                if t >= since]

    def now(self, role: str = "decode") -> dict[str, PodState]:
        """The latest snapshot's pods of the role."""
        snap = self.snapshots[-1][1] if self.snapshots else {}
        return {n: s for n, s in snap.items() if s.role == role}

    def max_pods(self, role: str = "decode") -> int:
        """The most pods of the role at once, draining and terminating ones included (they hold GPUs)."""
        return max(len(s) for s in self._of(role))

    def min_routable_ready(self, role: str = "decode") -> int:
        return min(sum(p.routable_ready for p in s.values()) for s in self._of(role))

    def lowest(self, role: str = "decode") -> str:
        """The snapshots around the one with the fewest routable ready pods of the role (an assertion's
        message): per pod its revision and R(eady) G(ate) r(outable label) D(raining)."""
        snaps = self._of(role)
        i = min(range(len(snaps)), key=lambda k: sum(p.routable_ready for p in snaps[k].values()))
        return "\n".join(f"{'>' if k == i else ' '} " + " ".join(f"{n[-8:]}={s}" for n, s in sorted(snaps[k].items()))
                         for k in range(max(0, i - 4), min(len(snaps), i + 3)))

    def max_alive_on(self, revision: str, role: str = "decode", since: float = 0.0) -> int:
        return max((sum(p.alive and p.revision == revision for p in s.values()) for s in self._of(role, since)),
                   default=0)

    def ever(self, role: str = "decode") -> dict[str, PodState]:
        """The last state seen of every pod of the role that existed during the watch."""
        out: dict[str, PodState] = {}
        for snap in self._of(role):
            out.update(snap)
        return out


def _state(pod: Any) -> PodState:
    conds = {c.type: c.status for c in pod.status.conditions or ()}
    labels = pod.metadata.labels or {}
    return PodState(
        role=labels.get("pdfleet.io/role", ""), revision=labels.get("pdfleet.io/revision", ""),
        image=pod.spec.containers[0].image, alive=pod.metadata.deletion_timestamp is None,
        ready=conds.get("Ready") == "True", gate=conds.get(READINESS_GATE) == "True",
        routable=labels.get("pdfleet.io/routable") == "true",
        draining="pdfleet.io/drain-started" in (pod.metadata.annotations or {}))
