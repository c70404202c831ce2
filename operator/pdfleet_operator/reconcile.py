"""Reconcile handlers: observe -> plan (pure) -> apply (the only writer) -> status.

Every trigger (create, update, resume, a periodic resync, an event on any child) funnels into
``Reconciler.reconcile(namespace, name)``, which re-reads everything from the API, so a pass
never acts on a stale cache and an operator restart resumes without duplicates. Passes of one
object are serialised by a per-object lock; the blocking kubernetes client runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client import ApiClient, CustomObjectsApi
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from pdfleet_operator.api.constants import GROUP, LABEL_DEPLOYMENT, PLURAL, VERSION, ConditionType
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.apply import Outcome, Writer
from pdfleet_operator.metrics import METRICS
from pdfleet_operator.observe import observe, observe_nodes
from pdfleet_operator.placement import check_placement
from pdfleet_operator.plan import ActionKind, Owner, plan, pods_running
from pdfleet_operator.resources.secret import AUTH_SECRET_MISSING, missing_key_in_use
from pdfleet_operator.rollout_state import (
    decide_rollouts,
    rollout_status,
    rollout_targets,
    with_rollout_failures,
)
from pdfleet_operator.status import compute_status, with_degraded, with_placement

__all__ = ["PassResult", "Reconciler", "register"]

# obj -> (Admitted/Degraded conditions, extra status fields such as matrixVersion)
AdmissionStatus = Callable[[dict], tuple[list[dict], dict]]


@dataclass
class PassResult:
    """What one pass did, for events and logs (built in the worker thread, posted on the loop)."""

    outcomes: list[Outcome] = field(default_factory=list)
    transitions: list[tuple[str, str, str, str]] = field(default_factory=list)  # type, status, reason, msg
    body: dict | None = None
    skipped: str | None = None
    conditions: list[dict] | None = None


def _admitted(conditions: list[dict]) -> bool:
    return not any(
        c["type"] == ConditionType.ADMITTED.value and c["status"] == "False" for c in conditions
    )


class Reconciler:
    def __init__(self, api: ApiClient, admission_status: AdmissionStatus) -> None:
        self._api = api
        self._custom = CustomObjectsApi(api)
        self._writer = Writer(api)
        self._admission = admission_status
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def reconcile(self, namespace: str, name: str, logger: Any) -> PassResult:
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            try:
                with METRICS.seconds.time():
                    result = await asyncio.to_thread(self._pass, namespace, name)
            except Exception:
                METRICS.passes.labels("error").inc()
                raise
        METRICS.passes.labels("skipped" if result.skipped else "ok").inc()
        for o in result.outcomes:
            if o.changed:
                METRICS.actions.labels(o.action.kind.value, o.action.object_kind).inc()
        if result.conditions is not None:
            METRICS.record_conditions((namespace, name), result.conditions)
        if result.body is not None:
            for o in result.outcomes:
                if o.changed and o.action.kind is not ActionKind.APPLY:
                    verb = {"create": "Created", "delete": "Deleted", "patch-labels": "Relabelled",
                            "patch-meta": "Drain"}[o.action.kind]
                    kopf.info(result.body, reason=verb, message=f"{verb} {o.action.object_kind.lower()} "
                              f"{o.action.name}" + (f": {o.action.reason}" if o.action.reason else ""))
            for ctype, status, reason, message in result.transitions:
                post = kopf.warn if ctype == ConditionType.DEGRADED.value and status == "True" else kopf.info
                post(result.body, reason=reason or ctype, message=f"{ctype}={status}: {message}")
        if result.skipped:
            logger.debug(f"reconcile skipped: {result.skipped}")
        return result

    def _pass(self, namespace: str, name: str) -> PassResult:
        try:
            body = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 404:
                return PassResult(skipped="gone")
            raise
        obj = json.loads(body.data)
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return PassResult(skipped="being deleted; children go by garbage collection")
        owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
        old_status = obj.get("status") or {}
        admission, extra_status = self._admission(obj)
        try:
            spec = PDDeploymentSpec.model_validate(obj.get("spec") or {})
        except ValidationError as exc:
            msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            admission = [*admission, {"type": ConditionType.DEGRADED.value, "status": "True",
                                      "reason": "SpecUnreadable", "message": msg,
                                      "observedGeneration": meta.get("generation", 0)}]
            self._writer.patch_status(namespace, name, {"conditions": admission})
            return PassResult(body=obj, skipped=f"spec unreadable: {msg}")
        snapshot = observe(self._api, owner)
        problems = check_placement(spec, observe_nodes(self._api))
        admission = with_placement(admission, problems, meta.get("generation", 0))
        if (why := missing_key_in_use(name, snapshot.secret_exists, pods_running(snapshot))) is not None:
            admission = with_degraded(admission, AUTH_SECRET_MISSING, why, meta.get("generation", 0))
        now = time.time()
        decisions = decide_rollouts(spec, snapshot, old_status.get("rollout") or {}, now)
        targets = rollout_targets(spec, snapshot, decisions)
        admission = with_rollout_failures(admission, decisions, spec, meta.get("generation", 0))
        actions = plan(owner, spec, snapshot, now=now, targets=targets)
        if not _admitted(admission):
            # A stored spec the running matrix rejects: keep what runs, start nothing new.
            actions = [a for a in actions if a.kind is ActionKind.APPLY or a.object_kind == "Secret"]
        outcomes = self._writer.run(owner, actions)
        if any(o.action.object_kind == "Pod" and o.changed for o in outcomes):
            snapshot = observe(self._api, owner)
        status = compute_status(
            spec, name, meta.get("generation", 0), snapshot.pods, old_status, admission, datetime.now(UTC),
            namespace=owner.namespace,
        )
        status["rollout"] = rollout_status(spec, decisions)
        holds = [a.reason for a in actions if a.kind is ActionKind.HOLD]
        if holds:
            status["rollout"]["message"] = "; ".join([*holds, status["rollout"]["message"]])
        phase_before = (old_status.get("rollout") or {}).get("phase")
        before = {c.get("type"): c for c in old_status.get("conditions") or ()}
        transitions = [
            (c["type"], c["status"], c.get("reason", ""), c.get("message", ""))
            for c in status["conditions"]
            if before.get(c["type"], {}).get("status") != c["status"]
        ]
        if status["rollout"]["phase"] != phase_before:
            transitions.append(("Rollout", status["rollout"]["phase"], "Rollout" + status["rollout"]["phase"],
                                status["rollout"].get("message") or ""))
        for role, d in decisions.items():
            if d.failure:
                transitions.append((ConditionType.DEGRADED.value, "True", "RolloutFailed", f"{role.value}: {d.message}"))
        self._writer.patch_status(namespace, name, {**status, **extra_status})
        return PassResult(outcomes=outcomes, transitions=transitions, body=obj, conditions=status["conditions"])


def _owner_of(body: dict) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("apiVersion", "").startswith(f"{GROUP}/") and ref.get("controller"):
            return ref.get("name")
    return None


CHILD_KINDS = (
    ("v1", "pods"),
    ("v1", "services"),
    ("v1", "configmaps"),
    ("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "rolebindings"),
    ("networking.k8s.io/v1", "networkpolicies"),
    ("policy/v1", "poddisruptionbudgets"),
)


def register(registry: kopf.OperatorRegistry, reconciler_ref: Callable[[], Reconciler],
             resync_seconds: float = 10.0) -> None:
    """Register the reconcile handlers on ``registry``; ``reconciler_ref`` is set at startup."""

    async def on_spec(namespace: str, name: str, logger: Any, **_: Any) -> None:
        await reconciler_ref().reconcile(namespace, name, logger)

    for cause in ("resume", "create", "update"):
        getattr(kopf.on, cause)(GROUP, VERSION, PLURAL, registry=registry, id=f"reconcile-{cause}")(on_spec)

    @kopf.timer(GROUP, VERSION, PLURAL, registry=registry, interval=resync_seconds, id="resync")
    async def resync(namespace: str, name: str, logger: Any, **_: Any) -> None:
        await reconciler_ref().reconcile(namespace, name, logger)

    async def on_child(body: dict, namespace: str, logger: Any, type: str | None, **_: Any) -> None:
        owner = _owner_of(body)
        if owner is not None and type is not None:  # type None: the initial listing, resume covers it
            await reconciler_ref().reconcile(namespace, owner, logger)

    for api_version, plural in CHILD_KINDS:
        group, _, version = api_version.rpartition("/")
        kopf.on.event(group=group, version=version, plural=plural, registry=registry, id=f"child-{plural}",
                      labels={LABEL_DEPLOYMENT: kopf.PRESENT})(on_child)
