"""The harness's kubelet: runs the containers of the kwok pods it is asked to, each in its pod sandbox.

kwok's fake nodes run nothing; this loop plays their kubelet for the pods that match a label
selector (all of a namespace's, or only the project's): once kwok reports a pod Running with its
IP, it starts the pod in a ``PodSandbox`` (network namespace at that IP, volumes, a ServiceAccount
token through the TokenRequest API, the container commands); once the pod has a deletion timestamp
it terminates it as a kubelet does (preStop hook, SIGTERM, the grace period, SIGKILL), in the
background so the loop goes on. A pod without readiness gates has its readiness probes run
(``probes.ProbeLoop``), which write its ``ContainersReady`` condition. It runs inside the cluster's
private network namespace (``sandbox.enter``), the node every pod is on.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client import AuthenticationV1Api, CoreV1Api
from kubernetes.client.exceptions import ApiException

from pdfleet_devcluster import podsandbox
from pdfleet_devcluster.image import Image, local_image
from pdfleet_devcluster.podsandbox import PodSandbox
from pdfleet_devcluster.podspec import PodSpecError
from pdfleet_devcluster.probes import ProbeLoop, readiness_probes
from pdfleet_devcluster.sandbox import Ranges

__all__ = ["Kubelet", "StartedPod", "wait"]
ROLE_LABEL = "pdfleet.io/role"
POD_UID_CLAIM = "authentication.kubernetes.io/pod-uid"  # what a TokenReview says of a pod-bound token
TOKEN_ACCEPT_S = 30.0
API_TIMEOUT_S = 15  # no call may hang the loop (the client has no timeout of its own)


@dataclass(frozen=True)
class StartedPod:
    """What the kubelet started: the pod's identity at start."""

    name: str
    role: str
    revision: str
    image: str


@dataclass(eq=False)  # a Thread must stay hashable
class Kubelet(threading.Thread):
    api_client: Any
    namespace: str
    workdir: Path
    ranges: Ranges
    api_endpoint: tuple[str, int]  # KUBERNETES_SERVICE_HOST/PORT for the pods
    selector: str = ""
    extra_args: Callable[[dict], tuple[str, ...]] = lambda pod: ()  # local-run flags for a pod's command
    extra_env: dict[str, str] = field(default_factory=dict)
    rewrite: Callable[[PodSandbox, dict], dict] | None = None  # a stand-in image (standin.SGLangStandIn)
    image: Image = field(default_factory=local_image)  # this process's interpreter and checkout (image.py)
    pods: dict[str, PodSandbox] = field(default_factory=dict)  # by pod uid
    started: dict[str, StartedPod] = field(default_factory=dict)  # uid -> identity, kept after the pod went
    finished: dict[str, PodSandbox] = field(default_factory=dict)  # terminated pods, logs kept
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True)
        self.core = CoreV1Api(self.api_client)
        self.auth = AuthenticationV1Api(self.api_client)
        self._stop_event = threading.Event()
        self._stoppers: list[threading.Thread] = []
        self._probes: dict[str, ProbeLoop] = {}  # by pod uid
        self._base_env = self.image.env | dict(self.extra_env)
        self.workdir.mkdir(parents=True, exist_ok=True)

    # ---- what a pod's volumes and env read ----------------------------------------------------
    def _lookup(self, kind: str, name: str) -> dict[str, bytes] | None:
        try:
            if kind == "secret":
                obj = self.core.read_namespaced_secret(name, self.namespace, _request_timeout=API_TIMEOUT_S)
                return {k: base64.b64decode(v) for k, v in (obj.data or {}).items()}
            obj = self.core.read_namespaced_config_map(name, self.namespace, _request_timeout=API_TIMEOUT_S)
            return {k: v.encode() for k, v in (obj.data or {}).items()}
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _mint(self, pod: dict, sa: str, expiration_s: int, audience: str) -> str:
        """A token for ``sa`` bound to the pod (deleting the pod invalidates it), as the kubelet asks for,
        returned once the API accepts it for this pod (``_accepted``)."""
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        spec: dict = {"expirationSeconds": expiration_s,
                      "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}}
        if audience:
            spec["audiences"] = [audience]
        tr = self.core.create_namespaced_service_account_token(sa, self.namespace, {"spec": spec},
                                                               _request_timeout=API_TIMEOUT_S)
        token = str(tr.status.token)
        self._accepted(token, name, uid, [audience] if audience else [])
        return token

    def _accepted(self, token: str, name: str, uid: str, audiences: list[str]) -> None:
        """Wait until the API authenticates ``token`` as the pod ``uid`` (a TokenReview goes through the
        authenticator every request goes through). The apiserver checks a pod-bound token against its
        informer's copy of the pod by name: until that copy is the new pod, a token of a pod recreated under
        an earlier pod's name is refused (401). A real kubelet starts containers seconds after a pod is
        created; this one can within a fraction of a second, so it waits for what a pod's first request
        needs. Not accepted within ``TOKEN_ACCEPT_S``: the start is undone and tried again, with a new token."""
        deadline = time.monotonic() + TOKEN_ACCEPT_S
        body = {"spec": {"token": token, **({"audiences": audiences} if audiences else {})}}
        while True:
            st = self.auth.create_token_review(body, _request_timeout=API_TIMEOUT_S).status
            extra = (st.user.extra or {}) if st.authenticated and st.user else {}
            if (extra.get(POD_UID_CLAIM) or [None])[0] == uid:
                return
            if time.monotonic() > deadline:
                raise PodSpecError(f"pod {name}: the API does not accept the token minted for it (uid {uid}) after "
                                   f"{TOKEN_ACCEPT_S:.0f}s: {st.error or extra}")
            time.sleep(0.2)

    # ---- one pod -----------------------------------------------------------------------------
    def _start(self, pod: Any) -> None:
        d = self.api_client.sanitize_for_serialization(pod)
        labels = d["metadata"].get("labels") or {}
        uid = d["metadata"]["uid"]
        self.started[uid] = StartedPod(d["metadata"]["name"], labels.get(ROLE_LABEL, ""),
                                       labels.get("pdfleet.io/revision", ""), d["spec"]["containers"][0]["image"])
        # A directory per pod UID, as a kubelet keeps them: a pod recreated under an earlier pod's name shares
        # no log, volume or emptyDir with the one before (which may still be stopping).
        sandbox = PodSandbox(d, self.workdir / f"{d['metadata']['name']}_{uid[:8]}", self.ranges, self.api_endpoint,
                             self._lookup, self._mint, self._base_env, self.extra_args(d), self.rewrite,
                             image_paths=self.image.paths)
        self.pods[uid] = sandbox
        try:
            probes = readiness_probes(d)
            sandbox.start()
        except PodSpecError:
            # A kubelet's CreateContainerConfigError: a Secret or ConfigMap the pod names may not exist yet
            # (the router's keys Secret can come after its Deployment). Undone here, tried again next pass.
            sandbox.terminate(0.0)
            self.pods.pop(uid, None)
            self.started.pop(uid, None)
            raise
        if probes:
            name = d["metadata"]["name"]
            loop = ProbeLoop(sandbox.ip, probes, lambda ready: self._containers_ready(name, ready),
                             lambda c, cmd, t: sandbox.exec(*cmd, container=c, timeout_s=t).returncode)
            self._probes[uid] = loop
            loop.start()

    def _containers_ready(self, name: str, ready: bool) -> None:
        """What the probes found, as the kubelet writes it: ``ContainersReady`` (the Stages derive ``Ready``)."""
        cond = {"type": "ContainersReady", "status": "True" if ready else "False",
                "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "reason": "" if ready else "ReadinessProbeFailed", "message": ""}
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {"conditions": [cond]}},
                                              _request_timeout=API_TIMEOUT_S)

    def _terminate(self, uid: str, grace_s: float) -> None:
        loop = self._probes.pop(uid, None)
        if loop is not None:
            loop.stop()
        sandbox = self.pods.pop(uid)
        self.finished[uid] = sandbox  # its log stays reachable while it stops
        t = threading.Thread(target=sandbox.terminate, args=(grace_s,), daemon=True)
        self._stoppers.append(t)
        t.start()

    def _ips_taken(self) -> set[str]:
        return {p.ip for p in self._all() if p.network_up} | podsandbox.IPS_IN_USE

    @staticmethod
    def _grace(pod: Any) -> float:
        g = pod.metadata.deletion_grace_period_seconds
        return float(g if g is not None else pod.spec.termination_grace_period_seconds or 30)

    # ---- loop --------------------------------------------------------------------------------
    def step(self) -> None:
        seen = set()
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector, _request_timeout=API_TIMEOUT_S)
        for pod in pods.items:
            uid = pod.metadata.uid
            seen.add(uid)
            if pod.metadata.deletion_timestamp is not None:
                if uid in self.pods:
                    self._terminate(uid, self._grace(pod))
                continue
            ip = pod.status.pod_ip
            # kwok frees a pod's IP when its object goes: wait until a pod still stopping here let go of it.
            if uid not in self.started and pod.status.phase == "Running" and ip and ip not in self._ips_taken():
                self._start(pod)
        for uid in [u for u in self.pods if u not in seen]:
            self._terminate(uid, 30.0)  # gone without a deletion we saw (forced): the default grace

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.step()
            except Exception as exc:  # a pod or config gone between list and read: next round
                if not self.errors or self.errors[-1] != repr(exc):  # one entry while it repeats
                    self.errors.append(repr(exc))
            self._stop_event.wait(0.2)

    def shutdown(self, grace_s: float = 30.0) -> None:
        self._stop_event.set()
        self.join(timeout=10)
        for uid in list(self.pods):
            self._terminate(uid, grace_s)
        for t in self._stoppers:
            t.join(timeout=grace_s + 30)

    # ---- what tests read (from other threads: copies of the dicts, taken atomically) -----------
    def running(self, role: str) -> dict[str, PodSandbox]:
        """The pods of ``role`` whose containers all started and that are not terminating."""
        started = dict(self.started)
        return {p.name: p for uid, p in list(self.pods.items()) if started[uid].role == role and p.started}

    def decode_pods(self) -> dict[str, PodSandbox]:
        return self.running("decode")

    def left_running(self) -> dict[str, list[int]]:
        """The pods whose processes outlived their termination (their pids), by name; empty: none."""
        return {p.name: list(p.left) for p in self._all() if p.left}

    def _all(self) -> list[PodSandbox]:
        return [*list(self.pods.values()), *list(self.finished.values())]

    def sandbox_of(self, name: str) -> PodSandbox:
        return next(p for p in reversed(self._all()) if p.name == name)

    def log_of(self, name: str) -> str:
        return self.sandbox_of(name).log()

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
