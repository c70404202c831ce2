"""Revision hashes: which pods are up to date with a role's spec.

A role's revision covers every spec field that ends up in its pods or its runtime config,
including the shared model and transfer settings and the other role's shape (the runtime
plans with both). Replicas, the scaling adapter and rollout settings are excluded: scaling is not a new
revision. ``spec.scheduling`` counts only where it changes the role's pods (a gang's labels and Kueue's
gate are set at creation; a topology key only on a multi-node role's groups), and only when not the default,
so every earlier revision keeps its hash.
"""

from __future__ import annotations

import hashlib
import json

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_runtime.versions import release_of

__all__ = ["compat_key", "role_revision"]

REVISION_LEN = 10


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
    }
    if spec.engine is not None:  # absent (the built-in runtime) keeps every earlier revision's hash
        material["engine"] = spec.engine.model_dump(mode="json", by_alias=True, exclude_none=True)
    scheduling = spec.scheduling.model_dump(mode="json", by_alias=True, exclude_none=True,
                                            exclude=None if mine.parallelism.nodes_per_replica > 1 else {"topology_key"})
    if scheduling != {"gang": "none"}:  # the default keeps every earlier revision's hash
        material["scheduling"] = scheduling
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_LEN]


def compat_key(spec: PDDeploymentSpec, role: Role) -> str:
    """Which pods may pair: protocol major version, layout (dtype, page size, state), backend and
    both roles' TP/PP. A decode revision rolls out only once a ready prefill shares its key."""
    mine = spec.prefill if role is Role.PREFILL else spec.decode
    release = release_of(mine.runtime_version)
    material = {
        "wire": release.wire.major if release else mine.runtime_version,
        "layout": spec.model.layout.model_dump(mode="json", by_alias=True, exclude_none=True),
        "backend": spec.transfer.backend.value,
        "prefill": spec.prefill.parallelism.model_dump(mode="json", by_alias=True),
        "decode": spec.decode.parallelism.model_dump(mode="json", by_alias=True),
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_LEN]
