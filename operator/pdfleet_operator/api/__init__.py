"""The PDDeployment API (pdfleet.io/v1alpha1): models, names, CEL rules and the CRD generator.

Reading order: ``constants`` (group, kind, labels, condition types) -> ``models`` (spec and status,
the source of truth) -> ``rules`` (CEL rules with their Python twins) -> ``schema`` (pydantic JSON
schema -> structural schema) -> ``crd`` (the CustomResourceDefinition; ``python -m
pdfleet_operator.api.crd --write`` regenerates ``crds/``).
"""

from pdfleet_operator.api.constants import (
    API_VERSION,
    CRD_NAME,
    GROUP,
    KIND,
    LABEL_DEPLOYMENT,
    LABEL_REVISION,
    LABEL_ROLE,
    PLURAL,
    SHORT_NAMES,
    VERSION,
    ConditionStatus,
    ConditionType,
    Role,
    RolloutPhase,
)
from pdfleet_operator.api.models import (
    Condition,
    ModelSpec,
    Parallelism,
    PDDeployment,
    PDDeploymentSpec,
    PDDeploymentStatus,
    PoolSpec,
    RoleSpec,
    RoleStatus,
    RolloutSpec,
    RolloutStatus,
    TransferSpec,
    shapes_text,
)

__all__ = [
    "API_VERSION",
    "CRD_NAME",
    "GROUP",
    "KIND",
    "LABEL_DEPLOYMENT",
    "LABEL_REVISION",
    "LABEL_ROLE",
    "PLURAL",
    "SHORT_NAMES",
    "VERSION",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "ModelSpec",
    "PDDeployment",
    "PDDeploymentSpec",
    "PDDeploymentStatus",
    "Parallelism",
    "PoolSpec",
    "Role",
    "RoleSpec",
    "RoleStatus",
    "RolloutPhase",
    "RolloutSpec",
    "RolloutStatus",
    "TransferSpec",
    "shapes_text",
]
