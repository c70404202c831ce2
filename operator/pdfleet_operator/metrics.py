"""The operator's Prometheus metrics (one registry, served on ``--metrics-listen``).

Names (all prefixed ``pdfleet_operator_``):
- ``reconcile_passes_total{result}``: passes by result (ok, error, skipped);
- ``reconcile_seconds``: histogram of one pass, observe to status write;
- ``actions_total{kind,object}``: writes by action kind (apply, create, delete, patch-labels);
- ``deployments{condition,status}``: PDDeployments by condition status, as of their last pass;
- ``reconcile_last_seconds{namespace,name}``: the duration of each PDDeployment's latest pass;
- ``queue_depth{namespace,name}``: wake-ups (child and spec events) waiting for its next pass;
- ``queue_waiting``: PDDeployments woken and waiting for a free reconcile slot (the parallel bound);
- ``api_calls_per_pass``: histogram of the API calls one pass made (reads and writes);
- ``api_calls_total``: every API call of the reconcile passes;
- ``watch_restarts_total{resource}``: watch streams kopf restarted (expired, inactive or reconnected).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdfleet_operator.api.models import Condition

__all__ = ["METRICS", "Metrics", "count_watch_restarts", "serve"]


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
        self.last_seconds = Gauge("pdfleet_operator_reconcile_last_seconds", "Duration of the latest pass of "
                                  "a PDDeployment", ["namespace", "name"], registry=self.registry)
        self.queue_depth = Gauge("pdfleet_operator_queue_depth", "Wake-ups waiting for a PDDeployment's next pass",
                                 ["namespace", "name"], registry=self.registry)
        self.queue_waiting = Gauge("pdfleet_operator_queue_waiting", "PDDeployments waiting for a reconcile slot",
                                   registry=self.registry)
        self.api_calls = Histogram("pdfleet_operator_api_calls_per_pass", "API calls made by one reconcile pass",
                                   buckets=(0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89), registry=self.registry)
        self.api_calls_total = Counter("pdfleet_operator_api_calls_total", "API calls of the reconcile passes",
                                       registry=self.registry)
        self.watch_restarts = Counter("pdfleet_operator_watch_restarts_total", "Watch streams restarted",
                                      ["resource"], registry=self.registry)
        self.restart_count = 0  # the same, as a plain number: passes compare it (reconcile.Reconciler)
        self._last: dict[tuple[str, str], dict[str, str]] = {}

    def record_conditions(self, key: tuple[str, str], conditions: Sequence[Condition]) -> None:
        """Keep the gauge equal to the count over deployments of their latest conditions."""
        new = {c.type.value: c.status.value for c in conditions}
        for ctype, status in self._last.get(key, {}).items():
            self.conditions.labels(ctype, status).dec()
        for ctype, status in new.items():
            self.conditions.labels(ctype, status).inc()
        self._last[key] = new

    def forget(self, key: tuple[str, str]) -> None:
        """A deleted PDDeployment leaves the per-deployment series and the condition counts."""
        for ctype, status in self._last.pop(key, {}).items():
            self.conditions.labels(ctype, status).dec()
        for gauge in (self.last_seconds, self.queue_depth):
            with contextlib.suppress(KeyError):
                gauge.remove(*key)


METRICS = Metrics()


def serve(host: str, port: int) -> None:
    """Serve /metrics in a daemon thread (prometheus_client's own server)."""
    start_http_server(port, addr=host, registry=METRICS.registry)


_KOPF_WATCH_LOGGER = "kopf._cogs.clients.watching"
# 410 Gone (a re-list), an inactive stream (reconnected), a resume after a pause (a re-list)
_RESTARTS = ("Restarting the watch-stream for ", "Watch-stream for ", "Resuming the watch-stream for ")


class _WatchRestarts(logging.Filter):
    """Counts kopf's watch restarts from its own log records (kopf has no hook for them); passes the
    debug records on only when the operator logs at DEBUG."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for prefix in _RESTARTS:
            if message.startswith(prefix):
                METRICS.watch_restarts.labels(message[len(prefix):].split(" ", 1)[0]).inc()
                METRICS.restart_count += 1
        return self.verbose or record.levelno >= logging.INFO


def count_watch_restarts(verbose: bool) -> None:
    """Let kopf's watcher log its debug records so that ``watch_restarts_total`` sees them."""
    log = logging.getLogger(_KOPF_WATCH_LOGGER)
    log.setLevel(logging.DEBUG)
    log.addFilter(_WatchRestarts(verbose))
