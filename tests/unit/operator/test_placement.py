"""Placement: unschedulable roles are named with the reason, folded into Degraded."""

from __future__ import annotations

import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import Condition, PDDeploymentSpec
from pdfleet_operator.placement import NodeFacts, Problem, check_placement, node_facts
from pdfleet_operator.status import with_placement
from tests.unit.operator.test_plan import EXAMPLES

H200 = {"nvidia.com/gpu.memory": "143771", "pool": "a"}


def spec(**decode: object) -> PDDeploymentSpec:
    raw = yaml.safe_load((EXAMPLES[0].parent / "llama-dense.yaml").read_text())["spec"]
    raw["decode"].update(decode)
    return PDDeploymentSpec.model_validate(raw)


def nodes(n: int = 2, gpus: int = 8, labels: dict | None = None, taints: tuple = ()) -> list[NodeFacts]:
    return [NodeFacts(f"n{i}", labels=labels or H200, gpus=gpus, taints=taints) for i in range(n)]


def test_fits() -> None:
    assert check_placement(spec(), nodes()) == []


def test_no_matching_nodes() -> None:
    problems = check_placement(spec(nodeSelector={"pool": "b"}), nodes())
    assert [(p.role, p.problem) for p in problems] == [(Role.DECODE, Problem.NO_MATCHING_NODES)]
    assert "spec.decode.nodeSelector pool=b" in problems[0].message


def test_taints_need_tolerations() -> None:
    tainted = nodes(taints=({"key": "gpu", "value": "x", "effect": "NoSchedule"},))
    assert {p.problem for p in check_placement(spec(), tainted)} == {Problem.NO_MATCHING_NODES}
    tolerant = spec(tolerations=[{"key": "gpu", "operator": "Exists"}])
    assert [p.role for p in check_placement(tolerant, tainted)] == [Role.PREFILL]


def test_more_gpus_than_any_node() -> None:
    problems = check_placement(spec(), nodes(gpus=2))
    assert [(p.role, p.problem) for p in problems] == [(Role.PREFILL, Problem.INSUFFICIENT_GPUS_PER_NODE)]
    assert "needs 4 GPUs" in problems[0].message and "at most 2" in problems[0].message


def test_pool_bigger_than_gpu_memory() -> None:
    small = nodes(labels={"nvidia.com/gpu.memory": "1024"})
    problems = check_placement(spec(pool={"kvTokensPerReplica": 1 << 20}), small)
    assert Problem.POOL_EXCEEDS_GPU_MEMORY in {p.problem for p in problems}
    # Without the label the memory is unknown: not reported (admission checks gpuMemoryGiB).
    assert check_placement(spec(pool={"kvTokensPerReplica": 1 << 20}), nodes(labels={"x": "y"})) == []


def test_zero_replicas_need_no_nodes() -> None:
    assert [p.role for p in check_placement(spec(replicas=0), [])] == [Role.PREFILL]


def test_node_facts_from_json() -> None:
    facts = node_facts({
        "metadata": {"name": "a", "labels": {"x": "1"}},
        "spec": {"taints": [{"key": "k", "effect": "PreferNoSchedule"}, {"key": "k2", "effect": "NoExecute"}],
                 "unschedulable": True},
        "status": {"allocatable": {"nvidia.com/gpu": "4"}},
    })
    assert facts.gpus == 4 and facts.unschedulable and [t["key"] for t in facts.taints] == ["k2"]
    assert node_facts({}).gpus == 0


def test_degraded_folds_placement_into_admission() -> None:
    problems = check_placement(spec(), nodes(gpus=2))
    admitted = [Condition(type="Admitted", status="True"),
                Condition(type="Degraded", status="False", reason="MatrixAdmits")]
    out = {c.type: c for c in with_placement(admitted, problems, 1)}
    assert out["Degraded"].status == "True" and out["Degraded"].reason == "InsufficientGPUsPerNode"
    rejected = [Condition(type="Degraded", status="True", reason="MatrixRejects", message="m")]
    kept = with_placement(rejected, problems, 1)[0]
    assert kept.reason == "MatrixRejects" and "needs 4 GPUs" in (kept.message or "")
    assert with_placement(admitted, [], 1) == admitted


def test_network_policy_admits_only_the_deployment_and_its_routers() -> None:
    from pdfleet_operator.resources.policy import network_policy

    spec_ = network_policy("demo", "ns")["spec"]
    sources, http = spec_["ingress"]
    assert sources == {"from": [{"podSelector": {"matchLabels": {
        "pdfleet.io/deployment": "demo", "app.kubernetes.io/managed-by": "pdfleet-operator"}}}]}
    # The HTTP port (prompts arrive there) from the deployment's routers only, not from anywhere.
    assert http == {"from": [{"podSelector": {"matchLabels": {"pdfleet.io/router": "demo"}}}],
                    "ports": [{"protocol": "TCP", "port": 8080}]}
    assert spec_["policyTypes"] == ["Ingress"]
