"""Revision hashes: which pods are up to date with a role's spec and with this operator's rendering.

A role's revision covers every spec field that ends up in its pods or its runtime config, including the
shared model and transfer settings and the other role's shape (the runtime plans with both), and a digest
of what this operator renders from them (``rendering_digest``): an operator upgrade that changes a rendered
pod (a flag, an env var, a probe) gives every fleet a new revision, so an ordinary rollout moves its pods
(surge, drains, canary, rollback), and an upgrade that renders the same pods changes nothing. Replicas, the
scaling adapter and rollout settings are excluded: scaling is not a new revision. ``spec.scheduling``
counts only where it changes the role's pods (a gang's labels and Kueue's gate are set at creation; a topology
key only on a multi-node role's groups), and only when not the default.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.runtime_config import runtime_configmap

__all__ = ["REVISION_LEN", "rendering_digest", "role_revision"]

REVISION_LEN = 10
# Stand-ins for what differs between deployments and pods but not between renderings: the digest is the same
# for every name, namespace, revision and replica index.
_NAME, _NAMESPACE, _REVISION, _INDEX = "pdd", "ns", "0" * REVISION_LEN, 0


def rendering_digest(spec: PDDeploymentSpec, role: Role) -> str:
    """A digest of the pods and runtime config this operator renders for ``role`` of ``spec`` (every member
    of a replica group), under stand-in names: it changes when the operator's rendering does. The router is
    left out, as from the revision: adding or removing one does not restart the engines (the runtime config's
    router drop timing then differs between pods started before and after; docs/router.md)."""
    return _digest(spec.model_dump_json(by_alias=True, exclude_none=True, exclude={"router"}), role)


@lru_cache(maxsize=512)
def _digest(spec_json: str, role: Role) -> str:
    spec = PDDeploymentSpec.model_validate_json(spec_json)
    mine = spec.prefill if role is Role.PREFILL else spec.decode
    rendered = [runtime_pod(_NAME, _NAMESPACE, spec, role, _REVISION, _INDEX, member)
                for member in range(mine.parallelism.nodes_per_replica)]
    rendered.append(runtime_configmap(_NAME, _NAMESPACE, spec, role, _REVISION))
    text = json.dumps(rendered, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def role_revision(spec: PDDeploymentSpec, role: Role) -> str:
    mine = spec.prefill if role is Role.PREFILL else spec.decode
    other = spec.decode if role is Role.PREFILL else spec.prefill
    material = {
        "role": role.value,
        "model": spec.model.model_dump(mode="json", by_alias=True, exclude_none=True),
        "transfer": spec.transfer.model_dump(mode="json", by_alias=True, exclude_none=True),
        "self": mine.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"replicas", "scaling_adapter"}),
        "peerShape": other.parallelism.model_dump(mode="json", by_alias=True),
        "drain": spec.rollout.drain_timeout_seconds,
        "rendering": rendering_digest(spec, role),
    }
    if spec.engine is not None:  # absent (the built-in runtime) keeps every earlier revision's hash
        material["engine"] = spec.engine.model_dump(mode="json", by_alias=True, exclude_none=True)
    scheduling = spec.scheduling.model_dump(mode="json", by_alias=True, exclude_none=True,
                                            exclude=None if mine.parallelism.nodes_per_replica > 1 else {"topology_key"})
    if scheduling != {"gang": "none"}:  # the default keeps every earlier revision's hash
        material["scheduling"] = scheduling
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_LEN]
