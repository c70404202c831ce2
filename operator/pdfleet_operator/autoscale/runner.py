"""The autoscaler's edges and its timer: read (scrape), decide (pure: ``inputs``, ``decide``), write.

Every ``interval`` seconds per PDDeployment with ``spec.autoscaling`` (a kopf timer; only on the
active peer, as the reconcile daemon): read the deployment and its pods from the watched state,
scrape each pod's ``/metrics`` (and the router pods', listed by label) with a deadline per call, turn
this scrape and the last into the planner's inputs, decide, and write:

* ``status.autoscaling`` (a merge patch of that one key: the reconcile's status writes leave it
  alone), laid over the watched state so the next reconcile pass plans with the new count at once;
* an event per change of count or of reason (``decide``);
* the autoscaler's metrics (``telemetry``);
* a wake-up of the deployment's reconcile, which hands the count to the same create and drain path
  a spec edit takes (``replicas.replicas_in_effect``).

The previous scrape is kept in memory only (rates need two); after an operator restart the first
pass has levels but no rates, and decides from those.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes.client import ApiClient, CoreV1Api
from pydantic import ValidationError

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec, PDDeploymentStatus
from pdfleet_operator.apply import Writer
from pdfleet_operator.autoscale.admission import gpus_per_replica
from pdfleet_operator.autoscale.decide import Outcome, decide
from pdfleet_operator.autoscale.inputs import RoleScrape, decode_metrics, prefill_metrics, role_fleet
from pdfleet_operator.autoscale.replicas import replicas_in_effect, rollout_in_progress
from pdfleet_operator.autoscale.scrape import Scraper
from pdfleet_operator.autoscale.telemetry import AutoscaleMetrics
from pdfleet_operator.metrics import METRICS
from pdfleet_operator.observe import snapshot_of
from pdfleet_operator.observed import ObservedPod, Owner
from pdfleet_operator.resources.router import LABEL_ROUTER, scrape_port
from pdfleet_operator.watched import WatchedState

__all__ = ["DEFAULT_INTERVAL_S", "Autoscaler", "register"]

DEFAULT_INTERVAL_S = 15.0
"""An HPA's sync period; the planner's windows and rates are in seconds, so any interval works."""
TELEMETRY = AutoscaleMetrics(METRICS.registry)


def _targets(pods: list[ObservedPod], role: Role, port: int) -> list[tuple[str, str]]:
    """Each live replica's leader with an IP (a group's metrics come from its leader)."""
    return [(p.name, f"http://{p.ip}:{port}/metrics") for p in pods
            if p.role is role and p.member == 0 and p.ip and not p.deleting]


class Autoscaler:
    """Runs the passes; keeps each deployment's last scrape (the rates' other end)."""

    def __init__(self, api: ApiClient, state: WatchedState, wake: Callable[[tuple[str, str]], None],
                 scraper: Scraper | None = None, writer: Writer | None = None) -> None:
        self._api = api
        self._state = state
        self._wake = wake
        self._scraper = scraper or Scraper()
        self._writer = writer or Writer(api)
        self._last: dict[tuple[str, str], dict[Role, RoleScrape]] = {}

    def forget(self, namespace: str, name: str) -> None:
        self._last.pop((namespace, name), None)
        TELEMETRY.forget((namespace, name))

    async def run(self, namespace: str, name: str) -> Outcome | None:
        """One pass; None when the deployment has no (readable) ``spec.autoscaling``."""
        key = (namespace, name)
        view = self._state.view(namespace, name)
        body = view.body
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        try:
            spec = PDDeploymentSpec.model_validate(body.get("spec") or {})
            status = PDDeploymentStatus.model_validate(body.get("status") or {})
        except ValidationError:
            return None  # the reconcile reports an unreadable spec or status
        if spec.autoscaling is None:
            self.forget(namespace, name)
            return None
        started = time.monotonic()
        owner = Owner(name=name, namespace=namespace, uid=body["metadata"]["uid"])
        pods = list(snapshot_of(owner, view.of("Pod"), (), secret_exists=True, router_secret_exists=True).pods)
        port = scrape_port(spec)  # the built-in runtime's metrics port, or the engine's own
        loop = asyncio.get_running_loop()
        routers = await loop.run_in_executor(None, self._router_targets, namespace, name, spec)
        targets = {role: _targets(pods, role, port) for role in Role}
        got = await asyncio.gather(*(self._scraper.scrape(targets[role]) for role in Role),
                                   self._scraper.scrape(routers))
        samples = dict(zip(Role, got[:2], strict=True))
        router = next(iter(got[2].values()), None) if len(got[2]) == 1 else None  # several: no one view
        now = time.time()
        cur = {role: RoleScrape(now, samples[role], router if role is Role.PREFILL else None) for role in Role}
        for role in Role:
            if missed := len(targets[role]) - len(samples[role]):
                TELEMETRY.scrape_failures.labels(role.value).inc(missed)
        prev = self._last.get(key, {})
        self._last[key] = cur
        a = spec.autoscaling
        counts = replicas_in_effect(spec, status)
        fleets = {role: role_fleet([p for p in pods if p.role is role], counts[role], now,
                                   gpus_per_replica(spec, role.value)) for role in Role}
        pm = prefill_metrics(prev.get(Role.PREFILL), cur[Role.PREFILL],
                             a.prefill.signals.ttft.percentile if a.prefill.signals.ttft else None)
        dm = decode_metrics(prev.get(Role.DECODE), cur[Role.DECODE],
                            a.decode.signals.itl.percentile if a.decode.signals.itl else None)
        outcome = decide(a, now, (pm, fleets[Role.PREFILL]), (dm, fleets[Role.DECODE]), status.autoscaling,
                         rollout_in_progress(spec, pods), (len(samples[Role.PREFILL]), len(samples[Role.DECODE])))
        doc = outcome.status.model_dump(by_alias=True, mode="json", exclude_none=True)
        answer = await loop.run_in_executor(None, self._writer.patch_status, namespace, name, {"autoscaling": doc})
        self._state.wrote("PDDeployment", namespace, name, answer)
        for e in outcome.events:
            kopf.info(body, reason=f"Autoscale{e.reason}", message=e.message)
        TELEMETRY.record(key, outcome)
        TELEMETRY.seconds.observe(time.monotonic() - started)
        if any(outcome.desired(role) != counts[role] for role in Role):
            self._wake(key)
        return outcome

    def _router_targets(self, namespace: str, name: str, spec: PDDeploymentSpec) -> list[tuple[str, str]]:
        """The router pods' metrics URLs (listed by label: they are a Deployment's, not in the watched
        state); none without ``spec.router``."""
        if spec.router is None:
            return []
        listing = CoreV1Api(self._api).list_namespaced_pod(namespace, label_selector=f"{LABEL_ROUTER}={name}",
                                                           _preload_content=False)
        port = spec.router.metrics_port
        return [(str(p["metadata"]["name"]), f"http://{p['status']['podIP']}:{port}/metrics")
                for p in json.loads(listing.data).get("items") or ()  # type: ignore[attr-defined]
                if (p.get("status") or {}).get("podIP") and not p["metadata"].get("deletionTimestamp")]

    async def close(self) -> None:
        await self._scraper.close()


def register(registry: kopf.OperatorRegistry, autoscaler_ref: Callable[[], Autoscaler],
             interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """A timer per PDDeployment whose spec sets ``autoscaling`` (kopf runs it on the active peer only)."""
    from pdfleet_operator.api.constants import GROUP, PLURAL, VERSION

    def has_autoscaling(spec: Any, **_: Any) -> bool:
        return bool(spec.get("autoscaling"))

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="autoscale-forget")
    async def deleted(event: Any, namespace: str | None, name: str, **_: Any) -> None:
        """A deleted deployment: drop its last scrape and its metric series."""
        if event.get("type") == "DELETED" and namespace is not None:
            with contextlib.suppress(KeyError):  # before start-up: nothing kept yet
                autoscaler_ref().forget(namespace, name)

    @kopf.timer(GROUP, VERSION, PLURAL, registry=registry, id="autoscale", interval=interval_s,
                when=has_autoscaling)
    async def autoscale(namespace: str | None, name: str, logger: Any, **_: Any) -> None:
        if namespace is None:
            return
        try:
            outcome = await autoscaler_ref().run(namespace, name)
        except Exception as exc:  # a write or list failed: the next tick retries (reads never raise)
            logger.warning(f"autoscaling pass failed ({type(exc).__name__}: {exc})")
            return
        if outcome is not None:
            p, d = outcome.status.prefill, outcome.status.decode
            assert p is not None and d is not None
            logger.debug(f"autoscale: prefill {p.desired} ({p.reason}), decode {d.desired} ({d.reason})")
