"""The autoscaler's own Prometheus metrics, on the operator's registry (``metrics.METRICS``).

Names (all prefixed ``pdfleet_operator_autoscale_``):
- ``desired_replicas{namespace,name,role}``: the latest decision's count;
- ``recommended_replicas{namespace,name,role}``: what the signals asked for, before the windows, the
  bounds, the budget and the band;
- ``signal_value{namespace,name,role,signal}`` and ``signal_target{...}``: each reading;
- ``decisions_total{role,reason}``: decisions by reason (``RolloutInProgress`` while a rollout holds);
- ``held_by_rollout{namespace,name}``: 1 while a rollout holds the autoscaler;
- ``scrape_failures_total{role}``: pods whose metrics did not come within the deadline;
- ``pass_seconds``: one autoscaling pass, scrape to status write.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdfleet_operator.api.constants import Role
from pdfleet_operator.autoscale.decide import Outcome

__all__ = ["AutoscaleMetrics"]

_P = "pdfleet_operator_autoscale_"


class AutoscaleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.desired = Gauge(f"{_P}desired_replicas", "The autoscaler's latest count per role",
                             ["namespace", "name", "role"], registry=r)
        self.recommended = Gauge(f"{_P}recommended_replicas", "What the signals asked for, before windows, "
                                 "bounds, budget and band", ["namespace", "name", "role"], registry=r)
        self.value = Gauge(f"{_P}signal_value", "A signal's value at the latest decision",
                           ["namespace", "name", "role", "signal"], registry=r)
        self.target = Gauge(f"{_P}signal_target", "A signal's target", ["namespace", "name", "role", "signal"],
                            registry=r)
        self.decisions = Counter(f"{_P}decisions_total", "Autoscaling decisions by role and reason",
                                 ["role", "reason"], registry=r)
        self.held = Gauge(f"{_P}held_by_rollout", "1 while a rollout holds the autoscaler", ["namespace", "name"],
                          registry=r)
        self.scrape_failures = Counter(f"{_P}scrape_failures_total", "Pods whose metrics did not come in time",
                                       ["role"], registry=r)
        self.seconds = Histogram(f"{_P}pass_seconds", "One autoscaling pass, scrape to status write",
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=r)
        self._series: dict[tuple[str, str], set[tuple[str, str]]] = {}

    def record(self, key: tuple[str, str], outcome: Outcome) -> None:
        self.held.labels(*key).set(1 if outcome.status.held_by_rollout else 0)
        seen = self._series.setdefault(key, set())
        for role in Role:
            s = outcome.status.prefill if role is Role.PREFILL else outcome.status.decode
            if s is None:
                continue
            self.desired.labels(*key, role.value).set(s.desired)
            if s.recommendation is not None:
                self.recommended.labels(*key, role.value).set(s.recommendation)
            self.decisions.labels(role.value, s.reason).inc()
            for r in s.readings or ():
                self.value.labels(*key, role.value, r.signal).set(r.value)
                self.target.labels(*key, role.value, r.signal).set(r.target)
                seen.add((role.value, r.signal))

    def forget(self, key: tuple[str, str]) -> None:
        for gauge in (self.held,):
            with contextlib.suppress(KeyError):
                gauge.remove(*key)
        for role in Role:
            for gauge in (self.desired, self.recommended):
                with contextlib.suppress(KeyError):
                    gauge.remove(*key, role.value)
        for role_value, signal in self._series.pop(key, set()):
            for gauge in (self.value, self.target):
                with contextlib.suppress(KeyError):
                    gauge.remove(*key, role_value, signal)
