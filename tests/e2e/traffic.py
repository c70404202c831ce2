"""What the end-to-end rollout tests share: a fleet of real runtimes on kwok pods (``running_fleet``, each
in its pod sandbox, run by the harness's kubelet, ``devcluster.kubelet``), synthetic traffic through it (``Traffic``), and a record of every pod
state the API showed during a rollout (``PodTimeline``), from which the tests read the budgets.

Every prefill pod runs with a write delay, so each transfer takes a while and a pod whose drain starts
has transfers in flight; the decode pods' canary floor is lowered to match.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import watch
from kubernetes.client import CoreV1Api

from pdfleet_operator.devcluster import LocalCluster
from pdfleet_operator.devcluster.kubelet import Kubelet, wait
from pdfleet_runtime.config import READINESS_GATE
from pdfleet_runtime.server.local import http

__all__ = ["NAME", "WRITE_DELAY_S", "Fleet", "PodTimeline", "Result", "Traffic", "manifest", "running_fleet"]

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
# The one local-run difference: kwok nodes have no GPU, so the pools live on the CPU.
LOCAL_ARGS = ("--device", "cpu")


def manifest(ns: str, mark: str = "v1", *, prefill: int = 1, decode: int = 2, **rollout: Any) -> dict:
    """``decode`` pods carry ``ROLLOUT_MARK=mark`` (change it to roll them); ``rollout`` overrides the budgets."""
    role = {"parallelism": {"tensor": 1}, "image": IMAGE}
    pool = {"maxConcurrentRequests": 8, "kvTokensPerReplica": 2048}
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "model": {"layout": {"preset": "llama-dense"}},
            "transfer": {"backend": "mooncake", "protocol": "tcp"},
            # A prefill pod serves every decode pod's traffic and canaries (two requests in flight per
            # decode pod, surge pods included): room for all of them, so no request is shed for load.
            "prefill": {"replicas": prefill, **role, "pool": {**pool, "maxConcurrentRequests": 16}},
            "decode": {"replicas": decode, **role, "pool": pool, "env": [{"name": "ROLLOUT_MARK", "value": mark}]},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 60,
                        "progressDeadlineSeconds": 300, **rollout},
        },
    }


@dataclass
class Fleet:
    cluster: LocalCluster
    ns: str
    core: CoreV1Api
    runner: Kubelet
    _threads: list[Any] = field(default_factory=list)  # Traffic and PodTimeline, stopped at the end

    def traffic(self) -> Traffic:
        """Synthetic traffic, started; stopped at the end of the fleet if the test did not."""
        t = Traffic(self)
        self._threads.append(t)
        t.start()
        return t

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
        logs = "\n".join(f"--- {n}\n" + "\n".join([ln for ln in t.splitlines() if any(k in ln for k in keep)][-15:])
                         for n, t in self.runner.all_logs().items())
        pods = self.cluster.kubectl("-n", self.ns, "get", "pods", "-o", "wide", "-L", "pdfleet.io/revision").stdout
        return f"runner errors {self.runner.errors[-3:]}\n{pods}\nstatus {json.dumps(self.status())}\n{logs}"


@contextmanager
def running_fleet(cluster: LocalCluster, ns: str, workdir: Path, *, image_args: dict[str, tuple[str, ...]] | None = None,
                  **manifest_kw: Any) -> Iterator[Fleet]:
    """A PDDeployment of real runtimes, Available through their own gates; the runner stops at the end."""
    api = cluster.api_client()
    more = image_args or {}

    def args(pod: dict) -> tuple[str, ...]:
        role = pod["metadata"]["labels"].get("pdfleet.io/role", "")
        return (*LOCAL_ARGS, *RUNTIME_ARGS.get(role, ()), *more.get(pod["spec"]["containers"][0]["image"], ()))

    runner = cluster.kubelet(ns, workdir, selector="app.kubernetes.io/managed-by=pdfleet-operator",
                             extra_args=args, extra_env={"MC_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"})
    fleet = Fleet(cluster, ns, CoreV1Api(api), runner)
    runner.start()
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(ns, **manifest_kw)))
        fleet.wait(fleet.available, 180, "Available through real runtimes' gates")
        yield fleet
    finally:
        for t in fleet._threads:
            t.halt()
        runner.shutdown()


@dataclass(frozen=True)
class Result:
    pod: str
    revision: str
    code: int
    body: dict

    @property
    def admitted(self) -> bool:
        """The decode pod took the request (it refuses new ones once its own drain started: the router's
        view of routable pods lags by a moment, and a router sends such a request elsewhere)."""
        return not (self.code == 503 and "the pod is draining" in str(self.body.get("error", "")))

    @property
    def ok(self) -> bool:
        return self.code == 200 and bool(self.body.get("ok")) and self.body.get("mismatchedBytes") == 0


class Traffic(threading.Thread):
    """Synthetic requests, back to back, two workers per routable ready decode pod, until stopped.

    A worker sends its next request as soon as the last one answers, so with each transfer taking
    ``WRITE_DELAY_S`` a pod always has transfers in flight; workers of a pod that turned unroutable
    (its drain started) stop sending, and their last requests finish during the drain."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(daemon=True)
        self.fleet, self.runner = fleet, fleet.runner
        self.stop_event = threading.Event()
        self.results: list[Result] = []
        self.lock = threading.Lock()
        self.routable: set[str] = set()
        self.workers: dict[str, list[threading.Thread]] = {}
        self.sent = 0

    def _targets(self) -> set[str]:
        pods = self.fleet.core.list_namespaced_pod(self.fleet.ns,
                                                   label_selector="pdfleet.io/role=decode,pdfleet.io/routable=true")
        return {p.metadata.name for p in pods.items if p.metadata.deletion_timestamp is None
                and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())}

    def _worker(self, name: str) -> None:
        while not self.stop_event.is_set() and name in self.routable:
            local = self.runner.decode_pods().get(name)
            if local is None:
                return
            with self.lock:
                self.sent += 1
                n = self.sent
            code, body = http("POST", local.url + "/v1/synthetic", {"tokens": 64, "timeoutS": 30,
                                                                   "requestId": f"e2e-{name[-12:]}-{n}", "seed": n}, 60)
            with self.lock:
                self.results.append(Result(name, self.runner.revision_of(name), code,
                                           body if isinstance(body, dict) else {"raw": body}))

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.routable = self._targets()
            except Exception:  # the API answered slowly once: the next round asks again
                continue
            for name in self.routable - set(self.workers):
                self.workers[name] = [threading.Thread(target=self._worker, args=(name,), daemon=True)
                                      for _ in range(2)]
                for w in self.workers[name]:
                    w.start()
            self.stop_event.wait(0.1)

    def halt(self) -> None:
        self.stop_event.set()

    def stop(self) -> list[Result]:
        self.stop_event.set()
        self.join(timeout=30)
        for ws in self.workers.values():
            for w in ws:
                w.join(timeout=60)
        return list(self.results)

    # ---- reading the results -------------------------------------------------
    def served(self, revision: str | None = None) -> int:
        """Requests that succeeded, verified, on pods of ``revision`` (any revision: None)."""
        with self.lock:
            return sum(r.ok and (revision is None or r.revision == revision) for r in self.results)

    def wait_served(self, n: int, revision: str | None = None, timeout: float = 60) -> None:
        start = self.served(revision)
        self.fleet.wait(lambda: self.served(revision) >= start + n, timeout,
             f"{n} more requests served on {revision or 'any revision'}")

    def failures(self) -> list[Result]:
        """Admitted requests that failed or whose state arrived different (lost transfers)."""
        with self.lock:
            return [r for r in self.results if r.admitted and not r.ok]


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
