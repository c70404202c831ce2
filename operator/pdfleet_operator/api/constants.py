"""Names of the PDDeployment API: group, version, kind, labels, condition types.

One place, so the CRD generator, the operator, the webhook and the tests cannot drift apart.
"""

from __future__ import annotations

from enum import StrEnum

from pdfleet_runtime.roles import Role

__all__ = [
    "API_VERSION",
    "CATEGORIES",
    "CRD_NAME",
    "GROUP",
    "KIND",
    "LABEL_DEPLOYMENT",
    "LABEL_REVISION",
    "LABEL_ROLE",
    "LIST_KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "ConditionStatus",
    "ConditionType",
    "Role",
    "RolloutPhase",
]

GROUP = "pdfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PDDeployment"
LIST_KIND = "PDDeploymentList"
PLURAL = "pddeployments"
SINGULAR = "pddeployment"
SHORT_NAMES = ("pdd",)
CATEGORIES = ("pdfleet",)
CRD_NAME = f"{PLURAL}.{GROUP}"

LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ROLE = f"{GROUP}/role"
LABEL_REVISION = f"{GROUP}/revision"


class ConditionType(StrEnum):
    ADMITTED = "Admitted"  # the spec passed the schema, CEL and the capability matrix
    PROGRESSING = "Progressing"  # a rollout or scale is under way
    AVAILABLE = "Available"  # enough pods of both roles passed the transfer-path gate
    DEGRADED = "Degraded"  # e.g. the running matrix now rejects the stored spec


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class RolloutPhase(StrEnum):
    IDLE = "Idle"
    PROGRESSING = "Progressing"
    CANARY_HOLD = "CanaryHold"
    PAUSED = "Paused"
    ROLLING_BACK = "RollingBack"
    FAILED = "Failed"
    COMPLETE = "Complete"
