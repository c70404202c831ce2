"""A role's revision covers what this operator renders (issue 47): an operator whose rendering of a pod or
its runtime config differs gives a new revision, so the fleet rolls; one that renders the same keeps it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import pdfleet_operator.resources.pods as pods
import pdfleet_operator.resources.runtime_config as runtime_config
from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.revision import _digest, rendering_digest, role_revision

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "valid"


def _spec(name: str = "llama-dense.yaml") -> PDDeploymentSpec:
    return PDDeploymentSpec.model_validate(yaml.safe_load((EXAMPLES / name).read_text())["spec"])


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    _digest.cache_clear()  # a process renders with one operator's code; these tests swap it
    yield
    _digest.cache_clear()


def _revisions(spec: PDDeploymentSpec) -> dict[Role, str]:
    return {role: role_revision(spec, role) for role in Role}


def test_a_changed_pod_rendering_is_a_new_revision_of_both_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec()
    before = _revisions(spec)
    _digest.cache_clear()
    monkeypatch.setattr(pods, "TMP_SIZE_LIMIT", "2Gi")  # an upgrade renders a bigger /tmp
    after = _revisions(spec)
    assert all(before[r] != after[r] for r in Role), (before, after)


def test_a_changed_runtime_config_is_a_new_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec()
    before = _revisions(spec)
    _digest.cache_clear()
    monkeypatch.setattr(runtime_config, "GROUP_PORT", runtime_config.GROUP_PORT - 7)  # a free port, moved
    assert _revisions(spec) == before  # not rendered for one-node replicas
    multi = _spec("deepseek-mla.yaml")
    assert any(r.parallelism.nodes_per_replica > 1 for r in (multi.prefill, multi.decode))
    _digest.cache_clear()
    before_multi = _revisions(multi)
    monkeypatch.undo()
    _digest.cache_clear()
    assert _revisions(multi) != before_multi


def test_the_digest_ignores_names_replicas_and_the_router() -> None:
    spec = _spec()
    digest = {r: rendering_digest(spec, r) for r in Role}
    more = spec.model_copy(update={"decode": spec.decode.model_copy(update={"replicas": 9})})
    assert {r: rendering_digest(more, r) for r in Role} == digest
    assert _revisions(more) == _revisions(spec)
    routed = _spec("all-fields.yaml")
    bare = routed.model_copy(update={"router": None})
    assert routed.router is not None and _revisions(routed) == _revisions(bare)


def test_an_unchanged_rendering_keeps_every_revision() -> None:
    spec = _spec()
    before = _revisions(spec)
    _digest.cache_clear()
    assert _revisions(spec) == before
