"""Apply: the only module that writes a PDDeployment's children and status.

Server-side apply (field manager ``pdfleet-operator``, conflicts forced) for every non-pod
child; create-if-missing for pods and the secret (AlreadyExists is success, which makes a
retried or restarted pass idempotent); merge patches for pod labels and the status
subresource; deletes that treat NotFound as done. Synchronous (the kubernetes client is);
handlers run it in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from pdfleet_operator.api.constants import API_VERSION, KIND
from pdfleet_operator.plan import Action, ActionKind, Owner

__all__ = ["FIELD_MANAGER", "Outcome", "Writer"]

FIELD_MANAGER = "pdfleet-operator"


@dataclass(frozen=True)
class Outcome:
    action: Action
    changed: bool  # False when the server already had it (AlreadyExists, NotFound on delete)


class Writer:
    """Wraps one dynamic client; resources are discovered once and cached.

    The dynamic client (whose constructor reads discovery) is made at first use, in a pass's worker
    thread, so building a Writer at operator start makes no API call that could block the loop."""

    def __init__(self, api: ApiClient) -> None:
        self._api = api
        self._dyn_client: DynamicClient | None = None
        self._resources: dict[tuple[str, str], object] = {}

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

    def run(self, owner: Owner, actions: list[Action]) -> list[Outcome]:
        return [self.one(owner.namespace, a) for a in actions]

    def one(self, namespace: str, action: Action) -> Outcome:
        if action.kind is ActionKind.HOLD:
            return Outcome(action, changed=False)
        res = self._resource(action.api_version, action.object_kind)
        if action.kind is ActionKind.APPLY:
            self._dyn.server_side_apply(
                res, body=action.body, name=action.name, namespace=namespace,
                field_manager=FIELD_MANAGER, force_conflicts=True,
            )
            return Outcome(action, changed=True)
        if action.kind is ActionKind.CREATE:
            try:
                self._dyn.create(res, body=action.body, namespace=namespace, field_manager=FIELD_MANAGER)
            except ApiException as exc:
                if exc.status == 409:
                    return Outcome(action, changed=False)
                raise
            return Outcome(action, changed=True)
        if action.kind is ActionKind.PATCH_LABELS:
            self._dyn.patch(
                res, body={"metadata": {"labels": action.body}}, name=action.name, namespace=namespace,
                content_type="application/merge-patch+json", field_manager=FIELD_MANAGER,
            )
            return Outcome(action, changed=True)
        if action.kind is ActionKind.PATCH_META:
            self._dyn.patch(
                res, body={"metadata": action.body}, name=action.name, namespace=namespace,
                content_type="application/merge-patch+json", field_manager=FIELD_MANAGER,
            )
            return Outcome(action, changed=True)
        if action.kind is ActionKind.DELETE:
            try:
                self._dyn.delete(res, name=action.name, namespace=namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return Outcome(action, changed=False)
                raise
            return Outcome(action, changed=True)
        raise ValueError(f"unknown action kind {action.kind}")

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        """Merge-patch the status subresource (conditions are replaced as a whole list)."""
        res = self._resource(API_VERSION, KIND)
        self._dyn.patch(
            res.subresources["status"], body={"status": status}, name=name, namespace=namespace,
            content_type="application/merge-patch+json", field_manager=FIELD_MANAGER,
        )
