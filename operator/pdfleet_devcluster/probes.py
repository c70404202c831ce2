"""Readiness probes, run as a kubelet runs them, for the pods whose readiness nothing else decides.

kwok sets a pod's conditions from its Stages (``kwok-stages.yaml``): a pod with readiness gates is Ready when
they are all True (the runtime's transfer-path gate decides); a pod without gates used to be Ready at once,
whatever its readiness probe said. A router pod's probe is what keeps it out of its Service until its router
holds a healthy prefill and decode: a Deployment rolling its routers (new selectors, a new generation: docs/router.md)
replaces an old router pod only once the new one is Ready, so a harness that skipped the probe handed clients
to a router with no workers. For such a pod (no readiness gates, a ``readinessProbe`` on a container) the
kubelet runs this loop and writes ``ContainersReady``, which the Stages require for ``Ready``, as a kubelet
does. Pods with readiness gates keep ``ContainersReady`` True from their start (kwok's), as before.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from pdfleet_devcluster.podspec import Exec, HttpGet, PodSpecError, port_number

__all__ = ["Probe", "ProbeLoop", "TcpSocket", "readiness_probes"]


@dataclass(frozen=True)
class TcpSocket:
    port: int


@dataclass(frozen=True)
class Probe:
    """One container's readiness probe, with the kubelet's defaults."""

    container: int  # its index in spec.containers
    handler: Exec | HttpGet | TcpSocket
    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1
    initial_delay_s: float = 0.0


def _handler(container: dict, probe: dict) -> Exec | HttpGet | TcpSocket:
    if "httpGet" in probe:
        h = probe["httpGet"]
        return HttpGet(h.get("path") or "/", port_number(container, h["port"]), h.get("scheme") or "HTTP",
                       h.get("host") or "")
    if "tcpSocket" in probe:
        return TcpSocket(port_number(container, probe["tcpSocket"]["port"]))
    if "exec" in probe:
        return Exec(tuple(probe["exec"].get("command") or ()))
    raise PodSpecError(f"container {container['name']!r}: readinessProbe {sorted(probe)} is not supported "
                       "by the harness's kubelet")


def readiness_probes(pod: dict) -> list[Probe]:
    """The probes the kubelet runs for ``pod``: none when it has readiness gates (they decide its readiness)."""
    spec = pod["spec"]
    if spec.get("readinessGates"):
        return []
    out = []
    for i, c in enumerate(spec["containers"]):
        p = c.get("readinessProbe")
        if p:
            out.append(Probe(i, _handler(c, p), float(p.get("periodSeconds", 10)), float(p.get("timeoutSeconds", 1)),
                             int(p.get("failureThreshold", 3)), int(p.get("successThreshold", 1)),
                             float(p.get("initialDelaySeconds", 0))))
    return out


def probe_once(ip: str, handler: Exec | HttpGet | TcpSocket, timeout_s: float,
               exec_in: Callable[[tuple[str, ...], float], int]) -> bool:
    """One probe: an HTTP status in [200, 400), a TCP connect, or an exit status 0."""
    try:
        if isinstance(handler, HttpGet):
            url = f"{handler.scheme.lower()}://{handler.host or ip}:{handler.port}{handler.path}"
            ctx = ssl._create_unverified_context() if handler.scheme.upper() == "HTTPS" else None  # as the kubelet
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                                 urllib.request.HTTPSHandler(context=ctx))
            with opener.open(url, timeout=timeout_s) as resp:
                return 200 <= resp.status < 400
        if isinstance(handler, TcpSocket):
            with socket.create_connection((ip, handler.port), timeout=timeout_s):
                return True
        return exec_in(handler.command, timeout_s) == 0
    except (OSError, subprocess.SubprocessError):  # urllib's HTTPError (4xx/5xx) is an OSError too
        return False


class ProbeLoop(threading.Thread):
    """Probes one pod's containers until stopped; ``report(ready)`` on each change of "all containers ready",
    the first result included. A container starts not ready; it turns ready after ``success_threshold``
    passes in a row and not ready after ``failure_threshold`` failures in a row."""

    def __init__(self, ip: str, probes: list[Probe], report: Callable[[bool], None],
                 exec_in: Callable[[int, tuple[str, ...], float], int]) -> None:
        super().__init__(daemon=True)
        self.ip, self.probes, self.report, self.exec_in = ip, probes, report, exec_in
        self.stopped = threading.Event()

    def run(self) -> None:
        ready = [False] * len(self.probes)
        streak = [0] * len(self.probes)  # > 0: passes in a row; < 0: failures in a row
        due = [time.monotonic() + p.initial_delay_s for p in self.probes]
        reported: bool | None = None
        while not self.stopped.is_set():
            now = time.monotonic()
            for i, p in enumerate(self.probes):
                if now < due[i]:
                    continue
                due[i] = now + p.period_s
                ok = probe_once(self.ip, p.handler, p.timeout_s,
                                lambda cmd, t, c=p.container: self.exec_in(c, cmd, t))
                streak[i] = max(1, streak[i] + 1) if ok else min(-1, streak[i] - 1)
                if ok and streak[i] >= p.success_threshold:
                    ready[i] = True
                elif not ok and -streak[i] >= p.failure_threshold:
                    ready[i] = False
            if all(ready) != reported:
                reported = all(ready)
                try:
                    self.report(reported)
                except Exception:  # the API refused or timed out: report again on the next round
                    reported = None
            self.stopped.wait(min(0.2, *(max(0.0, d - time.monotonic()) for d in due)))

    def stop(self) -> None:
        self.stopped.set()
