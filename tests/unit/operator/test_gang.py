"""spec.scheduling rendered (resources/gang.py through runtime_pod and the planner): every pod of a replica
carries its gang's Kueue labels and annotations (one gang per replica group, prefill and decode apart, new
names per revision, so a surge makes whole new gangs), members require the topology key beside their
anti-affinity, nothing is rendered without the settings, and a group's pods stay within the pod shapes
Kueue accepts in one group."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.scheduling import (
    KUEUE_GROUP_NAME_LABEL,
    KUEUE_GROUP_SERVING_ANNOTATION,
    KUEUE_GROUP_TOTAL_COUNT_ANNOTATION,
    KUEUE_POD_INDEX_LABEL_ANNOTATION,
    KUEUE_QUEUE_LABEL,
    KUEUE_REQUIRED_TOPOLOGY_ANNOTATION,
)
from pdfleet_operator.placement import NodeFacts, Problem, check_placement
from pdfleet_operator.plan import ActionKind, plan
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.revision import role_revision
from tests.unit.operator.test_groups import OWNER, World, sglang_spec

RACK = "topology.example.com/rack"


def spec_with(scheduling: dict | None = None, *, decode_nodes: int = 2, prefill_nodes: int = 2,
              image: str = "example.invalid/rt:1", affinity: dict | None = None) -> PDDeploymentSpec:
    return PDDeploymentSpec.model_validate({
        "model": {"layout": {"preset": "llama-dense"}},
        "transfer": {"backend": "mooncake", "protocol": "tcp"},
        "prefill": {"replicas": 1, "parallelism": {"tensor": 2, "pipeline": 2, "nodesPerReplica": prefill_nodes},
                    "image": "example.invalid/rt:1"},
        "decode": {"replicas": 2, "parallelism": {"tensor": 4, "nodesPerReplica": decode_nodes}, "image": image,
                   **({"affinity": affinity} if affinity else {})},
        "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 60},
        **({"scheduling": scheduling} if scheduling is not None else {}),
    })


KUEUE = {"gang": "kueue", "queueName": "gpu-serving"}


def members(spec: PDDeploymentSpec, role: Role, index: int = 0) -> list[dict]:
    rs = spec.prefill if role is Role.PREFILL else spec.decode
    rev = role_revision(spec, role)
    return [runtime_pod("g", "ns", spec, role, rev, index, m) for m in range(rs.parallelism.nodes_per_replica)]


def test_every_member_carries_its_gang_for_kueue() -> None:
    spec = spec_with(KUEUE)
    names = set()
    for role in Role:
        pods = members(spec, role)
        leader = pods[0]["metadata"]["name"]
        for pod in pods:
            labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
            assert labels[KUEUE_QUEUE_LABEL] == "gpu-serving"
            assert labels[KUEUE_GROUP_NAME_LABEL] == leader == labels["pdfleet.io/group"]
            assert annotations[KUEUE_GROUP_TOTAL_COUNT_ANNOTATION] == "2"
            assert annotations[KUEUE_GROUP_SERVING_ANNOTATION] == "true"
            assert "schedulingGates" not in pod["spec"]  # Kueue's webhook adds its gate, not the operator
            assert KUEUE_REQUIRED_TOPOLOGY_ANNOTATION not in annotations  # no topology key: no TAS request
        names.add(leader)
    assert len(names) == 2  # prefill and decode groups are separate gangs


def test_with_kueue_the_topology_key_is_kueues_required_topology_for_multi_node_groups() -> None:
    spec = spec_with(KUEUE | {"topologyKey": RACK}, prefill_nodes=1)
    for pod in members(spec, Role.DECODE):
        annotations = pod["metadata"]["annotations"]
        assert annotations[KUEUE_REQUIRED_TOPOLOGY_ANNOTATION] == RACK
        assert annotations[KUEUE_POD_INDEX_LABEL_ANNOTATION] == "pdfleet.io/group-member"
        assert pod["metadata"]["labels"]["pdfleet.io/group-member"] in ("0", "1")
    (prefill,) = members(spec, Role.PREFILL)  # a one-node replica has no domain to choose
    assert KUEUE_REQUIRED_TOPOLOGY_ANNOTATION not in prefill["metadata"]["annotations"]


def test_a_one_node_replica_is_a_gang_of_one() -> None:
    spec = spec_with(KUEUE, decode_nodes=1)
    (pod,) = members(spec, Role.DECODE, index=3)
    assert pod["metadata"]["labels"][KUEUE_GROUP_NAME_LABEL] == pod["metadata"]["name"]
    assert pod["metadata"]["annotations"][KUEUE_GROUP_TOTAL_COUNT_ANNOTATION] == "1"
    assert "pdfleet.io/group" not in pod["metadata"]["labels"]


def test_gang_names_are_kueue_workload_names_and_unique_per_revision_and_index() -> None:
    a, b = spec_with(KUEUE), spec_with(KUEUE, image="example.invalid/rt:2")
    assert role_revision(a, Role.DECODE) != role_revision(b, Role.DECODE)
    names = {members(s, Role.DECODE, i)[0]["metadata"]["labels"][KUEUE_GROUP_NAME_LABEL]
             for s in (a, b) for i in range(3)}
    assert len(names) == 6
    for name in names:  # Kueue names the group's Workload after it: a DNS subdomain and a label value
        assert len(name) <= 63 and name == name.lower() and name[0].isalnum() and name[-1].isalnum()


@pytest.mark.parametrize("role", list(Role))
def test_members_share_the_topology_key_and_keep_one_member_per_node(role: Role) -> None:
    spec = spec_with({"topologyKey": RACK})
    pods = members(spec, role)
    leader = pods[0]["metadata"]["name"]
    selector = {"matchLabels": {"pdfleet.io/group": leader}}
    for pod in pods:
        affinity = pod["spec"]["affinity"]
        assert affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
            {"labelSelector": selector, "topologyKey": RACK}]
        assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
            {"labelSelector": selector, "topologyKey": "kubernetes.io/hostname"}]
        # the first member placed matches its own term (kube-scheduler then lets it pick any domain)
        assert pod["metadata"]["labels"]["pdfleet.io/group"] == leader
        assert KUEUE_GROUP_NAME_LABEL not in pod["metadata"]["labels"]  # packing without a gang


def test_the_roles_own_affinity_is_kept_beside_the_group_terms() -> None:
    own = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": "topology.kubernetes.io/zone"}]},
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}
    spec = spec_with({"topologyKey": RACK}, affinity=own)
    pod = members(spec, Role.DECODE)[1]
    terms = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [t["topologyKey"] for t in terms] == ["topology.kubernetes.io/zone", RACK]
    assert pod["spec"]["affinity"]["nodeAffinity"] == own["nodeAffinity"]
    assert spec.decode.affinity == own  # the spec is not mutated by rendering
    one = spec_with({"topologyKey": RACK}, decode_nodes=1, affinity=own)
    (single,) = members(one, Role.DECODE)
    assert single["spec"]["affinity"] == own  # a one-node replica has no group to pack


def test_nothing_is_rendered_without_scheduling_settings() -> None:
    for pod in members(spec_with(), Role.DECODE):
        assert not any(k.startswith("kueue.x-k8s.io/") for k in pod["metadata"]["labels"])
        assert not any(k.startswith("kueue.x-k8s.io/") for k in pod["metadata"]["annotations"])
        assert "podAffinity" not in pod["spec"]["affinity"]


def _kueue_shape(pod: dict) -> str:
    """The pod fields Kueue tells roles of one group apart by (its role hash: requests, ports, placement)."""
    s = pod["spec"]
    return json.dumps({
        "containers": [{"requests": c["resources"].get("requests"), "ports": c.get("ports")}
                       for c in s["containers"]],
        "init": [{"requests": c["resources"].get("requests"), "ports": c.get("ports")}
                 for c in s.get("initContainers", ())],
        **{k: s.get(k) for k in ("nodeSelector", "affinity", "tolerations", "runtimeClassName", "priority",
                                 "topologySpreadConstraints", "overhead", "resourceClaims")},
    }, sort_keys=True)


@pytest.mark.parametrize("nodes", [2, 4])
def test_a_group_stays_within_kueues_eight_pod_roles(nodes: int) -> None:
    """Kueue refuses a pod group of more than 8 distinct roles; members differ only in env and names."""
    for spec in (spec_with(KUEUE | {"topologyKey": RACK}, decode_nodes=nodes), sglang_spec(nodes=nodes)):
        pods = members(spec, Role.DECODE)
        assert len(pods) == nodes
        assert len({_kueue_shape(p) for p in pods}) <= 2  # at most the leader's and the members'


def test_a_surge_creates_whole_new_gangs_and_never_joins_an_old_one() -> None:
    """A rollout through the planner: at every pass each gang's pods share one revision, and no more pods
    ever carry a gang's name than its total count."""
    old, new = spec_with(KUEUE), spec_with(KUEUE, image="example.invalid/rt:2")
    w = World()
    w.apply(plan(OWNER, old, w.snapshot()), 0.0)
    w.tick()
    old_gangs = {b["metadata"]["labels"][KUEUE_GROUP_NAME_LABEL] for b in w.pods.values()
                 if b["metadata"]["labels"]["pdfleet.io/role"] == "decode"}
    seen: dict[str, set[str]] = {}
    ended: list[str] = []
    for step in range(60):
        actions = plan(OWNER, new, w.snapshot(), now=float(step))
        ends = [a for a in actions if a.object_kind == "Workload"]
        for a in ends:  # a gang deleted as a unit ends with its Kueue Workload, in the pass deleting its pods
            assert a.kind is ActionKind.DELETE and a.api_version == "kueue.x-k8s.io/v1beta2"
            assert {x.name for x in actions if x.kind is ActionKind.DELETE and x.object_kind == "Pod"} == {
                a.name, f"{a.name}-m1"}
        ended += [a.name for a in ends]
        created = [a.body for a in actions if a.kind is ActionKind.CREATE and a.object_kind == "Pod"]
        per_gang = Counter(b["metadata"]["labels"][KUEUE_GROUP_NAME_LABEL] for b in created)
        for gang, count in per_gang.items():  # a gang is created whole, in one pass, and only once
            assert gang not in seen and count == 2, (gang, count)
        w.apply(actions, float(step))
        for body in w.pods.values():
            labels = body["metadata"]["labels"]
            seen.setdefault(labels[KUEUE_GROUP_NAME_LABEL], set()).add(labels["pdfleet.io/revision"])
        assert all(len(revs) == 1 for revs in seen.values())
        w.tick()
        if {p.revision for p in w.snapshot().pods if p.role is Role.DECODE} == {role_revision(new, Role.DECODE)}:
            break
    else:
        pytest.fail("the rollout did not converge")
    assert sum(role_revision(new, Role.DECODE) in revs for revs in seen.values()) == 2
    assert sorted(ended) == sorted(old_gangs)  # each old gang's Workload deleted once


def test_a_group_without_a_gang_deletes_no_workload() -> None:
    w = World()
    spec = spec_with()
    w.apply(plan(OWNER, spec, w.snapshot()), 0.0)
    w.tick()
    member = next(n for n in w.pods if n.endswith("-m1") and "decode" in n)
    del w.pods[member]  # a broken group restarts as a unit: no Kueue, nothing else to delete
    actions = plan(OWNER, spec, w.snapshot(), now=1.0)
    assert [a.name for a in actions if a.kind is ActionKind.DELETE] == [member.removesuffix("-m1")]


def test_placement_reports_a_topology_key_no_domain_can_hold_a_group_in() -> None:
    def nodes(racks: list[str | None]) -> list[NodeFacts]:
        return [NodeFacts(name=f"n{i}", labels={RACK: r} if r else {}, gpus=8) for i, r in enumerate(racks)]

    spec = spec_with({"topologyKey": RACK})  # groups of 2 pods on both roles
    assert check_placement(spec, nodes(["a", "a", "b"])) == []
    for racks, seen in ((["a", "b", "c"], "the largest value has 1"), ([None, None, None], "no matching node")):
        found = check_placement(spec, nodes(racks))
        assert [p.problem for p in found] == [Problem.TOPOLOGY_DOMAIN_TOO_SMALL] * 2
        assert seen in found[0].message and RACK in found[0].message
    assert check_placement(spec_with(), nodes([None, None])) == []  # no key: any 2 nodes do
