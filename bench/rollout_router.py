"""What the real-runtime rollout reads beyond the pods' watch: the router's worker set, the router's
retries, the pods' failed transfers, and the drain steps each runtime logs.

- ``RouterWatch`` polls the router's ``GET /workers`` (with the deployment's admin key) every
  ``POLL_S`` and keeps each worker URL's transitions (healthy, unhealthy, absent), so a pod's
  "router added" and "router dropped" are the router's own view, not a bound.
- ``PodScraper`` reads every runtime pod's ``/metrics`` every ``POLL_S * 8``: failed request
  transfers and rooms no decode claimed, per pod; a pod's last figures stay after it went.
- ``drain_stamps`` reads a runtime's log: when its drain started, its admission stopped (the end of
  the routers' window) and its drain finished, as ``time.monotonic()`` values.

Imported by bench/rollout_real.py only.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pdfleet_runtime.testing.scrape import scrape

__all__ = ["PodScraper", "RouterWatch", "admin_key", "drain_stamps", "router_retries"]

POLL_S = 0.25
ROUTER_METRICS_PORT = 29000  # spec.router's default
HEALTHY, UNHEALTHY, ABSENT = "healthy", "unhealthy", "absent"


def admin_key(core: Any, ns: str, deployment: str) -> str:
    """The router's admin key, from the Secret the operator created (``id:name:role:key``)."""
    secret = core.read_namespaced_secret(f"{deployment}-router-keys", ns)
    return base64.b64decode(secret.data["control-plane-api-keys"]).decode().split(":", 3)[3]


def workers(url: str, key: str, via: Any = None) -> dict[str, bool]:
    """The router's worker set: worker URL -> is_healthy. The control endpoints are on the router pod's
    loopback only (its front refuses them): ``via`` is that pod (``PodSandbox``), whose network the GET uses."""
    if via is not None:
        out = via.exec("curl", "-sS", "--fail", "--max-time", "5", "-H", f"Authorization: Bearer {key}",
                       f"{url}/workers", timeout_s=10)
        if out.returncode != 0:
            raise OSError(f"GET {url}/workers in {via.name}: {out.stderr.strip()}")
        raw = out.stdout.encode()
    else:
        req = urllib.request.Request(f"{url}/workers", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            raw = resp.read()
    return {w["url"]: bool(w["is_healthy"]) for w in json.loads(raw)["workers"]}


@dataclass(eq=False)
class RouterWatch(threading.Thread):
    """Every change of the router's worker set, as (monotonic time, state) per worker URL."""

    url: str  # the router's control URL (its pod's loopback: http://127.0.0.1:PORT)
    key: str
    via: Any = None  # the router pod (``PodSandbox``) whose network reaches that loopback
    transitions: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    errors: int = 0

    def __post_init__(self) -> None:
        super().__init__(daemon=True)
        self.stop_event = threading.Event()
        self.last: dict[str, bool] = {}

    def run(self) -> None:
        while not self.stop_event.wait(POLL_S):
            try:
                now_set = workers(self.url, self.key, self.via)
            except (OSError, ValueError):
                self.errors += 1
                continue
            now = time.monotonic()
            for u in set(self.last) | set(now_set):
                state = ABSENT if u not in now_set else HEALTHY if now_set[u] else UNHEALTHY
                seq = self.transitions.setdefault(u, [])
                if not seq or seq[-1][1] != state:
                    seq.append((now, state))
            self.last = now_set

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)

    def healthy(self, ip: str) -> bool:
        return any(ok for u, ok in self.last.items() if f"//{ip}:" in u)

    def first(self, ip: str, after: float, states: tuple[str, ...]) -> float | None:
        """When the router first showed the worker at ``ip`` in one of ``states`` at or after ``after``."""
        for u, seq in self.transitions.items():
            if f"//{ip}:" in u:
                hit = [t for t, s in seq if s in states and t >= after]
                if hit:
                    return min(hit)
        return None

    def stamps(self, pods: dict[str, Any]) -> dict[str, dict[str, float]]:
        """Per pod (``PodWatch.pods``): ``router_added`` (healthy in the router after the pod appeared) and
        ``router_dropped`` (unhealthy or gone after its drain was requested, or its delete)."""
        out: dict[str, dict[str, float]] = {}
        for name, s in pods.items():
            if not s.ip:
                continue
            st = {}
            added = self.first(s.ip, s.seen, (HEALTHY,))
            if added is not None:
                st["router_added"] = added
            asked = s.drain_requested or s.deleting
            if asked is not None:
                dropped = self.first(s.ip, asked - POLL_S, (UNHEALTHY, ABSENT))
                if dropped is not None:
                    st["router_dropped"] = dropped
            out[name] = st
        return out


def router_retries(runner: Any, deployment: str) -> int:
    """The router pods' ``smg_worker_retries_total`` (requests the router sent again to another worker)."""
    total = 0
    for pod in list(runner.pods.values()):
        if pod.name.startswith(f"{deployment}-router-") and pod.started:
            m = scrape(f"http://{pod.ip}:{ROUTER_METRICS_PORT}/metrics")
            total += int(sum(v for k, v in m.items() if k.startswith("smg_worker_retries_total")))
    return total


@dataclass(eq=False)
class PodScraper(threading.Thread):
    """Failed request transfers and expired rooms per runtime pod, scraped while the pods run."""

    runner: Any
    failures: dict[str, int] = field(default_factory=dict)
    canary_failures: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(daemon=True)
        self.stop_event = threading.Event()

    def scrape_once(self) -> None:
        for pod in list(self.runner.pods.values()):
            role = (pod.pod["metadata"].get("labels") or {}).get("pdfleet.io/role")
            if role not in ("prefill", "decode") or not pod.started:
                continue
            try:
                m = scrape(pod.url + "/metrics")
            except OSError:
                continue  # stopping: its last figures stay
            failed = [(k, v) for k, v in m.items() if k.startswith("pdfleet_transfers_total{") and 'outcome="failed"' in k]
            self.failures[pod.name] = int(sum(v for k, v in failed if 'kind="request"' in k)
                                          + m.get("pdfleet_rooms_expired_total{}", 0))
            self.canary_failures[pod.name] = int(sum(v for k, v in failed if 'kind="canary"' in k))

    def run(self) -> None:
        while not self.stop_event.wait(POLL_S * 8):
            self.scrape_once()

    def stop(self) -> dict[str, Any]:
        self.stop_event.set()
        self.join(timeout=30)
        self.scrape_once()
        return {"failed_transfers": sum(self.failures.values()), "failed_canaries": sum(self.canary_failures.values()),
                "per_pod": {k: v for k, v in self.failures.items() if v}}


_LOG_STEPS = {"drain_started": "drain started: ", "admission_stopped": "admission stopped: ",
              "drain_finished": "drain finished after "}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def drain_stamps(log: str) -> dict[str, float]:
    """The runtime's drain steps from its log (``%(asctime)s`` local time -> monotonic)."""
    offset = time.time() - time.monotonic()
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        for key, text in _LOG_STEPS.items():
            if text in line and key not in out:
                out[key] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - offset
    return out
