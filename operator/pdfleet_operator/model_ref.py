"""A Hub model's branch or tag, resolved once to the commit every pod of the fleet loads.

``spec.model.source.huggingFace.revision`` may name a branch or tag. A branch moves, so pods started at
different times would load different weights; the operator therefore resolves the name once, records the
commit in ``status.model`` and renders that commit (``--revision COMMIT``, the roles' revision, the
compatibility key) for as long as the field keeps its value. It is never re-resolved behind the user's
back: a new commit on the branch reaches the fleet only when the field changes (to another name, or to the
commit itself), and that is an ordinary rollout of both roles.

``pinned`` is pure (the spec as rendered, from the spec and the stored record); ``HubClient`` is the one
side effect (the Hub's ``/api/models/{id}/revision/{ref}``, with a deadline, the token if the spec names
one); ``resolve_model`` joins them for a reconcile pass.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime

from pdfleet_operator.api.models import ModelStatus, PDDeploymentSpec

__all__ = ["COMMIT", "HubClient", "ModelRefError", "is_commit", "pinned", "resolve_model"]

COMMIT = re.compile(r"[0-9a-f]{40}")
HUB_TIMEOUT_S = 10.0
MAX_ANSWER_BYTES = 1 << 20


def is_commit(ref: str) -> bool:
    return COMMIT.fullmatch(ref) is not None


class ModelRefError(RuntimeError):
    """The branch or tag could not be resolved; the message names the model, the name, the Hub and the fix."""


class HubClient:
    """The Hub's revision API (``GET {endpoint}/api/models/{id}/revision/{ref}`` -> ``{"sha": ...}``)."""

    def __init__(self, endpoint: str = "https://huggingface.co", timeout_s: float = HUB_TIMEOUT_S) -> None:
        self.endpoint, self.timeout_s = endpoint.rstrip("/"), timeout_s

    def commit_of(self, model_id: str, ref: str, token: str | None = None) -> str:
        url = (f"{self.endpoint}/api/models/{urllib.parse.quote(model_id, safe='/')}/revision/"
               f"{urllib.parse.quote(ref, safe='')}")
        req = urllib.request.Request(url, headers={"Accept": "application/json"})
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        where = f"model {model_id!r} revision {ref!r} at {self.endpoint}"
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as e:
            hint = {401: "the Hub wants a token: set huggingFace.tokenSecret",
                    403: "the token in huggingFace.tokenSecret may not read this model",
                    404: "no such model, branch or tag: check huggingFace.id and huggingFace.revision"}
            raise ModelRefError(f"cannot resolve {where}: HTTP {e.code} ({hint.get(e.code, e.reason)})") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ModelRefError(f"cannot resolve {where}: the Hub did not answer within {self.timeout_s:g}s "
                                f"({reason}); set huggingFace.revision to the commit to need no lookup") from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise ModelRefError(f"cannot resolve {where}: the answer is over {MAX_ANSWER_BYTES} bytes")
        try:
            sha = json.loads(raw).get("sha")
        except (ValueError, AttributeError):
            sha = None
        if not isinstance(sha, str) or not is_commit(sha):
            raise ModelRefError(f"cannot resolve {where}: the answer holds no 40-hex commit under 'sha'")
        return sha


def pinned(spec: PDDeploymentSpec, record: ModelStatus | None) -> PDDeploymentSpec | None:
    """The spec as its pods are rendered: a branch or tag replaced by the commit ``record`` holds for it.
    The spec itself where there is nothing to resolve; None where the name is not resolved yet (or the
    record is for another model or name)."""
    src = spec.model.source
    hub = src.hugging_face if src is not None else None
    if hub is None or hub.revision is None or is_commit(hub.revision):
        return spec
    if record is None or record.id != hub.id or record.requested != hub.revision:
        return None
    assert src is not None
    source = src.model_copy(update={"hugging_face": hub.model_copy(update={"revision": record.commit})})
    return spec.model_copy(update={"model": spec.model.model_copy(update={"source": source})})


def resolve_model(spec: PDDeploymentSpec, record: ModelStatus | None, commit_of: Callable[[str, str], str],
                  now: Callable[[], datetime] = lambda: datetime.now(UTC)
                  ) -> tuple[PDDeploymentSpec, ModelStatus | None]:
    """The spec to render and the record to store. Calls ``commit_of(id, ref)`` only when the stored record
    does not answer for the spec's (id, name); raises ``ModelRefError`` when that call fails."""
    have = pinned(spec, record)
    src = spec.model.source
    hub = src.hugging_face if src is not None else None
    if hub is None or hub.revision is None or is_commit(hub.revision):
        return spec, None
    if have is not None:
        return have, record
    commit = commit_of(hub.id, hub.revision)
    fresh = ModelStatus(id=hub.id, requested=hub.revision, commit=commit,
                        resolved_at=now().strftime("%Y-%m-%dT%H:%M:%SZ"))
    out = pinned(spec, fresh)
    assert out is not None
    return out, fresh
