"""pdfleet's Grafana dashboard, built with grafanalib (Grafana itself cannot be had here).

Run by the grafanalib venv (``python3 scripts/venvs.py grafana`` prints it):

    "$(python3 scripts/venvs.py grafana)/bin/python" scripts/grafana/dashboard.py   # rewrites the committed JSON

The JSON is committed (charts/pdfleet/files/grafana-dashboard.json, the chart's dashboard ConfigMap);
tests/unit/monitoring/test_dashboard.py checks that this script gives its bytes, and the e2e
(tests/e2e/test_monitoring_runtimes.py) that every panel's query returns data from a Prometheus scraping real pods.
Every query reads the target labels of the chart's monitors (pdfleet_deployment, pdfleet_role, pdfleet_compat) and
raw series only, so the dashboard works without the recording rules.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from grafanalib._gen import write_dashboard
from grafanalib.core import Dashboard, GridPos, RowPanel, Target, Template, Templating, TimeSeries

OUT = Path(__file__).resolve().parents[2] / "charts" / "pdfleet" / "files" / "grafana-dashboard.json"
DS = "${datasource}"
SEL = 'namespace=~"$namespace", pdfleet_deployment=~"$deployment"'
RATE = "$__rate_interval"
WORKERS = 'pdfleet_role=~"prefill|decode"'


def _sel(extra: str = "") -> str:
    return "{" + SEL + (", " + extra if extra else "") + "}"


def _quantile(q: float, metric: str, by: str, extra: str = "") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{_sel(extra)}[{RATE}])))"


# (row, [(title, unit, [(legend, expr)])]): each panel's queries; the e2e queries every one.
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Transfers", [
        ("Transfer bytes/s per pod", "Bps", [
            ("{{pod}} {{kind}}", f"sum by (pod, kind) (rate(pdfleet_transfer_bytes_total{_sel()}[{RATE}]))")]),
        ("Transfer bytes/s by state type (decode)", "Bps", [
            ("{{state}} {{kind}}", f"sum by (state, kind) (rate(pdfleet_transfer_state_bytes_total{_sel()}[{RATE}]))")]),
        ("State bytes/s of served requests (rooms)", "Bps", [
            ("{{pod}}", f"sum by (pod) (rate(pdfleet_room_transfer_bytes_total{_sel()}[{RATE}]))")]),
        ("Transfer latency per pod (p50, p99)", "s", [
            ("p50 {{pod}}", _quantile(0.5, "pdfleet_transfer_seconds", "pod", 'kind="request"')),
            ("p99 {{pod}}", _quantile(0.99, "pdfleet_transfer_seconds", "pod", 'kind="request"'))]),
        ("Transfers/s by outcome", "ops", [
            ("{{pdfleet_role}} {{kind}} {{outcome}}",
             f"sum by (pdfleet_role, kind, outcome) (rate(pdfleet_transfers_total{_sel()}[{RATE}]))")]),
        ("Transfer failures/s by reason", "ops", [
            ("{{pod}} {{reason}}", f"sum by (pod, reason) (rate(pdfleet_transfer_failures_total{_sel()}[{RATE}]))")]),
        ("Transfers in flight", "short", [
            ("{{pod}}", f"sum by (pod) (pdfleet_transfers_in_flight{_sel()})")]),
    ]),
    ("Rooms and state integrity", [
        ("Rooms held (prefill)", "short", [("{{pod}}", f"sum by (pod) (pdfleet_rooms_held{_sel()})")]),
        ("Rooms expired/s (prefilled state unclaimed)", "ops", [
            ("{{pod}}", f"sum by (pod) (rate(pdfleet_rooms_expired_total{_sel()}[{RATE}]))")]),
        ("Mismatched bytes/s (decode verify)", "Bps", [
            ("{{pod}}", f"sum by (pod) (rate(pdfleet_verify_mismatched_bytes_total{_sel()}[{RATE}]))")]),
        ("vLLM handshake refusals/s", "ops", [
            ("{{pod}} {{reason}}",
             f"sum by (pod, reason) (rate(pdfleet_vllm_handshake_refusals_total{_sel()}[{RATE}]))")]),
        ("Silent fallbacks/s by reason (answered, but PD did not happen)", "ops", [
            ("{{pod}} {{reason}}",
             f"sum by (pod, reason) (rate(pdfleet_silent_fallbacks_total{_sel()}[{RATE}]))")]),
    ]),
    ("Canaries and gates", [
        ("Canary throughput vs floor", "decgbytes", [
            ("{{pod}} -> {{peer}}", f"pdfleet_canary_throughput_gbps{_sel()}"),
            ("floor {{pod}}", f"max by (pod) (pdfleet_canary_floor_gbps{_sel()})")]),
        ("Canary pairs: 1 passed, 0 failed", "short", [("{{pod}} -> {{peer}}", f"pdfleet_canary_peer_ok{_sel()}")]),
        ("Transfer-path gate (pdfleet_ready)", "short", [("{{pod}}", f"max by (pod) (pdfleet_ready{_sel()})")]),
        ("Pool items free (lowest rank)", "short", [
            ("{{pod}} {{kind}}", f"min by (pod, kind) (pdfleet_pool_items_free{_sel()})")]),
    ]),
    ("Rollouts and autoscaling", [
        ("Ready pods per generation", "short", [
            ("{{pdfleet_role}} {{pdfleet_compat}}",
             f"count by (pdfleet_role, pdfleet_compat) (pdfleet_ready{_sel(WORKERS)} == 1)")]),
        ("Pods per runtime version", "short", [
            ("{{version}} {{stand_in_for}}", f"count by (version, stand_in_for) (pdfleet_runtime_info{_sel()})")]),
        ("Pods draining", "short", [("{{pdfleet_role}}", f"sum by (pdfleet_role) (pdfleet_draining{_sel()})")]),
        ("PDDeployments by condition (operator)", "short", [
            ("{{condition}}={{status}}", "sum by (condition, status) (pdfleet_operator_deployments)")]),
        ("Operator writes/s", "ops", [
            ("{{kind}} {{object}}", f"sum by (kind, object) (rate(pdfleet_operator_actions_total[{RATE}]))")]),
        ("Autoscaler: desired and recommended replicas", "short", [
            ("desired {{role}}", 'max by (role) (pdfleet_operator_autoscale_desired_replicas'
                                 '{namespace=~"$namespace", name=~"$deployment"})'),
            ("recommended {{role}}", 'max by (role) (pdfleet_operator_autoscale_recommended_replicas'
                                     '{namespace=~"$namespace", name=~"$deployment"})')]),
        ("Autoscaler decisions/s by reason", "ops", [
            ("{{role}} {{reason}}",
             f"sum by (role, reason) (rate(pdfleet_operator_autoscale_decisions_total[{RATE}]))")]),
    ]),
    ("Latency: engines and router", [
        ("TTFT p99 (engines)", "s", [
            ("{{pdfleet_role}}", _quantile(0.99, "sglang:time_to_first_token_seconds", "pdfleet_role"))]),
        ("ITL p99 (engines)", "s", [
            ("{{pdfleet_role}}", _quantile(0.99, "sglang:inter_token_latency_seconds", "pdfleet_role"))]),
        ("Router request latency p99", "s", [
            ("{{pod}}", _quantile(0.99, "smg_router_request_duration_seconds", "pod"))]),
        ("Router requests/s", "ops", [
            ("{{pod}}", f"sum by (pod) (rate(smg_router_requests_total{_sel()}[{RATE}]))")]),
        ("Router worker retries/s", "ops", [
            ("{{pod}}", f"sum by (pod) (rate(smg_worker_retries_total{_sel()}[{RATE}]))")]),
    ]),
]


def dashboard() -> Dashboard:
    panels: list[object] = []
    y = 0
    for row, items in ROWS:
        panels.append(RowPanel(title=row, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        for i, (title, unit, queries) in enumerate(items):
            panels.append(TimeSeries(
                title=title, dataSource=DS, unit=unit, gridPos=GridPos(h=8, w=8, x=8 * (i % 3), y=y + 8 * (i // 3)),
                targets=[Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + k), datasource=DS)
                         for k, (legend, expr) in enumerate(queries)]))
        y += 8 * ((len(items) + 2) // 3)
    variables = [
        Template(name="datasource", query="prometheus", type="datasource", label="Data source"),
        Template(name="namespace", label="Namespace", dataSource=DS, query="label_values(pdfleet_ready, namespace)",
                 includeAll=True, multi=True, allValue=".*"),
        Template(name="deployment", label="PDDeployment", dataSource=DS,
                 query='label_values(pdfleet_ready{namespace=~"$namespace"}, pdfleet_deployment)',
                 includeAll=True, multi=True, allValue=".*"),
    ]
    return Dashboard(title="pdfleet", uid="pdfleet", tags=["pdfleet"], timezone="utc", refresh="30s",
                     panels=panels, templating=Templating(list=variables)).auto_panel_ids()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT), help="where to write the JSON ('-': stdout)")
    args = parser.parse_args(argv)
    buf = io.StringIO()
    write_dashboard(dashboard(), buf)
    if args.out == "-":
        sys.stdout.write(buf.getvalue())
    else:
        Path(args.out).write_text(buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
