"""Removes sglang-router workers whose pod is gone, before the pod's address is given to another pod.

sglang-router 0.3.2's discovery tracks pods by their whole state, readiness included, so a pod that went
not-Ready before its deletion (every drained pod) is never matched at its deletion and its worker stays
(docs/router.md). Harmless while the address is unused; harmful once the address is reused: in CI a
drained prefill's address went to a new decode at once, discovery could not add the decode ("already
exists"), the decode's ``/health`` made the stale *prefill* worker healthy again, and 35 client requests
were refused with the decode as their prefill.

The sweeper runs in a child of the router pod's launcher (forked before the router starts, which then holds
the GIL), beside the router, on the router's loopback and with its admin key. Every ``interval_s`` it reads the router's workers, then lists the pods of each role's
selector (the router's own selectors, through the pod's ServiceAccount, which discovery already uses),
and deletes each prefill or decode worker that no listed pod of its role stands behind (no pod has its
address, or the pod there is of the other role). Pods being deleted still count: a drain's worker
stays until its pod is gone. The decision is ``stale_workers``, pure; the loop only reads and deletes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from pdfleet_runtime.lifetime import die_with_parent

__all__ = ["RouterWorker", "SelectedPod", "StaleWorker", "Sweeper", "stale_workers", "stop_process",
           "sweeper_from_router_args"]

log = logging.getLogger("pdfleet.router.sweeper")
_ROUTER_TIMEOUT_S = 3.0
_SWEPT_ROLES = ("prefill", "decode")
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy


class RouterWorker(BaseModel):
    """One entry of the router's ``GET /workers``."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    url: str
    worker_type: str

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.url).hostname or ""


class SelectedPod(BaseModel):
    """A pod one role's selector lists, by address."""

    model_config = ConfigDict(frozen=True)

    name: str
    ip: str
    role: str


class StaleWorker(BaseModel):
    model_config = ConfigDict(frozen=True)

    worker: RouterWorker
    reason: str


def stale_workers(workers: Iterable[RouterWorker], pods: Iterable[SelectedPod]) -> list[StaleWorker]:
    """The prefill and decode workers no listed pod of their role stands behind (``pods``: every pod the
    router's selectors list now, each with the role whose selector listed it)."""
    at: dict[str, list[SelectedPod]] = {}
    for pod in pods:
        at.setdefault(pod.ip, []).append(pod)
    out = []
    for w in workers:
        if w.worker_type not in _SWEPT_ROLES:
            continue
        there = at.get(w.host, [])
        if any(p.role == w.worker_type for p in there):
            continue
        if there:
            reason = (f"the pod at {w.host} is {', '.join(f'{p.name} ({p.role})' for p in there)}, not a "
                      f"{w.worker_type}: the {w.worker_type} that had the address is gone")
        else:
            reason = f"no {w.worker_type} pod has the address {w.host} any more"
        out.append(StaleWorker(worker=w, reason=reason))
    return out


_ENDED = ("Succeeded", "Failed")  # an ended pod's address is free for another pod; its worker is not kept
ListPods = Callable[[str, Mapping[str, str]], list[tuple[str, str]]]
"""(namespace, selector) -> [(pod name, pod IP)] of the pods that hold an address (not ended)."""


class Sweeper:
    """Reads the router's workers and the selected pods every ``interval_s``; deletes stale workers."""

    def __init__(self, *, router_url: str, admin_key: str, namespace: str, selectors: Mapping[str, Mapping[str, str]],
                 list_pods: ListPods, interval_s: float = 1.0) -> None:
        self.router_url, self._key = router_url.rstrip("/"), admin_key
        self.namespace, self.selectors = namespace, {r: dict(s) for r, s in selectors.items()}
        self._list_pods, self.interval_s = list_pods, interval_s
        self._stop = threading.Event()
        self._failing = ""  # the last failure logged, so a down router or apiserver is logged once
        self._swept = False

    def _router(self, method: str, path: str) -> Any:
        req = urllib.request.Request(self.router_url + path, method=method,
                                     headers={"Authorization": f"Bearer {self._key}"})
        with _LOOPBACK.open(req, timeout=_ROUTER_TIMEOUT_S) as resp:
            return json.loads(resp.read() or b"null")

    def sweep(self) -> list[StaleWorker]:
        """One pass: the stale workers found, each deleted (``OSError`` and ``ValueError`` from the router
        or the apiserver go to the caller)."""
        listed = self._router("GET", "/workers")
        workers = [RouterWorker.model_validate(w) for w in (listed or {}).get("workers", [])]
        if not any(w.worker_type in _SWEPT_ROLES for w in workers):
            return []
        # Listed after the workers: every pod the router had added by then is in these lists.
        pods = [SelectedPod(name=name, ip=ip, role=role) for role, selector in self.selectors.items()
                for name, ip in self._list_pods(self.namespace, selector)]
        found = stale_workers(workers, pods)
        for stale in found:
            self._router("DELETE", "/workers/" + urllib.parse.quote(stale.worker.id, safe=""))
            log.info("removed the router's %s worker %s: %s", stale.worker.worker_type, stale.worker.url,
                     stale.reason)
        return found

    def run(self) -> None:
        log.info("removing the router's workers whose pods are gone, every %g s (namespace %s, selectors %s)",
                 self.interval_s, self.namespace, self.selectors)
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep()
                self._failing, self._swept = "", True
            except Exception as e:  # the router starting or restarting, the apiserver away: the next pass
                what = f"{type(e).__name__}: {e}"
                if what != self._failing:  # each new failure once; before the first pass the router is starting
                    log.log(logging.WARNING if self._swept else logging.INFO,
                            "stale-worker sweep failed (retried every %g s): %s", self.interval_s, what)
                    self._failing = what

    def start_process(self) -> int:
        """Run in a forked child that dies with this process; its pid. A thread would never run: sglang-router's
        ``launch_router`` holds the GIL for as long as the router runs (measured: a ticking thread stopped)."""
        pid = os.fork()
        if pid:
            return pid
        try:  # the child: nothing of the parent's but this object; killed with it (PR_SET_PDEATHSIG)
            die_with_parent()
            signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
            self.run()
        finally:
            os._exit(0)

    def stop(self) -> None:
        self._stop.set()


def stop_process(pid: int) -> None:
    """End the forked sweeper (the router has stopped)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _kube_list_pods() -> ListPods:
    from kubernetes import client

    from pdfleet_runtime.kubeapi import api_client

    core: list[Any] = []  # made at the first pass: a failure there is logged and retried, as any other

    def list_pods(namespace: str, selector: Mapping[str, str]) -> list[tuple[str, str]]:
        if not core:
            core.append(client.CoreV1Api(api_client(in_cluster=True)))
        text = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        # From the apiserver's watch cache (resource_version "0"), which the router's discovery watches too.
        items = core[0].list_namespaced_pod(namespace, label_selector=text, resource_version="0").items
        return [(p.metadata.name, p.status.pod_ip) for p in items if p.status is not None and p.status.pod_ip
                and p.status.phase not in _ENDED]

    return list_pods


def sweeper_from_router_args(args: Any, *, list_pods: ListPods | None = None) -> Sweeper | None:
    """The sweeper for sglang-router's parsed ``RouterArgs``: PD discovery with both selectors, a namespace
    and an admin key; None otherwise (nothing to sweep, or no key to sweep with)."""
    if not (args.pd_disaggregation and args.service_discovery and args.service_discovery_namespace
            and args.prefill_selector and args.decode_selector):
        return None
    admin = [key for (_id, _name, key, role) in args.control_plane_api_keys if role == "admin"]
    if not admin:
        return None
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    return Sweeper(router_url=f"http://{host}:{args.port}", admin_key=admin[0],
                   namespace=args.service_discovery_namespace,
                   selectors={"prefill": args.prefill_selector, "decode": args.decode_selector},
                   list_pods=list_pods or _kube_list_pods())
