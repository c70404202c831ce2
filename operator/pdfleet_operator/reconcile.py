"""Reconcile handlers: observe -> plan (pure) -> apply (the only writer) -> status.

Every trigger (create, update, resume, an event on any child, a time-based decision coming due, a
periodic resync) wakes the PDDeployment's daemon, which runs ``Reconciler.reconcile(namespace,
name)``. A pass reads the watched state (``watched``: kopf's indexes, complete before any handler
runs, plus the operator's own writes laid over them), so it lists nothing and its cost follows what
its deployment owns; an operator restart re-lists and resumes without duplicates (pod names are
deterministic, drains live on the pods). Passes of one object are serialised by a per-object lock,
at most ``workers`` run at once, each in a thread (the kubernetes client blocks).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from pdfleet_operator.api.constants import (
    API_VERSION,
    GROUP,
    LABEL_DEPLOYMENT,
    PLURAL,
    VERSION,
    ConditionStatus,
    ConditionType,
    Role,
)
from pdfleet_operator.api.models import Condition, PDDeploymentSpec, PDDeploymentStatus
from pdfleet_operator.api.rolescale import RS_KIND, RS_PLURAL, rolescale_name
from pdfleet_operator.apply import Outcome, Writer
from pdfleet_operator.autoscale.replicas import replicas_in_effect, with_replicas
from pdfleet_operator.autoscale.rolescale import (
    adapter_roles,
    external_counts,
    rolescale_body,
    rolescale_status,
)
from pdfleet_operator.metrics import METRICS
from pdfleet_operator.model_ref import HubClient, ModelRefError, resolve_model
from pdfleet_operator.observe import observe, observe_nodes, secret_exists, snapshot_of, with_group_secrets
from pdfleet_operator.observed import Owner, Snapshot
from pdfleet_operator.placement import check_placement, node_facts
from pdfleet_operator.plan import (
    Action,
    ActionKind,
    group_pods_running,
    grouped_roles,
    plan,
    pods_running,
)
from pdfleet_operator.resources.engine import HF_TOKEN_KEY
from pdfleet_operator.resources.names import router_secret_name, secret_name, worker_secret_name
from pdfleet_operator.resources.secret import (
    AUTH_SECRET_MISSING,
    missing_group_key_in_use,
    missing_key_in_use,
)
from pdfleet_operator.rollout_state import decide_rollouts, next_wake, rollout_targets, with_rollout_failures
from pdfleet_operator.status import (
    broken_wake,
    pass_status,
    spec_unreadable_status,
    status_document,
    with_degraded,
    with_mixed_generations,
    with_placement,
    with_silent_fallbacks,
    with_transfer_health,
)
from pdfleet_operator.watched import (
    INDEX_NODES,
    INDEX_PDDEPLOYMENTS,
    OWNED_KINDS,
    View,
    WatchedState,
    index_id,
)

__all__ = ["PassResult", "Reconciler", "register"]

UNRESOLVED_RETRY_S = 30.0
"""A Hub branch or tag that could not be resolved is tried again this often."""

# obj -> (Admitted/Degraded conditions, the matrix version that judged it or None)
AdmissionStatus = Callable[[dict], tuple[list[Condition], str | None]]


@dataclass
class PassResult:
    """What one pass did, for events and logs (built in the worker thread, posted on the loop)."""

    outcomes: list[Outcome] = field(default_factory=list)
    transitions: list[tuple[str, str, str, str]] = field(default_factory=list)  # type, status, reason, msg
    body: dict | None = None
    skipped: str | None = None
    conditions: list[Condition] | None = None
    requeue_after: float | None = None  # the next time-based decision (a drain deadline, a gate timeout)
    api_calls: int = 0


def _admitted(conditions: list[Condition]) -> bool:
    return not any(c.type is ConditionType.ADMITTED and c.status is ConditionStatus.FALSE for c in conditions)


def _earliest(*waits: float | None) -> float | None:
    return min((w for w in waits if w is not None), default=None)


class StatusUnreadable(ValueError):
    """The stored status does not parse as ``PDDeploymentStatus`` (only this operator writes it, through the
    same model that gives the CRD its schema): the pass stops rather than forget failed revisions."""


def _stored_status(raw: dict) -> PDDeploymentStatus:
    try:
        return PDDeploymentStatus.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"status.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise StatusUnreadable(f"the stored status does not parse: {problems}") from exc


class _CountedCalls(threading.local):
    calls = 0


def _count_calls(api: ApiClient) -> _CountedCalls:
    """Count every API call made through ``api`` in the calling thread (a pass runs in one thread)."""
    counter, call = _CountedCalls(), api.call_api

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.calls += 1
        return call(*args, **kwargs)

    api.call_api = counted  # type: ignore[method-assign]
    return counter


class Reconciler:
    """One pass at a time per PDDeployment, at most ``workers`` passes at once (a thread each).

    With ``state`` (the operator) a pass reads the watched state and overlays its own writes there;
    without it (tests, tools) it lists from the API as the pass did before watched state existed."""

    def __init__(self, api: ApiClient, admission_status: AdmissionStatus, state: WatchedState | None = None,
                 *, workers: int = 4, secret_recheck_s: float = 60.0, hub: HubClient | None = None,
                 router_generations: bool = True) -> None:
        self._api = api
        self._router_generations = router_generations
        self._hub = hub or HubClient()
        self._calls = _count_calls(api)
        self._custom = CustomObjectsApi(api)
        self._writer = Writer(api)
        self._admission = admission_status
        self._state = state
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._slots = asyncio.Semaphore(workers)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reconcile")
        # Secrets may be read by name only (no list/watch: least privilege): one found is trusted for
        # ``secret_recheck_s``, then read again, so a deleted one comes back within that time.
        self._secrets_seen: dict[tuple[str, str], float] = {}
        self._secret_recheck_s = secret_recheck_s
        self._verified: dict[tuple[str, str], int] = {}  # METRICS.restart_count at each deployment's last check

    def forget(self, namespace: str, name: str) -> None:
        """A deleted PDDeployment: drop what is kept for it."""
        self._locks.pop((namespace, name), None)
        self._verified.pop((namespace, name), None)
        self._writer.forget(namespace, name)
        if self._state is not None:
            self._state.forget(namespace, name)
        METRICS.forget((namespace, name))

    async def reconcile(self, namespace: str, name: str, logger: Any) -> PassResult:
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            METRICS.queue_waiting.inc()
            waiting = True
            try:
                async with self._slots:
                    METRICS.queue_waiting.dec()
                    waiting = False
                    watched = self._state is not None and self._state.bound
                    if watched and self._verified.get((namespace, name)) != METRICS.restart_count:
                        await self._verify(namespace, name)
                    view = self._state.view(namespace, name) if watched else None
                    started = time.monotonic()
                    try:
                        result = await asyncio.get_running_loop().run_in_executor(
                            self._pool, self._counted_pass, namespace, name, view)
                    except Exception:
                        METRICS.passes.labels("error").inc()
                        raise
                    finally:
                        took = time.monotonic() - started
                        METRICS.seconds.observe(took)
                        METRICS.last_seconds.labels(namespace, name).set(took)
            finally:
                if waiting:
                    METRICS.queue_waiting.dec()
        METRICS.passes.labels("skipped" if result.skipped else "ok").inc()
        METRICS.api_calls.observe(result.api_calls)
        METRICS.api_calls_total.inc(result.api_calls)
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

    async def _verify(self, namespace: str, name: str) -> None:
        """The first pass of a deployment, and the first after any watch restart: list its pods once, so
        pods deleted while a watch was down leave the view, and re-apply every child once, so a child
        deleted meanwhile comes back."""
        assert self._state is not None
        epoch = METRICS.restart_count
        listing = await asyncio.get_running_loop().run_in_executor(self._pool, self._list_pods, namespace, name)
        self._state.confirm(namespace, name, "Pod", listing)
        self._writer.forget(namespace, name)
        self._verified[(namespace, name)] = epoch

    def _list_pods(self, namespace: str, name: str) -> dict:
        listing = CoreV1Api(self._api).list_namespaced_pod(
            namespace, label_selector=f"{LABEL_DEPLOYMENT}={name}", _preload_content=False)
        return json.loads(listing.data)

    def _counted_pass(self, namespace: str, name: str, view: View | None) -> PassResult:
        before = self._calls.calls
        try:
            result = self._pass(namespace, name, view)
        finally:
            calls = self._calls.calls - before
        result.api_calls = calls
        return result

    def _secret_exists(self, namespace: str, name: str) -> bool:
        seen = self._secrets_seen.get((namespace, name))
        if seen is not None and time.monotonic() - seen < self._secret_recheck_s:
            return True
        if secret_exists(self._api, name, namespace):
            self._secrets_seen[(namespace, name)] = time.monotonic()
            return True
        self._secrets_seen.pop((namespace, name), None)
        return False

    def _read(self, namespace: str, name: str, view: View | None) -> dict | None:
        if view is not None:
            return view.body
        try:
            body = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(body.data)

    def _observe(self, owner: Owner, view: View | None, spec: PDDeploymentSpec) -> Snapshot:
        if view is None:
            snapshot = observe(self._api, owner)
        else:
            snapshot = snapshot_of(
                owner, view.of("Pod"), view.of("ControllerRevision"), deployments=view.of("Deployment"),
                secret_exists=self._secret_exists(owner.namespace, secret_name(owner.name)),
                router_secret_exists=self._secret_exists(owner.namespace, router_secret_name(owner.name)),
                worker_secret_exists=self._secret_exists(owner.namespace, worker_secret_name(owner.name)))
        grouped = grouped_roles(spec, snapshot)
        if not grouped:
            return snapshot
        return with_group_secrets(snapshot, owner, grouped, lambda n: self._secret_exists(owner.namespace, n))

    def _pass(self, namespace: str, name: str, view: View | None) -> PassResult:
        obj = self._read(namespace, name, view)
        if obj is None:
            return PassResult(skipped="gone")
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return PassResult(skipped="being deleted; children go by garbage collection")
        owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
        raw_status = obj.get("status") or {}
        old_status = _stored_status(raw_status)
        admission, matrix_version = self._admission(obj)
        try:
            spec = PDDeploymentSpec.model_validate(obj.get("spec") or {})
        except ValidationError as exc:
            msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            self._write_status(owner, raw_status, spec_unreadable_status(admission, msg, meta.get("generation", 0)))
            return PassResult(body=obj, skipped=f"spec unreadable: {msg}")
        # A Hub branch or tag: the commit recorded for it in status.model (resolved once), or resolved now.
        try:
            spec, model_record = resolve_model(spec, old_status.model,
                                               lambda model_id, ref: self._hub.commit_of(
                                                   model_id, ref, self._hub_token(namespace, spec)))
        except ModelRefError as exc:
            return self._unresolved(owner, obj, raw_status, old_status, admission, str(exc))
        # The count each role runs: the autoscaler's, a PDRoleScale's or the spec's (autoscale.replicas).
        declared, scales = spec, self._role_scales(owner, view)
        spec = with_replicas(spec, replicas_in_effect(spec, old_status, external_counts(declared, owner, scales)))
        snapshot = self._observe(owner, view, spec)
        problems = check_placement(spec, view.nodes if view is not None else observe_nodes(self._api))
        admission = with_placement(admission, problems, meta.get("generation", 0))
        if (why := missing_key_in_use(name, snapshot.secret_exists, pods_running(snapshot))) is not None:
            admission = with_degraded(admission, AUTH_SECRET_MISSING, why, meta.get("generation", 0))
        for role in sorted(grouped_roles(spec, snapshot) - snapshot.group_secrets):
            if running := group_pods_running(snapshot, role):
                admission = with_degraded(admission, AUTH_SECRET_MISSING, missing_group_key_in_use(name, role, running),
                                          meta.get("generation", 0))
        now = time.time()
        decisions = decide_rollouts(spec, snapshot, old_status.rollout, now)
        targets = rollout_targets(spec, snapshot, decisions)
        admission = with_rollout_failures(admission, decisions, spec, meta.get("generation", 0))
        admission = with_transfer_health(admission, snapshot.pods, now, meta.get("generation", 0))
        admission = with_silent_fallbacks(admission, snapshot.pods, meta.get("generation", 0))
        admission = with_mixed_generations(admission, snapshot.pods, snapshot.router, meta.get("generation", 0))
        actions = plan(owner, spec, snapshot, now=now, targets=targets, by_generation=self._router_generations)
        have = {(s.get("metadata") or {}).get("name") for s in scales}
        actions += [Action(ActionKind.CREATE, API_VERSION, RS_KIND, rolescale_name(name, role),
                           body=rolescale_body(owner, declared, role),
                           reason=f"{role.value} scalingAdapter: its count for an HPA or KEDA")
                    for role in adapter_roles(declared) if rolescale_name(name, role) not in have]
        if not _admitted(admission):
            # A stored spec the running matrix rejects: keep what runs, start nothing new.
            actions = [a for a in actions if a.kind is ActionKind.APPLY or a.object_kind == "Secret"]
        observed = None if view is None else {
            (kind, n): o for kind, objs in view.objects.items() for n, o in objs.items()}
        outcomes = self._writer.run(owner, actions, observed, done=lambda o: self._remember(owner, o))
        if any(o.action.object_kind == "Pod" and o.changed for o in outcomes):
            snapshot = (observe(self._api, owner) if view is None
                        else replace(snapshot, pods=_pods_after(owner, view, outcomes)))
        status = pass_status(
            spec, name, meta.get("generation", 0), snapshot.pods, old_status, admission, decisions,
            [a.reason for a in actions if a.kind is ActionKind.HOLD], datetime.now(UTC), namespace=owner.namespace,
            matrix_version=matrix_version,
        )
        status = status.model_copy(update={"model": model_record})
        if declared.autoscaling is None and old_status.autoscaling is not None:
            status = status.model_copy(update={"autoscaling": None})  # spec.autoscaling removed: clear its record
        conditions = status.conditions or []
        before = {c.type: c.status for c in old_status.conditions or ()}
        transitions = [(c.type.value, c.status.value, c.reason or "", c.message or "")
                       for c in conditions if before.get(c.type) is not c.status]
        rollout = status.rollout
        if rollout is not None and rollout.phase is not (old_status.rollout.phase if old_status.rollout else None):
            transitions.append(("Rollout", rollout.phase.value, f"Rollout{rollout.phase.value}", rollout.message or ""))
        for role, d in decisions.items():
            if d.failure:
                transitions.append((ConditionType.DEGRADED.value, "True", "RolloutFailed", f"{role.value}: {d.message}"))
        self._write_status(owner, raw_status, status)
        self._write_scales(owner, declared, scales, status)
        return PassResult(outcomes=outcomes, transitions=transitions, body=obj, conditions=conditions,
                          requeue_after=_earliest(next_wake(spec, snapshot, decisions, now),
                                                  broken_wake(snapshot.pods, now)))

    def _hub_token(self, namespace: str, spec: PDDeploymentSpec) -> str | None:
        """The Hub token of ``huggingFace.tokenSecret`` (key ``token``), read by name; None without one."""
        hub = spec.model.source.hugging_face if spec.model.source is not None else None
        if hub is None or hub.token_secret is None:
            return None
        try:
            secret = CoreV1Api(self._api).read_namespaced_secret(hub.token_secret, namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise ModelRefError(f"huggingFace.tokenSecret {hub.token_secret!r} does not exist in namespace "
                                    f"{namespace!r}: create it with the key {HF_TOKEN_KEY!r}") from None
            raise
        raw = (secret.data or {}).get(HF_TOKEN_KEY)
        if not raw:
            raise ModelRefError(f"huggingFace.tokenSecret {hub.token_secret!r} has no key {HF_TOKEN_KEY!r}")
        return base64.b64decode(raw).decode().strip()

    def _unresolved(self, owner: Owner, obj: dict, raw_status: dict, old_status: PDDeploymentStatus,
                    admission: list[Condition], why: str) -> PassResult:
        """A branch or tag that could not be resolved: nothing is rendered from it (pods would load whatever
        the branch holds), what runs keeps running, ``Degraded`` says why, and the pass comes back."""
        generation = obj["metadata"].get("generation", 0)
        conditions = with_degraded(admission, "ModelRevisionUnresolved", why, generation)
        status = old_status.model_copy(update={"conditions": conditions, "observed_generation": generation})
        self._write_status(owner, raw_status, status)
        before = {c.type: c.status for c in old_status.conditions or ()}
        transitions = [(c.type.value, c.status.value, c.reason or "", c.message or "")
                       for c in conditions if before.get(c.type) is not c.status]
        return PassResult(body=obj, transitions=transitions, conditions=conditions, skipped=why,
                          requeue_after=UNRESOLVED_RETRY_S)

    def _role_scales(self, owner: Owner, view: View | None) -> list[dict]:
        """The deployment's PDRoleScale objects: watched, or listed (a Reconciler without watched state);
        none where their CRD is not installed."""
        if view is not None:
            return view.of(RS_KIND)
        try:
            listing = self._custom.list_namespaced_custom_object(
                GROUP, VERSION, owner.namespace, RS_PLURAL, label_selector=f"{LABEL_DEPLOYMENT}={owner.name}",
                _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return []
            raise
        return list(json.loads(listing.data).get("items") or ())

    def _write_scales(self, owner: Owner, spec: PDDeploymentSpec, scales: list[dict],
                      status: PDDeploymentStatus) -> None:
        """Each PDRoleScale's status (the scale subresource's replicas and selector), when it changed."""
        counts = {role: ((s.replicas, s.ready) if s is not None else (0, 0))
                  for role, s in ((Role.PREFILL, status.prefill), (Role.DECODE, status.decode))}
        for body in scales:
            want = rolescale_status(spec, owner, body, counts)
            old = body.get("status") or {}
            if all(old.get(k) == v for k, v in want.items()):
                continue
            answer = self._writer.patch_status_of(API_VERSION, RS_KIND, owner.namespace, body["metadata"]["name"],
                                                  want)
            if self._state is not None:
                self._state.wrote(RS_KIND, owner.namespace, owner.name, answer)

    def _remember(self, owner: Owner, o: Outcome) -> None:
        """Overlay one write on the watched state; note a secret created."""
        if o.action.object_kind == "Secret" and o.action.kind is ActionKind.CREATE:
            self._secrets_seen[(owner.namespace, o.action.name)] = time.monotonic()
        if self._state is not None and o.response is not None:
            self._state.wrote(o.action.object_kind, owner.namespace, owner.name, o.response,
                              deleted=o.action.kind is ActionKind.DELETE)

    def _write_status(self, owner: Owner, old: dict, status: PDDeploymentStatus) -> None:
        """Patch the status only when it changed from the stored one (a pass with nothing new writes nothing)."""
        doc = status_document(status)
        if all(old.get(k) == v for k, v in doc.items()):
            return
        answer = self._writer.patch_status(owner.namespace, owner.name, doc)
        if self._state is not None:
            self._state.wrote("PDDeployment", owner.namespace, owner.name, answer)


def _pods_after(owner: Owner, view: View, outcomes: list[Outcome]) -> tuple:
    """The pods as the pass left them: the watched ones with the pass's own answers laid over."""
    pods = {p["metadata"]["name"]: p for p in view.of("Pod")}
    for o in outcomes:
        if o.action.object_kind == "Pod" and o.response is not None:
            pods[o.action.name] = o.response
    return snapshot_of(owner, pods.values(), (), secret_exists=True, router_secret_exists=True).pods


def _owner_of(body: dict) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("apiVersion", "").startswith(f"{GROUP}/") and ref.get("controller"):
            return ref.get("name")
    return None


# Every child kind the operator watches (the chart grants get/list/watch on each).
CHILD_KINDS = tuple((api_version, plural) for api_version, plural, _ in OWNED_KINDS)
ERROR_BACKOFF_MAX_S = 30.0


class Wakeups:
    """One event per PDDeployment, set by every event that concerns it, and the count of wake-ups
    since its last pass started (``queue_depth``): many events during a pass cost one more pass."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self._pending: dict[tuple[str, str], int] = {}

    def event(self, key: tuple[str, str]) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    def wake(self, key: tuple[str, str]) -> None:
        self.event(key).set()
        self._pending[key] = self._pending.get(key, 0) + 1
        METRICS.queue_depth.labels(*key).set(self._pending[key])

    def taken(self, key: tuple[str, str]) -> None:
        self.event(key).clear()
        self._pending[key] = 0
        METRICS.queue_depth.labels(*key).set(0)

    def forget(self, key: tuple[str, str]) -> None:
        self._events.pop(key, None)
        self._pending.pop(key, None)


def _index_child(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict:
    return {(namespace, labels.get(LABEL_DEPLOYMENT)): dict(body)}


def _index_deployment(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict:
    return {(namespace, name): dict(body)}


def _index_node(body: kopf.Body, **_: Any) -> dict:
    return {"nodes": node_facts(body)}


def register(registry: kopf.OperatorRegistry, reconciler_ref: Callable[[], Reconciler],
             resync_seconds: float = 10.0, kopf_settings: kopf.OperatorSettings | None = None,
             wakeups: Wakeups | None = None) -> Wakeups:
    """Register the reconcile handlers on ``registry``; ``reconciler_ref`` is set at startup.

    Indexes hold the watched state (``watched``); each PDDeployment gets a daemon that runs its
    passes: at once when an event wakes it, at the next time-based decision the last pass named (a
    drain deadline, a gate timeout), else every ``resync_seconds`` (drift a watch missed). Daemons run
    only while this replica is the active peer (kopf stops them when it pauses), and one deployment's
    pass never waits for another's except for a free slot (``Reconciler``'s bound). Returns the
    wake-ups, through which others (the autoscaler) ask for a pass."""
    wakeups = wakeups or Wakeups()

    for api_version, plural, _ in OWNED_KINDS:
        group, _, version = api_version.rpartition("/")
        kopf.index(group, version, plural, registry=registry, id=index_id(plural),
                   labels={LABEL_DEPLOYMENT: kopf.PRESENT})(_index_child)
        if kopf_settings is not None:  # the same filter on the server: the watch carries only ours
            kopf_settings.watching.label_selectors[f"{group}/{version}" if group else version, plural] = LABEL_DEPLOYMENT
    kopf.index(GROUP, VERSION, PLURAL, registry=registry, id=INDEX_PDDEPLOYMENTS)(_index_deployment)
    kopf.index("", "v1", "nodes", registry=registry, id=INDEX_NODES)(_index_node)

    async def on_spec(namespace: str, name: str, **_: Any) -> None:
        wakeups.wake((namespace, name))

    for cause in ("resume", "create", "update"):
        getattr(kopf.on, cause)(GROUP, VERSION, PLURAL, registry=registry, id=f"reconcile-{cause}")(on_spec)

    async def on_child(body: dict, namespace: str, **_: Any) -> None:
        owner = _owner_of(body)
        if owner is not None:
            wakeups.wake((namespace, owner))

    for api_version, plural, _ in OWNED_KINDS:
        group, _, version = api_version.rpartition("/")
        kopf.on.event(group=group, version=version, plural=plural, registry=registry, id=f"child-{plural}",
                      labels={LABEL_DEPLOYMENT: kopf.PRESENT})(on_child)

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, id="reconcile", cancellation_timeout=2.0)
    async def passes(namespace: str, name: str, logger: Any, stopped: kopf.DaemonStopped, **_: Any) -> None:
        key, delay, failures = (namespace, name), 0.0, 0
        event = wakeups.event(key)
        try:
            while not stopped:
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(event.wait(), timeout=delay)
                if stopped:
                    break
                wakeups.taken(key)
                try:
                    result = await reconciler_ref().reconcile(namespace, name, logger)
                except Exception as exc:  # the pass's typed failure or an API error: log, back off, retry
                    failures += 1
                    delay = min(ERROR_BACKOFF_MAX_S, 0.25 * 2 ** failures)
                    logger.warning(f"reconcile pass failed ({type(exc).__name__}: {exc}); retrying in {delay:.1f}s")
                    continue
                failures = 0
                delay = min(resync_seconds, result.requeue_after if result.requeue_after is not None else resync_seconds)
        finally:
            if stopped.reason is not None and stopped.reason & kopf.DaemonStoppingReason.RESOURCE_DELETED:
                wakeups.forget(key)
                reconciler_ref().forget(namespace, name)

    return wakeups
