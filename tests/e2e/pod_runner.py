"""The kwok pod runner: an end-to-end TEST HARNESS, named as such.

kwok nodes run nothing, so for pods of the project it starts each pod's real runtime command as
a local process (``pdfleet-runtime serve``, through ``LocalPod``) with the pod's own generated
config (read from the pod's ConfigMap volume) and secret (from its Secret volume), a port offset
(all pods share 127.0.0.1), ``POD_NAME``/``POD_NAMESPACE`` and a kubeconfig, so the runtime
itself patches its pod's readiness gate, follows the operator's drain annotation and reports
``pdfleet.io/drained`` through the real API. A pod marked for deletion gets SIGTERM (its drain),
a pod that is gone gets its process group stopped (in the background: the loop goes on meanwhile).

It also plays kube-dns for the prefill Service: in a cluster a decode pod resolves the headless
Service's name, and kube-dns answers from the Service's EndpointSlices (written by the real
kube-controller-manager from the kwok pods' IPs). The runner reads those same EndpointSlices every
round and writes, per Service, a JSON file of the loopback bootstrap address of each endpoint's pod,
which decode pods read on every lookup (``PDFLEET_PREFILL_ADDRESSES_FILE``). As CoreDNS does, it keeps
the endpoints whose ``ready`` condition is unset or True; the project's headless Services publish
not-ready addresses (discovery precedes readiness), so that is every pod with an IP, terminating ones
included, until the pod object is gone.

Local-run differences, and only these: the pools live on the CPU; an endpoint whose pod has no local
process yet is left out of the file (in a cluster its address would resolve and refuse connections);
``image_args`` adds serve flags to the pods of an image (a fault-injection flag plays a broken image).
"""

from __future__ import annotations

import base64
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import CoreV1Api, DiscoveryV1Api

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.protocol.discovery import Endpoint, FileResolver
from pdfleet_runtime.server.local import LocalPod

__all__ = ["PodRunner", "StartedPod", "wait"]

MANAGED = "app.kubernetes.io/managed-by=pdfleet-operator"


@dataclass(frozen=True)
class StartedPod:
    """What the runner started a process for: the pod's identity at start."""

    name: str
    role: str
    revision: str
    image: str


@dataclass(eq=False)  # a Thread must stay hashable
class PodRunner(threading.Thread):
    api_client: Any
    namespace: str
    kubeconfig: Path
    workdir: Path
    extra_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # role -> serve flags
    image_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # image -> more serve flags
    pods: dict[str, LocalPod] = field(default_factory=dict)  # by pod uid
    started: dict[str, StartedPod] = field(default_factory=dict)  # uid -> identity, kept after the pod went
    finished: dict[str, LocalPod] = field(default_factory=dict)  # stopped pods, logs kept
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True)
        self.core = CoreV1Api(self.api_client)
        self.discovery = DiscoveryV1Api(self.api_client)
        self._stop_event = threading.Event()
        self._idle = threading.Event()  # shutdown: the loop stays alive but starts and stops nothing
        self._stepping = threading.Lock()
        self._stoppers: list[threading.Thread] = []
        self._dns: dict[str, list[Endpoint]] = {}  # prefill Service -> what its file lists now
        self.workdir.mkdir(parents=True, exist_ok=True)

    # ---- kube-dns ------------------------------------------------------------
    def dns_file(self, service: str) -> Path:
        return self.workdir / f"dns-{service}.json"

    def _publish_dns(self) -> None:
        """One file per prefill Service, from its EndpointSlices (CoreDNS's rule: ready unset or True)."""
        by_uid = {**self.finished, **self.pods}
        answers: dict[str, list[Endpoint]] = {service: [] for service in self._dns}
        for eps in self.discovery.list_namespaced_endpoint_slice(self.namespace,
                                                                 label_selector="kubernetes.io/service-name").items:
            service = eps.metadata.labels["kubernetes.io/service-name"]
            if service not in answers:
                continue  # not a Service some decode pod looks up
            found = answers[service]
            for ep in eps.endpoints or ():
                ready = ep.conditions.ready if ep.conditions is not None else None
                ref = ep.target_ref
                local = by_uid.get(ref.uid) if ref is not None and ref.kind == "Pod" else None
                if ready is not False and local is not None:
                    host, _, port = local.bootstrap.rpartition(":")
                    found.append(Endpoint(host, int(port)))
        for service, endpoints in answers.items():
            endpoints = sorted(set(endpoints))
            if self._dns[service] != endpoints or not self.dns_file(service).exists():
                FileResolver.write(self.dns_file(service), endpoints)
                self._dns[service] = endpoints

    def dns(self, service: str) -> list[Endpoint]:
        """What the runner's kube-dns answers for ``service`` now."""
        return list(self._dns.get(service, ()))

    # ---- one pod ---------------------------------------------------------
    def _config(self, pod: Any) -> tuple[RuntimeConfig, bytes]:
        vols = {v.name: v for v in pod.spec.volumes}
        cm = self.core.read_namespaced_config_map(vols["config"].config_map.name, self.namespace)
        cfg = RuntimeConfig.model_validate(yaml.safe_load(cm.data["runtime.yaml"]))
        secret = self.core.read_namespaced_secret(vols["auth"].secret.secret_name, self.namespace)
        key = base64.b64decode(next(iter(secret.data.values())))
        return cfg.model_copy(update={"device": "cpu"}), key

    def _start(self, pod: Any) -> None:
        labels = pod.metadata.labels or {}
        role, image = labels.get("pdfleet.io/role", ""), pod.spec.containers[0].image
        cfg, key = self._config(pod)
        env = {"POD_NAMESPACE": self.namespace, "PYTHONUNBUFFERED": "1"}
        if role == "decode":
            env["PDFLEET_PREFILL_ADDRESSES_FILE"] = str(self.dns_file(cfg.prefill_service))
            self._dns.setdefault(cfg.prefill_service, [])
        workdir = self.workdir / pod.metadata.name
        workdir.mkdir(parents=True, exist_ok=True)
        args = ("--kubeconfig", str(self.kubeconfig), *self.extra_args.get(role, ()), *self.image_args.get(image, ()))
        local = LocalPod(workdir, pod.metadata.name, cfg, key, args=args, env=env)
        uid = pod.metadata.uid
        self.started[uid] = StartedPod(pod.metadata.name, role, labels.get("pdfleet.io/revision", ""), image)
        self.pods[uid] = local
        local.start()

    def _stop_pod(self, uid: str) -> None:
        local = self.pods[uid]
        self.finished[uid] = local  # first: its log stays reachable while it stops
        del self.pods[uid]
        t = threading.Thread(target=local.stop, kwargs={"timeout_s": 60}, daemon=True)
        self._stoppers.append(t)
        t.start()

    # ---- loop --------------------------------------------------------------
    def step(self) -> None:
        seen = set()
        for pod in self.core.list_namespaced_pod(self.namespace, label_selector=MANAGED).items:
            uid = pod.metadata.uid
            seen.add(uid)
            if pod.metadata.deletion_timestamp is not None:
                if uid in self.pods and self.pods[uid].proc is not None:
                    self.pods[uid].signal(signal.SIGTERM)  # kubelet's part: the pod's drain
                continue
            if uid not in self.pods and uid not in self.finished and pod.status.phase == "Running":
                self._start(pod)
        for uid in [u for u in self.pods if u not in seen]:
            self._stop_pod(uid)
        self._publish_dns()

    def run(self) -> None:
        while not self._stop_event.is_set():
            with self._stepping:
                try:
                    if not self._idle.is_set():
                        self.step()
                except Exception as exc:  # a pod or config gone between list and read: next round
                    self.errors.append(repr(exc))
            self._stop_event.wait(0.2)

    def shutdown(self) -> None:
        # The pods die with this thread (LocalPod: PR_SET_PDEATHSIG of the thread that started them), so
        # they are stopped (SIGTERM, their drain) while it still runs, and only then is it ended.
        self._idle.set()
        with self._stepping:
            for uid in list(self.pods):
                self._stop_pod(uid)
        for t in self._stoppers:
            t.join(timeout=90)
        self._stop_event.set()
        self.join(timeout=10)

    # ---- what tests read (from other threads: copies of the dicts, taken atomically) ---------------
    def running(self, role: str) -> dict[str, LocalPod]:
        started = dict(self.started)
        return {p.name: p for uid, p in list(self.pods.items()) if started[uid].role == role}

    def decode_pods(self) -> dict[str, LocalPod]:
        return self.running("decode")

    def revision_of(self, name: str) -> str:
        return next(s.revision for s in list(self.started.values()) if s.name == name)

    def _all(self) -> list[LocalPod]:
        return [*list(self.pods.values()), *list(self.finished.values())]

    def log_of(self, name: str) -> str:
        return next(p.log() for p in self._all() if p.name == name)

    def all_logs(self) -> dict[str, str]:
        return {p.name: p.log() for p in self._all() if p.log_path.exists()}


def wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
