"""A Hub branch or tag resolved once to a commit (model_ref.py, issue 47).

``HubClient`` against a stand-in of the Hub's revision API on loopback (no network): the commit of a branch,
the token sent, and each failure a clear ``ModelRefError`` naming the model, the name and the fix. ``resolve_model``
asks the Hub only when the stored record does not answer for the spec's (id, name): never again for the same
name (a branch that moved does not reach running pods), once more when the field changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import ModelStatus, PDDeploymentSpec
from pdfleet_operator.model_ref import HubClient, ModelRefError, pinned, resolve_model
from pdfleet_operator.resources.compat import compat_key
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.validation import validate_object
from tests.hub_standin import MODEL, A, B, Hub, running_hub
from tests.unit.engine_rules.builders import sglang_obj


@pytest.fixture
def hub() -> Iterator[Hub]:
    with running_hub() as h:
        yield h


def _spec(revision: str | None, model: str = MODEL) -> PDDeploymentSpec:
    src: dict[str, Any] = {"id": model}
    if revision is not None:
        src["revision"] = revision
    v = validate_object(sglang_obj(spec__model__source={"huggingFace": src}))
    assert v.admitted, v.violations
    return PDDeploymentSpec.model_validate(v.spec)


def test_a_branch_resolves_to_its_commit_with_the_token(hub: Hub) -> None:
    client = HubClient(hub.endpoint)
    assert client.commit_of(MODEL, "main", "hf_secret") == A
    assert client.commit_of(MODEL, "v2") == B
    assert hub.seen == [(f"/api/models/{MODEL}/revision/main", "Bearer hf_secret"),
                        (f"/api/models/{MODEL}/revision/v2", None)]


def test_a_name_with_a_slash_is_one_path_segment(hub: Hub) -> None:
    hub.refs["refs/pr/3"] = B
    assert HubClient(hub.endpoint).commit_of(MODEL, "refs/pr/3") == B
    assert hub.seen[-1][0] == f"/api/models/{MODEL}/revision/refs%2Fpr%2F3"


@pytest.mark.parametrize(("answer", "words"), [
    ((404, b"{}"), "HTTP 404 (no such model, branch or tag"),
    ((401, b""), "HTTP 401 (the Hub wants a token: set huggingFace.tokenSecret"),
    ((200, b"not json"), "no 40-hex commit"),
    ((200, b'{"sha": "main"}'), "no 40-hex commit"),
    ((200, b"[1, 2]"), "no 40-hex commit"),
    ((599, b""), "did not answer within 0.5s"),
])
def test_each_failure_names_the_model_the_name_and_the_fix(hub: Hub, answer: tuple[int, bytes], words: str) -> None:
    hub.answer = answer
    with pytest.raises(ModelRefError) as e:
        HubClient(hub.endpoint, timeout_s=0.5).commit_of(MODEL, "main")
    assert words in str(e.value) and f"model {MODEL!r} revision 'main' at {hub.endpoint}" in str(e.value)


def test_a_hub_that_is_not_there_is_a_clear_error() -> None:
    with pytest.raises(ModelRefError, match="did not answer"):
        HubClient("http://127.0.0.1:9", timeout_s=1.0).commit_of(MODEL, "main")


def test_resolved_once_and_never_again_for_the_same_name(hub: Hub) -> None:
    client = HubClient(hub.endpoint)
    calls: list[tuple[str, str]] = []

    def commit_of(model_id: str, ref: str) -> str:
        calls.append((model_id, ref))
        return client.commit_of(model_id, ref)

    when = datetime(2026, 12, 6, tzinfo=UTC)
    spec, record = resolve_model(_spec("main"), None, commit_of, now=lambda: when)
    assert record == ModelStatus(id=MODEL, requested="main", commit=A, resolved_at="2026-12-06T00:00:00Z")
    assert spec.model.source is not None and spec.model.source.hugging_face is not None
    assert spec.model.source.hugging_face.revision == A
    hub.refs["main"] = B  # the branch moves: the running fleet does not follow it
    again, kept = resolve_model(_spec("main"), record, commit_of)
    assert kept is record and again == spec and len(calls) == 1
    moved, fresh = resolve_model(_spec("v2"), record, commit_of)  # the field changed: resolved again
    assert fresh is not None and fresh.commit == B and fresh.requested == "v2" and len(calls) == 2
    assert moved.model.source is not None and moved.model.source.hugging_face is not None
    assert moved.model.source.hugging_face.revision == B


def test_a_commit_or_a_path_needs_no_lookup_and_no_record() -> None:
    def never(*_: str) -> str:
        raise AssertionError("the Hub was asked")

    stale = ModelStatus(id=MODEL, requested="main", commit=A, resolved_at="x")
    assert resolve_model(_spec(B), stale, never) == (_spec(B), None)
    assert resolve_model(_spec(None), stale, never) == (_spec(None), None)
    assert pinned(_spec("main", model="Org/Other"), stale) is None  # a record for another model answers nothing


def test_the_resolved_commit_renders_as_the_commit_itself() -> None:
    """A fleet on branch main resolved to A renders, hashes and pairs exactly as one pinned to A."""
    record = ModelStatus(id=MODEL, requested="main", commit=A, resolved_at="x")
    by_branch, by_commit = pinned(_spec("main"), record), _spec(A)
    assert by_branch is not None
    for role in Role:
        assert role_revision(by_branch, role) == role_revision(by_commit, role)
        assert compat_key(by_branch, role) == compat_key(by_commit, role)
        pod = runtime_pod("x", "default", by_branch, role, "r", 0)
        (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
        assert engine["command"][engine["command"].index("--revision") + 1] == A
