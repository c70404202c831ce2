"""What the rollout benchmark reads from a watch: every pod state the API showed, the budgets, and
where a rollout's time went.

``PodWatch`` follows one namespace's pods of a label selector and keeps, per pod, when it was first
seen, became Ready, was made unroutable (drain started), reported drained, got its deletion stamp and
went. At every event it checks the budgets as the operator must keep them: pods of the fleet
(terminating ones included) at most ``replicas + maxSurge``; routable ready pods, once the fleet was
whole, never below ``replicas - maxUnavailable``. Imported by bench/rollout.py only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Any

__all__ = ["PodWatch", "Stamps"]


@dataclass
class Stamps:
    seen: float
    ready: float | None = None
    unroutable: float | None = None
    drained: float | None = None
    deleting: float | None = None
    gone: float | None = None
    image: str = ""


@dataclass(eq=False)
class PodWatch(threading.Thread):
    core: Any
    namespace: str
    selector: str
    replicas: int
    surge: int
    unavailable: int
    pods: dict[str, Stamps] = field(default_factory=dict)
    state: dict[str, dict] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    max_pods: int = 0
    min_routable_ready: int | None = None
    events: int = 0
    restarts: int = 0
    since: float = 0.0  # when the rollout under watch started (monotonic)
    check: bool = True  # False: record only (a Deployment keeps its own, different budget rules)

    def __post_init__(self) -> None:
        super().__init__(daemon=True)
        self.stop_event = threading.Event()
        self.whole = False  # the fleet reached replicas routable ready pods once: the floor applies
        self.synced = threading.Event()

    def run(self) -> None:
        from kubernetes import watch

        w, version = watch.Watch(), None
        while not self.stop_event.is_set():
            try:
                listing = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
                if version is None:
                    listed = {pod.metadata.name for pod in listing.items}
                    for name in set(self.state) - listed:  # went while the watch was down
                        self.state.pop(name, None)
                        self.pods[name].gone = self.pods[name].gone or time.monotonic()
                    for pod in listing.items:
                        self._saw("ADDED", pod)
                    version = listing.metadata.resource_version
                    self.synced.set()
                for event in w.stream(self.core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                      resource_version=version, timeout_seconds=5):
                    self._saw(event["type"], event["object"])
                    version = event["object"].metadata.resource_version
            except Exception:  # 410 Gone: re-list (counted, so a result with restarts says so)
                self.restarts += 1
                version = None

    def _saw(self, kind: str, pod: Any) -> None:
        now, name = time.monotonic(), pod.metadata.name
        self.events += 1
        s = self.pods.setdefault(name, Stamps(seen=now, image=pod.spec.containers[0].image))
        conds = {c.type: c for c in pod.status.conditions or ()}
        labels = pod.metadata.labels or {}
        ready = "Ready" in conds and conds["Ready"].status == "True"
        routable = labels.get("pdfleet.io/routable", "true") == "true"
        if ready and s.ready is None:
            s.ready = now
        if not routable and s.unroutable is None:
            s.unroutable = now
        if "pdfleet.io/drained" in conds and conds["pdfleet.io/drained"].status == "True" and s.drained is None:
            s.drained = now
        if pod.metadata.deletion_timestamp and s.deleting is None:
            s.deleting = now
        if kind == "DELETED":
            s.gone = now
            self.state.pop(name, None)
        else:
            self.state[name] = {"ready": ready, "routable": routable, "deleting": bool(pod.metadata.deletion_timestamp),
                                "image": pod.spec.containers[0].image}
        self._check()

    def _check(self) -> None:
        count = len(self.state)
        self.max_pods = max(self.max_pods, count)
        rr = sum(p["ready"] and p["routable"] and not p["deleting"] for p in self.state.values())
        if rr >= self.replicas:
            self.whole = True
        if self.whole:
            self.min_routable_ready = rr if self.min_routable_ready is None else min(self.min_routable_ready, rr)
        if not self.check:
            return
        if count > self.replicas + self.surge:
            self.violations.append(f"{count} pods > replicas {self.replicas} + maxSurge {self.surge}")
        if self.whole and rr < self.replicas - self.unavailable:
            self.violations.append(f"{rr} routable ready < replicas {self.replicas} - maxUnavailable {self.unavailable}")

    def settled(self, n: int, image: str) -> bool:
        """``n`` live pods, all Ready, all of ``image`` (what the watch last showed: no list, no kubectl)."""
        live = [p for p in list(self.state.values()) if not p["deleting"]]
        return len(live) == n and all(p["ready"] and p["image"] == image for p in live)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)

    def breakdown(self, new_image: str | None, since: float) -> dict[str, float | None]:
        """Median seconds of each step of the rollout that started at ``since`` (monotonic); new pods are
        those of ``new_image``, or (None) those that appeared after ``since``."""
        def med(xs: list[float]) -> float | None:
            return round(median(xs), 3) if xs else None
        new = [s for s in self.pods.values() if (new_image is None or s.image == new_image) and s.seen >= since]
        old = [s for s in self.pods.values() if (s.image != new_image if new_image else s.seen < since)
               and s.gone is not None and s.gone >= since]
        return {
            "new_pods": len(new), "old_pods_gone": len(old),
            "created_to_ready_s": med([s.ready - s.seen for s in new if s.ready]),
            "unroutable_to_drained_s": med([s.drained - s.unroutable for s in old if s.drained and s.unroutable]),
            "drained_to_deleting_s": med([s.deleting - s.drained for s in old if s.deleting and s.drained]),
            "unroutable_to_deleting_s": med([s.deleting - s.unroutable for s in old if s.deleting and s.unroutable]),
            "deleting_to_gone_s": med([s.gone - s.deleting for s in old if s.gone and s.deleting]),
            # the controller's reactions: a new pod ready -> the next old pod leaves routing (or is deleted,
            # for a Deployment); an old pod gone -> the next new pod appears
            "ready_to_next_removal_s": med(_gaps([s.ready for s in new if s.ready],
                                                 [s.unroutable or s.deleting for s in old if s.unroutable or s.deleting])),
            "gone_to_next_create_s": med(_gaps([s.gone for s in old if s.gone], [s.seen for s in new])),
        }


def _gaps(causes: list[float], effects: list[float]) -> list[float]:
    """For each effect, the time since the latest cause before it (effects with no cause before: skipped)."""
    out = []
    for e in effects:
        before = [c for c in causes if c <= e]
        if before:
            out.append(e - max(before))
    return out
