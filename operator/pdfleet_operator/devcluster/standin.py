"""A stand-in for the runtime on kwok nodes, named as such wherever it is used.

Nothing runs in a kwok pod, so tests, benchmarks and the demo that do not start real runtimes use
this thread to do the two things a runtime does to its pod through the API: set the
``pdfleet.io/transfer-path`` readiness-gate condition once the pod runs (a real runtime does so
only after a verified canary transfer), and report ``pdfleet.io/drained`` a moment after the
operator starts draining it (a real runtime does so once no transfer is in flight).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pdfleet_runtime.config import DRAIN_ANNOTATION, READINESS_GATE, drain_of, drained_message
from pdfleet_runtime.config import DRAINED_CONDITION as DRAINED_CONDITION

__all__ = ["DRAINED_CONDITION", "RuntimeStandIn"]



class RuntimeStandIn(threading.Thread):
    """Polls pods (one namespace, or all with the managed-by label) and sets the two conditions."""

    def __init__(self, api_client: Any, namespace: str | None = None, drain_delay: float = 0.3,
                 interval: float = 0.1, reason: str = "RuntimeStandIn", failing_images: frozenset[str] = frozenset(),
                 watch: bool = False) -> None:
        super().__init__(daemon=True)
        from kubernetes.client import CoreV1Api

        self.core = CoreV1Api(api_client)
        self.namespace, self.drain_delay, self.interval, self.reason = namespace, drain_delay, interval, reason
        # Pods of these images fail their canary: the gate goes False with a reason, as a runtime
        # that cannot complete a verified transfer reports it.
        self.failing_images = failing_images
        self.stop_event = threading.Event()
        self.gated = 0
        self.drained = 0
        self.errors: list[str] = []  # e.g. a pod deleted between list and patch; retried next round
        # watch: follow a watch instead of listing every ``interval`` (benchmarks of a thousand pods,
        # where polling lists would cost more CPU than the operator under test)
        self.watch = watch
        self._waiting: dict[tuple[str, str], Any] = {}  # drains whose delay has not passed yet

    def _list(self) -> list[Any]:
        selector = "app.kubernetes.io/managed-by=pdfleet-operator"
        if self.namespace:
            return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return self.core.list_pod_for_all_namespaces(label_selector=selector).items

    def _set(self, pod: Any, kind: str, status: str = "True", message: str = "set by a stand-in for the runtime",
             reason: str | None = None) -> None:
        body = {"status": {"conditions": [{"type": kind, "status": status, "reason": reason or self.reason,
                                           "message": message}]}}
        self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def step(self) -> None:
        for pod in self._list():
            self.step_pod(pod)

    def step_pod(self, pod: Any) -> None:
        if pod.metadata.deletion_timestamp or pod.status.phase != "Running":
            return
        conds = {c.type: c.status for c in pod.status.conditions or ()}
        if pod.spec.containers[0].image in self.failing_images:
            if conds.get(READINESS_GATE) != "False":
                self._set(pod, READINESS_GATE, "False", "canary transfer failed (stand-in: failing image)",
                          reason="TransfersFailing")
        elif conds.get(READINESS_GATE) != "True":
            self._set(pod, READINESS_GATE)
            self.gated += 1
        started = (pod.metadata.annotations or {}).get(DRAIN_ANNOTATION)
        reported = {c.type: c.message for c in pod.status.conditions or ()}.get(DRAINED_CONDITION)
        key = (pod.metadata.namespace, pod.metadata.name)
        self._waiting.pop(key, None)
        if started and drain_of(reported) != started:
            if time.time() - float(started) >= self.drain_delay:
                self._set(pod, DRAINED_CONDITION, message=drained_message(started, "set by a stand-in for the runtime"))
                self.drained += 1
            else:
                self._waiting[key] = pod

    def _follow(self) -> None:
        from kubernetes import watch

        selector, w = "app.kubernetes.io/managed-by=pdfleet-operator", watch.Watch()
        list_fn = (self.core.list_pod_for_all_namespaces if not self.namespace
                   else lambda **kw: self.core.list_namespaced_pod(self.namespace, **kw))
        version = None
        while not self.stop_event.is_set():
            try:
                for event in w.stream(list_fn, label_selector=selector, timeout_seconds=1,
                                      **({"resource_version": version} if version else {})):
                    if event["type"] != "DELETED":
                        self.step_pod(event["object"])
                    version = event["object"].metadata.resource_version
                for ns, name in list(self._waiting):
                    self.step_pod(self.core.read_namespaced_pod(name, ns))
            except Exception as exc:  # 410 Gone and the like: start over from a fresh listing
                self.errors.append(repr(exc))
                version = None

    def run(self) -> None:
        if self.watch:
            self._follow()
            return
        while not self.stop_event.is_set():
            try:
                self.step()
            except Exception as exc:
                self.errors.append(repr(exc))
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)
