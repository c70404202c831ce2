"""ControllerRevisions: the spec of every revision a role has run, kept in the cluster.

A rollback must build pods of the last good revision after the user's spec moved on (and the
user's spec is never edited), so each (role, revision) is stored once, as apps/v1
ControllerRevision owned by the PDDeployment, holding the whole spec it came from. Created once
(its data is immutable) and garbage-collected with the deployment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import ValidationError

from pdfleet_operator.api.constants import LABEL_REVISION, LABEL_ROLE, Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.names import _fit, owner_labels

__all__ = ["controller_revision", "parse_revisions", "revision_object_name"]


def revision_object_name(deployment: str, role: Role, revision: str) -> str:
    return _fit(f"{deployment}-{role.value}-{revision}", 253)


def controller_revision(name: str, namespace: str, role: Role, revision: str, spec: PDDeploymentSpec,
                        number: int) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": {
            "name": revision_object_name(name, role, revision),
            "namespace": namespace,
            "labels": {**owner_labels(name), LABEL_ROLE: role.value, LABEL_REVISION: revision},
        },
        "data": {"spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True)},
        "revision": number,
    }


def parse_revisions(items: Iterable[Mapping]) -> dict[tuple[Role, str], PDDeploymentSpec]:
    """Stored revisions by (role, revision); unreadable ones are skipped (they cannot be rebuilt)."""
    out: dict[tuple[Role, str], PDDeploymentSpec] = {}
    for item in items:
        labels = (item.get("metadata") or {}).get("labels") or {}
        try:
            role = Role(labels.get(LABEL_ROLE, ""))
            spec = PDDeploymentSpec.model_validate((item.get("data") or {}).get("spec") or {})
        except (ValueError, ValidationError):
            continue
        out[(role, str(labels.get(LABEL_REVISION)))] = spec
    return out
