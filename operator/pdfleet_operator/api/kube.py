"""The few Kubernetes core types a PDDeployment embeds, kept small and structural.

``affinity`` and ``env[].valueFrom`` are passed through to the pod template untouched
(``x-kubernetes-preserve-unknown-fields``): the apiserver validates them when it creates the pods,
and copying their full schemas here would only drift from upstream.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

__all__ = [
    "PRESERVE",
    "QUANTITY_PATTERN",
    "ApiModel",
    "EnvVar",
    "Quantity",
    "ResourceRequirements",
    "Toleration",
]

# resource.Quantity's pattern, as controller-gen emits it.
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
Quantity = int | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=64)]
PRESERVE: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}


class ApiModel(BaseModel):
    """camelCase on the wire, unknown fields refused (as `kubectl apply`'s strict field validation does)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(ApiModel):
    """A core/v1 Toleration, copied to the role's pods."""

    key: str | None = Field(
        None, max_length=317, description="Taint key; empty with operator Exists matches all."
    )
    operator: TolerationOperator | None = Field(None, description="Exists or Equal (the default).")
    value: str | None = Field(None, max_length=63, description="Taint value to match with operator Equal.")
    effect: TaintEffect | None = Field(None, description="Taint effect to match; empty matches all effects.")
    toleration_seconds: int | None = Field(
        None, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class EnvVar(ApiModel):
    """A core/v1 EnvVar added to the role's runtime container."""

    name: str = Field(min_length=1, max_length=253, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        None,
        description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...), passed through.",
        json_schema_extra=PRESERVE,
    )


class ResourceRequirements(ApiModel):
    """core/v1 ResourceRequirements of the runtime container; GPUs are added from the parallelism."""

    limits: dict[str, Quantity] | None = Field(
        None,
        description="Maximum resources, e.g. {cpu: 16, memory: 200Gi}. nvidia.com/gpu is set by the operator.",
    )
    requests: dict[str, Quantity] | None = Field(
        None, description="Requested resources; default to the limits where omitted."
    )
