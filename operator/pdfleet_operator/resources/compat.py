"""The compatibility key: which pods may pair.

Kept apart from the revision (``resources.revision``), which hashes what the operator renders: the rendered
pod carries this key as a label, so the key must not depend on the rendering.
"""

from __future__ import annotations

import hashlib
import json

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_runtime.versions import release_of

__all__ = ["KEY_LEN", "compat_key", "model_identity"]

KEY_LEN = 10


def model_identity(spec: PDDeploymentSpec) -> str:
    """The model every pod of the fleet must serve: ``hf:ORG/NAME@COMMIT`` (huggingFace.revision) or
    ``dir:sha256:...`` (source.digest); '' when not pinned. The built-in runtime's prefill and decode compare it
    at their handshake (``RuntimeConfig.model_identity``), so pods of two generations never pair."""
    src = spec.model.source
    if src is None:
        return ""
    hub = src.hugging_face
    if hub is not None and hub.revision is not None:
        return f"hf:{hub.id}@{hub.revision}"
    return f"dir:{src.digest}" if src.digest is not None else ""


def compat_key(spec: PDDeploymentSpec, role: Role) -> str:
    """Which pods may pair: protocol major version, layout (dtype, page size, state), backend, both roles'
    TP/PP and, where pinned, the Hub model's commit or the model directory's digest. A decode revision rolls out only once a ready prefill
    shares its key."""
    mine = spec.prefill if role is Role.PREFILL else spec.decode
    release = release_of(mine.runtime_version)
    material = {
        "wire": release.wire.major if release else mine.runtime_version,
        "layout": spec.model.layout.model_dump(mode="json", by_alias=True, exclude_none=True),
        "backend": spec.transfer.backend.value,
        "prefill": spec.prefill.parallelism.model_dump(mode="json", by_alias=True),
        "decode": spec.decode.parallelism.model_dump(mode="json", by_alias=True),
    }
    ident = model_identity(spec)
    if ident:  # unpinned sources keep every earlier key
        material["model"] = ident
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_LEN]
