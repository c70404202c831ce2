"""The cached verdict and the running matrix (pin, the --test-deny-cell hook), and the pure
Admitted/Degraded conditions the re-check writes."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from pydantic import ValidationError

from pdfleet_operator.admission import (
    Verdicts,
    admission_conditions,
    conditions_hook,
    merge_conditions,
    recheck_patch,
    running_matrix,
)
from pdfleet_operator.settings import RecheckSettings
from tests.unit.admission.builders import example

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(hours=1)


def _stored(obj: dict[str, Any], conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    obj = json.loads(json.dumps(obj))
    obj["metadata"].update({"generation": 3, "uid": "x", "resourceVersion": "42"})
    if conditions is not None:
        obj["status"] = {"conditions": conditions}
    return obj


def test_cache_ignores_metadata_churn_but_not_names_or_spec() -> None:
    v = Verdicts()
    obj = example("llama-dense")
    first = v.of(obj)
    again = json.loads(json.dumps(obj))
    again["metadata"]["resourceVersion"] = "7"
    again["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    assert v.of(again) is first and v.hits == 1
    renamed = json.loads(json.dumps(obj))
    renamed["metadata"]["name"] = "Bad_Name"
    assert v.of(renamed).admitted is False  # the name is part of the verdict
    changed = json.loads(json.dumps(obj))
    changed["spec"]["decode"]["parallelism"]["tensor"] = 3
    assert v.of(changed).admitted is False and v.misses == 3


def test_cache_is_bounded_and_skips_huge_objects() -> None:
    v = Verdicts(cache_size=2)
    for n in range(4):
        obj = example("llama-dense")
        obj["spec"]["decode"]["replicas"] = n
        v.of(obj)
    assert len(v._cache) == 2
    huge = example("llama-dense")
    huge["spec"]["decode"]["env"] = [{"name": f"V{i}", "value": "x" * 100} for i in range(1000)]
    v.of(huge)
    v.of(huge)
    assert v.hits == 0


def test_unpinned_operator_has_no_override() -> None:
    assert running_matrix(RecheckSettings()) is None
    assert running_matrix(RecheckSettings(matrix_version="1")).version == "1"


def test_deny_cell_hook_makes_the_matrix_stricter() -> None:
    strict = Verdicts(running_matrix(RecheckSettings(deny_cells=("nixl.sharded-hetero-tp",))))
    verdict = strict.of(example("llama-dense"))  # nixl, TP 4 -> 2
    assert not verdict.admitted
    (v,) = verdict.violations
    assert v.rule == "nixl.sharded-hetero-tp" and "spec.transfer.backend" in v.paths
    assert "--test-deny-cell" in v.reason
    assert verdict.matrix_versions == ("1+deny.nixl.sharded-hetero-tp",)
    assert strict.of(example("deepseek-mla")).admitted  # other cells are untouched


@pytest.mark.parametrize("bad", [{"deny_cells": ("nixl",)}, {"deny_cells": ("ucx.pipeline",)},
                                 {"matrix_version": "99"}])
def test_recheck_settings_refuse_unknown_cells_and_versions(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RecheckSettings.model_validate(bad)


def test_conditions_for_admitted_and_rejected() -> None:
    ok = {c.type.value: c for c in admission_conditions(Verdicts().of(example("llama-dense")), 3)}
    assert ok["Admitted"].status == "True" and ok["Degraded"].status == "False"
    assert ok["Admitted"].observed_generation == 3
    bad = {c.type.value: c for c in admission_conditions(Verdicts().of(example("kv-heads-tp", "invalid")), 3)}
    assert bad["Degraded"].status == "True" and bad["Degraded"].reason == "MatrixRejects"
    assert "[kv-heads-tp]" in bad["Degraded"].message and "why:" in bad["Degraded"].message


def test_merge_keeps_transition_time_and_other_conditions() -> None:
    conds = admission_conditions(Verdicts().of(example("llama-dense")), 3)
    available = {"type": "Available", "status": "True", "reason": "Ready", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    first = merge_conditions([available], conds, T0)
    assert first is not None and first[0] == available
    assert {c["type"]: c["lastTransitionTime"] for c in first}["Admitted"] == "2026-01-01T00:00:00Z"
    assert merge_conditions(first, conds, T1) is None  # nothing changed: no write
    rejected = admission_conditions(Verdicts().of(example("kv-heads-tp", "invalid")), 4)
    flipped = {c["type"]: c for c in merge_conditions(first, rejected, T1)}
    assert flipped["Degraded"]["status"] == "True" and flipped["Degraded"]["lastTransitionTime"] == "2026-01-01T01:00:00Z"


def test_someone_elses_degraded_is_not_cleared() -> None:
    theirs = {"type": "Degraded", "status": "True", "reason": "RolloutFailed", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    merged = merge_conditions([theirs], admission_conditions(Verdicts().of(example("llama-dense")), 1), T0)
    assert merged is not None and {c["type"]: c for c in merged}["Degraded"] == theirs


def test_recheck_patch_of_a_stored_object() -> None:
    strict = Verdicts(running_matrix(RecheckSettings(deny_cells=("nixl.sharded-hetero-tp",))))
    patch = recheck_patch(_stored(example("llama-dense")), strict, T0)
    conds = {c["type"]: c for c in patch["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["observedGeneration"] == 3
    assert patch["matrixVersion"] == "1+deny.nixl.sharded-hetero-tp"
    again = _stored(example("llama-dense"), patch["conditions"])
    again["status"]["matrixVersion"] = patch["matrixVersion"]
    assert recheck_patch(again, strict, T1) == {}  # converged: the handler writes nothing
    healed = recheck_patch(again, Verdicts(), T1)
    assert {c["type"]: c["status"] for c in healed["conditions"]} == {"Admitted": "True", "Degraded": "False"}


def test_conditions_hook_for_a_reconciler() -> None:
    strict = Verdicts(running_matrix(RecheckSettings(deny_cells=("nixl.sharded-hetero-tp",))))
    conds = conditions_hook(strict)(_stored(example("llama-dense")))
    assert [(c["type"], c["status"], c["observedGeneration"]) for c in conds] == [
        ("Admitted", "False", 3), ("Degraded", "True", 3)]
    assert all("lastTransitionTime" not in c for c in conds)
