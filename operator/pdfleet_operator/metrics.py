"""The operator's Prometheus metrics (one registry, served on ``--metrics-listen``).

Names (all prefixed ``pdfleet_operator_``):
- ``reconcile_passes_total{result}``: passes by result (ok, error, skipped);
- ``reconcile_seconds``: histogram of one pass, observe to status write;
- ``actions_total{kind,object}``: writes by action kind (apply, create, delete, patch-labels);
- ``deployments{condition,status}``: PDDeployments by condition status, as of their last pass.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["METRICS", "Metrics", "serve"]


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.passes = Counter("pdfleet_operator_reconcile_passes_total", "Reconcile passes by result",
                              ["result"], registry=self.registry)
        self.seconds = Histogram("pdfleet_operator_reconcile_seconds", "Duration of one reconcile pass",
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                                 registry=self.registry)
        self.actions = Counter("pdfleet_operator_actions_total", "Writes by action kind and object kind",
                               ["kind", "object"], registry=self.registry)
        self.conditions = Gauge("pdfleet_operator_deployments", "PDDeployments by condition status",
                                ["condition", "status"], registry=self.registry)
        self._last: dict[tuple[str, str], dict[str, str]] = {}

    def record_conditions(self, key: tuple[str, str], conditions: list[dict]) -> None:
        """Keep the gauge equal to the count over deployments of their latest conditions."""
        new = {c["type"]: c["status"] for c in conditions}
        for ctype, status in self._last.get(key, {}).items():
            self.conditions.labels(ctype, status).dec()
        for ctype, status in new.items():
            self.conditions.labels(ctype, status).inc()
        self._last[key] = new


METRICS = Metrics()


def serve(host: str, port: int) -> None:
    """Serve /metrics in a daemon thread (prometheus_client's own server)."""
    start_http_server(port, addr=host, registry=METRICS.registry)
