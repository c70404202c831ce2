"""`pdfleet doctor NAME`: is PD really happening in this deployment? Each check with its verdict and fix.

Reads only: the PDDeployment, its pods, and each pod's /metrics through the apiserver's pod proxy (the same
credentials as kubectl; ``pods/proxy`` get). With ``--window S`` the counters are read twice, S seconds apart,
and judged on what happened in between; without it, on what happened since each pod started. Exit status 1 when
a check fails, 2 when the deployment cannot be read. The checks are ``pdfleet_operator.doctor``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from pdfleet_operator.api.constants import GROUP, LABEL_DEPLOYMENT, PLURAL, VERSION
from pdfleet_operator.doctor import (
    ROUTER_RECHECK_S,
    CheckResult,
    Metrics,
    PodMetrics,
    Verdict,
    diagnose,
    failed,
    unknown_workers,
)
from pdfleet_operator.observed import ObservedPod, RouterState
from pdfleet_operator.resources.names import router_name
from pdfleet_operator.resources.router import LABEL_ROUTER
from pdfleet_runtime.config import HTTP_PORT
from pdfleet_runtime.kubeapi import api_client

__all__ = ["parse_metrics", "register", "run"]

MAX_METRICS_BYTES = 4 << 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check that a deployment's pods really move state (reads the cluster)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("name", help="the PDDeployment")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("--window", type=float, default=0.0, metavar="S",
                   help="judge the counters over S seconds (two reads); 0: since each pod started (default)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(handler=run)


def parse_metrics(text: str) -> Metrics:
    """Prometheus text -> ``Metrics``; ``ValueError`` when it is not that format."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return Metrics(samples={k: tuple(v) for k, v in samples.items()})


def _declared_port(pod: Mapping[str, Any], name: str) -> int | None:
    for c in (pod.get("spec") or {}).get("containers") or ():
        for port in c.get("ports") or ():
            if port.get("name") == name and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


def metrics_port(pod: Mapping[str, Any]) -> int:
    """The port a pod declares as ``metrics`` (the built-in runtime's: /metrics alone), else the HTTP port (an agent
    beside an engine serves its own metrics there). The pod proxy takes a number, not a port's name."""
    return _declared_port(pod, "metrics") or HTTP_PORT


def engine_port(pod: Mapping[str, Any]) -> int | None:
    """An engine container's HTTP port (``engine-http``: SGLang and vLLM serve /metrics there), or None."""
    return _declared_port(pod, "engine-http")


def _read_metrics(core: Any, namespace: str, pod: str, port: int) -> Metrics | str:
    """A pod's /metrics through the apiserver's proxy, or why not."""
    from kubernetes.client.exceptions import ApiException

    try:
        resp = core.connect_get_namespaced_pod_proxy_with_path(f"{pod}:{port}", namespace, "metrics",
                                                               _preload_content=False)  # urllib3's response
        try:
            body = resp.read(MAX_METRICS_BYTES + 1)
        finally:
            resp.release_conn()
        if len(body) > MAX_METRICS_BYTES:
            return f"more than {MAX_METRICS_BYTES} bytes"
        return parse_metrics(body.decode("utf-8", errors="replace"))
    except ApiException as e:
        return f"{e.status} {e.reason}"
    except Exception as e:  # unreadable text, or urllib3's own errors (a timeout, a reset): said, not raised
        return f"{type(e).__name__}: {e}"


def _read_pod(core: Any, namespace: str, pod: str, ports: tuple[int, ...]) -> Metrics | str:
    """The pod's own metrics port's, with its engine's merged in where it has one (an engine's series keep their
    names: ``sglang:``, ``vllm:``); an engine that cannot be read leaves the pod's own."""
    first = _read_metrics(core, namespace, pod, ports[0])
    if isinstance(first, str) or len(ports) == 1:
        return first
    engine = _read_metrics(core, namespace, pod, ports[1])
    if isinstance(engine, str):
        return first
    return Metrics(samples={**engine.samples, **first.samples})


def _read_all(core: Any, namespace: str, pods: list[ObservedPod],
              ports: Mapping[str, tuple[int, ...]]) -> dict[str, Metrics | str]:
    return {p.name: _read_pod(core, namespace, p.name, ports.get(p.name, (HTTP_PORT,)))
            for p in pods if not p.deleting and p.ip}


def _read_router(api: Any, namespace: str, name: str) -> RouterState | None:
    """The router Deployment's state (the generation its selectors carry); None when the deployment has none."""
    from kubernetes.client import AppsV1Api
    from kubernetes.client.exceptions import ApiException

    from pdfleet_operator.generations import router_state

    try:
        d = AppsV1Api(api).read_namespaced_deployment(router_name(name), namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return router_state(api.sanitize_for_serialization(d))


def _worker_ips(core: Any, namespace: str, name: str) -> set[str]:
    listed = core.list_namespaced_pod(namespace, label_selector=f"{LABEL_DEPLOYMENT}={name}").items
    return {p.status.pod_ip for p in listed if p.status is not None and p.status.pod_ip}


def _read_routers(core: Any, namespace: str, name: str, ips: set[str]) -> tuple[dict[str, list[Metrics | str]],
                                                                                   set[str]]:
    """Each running router pod's metrics (its ``metrics`` port); when one lists a worker no pod has the address of,
    the pods and the routers read again ``ROUTER_RECHECK_S`` later (the worker must be in both reads, its address
    in neither pod list). Returns the reads and the addresses of every pod seen."""
    listed = core.list_namespaced_pod(namespace, label_selector=f"{LABEL_ROUTER}={name}").items
    raw = [core.api_client.sanitize_for_serialization(p) for p in listed
           if p.metadata.deletion_timestamp is None and p.status is not None and p.status.pod_ip]
    ports = {p["metadata"]["name"]: metrics_port(p) for p in raw}
    reads: dict[str, list[Metrics | str]] = {r: [_read_metrics(core, namespace, r, port)] for r, port in ports.items()}
    if any(isinstance(m := rs[0], Metrics) and unknown_workers(m, ips) for rs in reads.values()):
        print(f"a router lists a worker no pod stands behind: reading again in {ROUTER_RECHECK_S:g} s ...",
              file=sys.stderr, flush=True)
        time.sleep(ROUTER_RECHECK_S)
        ips = ips | _worker_ips(core, namespace, name)
        for r, port in ports.items():
            reads[r].append(_read_metrics(core, namespace, r, port))
    return reads, ips


def run(args: argparse.Namespace) -> int:
    from kubernetes.client import CoreV1Api, CustomObjectsApi

    from pdfleet_operator.commands.reads import read_failed
    from pdfleet_operator.observe import observed_pod

    try:
        api = api_client()
        obj = CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, args.namespace, PLURAL, args.name)
        uid = (obj.get("metadata") or {}).get("uid", "") if isinstance(obj, dict) else ""
        core = CoreV1Api(api)
        listed = core.list_namespaced_pod(args.namespace, label_selector=f"{LABEL_DEPLOYMENT}={args.name}").items
        raw = [api.sanitize_for_serialization(p) for p in listed]
        pods = [o for o in (observed_pod(p, uid) for p in raw) if o is not None]
        ports = {p["metadata"]["name"]: (metrics_port(p), *((e,) if (e := engine_port(p)) else ())) for p in raw}
        spec = (obj.get("spec") or {}) if isinstance(obj, dict) else {}
        backend = (spec.get("transfer") or {}).get("backend")
        engine = (spec.get("engine") or {}).get("kind")
        router = _read_router(api, args.namespace, args.name)
    except Exception as e:  # the apiserver's refusal, no kubeconfig, an apiserver away: said, not a traceback
        return read_failed(args.name, args.namespace, e)
    first = _read_all(core, args.namespace, pods, ports) if args.window > 0 else {}
    if args.window > 0:
        print(f"reading the pods' counters again in {args.window:g} s ...", file=sys.stderr, flush=True)
        time.sleep(args.window)
    last = _read_all(core, args.namespace, pods, ports)
    metrics = {}
    for name, now in last.items():
        before = first.get(name)
        if isinstance(now, str):
            metrics[name] = PodMetrics(error=now)
        else:
            metrics[name] = PodMetrics(now=now, before=before if isinstance(before, Metrics) else None)
    try:
        routers, ips = _read_routers(core, args.namespace, args.name, {p.ip for p in pods if p.ip})
    except Exception as e:  # the apiserver's refusal: said as the check's input, not a traceback
        routers, ips = {"router pods": [f"cannot list them: {type(e).__name__}: {e}"]}, set()
    results = diagnose(pods, metrics, window_s=args.window or None, router=router, backend=backend,
                       engine=engine, spec=spec, routers=routers, worker_ips=ips)
    if args.output == "json":
        print(json.dumps({"name": args.name, "namespace": args.namespace, "window_s": args.window,
                          "failed": len(failed(results)),
                          "checks": [r.model_dump(mode="json") for r in results]}, indent=2))
    else:
        print(format_results(args.name, args.namespace, results))
    return 1 if failed(results) else 0


def format_results(name: str, namespace: str, results: list[CheckResult]) -> str:
    width = max((len(r.check) for r in results), default=10)
    lines = [f"pdd/{name} in {namespace}:"]
    for r in results:
        lines.append(f"  {r.verdict.value.upper():<12} {r.check:<{width}}  {r.subject}: {r.detail}")
        if r.fix and r.verdict is Verdict.FAIL:
            lines.append(f"  {'':<12} {'':<{width}}  fix: {r.fix}")
    bad = failed(results)
    lines.append(f"{len(bad)} check(s) failed" if bad else "no check failed")
    return "\n".join(lines)
