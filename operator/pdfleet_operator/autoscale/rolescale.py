"""The PDRoleScale objects of a deployment, pure: which to create, which count each hands to the
reconcile, and the status each shows (``api.rolescale`` says what the object is for).

An object is in effect when the operator made it (owned by this deployment, named
``<deployment>-<role>``, for the role it says) and the role sets ``scalingAdapter`` while
``spec.autoscaling`` is unset (admission refuses both; if both exist anyway, the built-in autoscaler
keeps the role and the object's status says it is ignored).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pdfleet_operator.api.constants import API_VERSION, Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.rolescale import RS_KIND, PDRoleScaleSpec, rolescale_name
from pdfleet_operator.observed import Owner
from pdfleet_operator.resources.names import owner_labels, role_selector

__all__ = ["adapter_roles", "external_counts", "in_effect", "rolescale_body", "rolescale_status"]


def adapter_roles(spec: PDDeploymentSpec) -> list[Role]:
    """Roles whose count comes from a PDRoleScale (none while spec.autoscaling is set)."""
    if spec.autoscaling is not None:
        return []
    return [r for r, rs in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode)) if rs.scaling_adapter]


def in_effect(spec: PDDeploymentSpec, owner: Owner, body: Mapping[str, Any]) -> tuple[Role | None, str]:
    """(the role this object drives, or None; why)."""
    meta = body.get("metadata") or {}
    try:
        s = PDRoleScaleSpec.model_validate(body.get("spec") or {})
    except ValueError as exc:
        return None, f"its spec does not parse: {exc}"
    if not any(ref.get("uid") == owner.uid for ref in meta.get("ownerReferences") or ()):
        return None, f"not made by the operator for PDDeployment {owner.name}: it drives nothing"
    if s.deployment != owner.name or meta.get("name") != rolescale_name(owner.name, s.role):
        return None, f"names {s.deployment}/{s.role.value}, not this object's role: it drives nothing"
    if spec.autoscaling is not None:
        return None, "spec.autoscaling is set: the built-in autoscaler drives the role, this object is ignored"
    if s.role not in adapter_roles(spec):
        return None, f"spec.{s.role.value}.scalingAdapter is false: the spec's replicas drive the role"
    return s.role, f"in effect: the {s.role.value} role runs spec.replicas of this object"


def external_counts(spec: PDDeploymentSpec, owner: Owner, bodies: Iterable[Mapping[str, Any]]) -> dict[Role, int]:
    """Each role's count from the object in effect for it."""
    out = {}
    for b in bodies:
        role, _ = in_effect(spec, owner, b)
        if role is not None:
            out[role] = int((b.get("spec") or {}).get("replicas", 0))
    return out


def rolescale_body(owner: Owner, spec: PDDeploymentSpec, role: Role) -> dict[str, Any]:
    """The object the operator creates once for a role with ``scalingAdapter``, starting from the spec's
    count (created only when missing: from then on its spec.replicas belongs to the outside autoscaler)."""
    rs = spec.prefill if role is Role.PREFILL else spec.decode
    return {
        "apiVersion": API_VERSION,
        "kind": RS_KIND,
        "metadata": {"name": rolescale_name(owner.name, role), "namespace": owner.namespace,
                     "labels": owner_labels(owner.name), "ownerReferences": [owner.reference()]},
        "spec": {"deployment": owner.name, "role": role.value, "replicas": rs.replicas},
    }


def rolescale_status(spec: PDDeploymentSpec, owner: Owner, body: Mapping[str, Any],
                     counts: Mapping[Role, tuple[int, int]]) -> dict[str, Any]:
    """The status the object should show, from each role's (live, ready) replicas: the scale subresource
    reads ``replicas`` and ``selector``."""
    role, why = in_effect(spec, owner, body)
    raw = (body.get("spec") or {}).get("role")
    target = Role(raw) if raw in {r.value for r in Role} else None
    live, ready = counts.get(target, (0, 0)) if target is not None else (0, 0)
    out: dict[str, Any] = {"replicas": live, "ready": ready, "inEffect": role is not None, "message": why}
    if target is not None:
        out["selector"] = ",".join(f"{k}={v}" for k, v in role_selector(owner.name, target).items())
    return out
