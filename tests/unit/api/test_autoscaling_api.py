"""spec.autoscaling at admission: each rule denies what it names with the field and the fix, the
loop-needing checks (exact ratio band, budget) agree with a brute force, their CEL relaxation
never denies what the exact check admits, and `pdfleet validate` reports them offline."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfleet_operator.api.autoscaling import AUTOSCALING_RULES, cheapest_in_band
from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_operator.validation import validate_object

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "valid" / "autoscaling.yaml"
BASE: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())


def with_autoscaling(**changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    a = obj["spec"]["autoscaling"]
    for path, value in changes.items():
        node = a
        *head, last = path.split("__")
        for key in head:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return obj


def rules_of(obj: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    return {v.rule: v.paths for v in validate_object(obj).violations}


def test_the_example_is_admitted_without_warnings() -> None:
    verdict = validate_object(copy.deepcopy(BASE))
    assert verdict.admitted and not verdict.warnings, verdict
    assert verdict.spec is not None
    a = verdict.spec["autoscaling"]
    assert a["prefill"]["scaleUpStabilizationSeconds"] == 0 and a["decode"]["scaleDownStabilizationSeconds"] == 300
    assert a["decode"]["signals"]["itl"]["percentile"] == "p90"  # defaulted by the schema


def test_every_autoscaling_cel_rule_has_a_reason_and_a_fix() -> None:
    ids = {r.id for r in CEL_RULES if r.id.startswith("autoscaling-")}
    assert ids == {"autoscaling-replicas-in-range", "autoscaling-budget-minimums", "autoscaling-min-max",
                   "autoscaling-signal", "autoscaling-ratio-order", "autoscaling-ratio-feasible",
                   "autoscaling-double-control"}
    for r in CEL_RULES:
        if r.id.startswith("autoscaling-"):
            assert r.reason == AUTOSCALING_RULES[r.id].reason and r.fix == AUTOSCALING_RULES[r.id].fix


def test_violations_name_the_field_and_the_fix() -> None:
    (v,) = validate_object(with_autoscaling(prefill__minReplicas=9)).violations
    assert v.rule == "autoscaling-min-max" and v.paths == ("spec.autoscaling.prefill.minReplicas",)
    assert "maxReplicas" in v.fix
    (v,) = validate_object(with_autoscaling(gpuBudget=5)).violations
    assert v.rule == "autoscaling-budget-minimums" and v.paths == ("spec.autoscaling.gpuBudget",)
    assert "raise gpuBudget" in v.fix


def test_a_band_that_meets_the_bounds_only_between_integers_is_denied_by_the_exact_check() -> None:
    """prefill/decode in [1.4, 1.6] with one decode replica: the reals allow it (CEL admits), no count of
    prefill replicas does; the webhook's exact check denies it and says which counts it tried."""
    obj = with_autoscaling(decode__minReplicas=1, decode__maxReplicas=1, prefillDecodeRatio={"min": 1.4, "max": 1.6})
    obj["spec"]["decode"]["replicas"] = 1
    found = validate_object(obj).violations
    assert [v.rule for v in found] == ["autoscaling-ratio-feasible"], found
    assert "decode count in [1, 1]" in found[0].message and found[0].paths == ("spec.autoscaling.prefillDecodeRatio",)
    relaxed = next(r for r in CEL_RULES if r.id == "autoscaling-ratio-feasible")
    assert relaxed.check(obj["spec"]["autoscaling"] | {"prefillDecodeRatio": {"min": 1.4, "max": 1.6}})


def test_the_budget_must_hold_a_pair_inside_the_band() -> None:
    obj = with_autoscaling(prefillDecodeRatio={"min": 1.5, "max": 4}, gpuBudget=12)
    assert rules_of(obj) == {"autoscaling-budget-feasible": ("spec.autoscaling.gpuBudget",)}
    assert validate_object(with_autoscaling(prefillDecodeRatio={"min": 1.5, "max": 4}, gpuBudget=16)).admitted


def test_a_max_the_budget_never_reaches_is_a_warning() -> None:
    verdict = validate_object(with_autoscaling(gpuBudget=20))
    assert verdict.admitted
    assert [(w.rule, w.paths) for w in verdict.warnings] == [
        ("autoscaling-max-unreachable", ("spec.autoscaling.prefill.maxReplicas",)),
        ("autoscaling-max-unreachable", ("spec.autoscaling.decode.maxReplicas",)),
    ]


def test_targets_must_be_positive_and_signals_known() -> None:
    found = rules_of(with_autoscaling(prefill__signals__backlog__targetSeconds=0))
    assert found == {"schema": ("spec.autoscaling.prefill.signals.backlog.targetSeconds",)}
    msg = validate_object(with_autoscaling(decode__signals__kvCache__target=0)).violations[0].message
    assert "should be greater than 0" in msg
    found = rules_of(with_autoscaling(decode__signals__kvCache__target=1.5))
    assert found == {"schema": ("spec.autoscaling.decode.signals.kvCache.target",)}
    found = rules_of(with_autoscaling(decode__signals__cpu={"target": 1}))
    assert found == {"schema": ("spec.autoscaling.decode.signals.cpu",)}
    found = rules_of(with_autoscaling(prefill__signals__ttft__percentile="p42"))
    assert found == {"schema": ("spec.autoscaling.prefill.signals.ttft.percentile",)}


def test_replicas_outside_the_bounds_and_min_above_max_are_one_problem_each() -> None:
    obj = with_autoscaling(decode__minReplicas=20)  # 20 > maxReplicas 16: replicas can lie nowhere
    assert rules_of(obj) == {"autoscaling-min-max": ("spec.autoscaling.decode.minReplicas",)}
    obj = copy.deepcopy(BASE)
    obj["spec"]["decode"]["replicas"] = 40
    assert rules_of(obj) == {"autoscaling-replicas-in-range": ("spec.decode.replicas",)}


def test_no_autoscaling_no_autoscaling_rules() -> None:
    obj = copy.deepcopy(BASE)
    del obj["spec"]["autoscaling"]
    obj["spec"]["decode"]["replicas"] = 400
    assert validate_object(obj).admitted


@settings(max_examples=300, deadline=None)
@given(pa=st.integers(1, 12), pw=st.integers(0, 12), da=st.integers(1, 12), dw=st.integers(0, 12),
       lo=st.sampled_from([0.1, 0.25, 1 / 3, 0.5, 1.0, 1.4, 1.5, 2.0, 3.0]),
       k=st.sampled_from([1.0, 1.1, 1.5, 2.0, 4.0]), gp=st.integers(1, 8), gd=st.integers(1, 8))
def test_cheapest_in_band_matches_a_brute_force_and_the_relaxation_is_sound(pa, pw, da, dw, lo, k, gp, gd) -> None:
    pb, db, hi = pa + pw, da + dw, lo * k
    pairs = [(p, d) for p in range(pa, pb + 1) for d in range(da, db + 1) if lo * d - 1e-9 <= p <= hi * d + 1e-9]
    best = cheapest_in_band((pa, pb), (da, db), (lo, hi), (gp, gd))
    if not pairs:
        assert best is None
    else:
        assert best in pairs and best[0] * gp + best[1] * gd == min(p * gp + d * gd for p, d in pairs)
    relaxed = next(r for r in CEL_RULES if r.id == "autoscaling-ratio-feasible")
    node = {"prefill": {"minReplicas": pa, "maxReplicas": pb}, "decode": {"minReplicas": da, "maxReplicas": db},
            "prefillDecodeRatio": {"min": lo, "max": hi}}
    if pairs:  # the CEL relaxation never denies what the exact check admits
        assert relaxed.check(node)
