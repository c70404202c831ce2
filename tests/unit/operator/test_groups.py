"""Replica groups (nodesPerReplica > 1) in the pure operator: the member pods and children rendered, and
the planner treating each group as one unit (created together, ready only when every member is,
restarted as a unit, drained through the leader and deleted together, budgets counted in groups).

The planner runs against a small simulated world of pod bodies read back through ``observed_pod``, so
what is checked is what observe, plan and status make of real pod objects."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest
import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.observe import observed_pod
from pdfleet_operator.placement import NodeFacts, Problem, check_placement
from pdfleet_operator.plan import ActionKind, Owner, Snapshot, desired_children, plan
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.router import router_command
from pdfleet_operator.status import compute_status, status_document
from pdfleet_runtime.config import (
    DRAINED_CONDITION,
    ENGINE_PORT,
    READINESS_GATE,
    RuntimeConfig,
    drained_message,
)
from tests.unit.engine_rules.builders import sglang_obj

OWNER = Owner(name="g", namespace="ns", uid="uid-g")
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def builtin_spec(nodes: int = 2, replicas: int = 2, **rollout: object) -> PDDeploymentSpec:
    return PDDeploymentSpec.model_validate({
        "model": {"layout": {"preset": "llama-dense"}},
        "transfer": {"backend": "mooncake", "protocol": "tcp"},
        "prefill": {"replicas": 1, "parallelism": {"tensor": 2}, "image": "example.invalid/rt:1"},
        "decode": {"replicas": replicas, "parallelism": {"tensor": 4, "nodesPerReplica": nodes},
                   "image": "example.invalid/rt:1"},
        "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 60, **rollout},
    })


def sglang_spec(nodes: int = 2, replicas: int = 1) -> PDDeploymentSpec:
    obj = sglang_obj(spec__model__layout={"preset": "deepseek-mla"},
                     spec__decode__parallelism={"tensor": 16, "data": 16, "expert": 16, "nodesPerReplica": nodes},
                     spec__decode__replicas=replicas)
    return PDDeploymentSpec.model_validate(obj["spec"])


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_member_pods_of_the_built_in_runtime() -> None:
    spec = builtin_spec()
    rev = role_revision(spec, Role.DECODE)
    leader = runtime_pod("g", "ns", spec, Role.DECODE, rev, 3, 0)
    member = runtime_pod("g", "ns", spec, Role.DECODE, rev, 3, 1)
    lname = leader["metadata"]["name"]
    assert member["metadata"]["name"] == f"{lname}-m1"
    for pod, m in ((leader, 0), (member, 1)):
        labels = pod["metadata"]["labels"]
        assert labels["pdfleet.io/group"] == lname and labels["pdfleet.io/group-member"] == str(m)
        assert labels["pdfleet.io/index"] == "3"
        assert pod["metadata"]["annotations"]["pdfleet.io/identity"] == f"decode/{rev}/3/{m}/2"
        spec_ = pod["spec"]
        assert spec_["hostname"] == pod["metadata"]["name"] and spec_["subdomain"] == "g-decode-group"
        (term,) = spec_["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term == {"labelSelector": {"matchLabels": {"pdfleet.io/group": lname}},
                        "topologyKey": "kubernetes.io/hostname"}
        (c,) = spec_["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"  # TP 4 over 2 nodes
        assert env(c)["PDFLEET_GROUP_MEMBER"] == str(m) and env(c)["PDFLEET_GROUP_LEADER"] == lname
        assert [p["containerPort"] for p in c["ports"] if p["name"].startswith("engine-")] == [ENGINE_PORT, ENGINE_PORT + 1]
        assert {"name": "group", "containerPort": 8997, "protocol": "TCP"} in c["ports"]
        mounts = {v["mountPath"]: v for v in c["volumeMounts"]}
        assert mounts["/var/run/pdfleet/group-auth"]["readOnly"] is True
        vols = {v["name"]: v for v in spec_["volumes"]}
        assert vols["group-auth"]["secret"]["secretName"] == "g-decode-group-auth"
    # the prefill (one node) is unchanged: no group, no group key
    prefill = runtime_pod("g", "ns", spec, Role.PREFILL, role_revision(spec, Role.PREFILL), 0)
    assert "pdfleet.io/group" not in prefill["metadata"]["labels"]
    assert prefill["spec"]["subdomain"] == "g-prefill" and "affinity" not in prefill["spec"]
    assert "PDFLEET_GROUP_MEMBER" not in env(prefill["spec"]["containers"][0])


def test_runtime_config_carries_the_group_and_local_world() -> None:
    spec = builtin_spec()
    children = desired_children(OWNER, spec)
    maps = [c for c in children if c["kind"] == "ConfigMap"]
    configs = {c["metadata"]["labels"]["pdfleet.io/role"]: RuntimeConfig.model_validate(
        yaml.safe_load(c["data"]["runtime.yaml"])) for c in maps}
    group = configs["decode"].group
    assert group is not None and group.nodes == 2 and group.service == "g-decode-group" and group.port == 8997
    assert str(group.secret_path) == "/var/run/pdfleet/group-auth/key"
    assert configs["decode"].local_world == 2
    assert configs["prefill"].group is None


def test_group_children_services_policies_and_router_select_leaders() -> None:
    spec = builtin_spec()
    children = {(c["kind"], c["metadata"]["name"]): c for c in desired_children(OWNER, spec)}
    group_svc = children["Service", "g-decode-group"]
    assert group_svc["spec"]["clusterIP"] == "None" and group_svc["spec"]["publishNotReadyAddresses"] is True
    assert group_svc["spec"]["selector"] == {"pdfleet.io/deployment": "g", "pdfleet.io/role": "decode"}
    assert group_svc["spec"]["ports"][0]["port"] == 8997
    # the role's Service (peer discovery) holds only leaders; the single-node prefill's is unchanged
    assert children["Service", "g-decode"]["spec"]["selector"]["pdfleet.io/group-member"] == "0"
    assert "pdfleet.io/group-member" not in children["Service", "g-prefill"]["spec"]["selector"]
    assert ("Service", "g-prefill-group") not in children
    # the group port: open from the same role only, left out of the deployment-wide rule
    gp = children["NetworkPolicy", "g-decode-group"]["spec"]
    assert gp["podSelector"]["matchLabels"]["pdfleet.io/role"] == "decode"
    assert gp["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"pdfleet.io/deployment": "g",
                                                                       "pdfleet.io/role": "decode"}}}],
                              "ports": [{"protocol": "TCP", "port": 8997}]}]
    wide = children["NetworkPolicy", "g-transfer"]["spec"]["ingress"][0]
    tcp = [(p["port"], p["endPort"]) for p in wide["ports"] if p["protocol"] == "TCP"]
    assert tcp == [(1, 8996), (8998, 65535)]
    single = {(c["kind"], c["metadata"]["name"]): c for c in desired_children(OWNER, builtin_spec(nodes=1))}
    assert "ports" not in single["NetworkPolicy", "g-transfer"]["spec"]["ingress"][0]  # N = 1: unchanged
    routed = PDDeploymentSpec.model_validate({**spec.model_dump(by_alias=True, mode="json"), "router": {"image": "example.invalid/router:1"}})
    cmd = router_command("g", "ns", routed)
    decode_sel = cmd[cmd.index("--decode-selector") + 1: cmd.index("--health-check-interval-secs")]
    assert decode_sel == ["pdfleet.io/deployment=g", "pdfleet.io/role=decode", "pdfleet.io/group-member=0"]
    prefill_sel = cmd[cmd.index("--prefill-selector") + 1: cmd.index("--decode-selector")]
    assert prefill_sel == ["pdfleet.io/deployment=g", "pdfleet.io/role=prefill"]


def test_sglang_members_get_their_node_rank_and_only_the_leader_the_bootstrap_annotation() -> None:
    spec = sglang_spec()
    obj = sglang_obj(spec__model__layout={"preset": "deepseek-mla"},
                     spec__prefill__parallelism={"tensor": 16, "nodesPerReplica": 2})
    pspec = PDDeploymentSpec.model_validate(obj["spec"])
    rev = role_revision(pspec, Role.PREFILL)
    for m in (0, 1):
        pod = runtime_pod("qwen", "ns", pspec, Role.PREFILL, rev, 0, m)
        engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        cmd = engine["command"]
        assert cmd[cmd.index("--node-rank") + 1] == str(m)
        assert cmd[cmd.index("--dist-init-addr") + 1] == f"qwen-prefill-{rev[:6]}-0.qwen-prefill-group.ns.svc:5000"
        assert ("sglang.ai/bootstrap-port" in pod["metadata"]["annotations"]) is (m == 0)
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "8"
        agent = next(c for c in pod["spec"]["containers"] if c["name"] == "runtime")
        assert env(agent)["PDFLEET_GROUP_MEMBER"] == str(m)  # the agent beside it knows its node rank
        assert "group" not in {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}  # NCCL instead
    children = {(c["kind"], c["metadata"]["name"]): c for c in desired_children(OWNER, spec)}
    assert children["Service", "g-decode-group"]["spec"]["ports"][0]["port"] == 5000


def test_placement_needs_a_node_per_member() -> None:
    nodes = [NodeFacts(name=f"n{i}", labels={}, taints=(), gpus=8) for i in range(3)]
    assert check_placement(sglang_spec(nodes=2), nodes) == []
    (problem,) = check_placement(sglang_spec(nodes=4), nodes)  # 4 x 4 GPUs: one pod per node, 3 nodes
    assert problem.problem is Problem.TOO_FEW_NODES_FOR_GROUP and "4 nodes" in problem.message


# -- the planner over a simulated world ------------------------------------------------------------


class World:
    """Pod bodies as the apiserver would hold them; ``apply`` performs a pass's pod actions."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.deleted: list[list[str]] = []  # the pod names each pass deleted
        self.drains: list[str] = []  # pods whose drain was started
        self.secret = self.router_secret = False
        self.group_secrets: set[Role] = set()
        self.worker_secret = False

    def snapshot(self) -> Snapshot:
        observed = (observed_pod(b, OWNER.uid) for b in self.pods.values())
        return Snapshot(pods=tuple(sorted((p for p in observed if p), key=lambda p: p.name)),
                        secret_exists=self.secret, group_secrets=frozenset(self.group_secrets),
                        worker_secret_exists=self.worker_secret)

    def apply(self, actions, now: float) -> None:
        gone = []
        for a in actions:
            if a.object_kind == "Secret" and a.kind is ActionKind.CREATE:
                if a.name == "g-transfer-auth":
                    self.secret = True
                elif a.name == "g-worker-auth":
                    self.worker_secret = True
                else:
                    self.group_secrets.add(Role(a.name.split("-")[1]))
            if a.object_kind != "Pod":
                continue
            if a.kind is ActionKind.CREATE:
                assert a.name not in self.pods, f"{a.name} created twice"
                self.pods[a.name] = {**a.body, "spec": {**a.body["spec"], "nodeName": "n"},
                                     "status": {"phase": "Running", "conditions": []}}
            elif a.kind is ActionKind.PATCH_META:
                if a.body["annotations"].get("pdfleet.io/drain-started"):
                    self.drains.append(a.name)
                meta = self.pods[a.name]["metadata"]
                for key in ("labels", "annotations"):
                    merged = {**meta.get(key, {}), **a.body.get(key, {})}
                    meta[key] = {k: v for k, v in merged.items() if v is not None}
            elif a.kind is ActionKind.DELETE:
                self.pods[a.name]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
                gone.append(a.name)
        self.deleted.append(gone)

    def tick(self, ready: set[str] | None = None) -> None:
        """Terminating pods go, running pods pass their gate (all, or ``ready``), draining ones report drained."""
        for name in [n for n, b in self.pods.items() if b["metadata"].get("deletionTimestamp")]:
            del self.pods[name]
        for name, body in self.pods.items():
            ok = ready is None or name in ready
            conds = [{"type": "Ready", "status": "True" if ok else "False"},
                     {"type": READINESS_GATE, "status": "True" if ok else "False", "reason": "Canary"}]
            stamp = body["metadata"].get("annotations", {}).get("pdfleet.io/drain-started")
            if stamp:
                conds.append({"type": DRAINED_CONDITION, "status": "True", "message": drained_message(stamp, "t")})
            body["status"]["conditions"] = conds

    def decode_groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, b in self.pods.items():
            labels = b["metadata"]["labels"]
            if labels["pdfleet.io/role"] == "decode":
                out.setdefault(labels.get("pdfleet.io/group", name), []).append(name)
        return out


def test_a_fresh_group_is_created_together_with_its_key_and_counted_once() -> None:
    spec, w = builtin_spec(), World()
    actions = plan(OWNER, spec, w.snapshot())
    created = [a.name for a in actions if a.kind is ActionKind.CREATE and a.object_kind == "Pod"]
    assert len(created) == 1 + 2 * 2  # one prefill pod, two decode groups of two
    secrets = {a.name for a in actions if a.object_kind == "Secret"}
    assert secrets == {"g-transfer-auth", "g-decode-group-auth", "g-worker-auth"}
    w.apply(actions, 0.0)
    (_, member) = sorted(w.decode_groups()[next(iter(sorted(w.decode_groups())))])
    w.tick(ready=set(w.pods) - {member})  # one member not yet joined: its group is not ready
    status = status_document(compute_status(spec, "g", 1, w.snapshot().pods, None, [], NOW))
    assert status["decode"]["replicas"] == 2 and status["decode"]["ready"] == 1 and status["decodeReady"] == "1/2"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Available"] == "False"
    w.tick()
    status = status_document(compute_status(spec, "g", 1, w.snapshot().pods, None, [], NOW))
    assert status["decodeReady"] == "2/2"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Available"] == "True"
    again = plan(OWNER, spec, w.snapshot())
    assert not [a for a in again if a.object_kind in ("Pod", "Secret") and a.kind is not ActionKind.APPLY]


@pytest.mark.parametrize("which", ["leader", "member"])
def test_a_deleted_member_restarts_its_whole_group(which: str) -> None:
    spec, w = builtin_spec(), World()
    w.apply(plan(OWNER, spec, w.snapshot()), 0.0)
    w.tick()
    groups = w.decode_groups()
    victim_group = sorted(groups)[0]
    members = sorted(groups[victim_group])
    victim = members[0] if which == "leader" else members[1]
    del w.pods[victim]  # deleted by a user, gone at once
    actions = plan(OWNER, spec, w.snapshot())
    deletes = [a for a in actions if a.kind is ActionKind.DELETE]
    (survivor,) = set(members) - {victim}
    assert [a.name for a in deletes] == [survivor] and deletes[0].reason.startswith("group restart")
    # the broken group still holds its GPUs: with maxSurge 1 one replacement group fits beside it
    created = [a.name for a in actions if a.kind is ActionKind.CREATE and a.object_kind == "Pod"]
    assert len(created) == 2 and all(n not in members for n in created)
    w.apply(actions, 0.0)
    w.tick()
    assert sorted(len(ms) for ms in w.decode_groups().values()) == [2, 2]
    assert not set(members) & set(w.pods)


def test_a_leader_that_lost_a_member_restarts_its_group() -> None:
    spec, w = builtin_spec(replicas=1), World()
    w.apply(plan(OWNER, spec, w.snapshot()), 0.0)
    w.tick()
    (members,) = [sorted(ms) for ms in w.decode_groups().values()]
    w.pods[members[0]]["status"]["conditions"] = [
        {"type": "Ready", "status": "False"},
        {"type": READINESS_GATE, "status": "False", "reason": "GroupMemberLost", "message": "member 1 went"}]
    deletes = {a.name for a in plan(OWNER, spec, w.snapshot()) if a.kind is ActionKind.DELETE}
    assert deletes == set(members)


@pytest.mark.parametrize("replicas,surge,unavailable", [(3, 1, 0), (3, 0, 1), (4, 2, 1), (1, 1, 0), (1, 0, 1)])
def test_a_group_rollout_respects_the_budgets_in_groups_and_deletes_whole_groups(
        replicas: int, surge: int, unavailable: int) -> None:
    spec = builtin_spec(replicas=replicas, maxSurge=surge, maxUnavailable=unavailable)
    w, rng = World(), random.Random(replicas * 10 + surge)
    w.apply(plan(OWNER, spec, w.snapshot()), 0.0)
    w.tick()
    new = builtin_spec(replicas=replicas, maxSurge=surge, maxUnavailable=unavailable)
    new = PDDeploymentSpec.model_validate({**new.model_dump(by_alias=True, mode="json"),
                                           "decode": {**new.model_dump(by_alias=True, mode="json")["decode"],
                                                      "image": "example.invalid/rt:2"}})
    new_rev = role_revision(new, Role.DECODE)
    old_leaders = {n for n in w.pods if "decode" in n and not n.endswith("-m1")}
    floor = replicas - max(unavailable, 0 if surge else 1)
    for step in range(200):
        snap = w.snapshot()
        actions = plan(OWNER, new, snap, now=float(step))
        w.apply(actions, float(step))
        groups = w.decode_groups()
        assert len(groups) <= replicas + surge, groups  # counting terminating groups: they hold GPUs
        ready_groups = [g for g, ms in groups.items() if len(ms) == 2 and all(
            {c["type"]: c["status"] for c in w.pods[m]["status"]["conditions"]}.get("Ready") == "True"
            and not w.pods[m]["metadata"].get("deletionTimestamp")
            and not w.pods[m]["metadata"].get("annotations", {}).get("pdfleet.io/drain-started") for m in ms)]
        assert len(ready_groups) >= floor, (step, groups)
        for gone in w.deleted[-1:]:  # deletes take whole groups: both members of each group at once
            decode_gone = [n for n in gone if "decode" in n]
            assert len(decode_gone) % 2 == 0 and all(f"{n}-m1" in decode_gone for n in decode_gone
                                                     if not n.endswith("-m1")), gone
        ready_now = {n for n, b in w.pods.items()
                     if {c["type"]: c["status"] for c in b["status"]["conditions"]}.get("Ready") == "True"}
        w.tick(ready={n for n in w.pods if n in ready_now or rng.random() < 0.5})  # once ready, stays ready
        pods = [p for p in w.snapshot().pods if p.role is Role.DECODE]
        if {p.revision for p in pods} == {new_rev} and len(pods) == 2 * replicas:
            w.tick()
            if all(p.ready for p in w.snapshot().pods):
                break
    else:
        pytest.fail("the group rollout did not converge")
    assert not any(b["metadata"].get("annotations", {}).get("pdfleet.io/drain-started") for b in w.pods.values())
    # every old group went through its leader's drain (members are never drained), once
    assert sorted(w.drains) == sorted(old_leaders), (w.drains, old_leaders)
