"""A real Prometheus (Debian's 2.42) for the e2e: its own process in the cluster's network namespace, a temporary
data directory, the namespace's pods relabelled with the chart's own PodMonitor relabelings (rendered by helm), the
operator's metrics, and the chart's rule file. Stopped (SIGTERM, then SIGKILL) at the end.

Debian builds Prometheus without the Kubernetes discovery, so the pods reach it through file_sd: a thread lists the
namespace's pods every second and writes one target per container port with the labels kubernetes_sd (role pod)
would give (``__meta_kubernetes_pod_label_*``, ``..._container_port_name``, ...), and the relabelling is that of a
PodMonitor: keep the operator's pods, keep the port named ``metrics``, then the chart's relabelings."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import CoreV1Api

from pdfleet_devcluster import toolchain
from pdfleet_devcluster.cluster import free_port
from pdfleet_runtime.lifetime import die_with_parent

CHART = Path(__file__).resolve().parents[2] / "charts" / "pdfleet"
RULES = CHART / "files" / "prometheus-rules.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
SCRAPE_S = 1


def chart_relabelings() -> list[dict[str, Any]]:
    """The fleet PodMonitor's relabelings as the chart renders them, in Prometheus' own spelling."""
    helm = toolchain.binary("helm")
    if not helm.exists():
        pytest.skip(f"helm is not built ({helm}): run `pdfleet dev build`")
    out = subprocess.run([str(helm), "template", "rel", str(CHART), "--set", "podMonitor.enabled=true"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    [monitor] = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PodMonitor"
                 and d["metadata"]["name"].endswith("-fleet")]
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{snake.get(k, k): v for k, v in r.items()} for r in monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]]


def _meta(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def pod_targets(core: CoreV1Api, namespace: str) -> list[dict[str, Any]]:
    """kubernetes_sd's role-pod targets of the namespace's running pods: one per declared container port."""
    out = []
    for pod in core.list_namespaced_pod(namespace).items:
        if not pod.status.pod_ip or pod.metadata.deletion_timestamp is not None:
            continue
        labels = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": pod.metadata.name}
        labels |= {f"__meta_kubernetes_pod_label_{_meta(k)}": v for k, v in (pod.metadata.labels or {}).items()}
        for c in pod.spec.containers:
            for port in c.ports or ():
                out.append({"targets": [f"{pod.status.pod_ip}:{port.container_port}"],
                            "labels": {**labels, "__meta_kubernetes_pod_container_name": c.name,
                                       "__meta_kubernetes_pod_container_port_name": port.name or ""}})
    return out


def config(targets: Path, operator_metrics: str) -> dict[str, Any]:
    """What the Prometheus Operator would make of the chart's fleet PodMonitor, plus the operator's metrics."""
    meta = "__meta_kubernetes_pod_"
    return {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                   "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "pdfleet",
             "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
             "relabel_configs": [
                 {"source_labels": [meta + "label_app_kubernetes_io_managed_by"], "regex": "pdfleet-operator",
                  "action": "keep"},
                 {"source_labels": [meta + "container_port_name"], "regex": "metrics", "action": "keep"},
                 {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                 {"source_labels": [meta + "name"], "target_label": "pod"},
                 *chart_relabelings()]},
            {"job_name": "pdfleet-operator", "static_configs": [{"targets": [operator_metrics]}]},
        ],
    }


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    started: float

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (an error answer raises, naming the expression)."""
        return self._get("query", {"query": expr})

    def query_range(self, expr: str) -> list[dict[str, Any]]:
        """The expression over the whole run as a Grafana panel asks it (a range query, 2 s steps): the series
        that had a value at any step."""
        return self._get("query_range", {"query": expr, "start": f"{self.started:.3f}", "end": f"{time.time():.3f}",
                                         "step": "2"})

    def samples(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """Each series of ``expr`` at every ``step_s`` from ``start`` to ``end`` (its last scraped sample then)."""
        return self._get("query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                         "step": f"{step_s:g}"})

    def _get(self, api: str, params: dict[str, str]) -> list[dict[str, Any]]:
        expr, q = params["query"], urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{api}?{q}", timeout=20) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{expr}: {e.read().decode()[:500]}") from None
        assert body["status"] == "success", (expr, body)
        result = body["data"]["result"]
        return result if isinstance(result, list) else [result]

    def targets(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as resp:
            return list(json.loads(resp.read())["data"]["activeTargets"])


@contextmanager
def running_prometheus(workdir: Path, core: CoreV1Api, namespace: str, operator_metrics: str) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian's package: scripts/setup.sh installs it)")
    workdir.mkdir(parents=True, exist_ok=True)
    targets, cfg = workdir / "pods.json", workdir / "prometheus.yml"
    stop = threading.Event()

    def discover() -> None:
        while True:
            with contextlib.suppress(Exception):  # the cluster going away at the end
                tmp = targets.with_suffix(".tmp")
                tmp.write_text(json.dumps(pod_targets(core, namespace)))
                tmp.replace(targets)  # whole files only: Prometheus may read at any moment
            if stop.wait(SCRAPE_S):
                return

    targets.write_text(json.dumps(pod_targets(core, namespace)))
    threading.Thread(target=discover, daemon=True).start()
    cfg.write_text(yaml.safe_dump(config(targets, operator_metrics)))
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log, time.time())
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"prometheus did not start:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.3)
        yield prom
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _series_text(metric: dict[str, str]) -> str:
    labels = ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{metric['__name__']}{{{labels}}}"


def replayed_rule_test(prom: Prometheus, names: list[str], namespace: str, start: float, end: float,
                       step_s: float, expected: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``promtool test rules`` file over what ``prom`` scraped of ``names`` between ``start`` and ``end``: every
    series' value at each ``step_s`` step, replayed one step per minute (the rules' windows and ``for:`` are
    minutes; a run lasts a few), ``_`` where it had none; ``expected``: its ``alert_rule_test`` items, each
    evaluated at the last step when it names no ``eval_time``."""
    steps = int((end - start) // step_s) + 1
    input_series = []
    for name in names:
        for s in prom.samples(f'{{__name__="{name}", namespace="{namespace}"}}', start, end, step_s):
            at = {round((float(t) - start) / step_s): v for t, v in s["values"]}
            input_series.append({"series": _series_text(s["metric"]),
                                 "values": " ".join(str(at.get(i, "_")) for i in range(steps))})
    last = f"{steps - 1}m"
    return {"rule_files": [str(RULES)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": input_series,
                       "alert_rule_test": [{"eval_time": last, **e} for e in expected]}]}


def promtool_test(test: dict[str, Any], workdir: Path) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` on ``test`` (written under ``workdir``)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package: scripts/setup.sh installs it)")
    path = workdir / "replayed_test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, width=1 << 20))
    return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=300)


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def panel_queries(namespace: str, deployment: str) -> list[tuple[str, str]]:
    """(panel title, expression) for every target of the dashboard, its variables given values (the rate
    interval: 30 s, which Grafana would pick for a 1 s scrape on a short range)."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for p in board["panels"]:
        for t in p.get("targets", ()):
            expr = t["expr"].replace("$__rate_interval", "30s")
            expr = re.sub(r"\$namespace\b", namespace, expr).replace("$deployment", deployment)
            out.append((p["title"], expr))
    return out
