"""The chart's monitoring objects (issue 46), rendered offline: the PodMonitors and the ServiceMonitor scrape ports
that the pods the operator renders really declare, relabel from pod labels those pods really carry, and the
PrometheusRule and the dashboard ConfigMap hold the committed files verbatim. All are off by default."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from pdfleet_operator.__main__ import build_parser
from pdfleet_operator.render import render_object
from tests.unit.chart.conftest import CHART, Render, by_kind, one

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "valid" / "llama-dense.yaml"
RULES = CHART / "files" / "prometheus-rules.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
ON = ("podMonitor.enabled=true", "prometheusRule.enabled=true", "grafanaDashboard.enabled=true",
      "serviceMonitor.enabled=true")


def _fleet() -> list[dict]:
    """What the operator's first pass creates for an example with a router: pods, Services, the router."""
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["spec"].setdefault("router", {"image": "example.invalid/router:1"})
    rendered = render_object(obj, str(EXAMPLE))
    assert rendered.verdict.admitted, rendered.verdict
    return rendered.objects


def _pod_templates(objs: list[dict]) -> list[dict]:
    out = [o for o in objs if o["kind"] == "Pod"]
    out += [o["spec"]["template"] for o in objs if o["kind"] == "Deployment"]
    return out


def _meta_label(key: str) -> str:
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def test_monitoring_objects_are_off_by_default(render: Render) -> None:
    objs = render()
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
        assert not by_kind(objs, kind), kind
    assert not [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]


def test_the_pod_monitor_scrapes_a_port_every_managed_pod_declares(render: Render) -> None:
    fleet, templates = render(*ON), _pod_templates(_fleet())
    monitor = next(o for o in by_kind(fleet, "PodMonitor") if o["metadata"]["name"].endswith("-fleet"))
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
    roles = {t["metadata"]["labels"].get("pdfleet.io/role", t["metadata"]["labels"].get("app.kubernetes.io/component"))
             for t in selected}
    assert roles == {"prefill", "decode", "router"}, roles
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    for t in selected:
        ports = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", ())}
        assert endpoint["port"] in ports, (t["metadata"].get("name"), ports)
    # Every label the relabelling reads is one some selected pod carries, and every target label comes out.
    carried = {_meta_label(k) for t in selected for k in t["metadata"]["labels"]}
    sources = {s for r in endpoint["relabelings"] for s in r["sourceLabels"]}
    assert sources <= carried, sources - carried
    assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"pdfleet_deployment", "pdfleet_role",
                                                                  "pdfleet_compat"}


def test_the_service_monitor_scrapes_the_headless_services_metrics_port(render: Render) -> None:
    sm = one(render(*ON), "ServiceMonitor")
    [endpoint] = sm["spec"]["endpoints"]
    services = [o for o in _fleet() if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"]
    assert services
    for svc in services:
        assert "pdfleet.io/deployment" in svc["metadata"]["labels"]
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}, svc["metadata"]["name"]


def test_the_operator_pod_monitor_scrapes_the_operators_metrics_listener(render: Render) -> None:
    objs = render(*ON)
    monitor = next(o for o in by_kind(objs, "PodMonitor") if o["metadata"]["name"].endswith("-operator"))
    deployment = one(objs, "Deployment")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
        "labels"].items()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [port] = [p for p in container["ports"] if p["name"] == monitor["spec"]["podMetricsEndpoints"][0]["port"]]
    # the --metrics-listen default, which the chart leaves as is
    assert build_parser().parse_args([]).metrics_listen.endswith(f":{port['containerPort']}")
    assert not any(a.startswith("--metrics-listen") for a in container["args"])


def test_the_rule_and_the_dashboard_are_the_committed_files(render: Render) -> None:
    objs = render(*ON)
    assert one(objs, "PrometheusRule")["spec"] == yaml.safe_load(RULES.read_text())
    [cm] = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pdfleet.json"]) == json.loads(DASHBOARD.read_text())
