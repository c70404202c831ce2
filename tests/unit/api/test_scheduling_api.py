"""spec.scheduling at admission: each rule denies what it names, at the field, with the fix; every
rule has an invalid example and `pdfleet explain-rule` explains it; the schema refuses malformed
queue names and label keys; and a default spec keeps every earlier revision hash."""

from __future__ import annotations

import argparse
import copy
import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_operator.api.scheduling import SCHEDULING_RULES
from pdfleet_operator.commands import matrix as matrix_cmd
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.validation import validate_object

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MULTI: dict[str, Any] = yaml.safe_load((EXAMPLES / "multi-node" / "llama-dense-2-nodes.yaml").read_text())
SINGLE: dict[str, Any] = yaml.safe_load((EXAMPLES / "valid" / "llama-dense.yaml").read_text())


def with_scheduling(base: dict[str, Any], **scheduling: Any) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    obj["spec"]["scheduling"] = scheduling
    return obj


def rules_of(obj: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    return {v.rule: v.paths for v in validate_object(obj).violations}


def test_every_scheduling_rule_is_a_cel_rule_with_its_reason_fix_and_an_invalid_example() -> None:
    cel = {r.id: r for r in CEL_RULES if r.id.startswith("scheduling-")}
    assert set(cel) == set(SCHEDULING_RULES)
    for rule_id, r in cel.items():
        assert (r.reason, r.fix) == SCHEDULING_RULES[rule_id]
        assert (EXAMPLES / "invalid" / f"{rule_id}.yaml").is_file(), rule_id


@pytest.mark.parametrize(
    ("base", "scheduling", "rule", "path"),
    [
        (SINGLE, {"queueName": "q"}, "scheduling-queue-needs-kueue", "spec.scheduling.queueName"),
        (SINGLE, {"gang": "none", "queueName": "q"}, "scheduling-queue-needs-kueue", "spec.scheduling.queueName"),
        (MULTI, {"gang": "kueue"}, "scheduling-kueue-queue", "spec.scheduling.queueName"),
        (SINGLE, {"topologyKey": "topology.example.com/rack"}, "scheduling-topology-multi-node",
         "spec.scheduling.topologyKey"),
        (MULTI, {"topologyKey": "kubernetes.io/hostname"}, "scheduling-topology-hostname",
         "spec.scheduling.topologyKey"),
    ],
)
def test_each_rule_denies_at_its_field(base: dict, scheduling: dict, rule: str, path: str) -> None:
    found = rules_of(with_scheduling(base, **scheduling))
    assert found == {rule: (path,)}
    (v,) = validate_object(with_scheduling(base, **scheduling)).violations
    assert v.fix == SCHEDULING_RULES[rule].fix and "spec.scheduling" in v.fix


@pytest.mark.parametrize(
    ("base", "scheduling"),
    [
        (SINGLE, {}),
        (SINGLE, {"gang": "kueue", "queueName": "gpu-serving"}),  # one-node replicas are gangs of one
        (MULTI, {"gang": "kueue", "queueName": "gpu-serving", "topologyKey": "topology.example.com/rack"}),
        (MULTI, {"topologyKey": "nvidia.com/gpu.clique"}),  # packing without a gang is allowed
    ],
)
def test_consistent_settings_are_admitted(base: dict, scheduling: dict) -> None:
    assert rules_of(with_scheduling(base, **scheduling)) == {}


def test_one_multi_node_role_is_enough_for_a_topology_key() -> None:
    obj = with_scheduling(SINGLE, topologyKey="topology.example.com/rack")
    obj["spec"]["decode"]["parallelism"]["nodesPerReplica"] = 2
    assert rules_of(obj) == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [("queueName", "Gpu_Queue"), ("queueName", "x" * 64), ("topologyKey", "rack name"),
     ("topologyKey", "/rack"), ("gang", "volcano")],
)
def test_the_schema_refuses_malformed_values(field: str, value: str) -> None:
    obj = with_scheduling(MULTI, gang="kueue", queueName="q")
    obj["spec"]["scheduling"][field] = value
    assert "schema" in rules_of(obj)
    assert any(p == f"spec.scheduling.{field}" for p in rules_of(obj)["schema"])


def test_explain_rule_knows_the_scheduling_rules() -> None:
    parser = argparse.ArgumentParser()
    matrix_cmd.register(parser.add_subparsers())
    out = io.StringIO()
    for rule_id, r in SCHEDULING_RULES.items():
        args = parser.parse_args(["explain-rule", rule_id])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("sys.stdout", out)
            assert args.handler(args) == 0
        assert r.fix in out.getvalue() and r.reason in out.getvalue()


def test_the_default_keeps_revisions_and_a_change_makes_a_new_one() -> None:
    default = PDDeploymentSpec.model_validate(MULTI["spec"])
    explicit = PDDeploymentSpec.model_validate({**MULTI["spec"], "scheduling": {"gang": "none"}})
    kueue = PDDeploymentSpec.model_validate(
        {**MULTI["spec"], "scheduling": {"gang": "kueue", "queueName": "q"}})
    for role in Role:
        assert role_revision(default, role) == role_revision(explicit, role)
        assert role_revision(default, role) != role_revision(kueue, role)
    # a topology key changes only the multi-node role's pods
    spec = copy.deepcopy(MULTI["spec"])
    spec["prefill"]["parallelism"]["nodesPerReplica"] = 1
    base = PDDeploymentSpec.model_validate(spec)
    packed = PDDeploymentSpec.model_validate({**spec, "scheduling": {"topologyKey": "rack"}})
    assert role_revision(base, Role.PREFILL) == role_revision(packed, Role.PREFILL)
    assert role_revision(base, Role.DECODE) != role_revision(packed, Role.DECODE)
