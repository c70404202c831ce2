"""``PDRoleScale``: one role's replica count as an object of its own, for an HPA or KEDA.

A CRD has one scale subresource (the PDDeployment's maps to decode), so a role an outside
autoscaler drives gets an object per role, as RBG's scaling adapter and Dynamo's per-service adapter
do. The operator creates it (``<deployment>-<role>``, owned by the deployment, so it goes with it)
when ``spec.<role>.scalingAdapter`` is true, starting from ``spec.<role>.replicas``, and from then on
reads the role's count from its ``spec.replicas`` (which ``/scale`` writes); it writes
``status.replicas`` (the role's live replicas) and ``status.selector`` (its pods' label selector,
which an HPA reads to find the pods). Removing a replica goes through the drain path as any other
lower count does.

Double control is refused at admission: ``spec.autoscaling`` (the built-in autoscaler, both roles)
and ``scalingAdapter`` on a role cannot both be set (CEL rule ``autoscaling-double-control``, checked
by ``pdfleet validate`` too). A PDRoleScale the operator did not make for a role with the adapter
(created by hand, or left from before the flag was cleared) drives nothing; the operator says so in
its status.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import Field

from pdfleet_operator.api.constants import CATEGORIES, GROUP, VERSION, Role
from pdfleet_operator.api.kube import ApiModel
from pdfleet_operator.api.schema import to_structural

__all__ = [
    "ROLESCALE_CRD_NAME",
    "RS_KIND",
    "RS_PLURAL",
    "PDRoleScaleSpec",
    "PDRoleScaleStatus",
    "build_rolescale_crd",
    "rolescale_name",
]

RS_KIND = "PDRoleScale"
RS_LIST_KIND = "PDRoleScaleList"
RS_PLURAL = "pdrolescales"
RS_SINGULAR = "pdrolescale"
RS_SHORT_NAMES = ("pdrs",)
ROLESCALE_CRD_NAME = f"{RS_PLURAL}.{GROUP}"


def rolescale_name(deployment: str, role: Role) -> str:
    return f"{deployment}-{role.value}"


class PDRoleScaleSpec(ApiModel):
    """Which role of which PDDeployment, and its count."""

    deployment: str = Field(min_length=1, max_length=253, description="The PDDeployment (same namespace).")
    role: Role = Field(description="prefill or decode.")
    replicas: int = Field(ge=0, le=4096, description="The role's replica count (the scale subresource's "
                          "spec.replicas: an HPA or KEDA writes it). A lower count drains the surplus.")


class PDRoleScaleStatus(ApiModel):
    """What the operator observed (the scale subresource's status)."""

    replicas: int = Field(0, ge=0, description="The role's live replicas (all revisions, draining excluded).")
    ready: int = Field(0, ge=0, description="The role's ready replicas.")
    selector: str | None = Field(None, description="Label selector of the role's pods (an HPA reads the "
                                 "pods' metrics through it).")
    in_effect: bool = Field(False, description="Whether the operator takes the role's count from this object.")
    message: str | None = Field(None, max_length=4096, description="Why it is or is not in effect.")


_PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Deployment", "type": "string", "jsonPath": ".spec.deployment"},
    {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Current", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "In-Effect", "type": "boolean", "jsonPath": ".status.inEffect"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


@cache
def _schema() -> dict[str, Any]:
    spec = to_structural(PDRoleScaleSpec.model_json_schema(by_alias=True))
    spec["x-kubernetes-validations"] = [{
        "rule": "self.deployment == oldSelf.deployment && self.role == oldSelf.role",
        "message": "rolescale-immutable: spec.deployment and spec.role cannot change (make a new object)",
        "reason": "FieldValueInvalid",
    }]
    return {
        "type": "object",
        "description": "PDRoleScale is one role's replica count of a PDDeployment, with a scale subresource for "
        "an HPA or KEDA (docs/autoscaling.md).",
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object: pdfleet.io/v1alpha1."},
            "kind": {"type": "string", "description": "Kind of this object: PDRoleScale."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": to_structural(PDRoleScaleStatus.model_json_schema(by_alias=True)),
        },
        "required": ["spec"],
    }


def build_rolescale_crd() -> dict[str, Any]:
    import copy

    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": ROLESCALE_CRD_NAME, "labels": {"app.kubernetes.io/part-of": "pdfleet"}},
        "spec": {
            "group": GROUP,
            "names": {"kind": RS_KIND, "listKind": RS_LIST_KIND, "plural": RS_PLURAL, "singular": RS_SINGULAR,
                      "shortNames": list(RS_SHORT_NAMES), "categories": list(CATEGORIES)},
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": copy.deepcopy(_schema())},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": [dict(c) for c in _PRINTER_COLUMNS],
            }],
        },
    }
