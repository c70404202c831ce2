"""Monitoring that runs (issue 46): a real Prometheus scrapes the runtime and router pods of a fleet in the local
cluster on their metrics port (listed from the apiserver as kubernetes_sd would, relabelled as the chart's
PodMonitor says) and the operator, and evaluates the chart's rules. With chat traffic through the router, then a prefill's processes killed:

- every dashboard panel's query returns data over the run, asked as Grafana asks it (a range query; the test
  lists any that return nothing);
- every recording rule returns data, and the alerts the fault raises (failed transfers, a canary below the floor,
  a failing canary pair, a closed transfer-path gate) return data; the other alerts' conditions are not produced here: their promtool
  tests (tests/unit/monitoring/rules_test.yaml) run over input series whose names and label names are checked here
  against the series this Prometheus scraped.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import yaml

from pdfleet_devcluster import LocalCluster
from pdfleet_runtime.config import METRICS_PORT
from tests.cluster.conftest import OperatorProcess
from tests.e2e.prometheus import Prometheus, panel_queries, rules, running_prometheus
from tests.e2e.traffic import NAME, running_fleet

pytestmark = pytest.mark.cluster

RULES_TEST = Path(__file__).resolve().parents[1] / "unit" / "monitoring" / "rules_test.yaml"
FIRED_HERE = {"PdfleetTransferFailures", "PdfleetCanaryBelowFloor", "PdfleetTransferPathNotReady",
              "PdfleetCanaryPeerFailing"}
# Replicas pinned (min = max): the autoscaler decides every pass and records it, and scales nothing.
AUTOSCALING = {"prefill": {"minReplicas": 1, "maxReplicas": 1,
                           "signals": {"backlog": {"targetSeconds": 1.0, "prefillTokensPerSecond": 1000}}},
               "decode": {"minReplicas": 2, "maxReplicas": 2, "signals": {"runningRequests": {"targetPerReplica": 2}}}}


def _empty(prom: Prometheus, exprs: list[tuple[str, str]], over_the_run: bool = False) -> list[tuple[str, str]]:
    """The expressions that return nothing now (or, ``over_the_run``, at any step since Prometheus started)."""
    query = prom.query_range if over_the_run else prom.query
    return [(what, expr) for what, expr in exprs if not query(expr)]


def _input_shapes() -> dict[str, set[frozenset[str]]]:
    """Each promtool input series' metric name -> the label-name sets it is given (empty values left out)."""
    shapes: dict[str, set[frozenset[str]]] = {}
    for case in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for s in case["input_series"]:
            name, labels = s["series"].split("{", 1)
            pairs = [kv.split("=", 1) for kv in labels.rstrip("}").split('",') if kv.strip()]
            # a label whose value is empty is no label (Prometheus drops it at the scrape, promtool on load)
            keys = frozenset(k.strip() for k, v in pairs if v.strip().strip('"'))
            shapes.setdefault(name, set()).add(keys)
    return shapes


def test_prometheus_scrapes_the_fleet_and_every_panel_and_rule_returns_data(
        cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path) -> None:
    with running_fleet(cluster, namespace, tmp_path / "pods") as fleet, \
            running_prometheus(tmp_path / "prometheus", fleet.core, namespace,
                               f"127.0.0.1:{operator.metrics_port}") as prom:
        fleet.patch({"autoscaling": AUTOSCALING})

        def pods() -> list[dict]:
            return [t for t in prom.targets() if t["labels"].get("job") == "pdfleet"]

        # Every runtime and router pod is a target on its metrics port (Prometheus applies discovery every 5 s).
        fleet.wait(lambda: sorted(t["labels"].get("pdfleet_role", "") for t in pods()) == [
            "decode", "decode", "prefill", "router"], 30, "the fleet's four pods as targets")
        traffic = fleet.traffic()
        traffic.wait_served(8)
        traffic.stop()
        fleet.wait(lambda: all(t["health"] == "up" for t in prom.targets()), 30, "every target up")
        assert {t["labels"]["pdfleet_deployment"] for t in pods()} == {NAME}
        assert {t["scrapeUrl"].rsplit(":", 1)[1] for t in pods() if t["labels"]["pdfleet_role"] != "router"} == {
            f"{METRICS_PORT}/metrics"}

        [prefill] = fleet.runner.running("prefill").values()
        prefill.signal(signal.SIGKILL)
        fired = [r for r in rules() if r.get("alert") in FIRED_HERE]
        # Each alert's expression returns data, and Prometheus' own rule evaluation holds it (pending: the
        # alerts wait their `for:` before firing).
        fleet.wait(lambda: not _empty(prom, [(r["alert"], r["expr"]) for r in fired]
                                      + [(r["alert"], f'ALERTS{{alertname="{r["alert"]}"}}') for r in fired]), 120,
                   "the alerts of a killed prefill returning data")
        chat = fleet.chat_traffic(timeout_s=5)
        for i in range(3):  # requests after the fault: the router's retries and errors count
            chat.once(i)

        panels = panel_queries(namespace, NAME)
        recorded = [(r["record"], r["expr"]) for r in rules() if "record" in r]
        alerts = [(r["alert"], r["expr"]) for r in fired]
        deadline = time.monotonic() + 60
        while (empty := _empty(prom, panels + recorded + alerts, over_the_run=True)) and time.monotonic() < deadline:
            time.sleep(2)
        assert not empty, "returned nothing:\n" + "\n".join(f"{w}: {e}" for w, e in empty)
        print(f"{len(panels)} panel queries, {len(recorded)} recording rules and {len(alerts)} alerts "
              f"({sorted(FIRED_HERE)}) returned data", flush=True)

        # The promtool tests' input series have the names and label names of what was scraped here.
        wrong = []
        for name, shapes in _input_shapes().items():
            scraped = {frozenset(k for k in s["metric"] if k != "__name__")
                       for s in prom.query(f'{{__name__="{name}", namespace="{namespace}"}}')}
            wrong += [(name, sorted(keys)) for keys in shapes if keys not in scraped]
        assert not wrong, f"promtool input series shaped unlike the scrape: {wrong}"
