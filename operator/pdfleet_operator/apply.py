"""Apply: the only module that writes a PDDeployment's children and status.

Server-side apply (field manager ``pdfleet-operator``, conflicts forced) for every non-pod
child, skipped when neither the desired body nor the watched object changed since this writer's
last apply of it (so an edited or deleted child is still restored on the pass its event wakes, and
an unchanged one costs no call); create-if-missing for pods and the secret (AlreadyExists is success, which makes a
retried or restarted pass idempotent); merge patches for pod labels and the status
subresource; deletes that treat NotFound as done. Synchronous (the kubernetes client is);
handlers run it in a thread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from pdfleet_operator.api.constants import API_VERSION, KIND
from pdfleet_operator.observed import Owner
from pdfleet_operator.plan import Action, ActionKind

__all__ = ["FIELD_MANAGER", "Outcome", "Writer", "fingerprint"]

FIELD_MANAGER = "pdfleet-operator"


@dataclass(frozen=True)
class Outcome:
    action: Action
    changed: bool  # False when the server already had it (AlreadyExists, NotFound on delete, an unchanged apply)
    response: dict | None = None  # the object the server answered with (its new resourceVersion)


def fingerprint(obj: Mapping | None) -> str:
    """What of an object an apply can change: everything but status and server-kept metadata."""
    if obj is None:
        return ""
    meta = obj.get("metadata") or {}
    kept = {k: meta.get(k) for k in ("labels", "annotations", "ownerReferences", "deletionTimestamp")}
    rest = {k: v for k, v in obj.items() if k not in ("metadata", "status")}
    return hashlib.sha256(json.dumps([kept, rest], sort_keys=True, default=str).encode()).hexdigest()


def _digest(body: Mapping | None) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


class Writer:
    """Wraps one dynamic client; resources are discovered once and cached.

    The dynamic client (whose constructor reads discovery) is made at first use, in a pass's worker
    thread, so building a Writer at operator start makes no API call that could block the loop."""

    def __init__(self, api: ApiClient) -> None:
        self._api = api
        self._dyn_client: DynamicClient | None = None
        self._resources: dict[tuple[str, str], object] = {}
        # (namespace, kind, name) -> (digest of the body applied, fingerprint of the server's answer)
        self._applied: dict[tuple[str, str, str], tuple[str, str]] = {}

    @property
    def _dyn(self) -> DynamicClient:
        if self._dyn_client is None:
            self._dyn_client = DynamicClient(self._api)
        return self._dyn_client

    def _resource(self, api_version: str, kind: str):
        key = (api_version, kind)
        if key not in self._resources:
            self._resources[key] = self._dyn.resources.get(api_version=api_version, kind=kind)
        return self._resources[key]

    def run(self, owner: Owner, actions: list[Action],
            observed: Mapping[tuple[str, str], Mapping] | None = None,
            done: Callable[[Outcome], None] | None = None) -> list[Outcome]:
        """Perform ``actions`` in order. ``observed``: the watched children by (kind, name); with it, an
        apply whose body and watched object are as this writer last left them is skipped. ``done`` hears
        each outcome as it happens, so writes made before a later one fails are known all the same."""
        outcomes = []
        for a in actions:
            outcomes.append(self.one(owner.namespace, a, observed))
            if done is not None:
                done(outcomes[-1])
        return outcomes

    def one(self, namespace: str, action: Action,
            observed: Mapping[tuple[str, str], Mapping] | None = None) -> Outcome:
        if action.kind is ActionKind.HOLD:
            return Outcome(action, changed=False)
        try:
            res = self._resource(action.api_version, action.object_kind)
        except ResourceNotFoundError:
            if action.kind is ActionKind.DELETE:  # a kind the cluster does not serve (Kueue uninstalled): none left
                return Outcome(action, changed=False)
            raise
        if action.kind is ActionKind.APPLY:
            key, digest = (namespace, action.object_kind, action.name), _digest(action.body)
            if observed is not None and self._applied.get(key) == (
                    digest, fingerprint(observed.get((action.object_kind, action.name)))):
                return Outcome(action, changed=False)
            answer = self._dyn.server_side_apply(
                res, body=action.body, name=action.name, namespace=namespace,
                field_manager=FIELD_MANAGER, force_conflicts=True,
            ).to_dict()
            self._applied[key] = (digest, fingerprint(answer))
            return Outcome(action, changed=True, response=answer)
        if action.kind is ActionKind.CREATE:
            try:
                answer = self._dyn.create(res, body=action.body, namespace=namespace, field_manager=FIELD_MANAGER)
            except ApiException as exc:
                if exc.status == 409:
                    return Outcome(action, changed=False)
                raise
            return Outcome(action, changed=True, response=answer.to_dict())
        if action.kind in (ActionKind.PATCH_LABELS, ActionKind.PATCH_META):
            meta = {"labels": action.body} if action.kind is ActionKind.PATCH_LABELS else action.body
            answer = self._dyn.patch(
                res, body={"metadata": meta}, name=action.name, namespace=namespace,
                content_type="application/merge-patch+json", field_manager=FIELD_MANAGER,
            )
            return Outcome(action, changed=True, response=answer.to_dict())
        if action.kind is ActionKind.DELETE:
            try:
                answer = self._dyn.delete(res, name=action.name, namespace=namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return Outcome(action, changed=False)
                raise
            body = answer.to_dict() if hasattr(answer, "to_dict") else None
            if (body or {}).get("kind") != action.object_kind:
                return Outcome(action, changed=True)  # a Status, not the object: nothing to overlay
            meta = body.setdefault("metadata", {})
            # Gone at once (no grace period) answers the last state without the stamp: it is going all the same.
            meta["deletionTimestamp"] = meta.get("deletionTimestamp") or datetime.now(UTC).isoformat().replace("+00:00", "Z")
            return Outcome(action, changed=True, response=body)
        raise ValueError(f"unknown action kind {action.kind}")

    def forget(self, namespace: str, deployment: str) -> None:
        """Drop the apply memory of a deleted deployment's children (named ``<deployment>-...``)."""
        for key in [k for k in self._applied if k[0] == namespace and k[2].startswith(f"{deployment}-")]:
            del self._applied[key]

    def patch_status_of(self, api_version: str, kind: str, namespace: str, name: str, status: dict) -> dict:
        """Merge-patch another kind's status subresource (a PDRoleScale's); the object after."""
        res = self._resource(api_version, kind)
        return self._dyn.patch(
            res.subresources["status"], body={"status": status}, name=name, namespace=namespace,
            content_type="application/merge-patch+json", field_manager=FIELD_MANAGER,
        ).to_dict()

    def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        """Merge-patch the status subresource (conditions are replaced as a whole list); the object after."""
        res = self._resource(API_VERSION, KIND)
        return self._dyn.patch(
            res.subresources["status"], body={"status": status}, name=name, namespace=namespace,
            content_type="application/merge-patch+json", field_manager=FIELD_MANAGER,
        ).to_dict()
