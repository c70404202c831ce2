"""Every kopf handler of the operator, registered on one registry from the settings read at start.

- admission (``pdfleet_operator.admission``): the validating webhook, served when a webhook mode
  is on;
- reconcile (``pdfleet_operator.reconcile``): children, pods and the whole status, including the
  Admitted/Degraded re-check of the stored spec (so the status has one writer), but for
  ``status.autoscaling``;
- autoscale (``pdfleet_operator.autoscale.runner``): a timer per deployment with ``spec.autoscaling``,
  the one writer of ``status.autoscaling``; it wakes the reconcile when a count changes.

Registering into an explicit registry, rather than decorating at import time, lets each handler
take its settings as arguments and keeps tests free of a hidden global registry.
"""

from __future__ import annotations

from typing import Any

import kopf

from pdfleet_operator import reconcile
from pdfleet_operator.admission import handlers as admission_handlers
from pdfleet_operator.autoscale import runner as autoscale_runner
from pdfleet_operator.model_ref import HubClient
from pdfleet_operator.settings import OperatorSettings
from pdfleet_operator.watched import WatchedState
from pdfleet_runtime.kubeapi import in_cluster_or_kubeconfig

__all__ = ["register"]


def _api_client() -> Any:
    """In-cluster credentials first, then KUBECONFIG (the same order as kopf's logins), with the
    deadlines of ``pdfleet_runtime.kubeapi`` on every call."""
    return in_cluster_or_kubeconfig()


def register(
    registry: kopf.OperatorRegistry, settings: OperatorSettings, kopf_settings: kopf.OperatorSettings
) -> None:
    """Register all handlers; ``kopf_settings`` gains the webhook server when admission serves one."""
    # An explicit registry starts without kopf's default logins: in-cluster first, then KUBECONFIG.
    kopf.on.login(id="login-service-account", registry=registry)(kopf.login_with_service_account)
    kopf.on.login(id="login-kubeconfig", registry=registry)(kopf.login_with_kubeconfig)
    verdicts = admission_handlers.register(registry, settings, kopf_settings, recheck_handlers=False)

    holder: dict[str, reconcile.Reconciler] = {}
    scalers: dict[str, autoscale_runner.Autoscaler] = {}
    state = WatchedState()
    wakeups = reconcile.Wakeups()

    @kopf.on.startup(registry=registry, id="reconciler")
    async def start_reconciler(**kwargs: Any) -> None:
        state.bind(kwargs)  # kopf hands its indices to startup handlers, still empty; it fills them later
        holder["r"] = reconcile.Reconciler(_api_client(), admission_handlers.status_hook(verdicts), state,
                                           workers=settings.max_parallel_reconciles,
                                           secret_recheck_s=settings.resync_seconds,
                                           hub=HubClient(settings.hub_endpoint),
                                           router_generations=settings.router_generations)
        scalers["a"] = autoscale_runner.Autoscaler(_api_client(), state, wakeups.wake)

    @kopf.on.cleanup(registry=registry, id="autoscaler-close")
    async def close_autoscaler(**_: Any) -> None:
        if "a" in scalers:
            await scalers["a"].close()

    reconcile.register(registry, lambda: holder["r"], resync_seconds=settings.resync_seconds,
                       kopf_settings=kopf_settings, wakeups=wakeups)
    autoscale_runner.register(registry, lambda: scalers["a"], interval_s=settings.autoscale_interval_seconds)
