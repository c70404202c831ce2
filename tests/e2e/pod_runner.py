"""The kwok pod runner: an end-to-end TEST HARNESS, named as such.

kwok nodes run nothing, so for pods of the project it starts each pod's real runtime command as
a local process (``pdfleet-runtime serve``, through ``LocalPod``) with the pod's own generated
config (read from the pod's ConfigMap volume) and secret (from its Secret volume), a port offset
(all pods share 127.0.0.1), ``POD_NAME``/``POD_NAMESPACE`` and a kubeconfig, so the runtime
itself patches its pod's readiness gate, follows the operator's drain annotation and reports
``pdfleet.io/drained`` through the real API. A pod marked for deletion gets SIGTERM (its drain),
a pod that is gone gets its process group stopped.

Local-run differences, and only these: the pools live on the CPU, and decode pods find prefill
pods through ``PDFLEET_PREFILL_ADDRESSES`` (the loopback addresses of the prefill processes
started so far) instead of the headless Service's DNS.
"""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import CoreV1Api

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.server.local import LocalPod

__all__ = ["PodRunner"]


@dataclass(eq=False)  # a Thread must stay hashable
class PodRunner(threading.Thread):
    api_client: Any
    namespace: str
    kubeconfig: Path
    workdir: Path
    extra_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # role -> serve flags
    pods: dict[str, LocalPod] = field(default_factory=dict)  # by pod uid
    roles: dict[str, str] = field(default_factory=dict)  # uid -> role
    finished: dict[str, LocalPod] = field(default_factory=dict)  # stopped pods, logs kept
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True)
        self.core = CoreV1Api(self.api_client)
        self._stop_event = threading.Event()
        self.workdir.mkdir(parents=True, exist_ok=True)

    # ---- one pod ---------------------------------------------------------
    def _config(self, pod: Any) -> tuple[RuntimeConfig, bytes]:
        vols = {v.name: v for v in pod.spec.volumes}
        cm = self.core.read_namespaced_config_map(vols["config"].config_map.name, self.namespace)
        cfg = RuntimeConfig.model_validate(yaml.safe_load(cm.data["runtime.yaml"]))
        secret = self.core.read_namespaced_secret(vols["auth"].secret.secret_name, self.namespace)
        key = base64.b64decode(next(iter(secret.data.values())))
        return cfg.model_copy(update={"device": "cpu"}), key

    def _prefill_addresses(self) -> str:
        return ",".join(p.bootstrap for uid, p in self.pods.items() if self.roles[uid] == "prefill")

    def _start(self, pod: Any) -> None:
        role = pod.metadata.labels.get("pdfleet.io/role", "")
        if role == "decode" and not self._prefill_addresses():
            return  # start prefill first: a decode needs somewhere to send its canary
        cfg, key = self._config(pod)
        env = {"POD_NAMESPACE": self.namespace, "PYTHONUNBUFFERED": "1"}
        if role == "decode":
            env["PDFLEET_PREFILL_ADDRESSES"] = self._prefill_addresses()
        local = LocalPod(self.workdir / pod.metadata.name, pod.metadata.name, cfg, key,
                         args=("--kubeconfig", str(self.kubeconfig), *self.extra_args.get(role, ())), env=env)
        self.pods[pod.metadata.uid], self.roles[pod.metadata.uid] = local, role
        local.start()

    def _stop_pod(self, uid: str) -> None:
        local = self.pods[uid]
        self.finished[uid] = local  # first: its log stays reachable while it stops
        del self.pods[uid]
        local.stop(timeout_s=60)

    # ---- loop --------------------------------------------------------------
    def step(self) -> None:
        seen = set()
        for pod in self.core.list_namespaced_pod(self.namespace,
                                                 label_selector="app.kubernetes.io/managed-by=pdfleet-operator").items:
            uid = pod.metadata.uid
            seen.add(uid)
            if pod.metadata.deletion_timestamp is not None:
                if uid in self.pods and self.pods[uid].proc is not None:
                    self.pods[uid].signal(__import__("signal").SIGTERM)  # kubelet's part: the pod's drain
                continue
            if uid not in self.pods and uid not in self.finished and pod.status.phase == "Running":
                (self.workdir / pod.metadata.name).mkdir(parents=True, exist_ok=True)
                self._start(pod)
        for uid in [u for u in self.pods if u not in seen]:
            self._stop_pod(uid)

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.step()
            except Exception as exc:  # a pod or config gone between list and read: next round
                self.errors.append(repr(exc))
            self._stop_event.wait(0.2)

    def shutdown(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
        for uid in list(self.pods):
            self._stop_pod(uid)

    def decode_pods(self) -> dict[str, LocalPod]:
        return {p.name: p for uid, p in self.pods.items() if self.roles[uid] == "decode"}

    def all_logs(self) -> dict[str, str]:
        return {p.name: p.log() for p in [*self.pods.values(), *self.finished.values()] if p.log_path.exists()}


def wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
