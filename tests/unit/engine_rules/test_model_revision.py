"""``spec.model.source.huggingFace.revision`` (issue 47): one commit for every pod of both roles.

A branch or tag is admitted and resolved once by the operator to a commit (tests/unit/operator/test_model_ref.py);
an unpinned Hub model is admitted with a warning; a pinned one renders ``--revision`` for SGLang and vLLM (whose own parsers check it: tests/sglang and
tests/vllm generate pinned specs), owns that flag, and enters both roles' revision and compatibility key.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.compat import compat_key
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.validation import validate_object
from tests.unit.engine_rules.builders import sglang_obj, vllm_obj

COMMIT_A, COMMIT_B = "a" * 40, "0123456789abcdef0123456789abcdef01234567"
BUILDERS = {"sglang": sglang_obj, "vllm": vllm_obj}


def _hub(kind: str, revision: str | None = None, **more: Any) -> dict:
    src: dict[str, Any] = {"id": "Qwen/Qwen3-Next-80B-A3B-Instruct"}
    if revision is not None:
        src["revision"] = revision
    return BUILDERS[kind](spec__model__source={"huggingFace": src}, **more)


def _spec(obj: dict) -> PDDeploymentSpec:
    v = validate_object(obj)
    assert v.admitted, v.violations
    return PDDeploymentSpec.model_validate(v.spec)


def _engine_cmd(obj: dict, role: Role) -> list[str]:
    pod = runtime_pod(obj["metadata"]["name"], "default", _spec(obj), role, "r", 0)
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return engine["command"]


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("ref", ["main", "v1.0", "a" * 39, "A" * 40, "refs/pr/3"])
def test_a_branch_or_tag_is_admitted_for_the_operator_to_resolve(kind: str, ref: str) -> None:
    v = validate_object(_hub(kind, ref))
    assert v.admitted, v.violations
    assert "warn-engine-model-revision" not in [w.rule for w in v.warnings]


@pytest.mark.parametrize("ref", ["-main", "a b", "x" * 129])
def test_a_revision_that_is_no_git_name_is_denied_by_the_schema(ref: str) -> None:
    v = validate_object(_hub("sglang", ref))
    assert not v.admitted and any(p.endswith("huggingFace.revision") for x in v.violations for p in x.paths), v


@pytest.mark.parametrize("kind", BUILDERS)
def test_an_unpinned_hub_model_is_admitted_with_a_warning(kind: str) -> None:
    v = validate_object(_hub(kind))
    assert v.admitted and "warn-engine-model-revision" in [w.rule for w in v.warnings]
    pinned = validate_object(_hub(kind, COMMIT_A))
    assert pinned.admitted and "warn-engine-model-revision" not in [w.rule for w in pinned.warnings]


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_pinned_commit_is_rendered_on_both_roles(kind: str) -> None:
    for role in Role:
        cmd = _engine_cmd(_hub(kind, COMMIT_A), role)
        assert cmd[cmd.index("--revision") + 1] == COMMIT_A and cmd.count("--revision") == 1
        assert "--revision" not in _engine_cmd(_hub(kind), role)


@pytest.mark.parametrize("kind", BUILDERS)
def test_the_revision_flag_is_owned(kind: str) -> None:
    v = validate_object(_hub(kind, COMMIT_A, spec__engine__args=["--revision", COMMIT_B]))
    assert "engine-flag-owned" in [x.rule for x in v.violations]
    assert any("huggingFace.revision" in x.message for x in v.violations)


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_new_commit_rolls_both_roles_and_pairs_only_with_itself(kind: str) -> None:
    a, b = _spec(_hub(kind, COMMIT_A)), _spec(_hub(kind, COMMIT_B))
    for role in Role:
        assert role_revision(a, role) != role_revision(b, role)
        assert compat_key(a, role) != compat_key(b, role)
    unpinned, path = _spec(_hub(kind)), _spec(BUILDERS[kind]())
    assert compat_key(unpinned, Role.DECODE) == compat_key(path, Role.DECODE)  # earlier keys are kept
