"""Which replica count a role runs, and whether a rollout holds the autoscaler (pure).

One count per role reaches the reconcile, from exactly one owner:

* ``spec.autoscaling`` set: the autoscaler's latest ``status.autoscaling.<role>.desired`` (clamped to
  the role's bounds, so a bound the user moves takes effect at the next pass), or
  ``spec.<role>.replicas`` before its first decision;
* a ``PDRoleScale`` for the role (an HPA or KEDA drives its scale subresource): its
  ``spec.replicas``; admission refuses it together with ``spec.autoscaling``, and if both exist
  anyway (a webhook down) the autoscaler keeps the role and the object is reported as ignored;
* otherwise ``spec.<role>.replicas``.

The reconcile then plans with that count exactly as with a spec edit: growth creates pods, a lower
count drains the surplus (``rollout.plan_steps``), so a pod leaves only once it holds no room or
transfer (or its drain deadline passed). Replicas are not part of a revision, so this is never a
rollout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec, PDDeploymentStatus
from pdfleet_operator.observed import ObservedPod
from pdfleet_operator.resources.revision import role_revision

__all__ = ["replicas_in_effect", "rollout_in_progress", "with_replicas"]


def replicas_in_effect(spec: PDDeploymentSpec, status: PDDeploymentStatus | None,
                       external: Mapping[Role, int] | None = None) -> dict[Role, int]:
    """Each role's count and its owner (module docstring)."""
    out = {Role.PREFILL: spec.prefill.replicas, Role.DECODE: spec.decode.replicas}
    a = spec.autoscaling
    if a is None:
        for role, n in (external or {}).items():
            out[role] = n
        return out
    decided = status.autoscaling if status is not None else None
    for role, bounds, s in ((Role.PREFILL, a.prefill, decided.prefill if decided else None),
                            (Role.DECODE, a.decode, decided.decode if decided else None)):
        n = s.desired if s is not None else out[role]
        out[role] = min(max(n, bounds.min_replicas), bounds.max_replicas)
    return out


def with_replicas(spec: PDDeploymentSpec, counts: Mapping[Role, int]) -> PDDeploymentSpec:
    """The spec the reconcile plans with: each role's replicas replaced by its count in effect."""
    if counts.get(Role.PREFILL, spec.prefill.replicas) == spec.prefill.replicas and \
            counts.get(Role.DECODE, spec.decode.replicas) == spec.decode.replicas:
        return spec
    return spec.model_copy(update={
        "prefill": spec.prefill.model_copy(update={"replicas": counts.get(Role.PREFILL, spec.prefill.replicas)}),
        "decode": spec.decode.model_copy(update={"replicas": counts.get(Role.DECODE, spec.decode.replicas)}),
    })


def rollout_in_progress(spec: PDDeploymentSpec, pods: Iterable[ObservedPod]) -> str | None:
    """Why a rollout is in progress (a pod of another revision than its role's is still there, draining
    ones included), or None."""
    stale: dict[Role, int] = {}
    for p in pods:
        if not p.deleting and p.revision != role_revision(spec, p.role):
            stale[p.role] = stale.get(p.role, 0) + 1
    if not stale:
        return None
    return "a rollout is in progress (" + ", ".join(
        f"{n} {role.value} pod{'s' if n > 1 else ''} of an older revision" for role, n in sorted(stale.items())) + ")"
