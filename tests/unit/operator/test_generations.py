"""Routers pair one generation at a time (generations.py): a change of the compatibility key keeps the old
generation serving until the router has switched to a new one with a ready prefill and decode, and has rolled.

A simulated fleet (pods as the planner observes them) goes through the passes of such a rollout; at every pass
the pods the router's selectors find are of one generation, and that generation has a ready prefill and decode.
The same rollout planned with ``by_generation=False`` selects both generations (what the e2e's refusals show).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.generations import kept, router_state, serving
from pdfleet_operator.observed import Generation, ObservedPod, Owner, RouterState, Snapshot
from pdfleet_operator.plan import Action, ActionKind, plan, target_generation
from pdfleet_operator.resources.compat import compat_key
from pdfleet_operator.resources.names import ANNOTATION_DECODE_COMPAT, ANNOTATION_PREFILL_COMPAT, LABEL_COMPAT
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.router import router_deployment
from pdfleet_runtime.readiness_problems import Problem

OWNER = Owner(name="demo", namespace="ns", uid="uid-1")
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "valid" / "llama-dense.yaml"
A, B = Generation("ka", "ka"), Generation("kb", "kb")


def spec(dtype: str = "bfloat16", surge: int = 1) -> PDDeploymentSpec:
    raw = yaml.safe_load(EXAMPLE.read_text())["spec"]
    raw["model"]["layout"] = {"inline": {"numLayers": 32, "fullAttentionLayers": {"interval": 1}, "kvHeads": 8,
                                         "headDim": 128, "pageSize": 16, "dtype": dtype}}
    raw["prefill"]["replicas"], raw["decode"]["replicas"] = 1, 2
    raw["rollout"] = {"maxSurge": surge, "maxUnavailable": 0 if surge else 1}
    raw["router"] = {"image": "ghcr.io/pdfleet/runtime:0.1.0"}
    return PDDeploymentSpec.model_validate(raw)


def pod(name: str, role: Role, compat: str, index: int = 0, ready: bool = True) -> ObservedPod:
    return ObservedPod(name=name, role=role, revision=compat, index=index, ready=ready, compat=compat)


def test_the_router_keeps_its_generation_until_the_new_one_has_a_ready_prefill_and_decode() -> None:
    old = [pod("p0", Role.PREFILL, "ka"), pod("d0", Role.DECODE, "ka")]
    settled_a = RouterState(A, settled=True)
    assert serving(B, None, old)[0] == B  # a new router: the target at once
    assert serving(B, settled_a, old)[0] == A
    assert serving(B, settled_a, [*old, pod("p1", Role.PREFILL, "kb")])[0] == A  # no decode of B yet
    assert serving(B, settled_a, [*old, pod("p1", Role.PREFILL, "kb"), pod("d1", Role.DECODE, "kb", ready=False)])[0] == A
    assert serving(B, settled_a, [*old, pod("p1", Role.PREFILL, "kb"), pod("d1", Role.DECODE, "kb")])[0] == B
    # The old generation has nothing left to protect (its prefill gone): switch rather than serve nothing.
    assert serving(B, settled_a, [pod("d0", Role.DECODE, "ka"), pod("p1", Role.PREFILL, "kb")])[0] == B
    assert serving(B, RouterState(None, settled=True), old)[0] == B  # a router from before generations


def test_one_old_pod_per_role_is_kept_until_the_router_settled_on_the_target() -> None:
    pods = [pod("p0", Role.PREFILL, "ka"), pod("d0", Role.DECODE, "ka", 0), pod("d1", Role.DECODE, "ka", 1),
            pod("d2", Role.DECODE, "kb", 2)]
    assert kept(Role.DECODE, B, A, RouterState(A, True), pods, surge=1) == {"d0"}
    assert kept(Role.PREFILL, B, A, RouterState(A, True), pods, surge=1) == {"p0"}
    assert kept(Role.DECODE, B, B, RouterState(A, True), pods, surge=1) == {"d0"}  # switching in this pass
    assert kept(Role.DECODE, B, B, RouterState(B, False), pods, surge=1) == {"d0"}  # rolling its router pods
    assert kept(Role.DECODE, B, B, RouterState(B, True), pods, surge=1) == frozenset()
    assert kept(Role.DECODE, B, A, None, pods, surge=1) == frozenset()  # no router
    assert kept(Role.DECODE, B, A, RouterState(A, True), pods, surge=0) == frozenset()  # no room: as before
    draining = [replace(p, drain_started=1.0) if p.name == "d0" else p for p in pods]
    assert kept(Role.DECODE, B, A, RouterState(A, True), draining, surge=1) == {"d1"}


def test_router_state_reads_the_deployments_generation_and_whether_it_rolled_out() -> None:
    body = router_deployment("demo", "ns", spec(), A)
    body["metadata"]["generation"] = 3
    assert body["metadata"]["annotations"] == {ANNOTATION_PREFILL_COMPAT: "ka", ANNOTATION_DECODE_COMPAT: "ka"}
    done = {"observedGeneration": 3, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}
    assert router_state({**body, "status": done}) == RouterState(A, True)
    assert router_state({**body, "status": {**done, "observedGeneration": 2}}) == RouterState(A, False)
    assert router_state({**body, "status": {**done, "replicas": 2}}) == RouterState(A, False)  # an old pod left
    assert router_state({**body, "status": {**done, "availableReplicas": 0}}) == RouterState(A, False)
    assert router_state({**body, "status": {**done, "terminatingReplicas": 1}}) == RouterState(A, False)
    bare = copy.deepcopy(body)
    del bare["metadata"]["annotations"]
    assert router_state({**bare, "status": done}) == RouterState(None, True)
    assert router_state(None) is None


# --------------------------------------------------------------------------- a simulated rollout


class Fleet:
    """Pods as the planner observes them, and the router Deployment; each pass applies the plan's pod actions
    (new pods start not ready; ``ready()`` readies them), drains finish at once, the Deployment rolls when told."""

    def __init__(self, s: PDDeploymentSpec) -> None:
        self.pods: dict[str, ObservedPod] = {}
        self.router: RouterState | None = None
        self.selected: list[set[str]] = []  # per pass: the compat keys the router's selectors allow
        self.step(s, by_generation=True)
        self.ready()
        self.step(s, by_generation=True)
        self.router = RouterState(self.router.serving if self.router else None, settled=True)

    def step(self, s: PDDeploymentSpec, *, by_generation: bool) -> list[Action]:
        snap = Snapshot(pods=tuple(sorted(self.pods.values(), key=lambda p: p.name)), secret_exists=True,
                        router_secret_exists=True, worker_secret_exists=True, router=self.router)
        actions = plan(OWNER, s, snap, now=100.0, by_generation=by_generation)
        for a in actions:
            if a.object_kind == "Pod" and a.kind is ActionKind.CREATE:
                labels = a.body["metadata"]["labels"]
                self.pods[a.name] = ObservedPod(
                    name=a.name, role=Role(labels["pdfleet.io/role"]), revision=labels["pdfleet.io/revision"],
                    index=int(labels["pdfleet.io/index"]), ready=False, compat=labels[LABEL_COMPAT],
                    gate="False", gate_problem=Problem.WAITING)  # its runtime runs: no canary through it yet
            elif a.object_kind == "Pod" and a.kind is ActionKind.PATCH_META:
                self.pods[a.name] = replace(self.pods[a.name], drain_started=100.0, drained=True)
            elif a.object_kind == "Pod" and a.kind is ActionKind.DELETE:
                self.pods.pop(a.name, None)
        [dep] = [a.body for a in actions if a.kind is ActionKind.APPLY and a.object_kind == "Deployment"]
        notes = dep["metadata"].get("annotations") or {}
        gen = Generation(notes[ANNOTATION_PREFILL_COMPAT], notes[ANNOTATION_DECODE_COMPAT]) if notes else None
        if self.router is None or gen != self.router.serving:
            self.router = RouterState(gen, settled=False)  # a new template: its pods roll
        terms = [t.split("=", 1)[1] for t in dep["spec"]["template"]["spec"]["containers"][0]["command"]
                 if t.startswith(f"{LABEL_COMPAT}=")]
        self.selected.append(set(terms) or {"any"})
        return actions

    def ready(self) -> None:
        self.pods = {n: replace(p, ready=True, gate="True", gate_problem=None) for n, p in self.pods.items()}

    def routable(self, role: Role, key: str) -> list[str]:
        return [p.name for p in self.pods.values()
                if p.role is role and p.compat == key and p.ready and p.drain_started is None]

    @staticmethod
    def key(s: PDDeploymentSpec) -> str:
        return compat_key(s, Role.DECODE)


def test_a_rollout_of_the_compatibility_key_never_gives_the_router_two_generations_or_none() -> None:
    s_a, s_b = spec("bfloat16"), spec("float16")
    ka, kb = Fleet.key(s_a), Fleet.key(s_b)
    assert ka != kb and role_revision(s_a, Role.DECODE) != role_revision(s_b, Role.DECODE)
    assert target_generation({r: (role_revision(s_b, r), s_b) for r in Role}) == Generation(kb, kb)
    fleet = Fleet(s_a)
    assert fleet.router == RouterState(Generation(ka, ka), settled=True)
    switched_at = None
    for n in range(30):
        fleet.step(s_b, by_generation=True)
        [keys] = fleet.selected[-1:]
        assert len(keys) == 1, keys  # one generation at a time
        [key] = keys
        # the generation the router's selectors carry has a ready prefill and decode at every pass
        assert fleet.routable(Role.PREFILL, key) and fleet.routable(Role.DECODE, key), (n, key, fleet.pods)
        if key == kb and switched_at is None:
            switched_at = n
        fleet.ready()
        if fleet.router is not None and not fleet.router.settled and n > (switched_at or 99):
            fleet.router = replace(fleet.router, settled=True)  # the Deployment rolled in between
        if all(p.compat == kb for p in fleet.pods.values()) and len(fleet.pods) == 3:
            break
    else:
        raise AssertionError(f"the rollout did not finish: {fleet.pods}")
    assert switched_at is not None


def test_without_generations_the_router_selects_both_generations_during_the_same_rollout() -> None:
    s_a, s_b = spec("bfloat16"), spec("float16")
    fleet = Fleet(s_a)
    mixed = False
    for _ in range(30):
        fleet.step(s_b, by_generation=False)
        assert fleet.selected[-1] == {"any"}
        ka, kb = Fleet.key(s_a), Fleet.key(s_b)
        mixed |= bool(fleet.routable(Role.PREFILL, ka) or fleet.routable(Role.DECODE, ka)) and bool(
            fleet.routable(Role.PREFILL, kb) or fleet.routable(Role.DECODE, kb))
        fleet.ready()
        if all(p.compat == kb for p in fleet.pods.values()) and len(fleet.pods) == 3:
            break
    assert mixed  # pods of both generations were routable at once: the router would pair them
