"""What the rollout benchmark reads from a watch: every pod state the API showed, the budgets, and
where a rollout's time went.

``PodWatch`` follows one namespace's pods of a label selector and keeps, per pod, when it was first
seen, scheduled, Running, when its runtime first wrote the gate and when the gate passed, Ready, the
drain requested, reported drained, its deletion stamp and when it went. At every event it checks the budgets as the operator must keep them: pods of the fleet
(terminating ones included) at most ``replicas + maxSurge``; routable ready pods, once the fleet was
whole, never below ``replicas - maxUnavailable``. Imported by bench/rollout.py only.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from pdfleet_runtime.config import DRAIN_ANNOTATION
from pdfleet_runtime.config import READINESS_GATE as GATE

__all__ = ["PodWatch", "Stamps"]


@dataclass
class Stamps:
    """When the watch first showed each state of one pod (time.monotonic())."""

    seen: float
    scheduled: float | None = None  # PodScheduled True
    running: float | None = None  # phase Running (kwok): the harness's kubelet starts the runtime
    runtime_up: float | None = None  # the runtime wrote its gate condition (any status): its server runs
    gate: float | None = None  # the gate condition True: a verified canary transfer
    ready: float | None = None
    drain_requested: float | None = None  # pdfleet.io/drain-started annotation (the operator's drain)
    unroutable: float | None = None
    drained: float | None = None
    deleting: float | None = None
    gone: float | None = None
    image: str = ""
    mark: str = ""  # the container's ROLLOUT_MARK env (the real-runtime arm rolls by changing it)
    ip: str = ""


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
    floor_breaks_by_removal: list[str] = field(default_factory=list)  # of the violations: those a drain or delete made
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
        s = self.pods.setdefault(name, Stamps(seen=now, image=pod.spec.containers[0].image, mark=next(
            (e.value for e in pod.spec.containers[0].env or () if e.name == "ROLLOUT_MARK"), "")))
        conds = {c.type: c for c in pod.status.conditions or ()}
        labels = pod.metadata.labels or {}
        ready = "Ready" in conds and conds["Ready"].status == "True"
        routable = labels.get("pdfleet.io/routable", "true") == "true"
        s.ip = pod.status.pod_ip or s.ip
        before = self.state.get(name) or {}
        # the operator took a serving pod out: a routable ready pod made unroutable or deleted by this event
        took_out = (before.get("ready") and before.get("routable") and not before.get("deleting")
                    and (not routable or bool(pod.metadata.deletion_timestamp) or kind == "DELETED"))
        for attr, hit in (("scheduled", "PodScheduled" in conds and conds["PodScheduled"].status == "True"),
                          ("running", pod.status.phase == "Running"),
                          ("runtime_up", GATE in conds),
                          ("gate", GATE in conds and conds[GATE].status == "True"),
                          ("ready", ready),
                          ("drain_requested", DRAIN_ANNOTATION in (pod.metadata.annotations or {}))):
            if hit and getattr(s, attr) is None:
                setattr(s, attr, now)
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
                                "image": pod.spec.containers[0].image, "mark": s.mark}
        self._check(took_out=name if took_out else None)

    def _check(self, took_out: str | None = None) -> None:
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
            if took_out:  # the floor broken by taking a serving pod out, not by pods failing on their own
                self.floor_breaks_by_removal.append(f"{took_out} taken out leaving {rr} routable ready")

    def settled(self, n: int, image: str | None = None, mark: str | None = None) -> bool:
        """``n`` live pods, all Ready, all of ``image`` (or ``ROLLOUT_MARK=mark``): what the watch last
        showed, no list, no kubectl. Terminating pods do not count (a Deployment is done when its old pods
        are terminating, their preStop drain still running; pdfleet deletes a pod once it drained)."""
        live = [p for p in list(self.state.values()) if not p["deleting"]]
        return len(live) == n and all(p["ready"] and (image is None or p["image"] == image)
                                      and (mark is None or p["mark"] == mark) for p in live)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)

    def breakdown(self, new_image: str | None, since: float,
                  extra: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
        """Where the rollout that started at ``since`` (monotonic) went, by named phase: the median
        seconds of each step of a new pod (created -> scheduled -> running -> runtime up -> gate passed ->
        Ready -> in the router) and of an old pod (drain requested -> drain started -> router dropped ->
        admission stopped -> drained -> deleted -> gone), and the controller's reactions between them.
        New pods are those of ``new_image``, or (None) those that appeared after ``since``. ``extra``:
        stamps per pod name read elsewhere (the router's worker list, the runtime's log), laid over the
        watch's. Also each pod's stamps, in seconds from ``since``."""
        def med(xs: list[float]) -> float | None:
            return round(median(xs), 3) if xs else None

        stamps = {name: {k: v for k, v in vars(s).items() if isinstance(v, float) and k != "unroutable"}
                  | (extra or {}).get(name, {})
                  for name, s in self.pods.items()}
        for st in stamps.values():  # a Deployment's drain is its delete (the preStop hook runs then)
            if "drain_requested" not in st and "deleting" in st:
                st["drain_requested"] = st.pop("deleting")
        new = {n: st for n, st in stamps.items()
               if (new_image is None or self.pods[n].image == new_image) and st["seen"] >= since}
        old = {n: st for n, st in stamps.items() if n not in new and st.get("gone") is not None and st["gone"] >= since}

        def chain(group: dict[str, dict[str, float]], steps: tuple[str, ...]) -> dict[str, float | None]:
            """Median seconds from each step to the next one a pod has (a step it lacks is skipped; a
            negative figure: that step came first, as a Deployment's router drop before the drain)."""
            gaps: dict[str, list[float]] = {}
            for st in group.values():
                have = [k for k in steps if st.get(k) is not None]
                for a, b in itertools.pairwise(have):
                    gaps.setdefault(f"{a}_to_{b}_s", []).append(st[b] - st[a])
            return {k: med(v) for k, v in gaps.items()}

        requests = [st["drain_requested"] for st in old.values() if st.get("drain_requested")]
        return {
            "new_pods": len(new), "old_pods_gone": len(old),
            "new_pod": chain(new, ("seen", "scheduled", "running", "runtime_up", "gate", "ready", "router_added")),
            "old_pod": chain(old, ("drain_requested", "drain_started", "router_dropped", "admission_stopped",
                                   "drain_finished", "drained", "deleting", "gone")),
            "old_pod_request_to_gone_s": med([st["gone"] - st["drain_requested"] for st in old.values()
                                              if st.get("drain_requested")]),
            "new_pod_seen_to_ready_s": med([st["ready"] - st["seen"] for st in new.values() if st.get("ready")]),
            # the controller's reactions: a new pod ready -> the next old pod's drain (pdfleet) or delete
            # (Deployment); an old pod gone -> the next new pod created
            "ready_to_next_drain_request_s": med(_gaps([st["ready"] for st in new.values() if st.get("ready")],
                                                       requests)),
            "gone_to_next_create_s": med(_gaps([st["gone"] for st in old.values()], [st["seen"] for st in new.values()])),
            "pods": {n: {k: round(v - since, 3) for k, v in sorted(st.items(), key=lambda kv: kv[1]) if v is not None}
                     for n, st in sorted({**old, **new}.items())},
        }


def _gaps(causes: list[float], effects: list[float]) -> list[float]:
    """For each effect, the time since the latest cause before it (effects with no cause before: skipped)."""
    out = []
    for e in effects:
        before = [c for c in causes if c <= e]
        if before:
            out.append(e - max(before))
    return out
