"""The pure reconcile planner and status: spec + observed pods -> desired objects and actions.

Covers every valid example (each role shape and option) without a cluster.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from pdfleet_operator.api.constants import ConditionType, Role
from pdfleet_operator.api.models import PDDeploymentSpec, PDDeploymentStatus
from pdfleet_operator.observe import observed_pod
from pdfleet_operator.plan import ActionKind, ObservedPod, Owner, Snapshot, desired_children, plan
from pdfleet_operator.resources.pods import ANNOTATION_IDENTITY, GPU_RESOURCE, runtime_pod
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.runtime_config import runtime_config
from pdfleet_operator.status import compute_status, status_document
from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.readiness_problems import Problem

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "valid").glob("*.yaml"))
OWNER = Owner(name="demo", namespace="ns", uid="uid-1")
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def load_spec(path: Path) -> PDDeploymentSpec:
    return PDDeploymentSpec.model_validate(yaml.safe_load(path.read_text())["spec"])


def base_spec(**decode: object) -> PDDeploymentSpec:
    raw = yaml.safe_load((EXAMPLES[0].parent / "llama-dense.yaml").read_text())["spec"]
    raw["decode"].update(decode)
    return PDDeploymentSpec.model_validate(raw)


def pods_of(actions, role: Role | None = None) -> list[dict]:
    out = [a.body for a in actions if a.kind is ActionKind.CREATE and a.object_kind == "Pod"]
    return [p for p in out if role is None or p["metadata"]["labels"]["pdfleet.io/role"] == role.value]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_fresh_deployment_creates_every_child_owned(path: Path) -> None:
    spec = load_spec(path)
    actions = plan(OWNER, spec, Snapshot())
    kinds = sorted({(a.kind, a.object_kind) for a in actions})
    assert (ActionKind.CREATE, "Secret") in kinds
    assert {a.object_kind for a in actions if a.kind is ActionKind.APPLY} == {
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "NetworkPolicy", "PodDisruptionBudget",
        *(["Deployment"] if spec.router else [])}
    for a in actions:
        if a.body is not None and a.kind is not ActionKind.PATCH_LABELS:
            refs = a.body["metadata"]["ownerReferences"]
            assert refs == [OWNER.reference()] and refs[0]["controller"] is True
    for role, rs in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode)):
        pods = pods_of(actions, role)
        nodes = rs.parallelism.nodes_per_replica  # a multi-node replica is one pod per node, in its group
        assert len(pods) == rs.replicas * nodes
        gpus = rs.parallelism.tensor * rs.parallelism.pipeline // nodes
        sglang = spec.engine is not None and spec.engine.kind.value in ("sglang", "vllm")  # an engine container
        for pod in pods:
            c = pod["spec"]["containers"][-1]  # the runtime (on SGLang pods the agent beside the engine)
            gpu_holder = pod["spec"]["containers"][0]  # the runtime, or SGLang's engine container
            assert gpu_holder["resources"]["limits"][GPU_RESOURCE] == str(gpus)
            assert [g["conditionType"] for g in pod["spec"]["readinessGates"]] == ["pdfleet.io/transfer-path"]
            assert pod["spec"]["terminationGracePeriodSeconds"] == spec.rollout.drain_timeout_seconds + 30
            assert len(pod["metadata"]["name"]) <= 63
            assert pod["spec"]["subdomain"] == f"demo-{role.value}" + ("-group" if nodes > 1 else "")
            engine_ports = [p for p in gpu_holder["ports"] if p["name"].startswith("engine-")]
            assert len(engine_ports) == (1 if sglang else gpus)  # SGLang: its HTTP port; it picks the rest
            assert any(e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
                       for e in c["env"])
            # The drain runs in the container (exec) against the loopback admin port, never over the pod IP.
            assert c["lifecycle"]["preStop"] == {"exec": {"command": ["pdfleet-runtime", "drain", "--wait",
                                                                      "--config", "/etc/pdfleet/runtime.yaml"]}}
            assert "httpGet" not in c["lifecycle"]["preStop"]
            assert c["securityContext"]["privileged"] is False
            assert pod["spec"].get("hostIPC", False) is (spec.transfer.protocol.value == "nvlink")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_runtime_config_round_trips_through_the_runtime_model(path: Path) -> None:
    spec = load_spec(path)
    for role in Role:
        rev = role_revision(spec, role)
        cm = next(o for o in desired_children(OWNER, spec)
                  if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"demo-{role.value}-{rev}-runtime")
        parsed = RuntimeConfig.model_validate(yaml.safe_load(cm["data"]["runtime.yaml"]))
        assert parsed == runtime_config("demo", "ns", spec, role)
        assert parsed.role.value == role.value
        assert parsed.prefill_service == "demo-prefill"
        assert "key" not in cm["data"]["runtime.yaml"].split("secretPath")[0]  # only a path, no secret


def test_runtime_config_carries_the_served_name() -> None:
    raw = yaml.safe_load((EXAMPLES[0].parent / "llama-dense.yaml").read_text())["spec"]
    named = PDDeploymentSpec.model_validate({**raw, "model": {**raw["model"], "servedName": "org/llama-3.1@v2"}})
    unset = base_spec()
    assert unset.model.served_name is None
    for role in Role:
        cm = next(o for o in desired_children(OWNER, named)
                  if o["kind"] == "ConfigMap" and o["metadata"]["labels"]["pdfleet.io/role"] == role.value)
        text = cm["data"]["runtime.yaml"]
        assert yaml.safe_load(text)["servedModelName"] == "org/llama-3.1@v2"
        assert RuntimeConfig.model_validate(yaml.safe_load(text)).served_model_name == "org/llama-3.1@v2"
        # Unset: nothing in the file (earlier configs unchanged); the runtime answers as the deployment.
        fallback = runtime_config("demo", "ns", unset, role)
        assert fallback.served_model_name is None and "servedModelName" not in fallback.to_yaml()
        assert fallback.deployment == "demo"


def test_second_pass_is_idempotent() -> None:
    spec = base_spec()
    first = plan(OWNER, spec, Snapshot())
    created = [observed_pod({**p, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}, "uid-1")
               for p in pods_of(first)]
    second = plan(OWNER, spec, Snapshot(pods=tuple(created), secret_exists=True, worker_secret_exists=True))
    assert [a.kind for a in second] == [ActionKind.APPLY] * len(desired_children(OWNER, spec)) + [ActionKind.CREATE] * 2
    assert {a.object_kind for a in second if a.kind is ActionKind.CREATE} == {"ControllerRevision"}
    stored = {(r, role_revision(spec, r)): spec for r in Role}
    third = plan(OWNER, spec, Snapshot(pods=tuple(created), secret_exists=True, revisions=stored,
                                       worker_secret_exists=True))
    assert [a.kind for a in third] == [ActionKind.APPLY] * len(desired_children(OWNER, spec))


def drains(actions) -> list[str]:
    return [a.name for a in actions if a.kind is ActionKind.PATCH_META
            and a.body["labels"]["pdfleet.io/routable"] == "false"]


def test_scale_up_and_down_decode() -> None:
    spec = base_spec(replicas=2)
    rev = role_revision(spec, Role.DECODE)
    pods = [ObservedPod(f"d{i}", Role.DECODE, rev, i, ready=i != 1) for i in range(4)]
    pods.append(ObservedPod("p0", Role.PREFILL, role_revision(spec, Role.PREFILL), 0, ready=True))
    actions = plan(OWNER, spec, Snapshot(pods=tuple(pods), secret_exists=True), now=100.0)
    assert drains(actions) == ["d1", "d3"]  # the not-ready one first, then the highest index
    assert not [a for a in actions if a.kind is ActionKind.DELETE]  # drain first, delete later
    drained = [*pods[:4]]
    drained[1] = ObservedPod("d1", Role.DECODE, rev, 1, ready=False, drain_started=100.0, drained=True)
    drained[3] = ObservedPod("d3", Role.DECODE, rev, 3, ready=True, drain_started=100.0)
    later = plan(OWNER, spec, Snapshot(pods=(*drained, pods[4]), secret_exists=True), now=101.0)
    deletes = [a for a in later if a.kind is ActionKind.DELETE]
    assert [(a.name, a.reason) for a in deletes] == [("d1", "drained")]
    forced = plan(OWNER, spec, Snapshot(pods=(*drained, pods[4]), secret_exists=True),
                  now=100.0 + spec.rollout.drain_timeout_seconds)
    assert {a.name: a.reason for a in forced if a.kind is ActionKind.DELETE}["d3"].startswith("FORCED")
    up = plan(OWNER, base_spec(replicas=5), Snapshot(pods=tuple(pods[:2] + pods[4:]), secret_exists=True))
    new = pods_of(up, Role.DECODE)
    assert [p["metadata"]["labels"]["pdfleet.io/index"] for p in new] == ["2", "3", "4"]


def test_template_change_surges_then_drains_old_when_new_ready() -> None:
    old_spec, new_spec = base_spec(replicas=2), base_spec(replicas=2, image="ghcr.io/pdfleet/runtime:0.2.0")
    old_rev, new_rev = role_revision(old_spec, Role.DECODE), role_revision(new_spec, Role.DECODE)
    assert old_rev != new_rev
    assert role_revision(old_spec, Role.PREFILL) == role_revision(new_spec, Role.PREFILL)
    old = (ObservedPod("o0", Role.DECODE, old_rev, 0, True), ObservedPod("o1", Role.DECODE, old_rev, 1, True))
    step1 = plan(OWNER, new_spec, Snapshot(pods=old, secret_exists=True))
    assert len(pods_of(step1, Role.DECODE)) == 1  # maxSurge 1
    assert not drains(step1)  # one side per pass, and maxUnavailable 0
    new0 = ObservedPod("n2", Role.DECODE, new_rev, 2, ready=True)
    step2 = plan(OWNER, new_spec, Snapshot(pods=(*old, new0), secret_exists=True))
    assert drains(step2) == ["o1"]
    assert not pods_of(step2, Role.DECODE)  # no room until o1 is gone


def test_a_pod_whose_drain_was_just_cancelled_is_not_counted_as_ready_capacity() -> None:
    """A revert mid-rollout cancels the drain of a pod of the reverted-to revision; its runtime may still be
    going not ready for that drain while Ready shows the state before: no new drain may count on it yet."""
    spec = base_spec(replicas=2)
    rev, other = role_revision(spec, Role.DECODE), "d" * 10
    prefill = ObservedPod("p0", Role.PREFILL, role_revision(spec, Role.PREFILL), 0, ready=True)
    back = plan(OWNER, spec, Snapshot(pods=(
        ObservedPod("c1", Role.DECODE, rev, 1, ready=True),
        ObservedPod("c2", Role.DECODE, rev, 2, ready=True, drain_started=99.0),
        ObservedPod("d0", Role.DECODE, other, 0, ready=True), prefill), secret_exists=True), now=100.0)
    [cancel] = [a for a in back if a.kind is ActionKind.PATCH_META]
    assert cancel.name == "c2" and cancel.body["annotations"]["pdfleet.io/drain-cancelled"] == "100.000"
    body = runtime_pod("demo", "ns", spec, Role.DECODE, rev, 2)
    body["metadata"]["ownerReferences"] = [OWNER.reference()]
    body["metadata"]["annotations"].update(cancel.body["annotations"])
    observed = observed_pod(body, "uid-1")
    assert observed is not None and observed.drain_cancelled == 100.0 and observed.drain_started is None
    pods = (ObservedPod("c1", Role.DECODE, rev, 1, ready=True),
            ObservedPod("c2", Role.DECODE, rev, 2, ready=True, drain_cancelled=100.0),
            ObservedPod("d0", Role.DECODE, other, 0, ready=True), prefill)
    assert drains(plan(OWNER, spec, Snapshot(pods=pods, secret_exists=True), now=101.0)) == []
    assert drains(plan(OWNER, spec, Snapshot(pods=pods, secret_exists=True), now=106.0)) == ["d0"]


def test_scaling_is_not_a_new_revision() -> None:
    assert role_revision(base_spec(replicas=1), Role.DECODE) == role_revision(base_spec(replicas=7), Role.DECODE)


def test_edited_identity_labels_are_restored() -> None:
    spec = base_spec(replicas=1)
    pod = pods_of(plan(OWNER, spec, Snapshot()), Role.DECODE)[0]
    edited = copy.deepcopy(pod)
    edited["metadata"]["labels"]["pdfleet.io/role"] = "oops"
    seen = observed_pod(edited, "uid-1")
    assert seen is not None and not seen.labels_ok
    actions = plan(OWNER, spec, Snapshot(pods=(seen,), secret_exists=True))
    fix = [a for a in actions if a.kind is ActionKind.PATCH_LABELS]
    assert len(fix) == 1 and fix[0].body["pdfleet.io/role"] == "decode"
    assert observed_pod(pod, "someone-else") is None
    no_identity = copy.deepcopy(pod)
    del no_identity["metadata"]["annotations"][ANNOTATION_IDENTITY]
    assert observed_pod(no_identity, "uid-1") is None


def test_status_available_only_when_gates_pass() -> None:
    spec = base_spec(replicas=2)
    rev_p, rev_d = role_revision(spec, Role.PREFILL), role_revision(spec, Role.DECODE)

    def status(ready: bool) -> dict:
        pods = [ObservedPod("p0", Role.PREFILL, rev_p, 0, ready)] + [
            ObservedPod(f"d{i}", Role.DECODE, rev_d, i, ready) for i in range(2)]
        return status_document(compute_status(spec, "demo", 3, pods, None, [], NOW))

    not_ready, ready = status(False), status(True)
    cond = {c["type"]: c for c in not_ready["conditions"]}
    assert cond[ConditionType.AVAILABLE.value]["status"] == "False"
    assert "transfer" in cond[ConditionType.AVAILABLE.value]["message"]
    assert {c["type"]: c["status"] for c in ready["conditions"]}["Available"] == "True"
    assert ready["decodeReady"] == "2/2" and ready["prefillReady"] == "1/1"
    assert ready["shapes"] == "P tp4xpp1 / D tp2xpp1" and ready["observedGeneration"] == 3
    assert ready["decode"]["selector"] == "pdfleet.io/deployment=demo,pdfleet.io/role=decode"
    # Unchanged statuses keep their transition time; changed ones get a new one.
    later = datetime(2026, 1, 2, tzinfo=UTC)
    again = status_document(compute_status(spec, "demo", 3, [], PDDeploymentStatus.model_validate(ready), [], later))
    times = {c["type"]: c["lastTransitionTime"] for c in again["conditions"]}
    assert times["Available"].startswith("2026-01-02")
    same = status_document(compute_status(spec, "demo", 3, [ObservedPod("p0", Role.PREFILL, rev_p, 0, True)] + [
        ObservedPod(f"d{i}", Role.DECODE, rev_d, i, True) for i in range(2)], PDDeploymentStatus.model_validate(ready),
        [], later))
    assert {c["type"]: c["lastTransitionTime"] for c in same["conditions"]}["Available"].startswith("2026-01-01")


def test_long_names_fit_hostnames() -> None:
    owner = Owner(name="x" * 120, namespace="ns", uid="u")
    pod = runtime_pod(owner.name, "ns", base_spec(), Role.DECODE, "abcdef1234", 17)
    assert len(pod["metadata"]["name"]) <= 63
    assert pod["spec"]["hostname"] == pod["metadata"]["name"]


def test_decode_rollout_holds_until_a_running_prefill_shares_its_key() -> None:
    """Running, not ready: a new-key prefill is ready only once a new-key decode canaried it (the handshake refuses
    the old decodes), so the decode starts beside a prefill still waiting for it."""
    from pdfleet_operator.resources.compat import compat_key

    old_spec = base_spec(replicas=1)
    raw = old_spec.model_dump(mode="json", by_alias=True)
    raw["decode"]["parallelism"]["tensor"] = 1  # a new pairing shape: a new compatibility key
    new_spec = PDDeploymentSpec.model_validate(raw)
    old_key, new_key = compat_key(old_spec, Role.DECODE), compat_key(new_spec, Role.DECODE)
    assert old_key != new_key and compat_key(new_spec, Role.PREFILL) == new_key
    decode = ObservedPod("d0", Role.DECODE, role_revision(old_spec, Role.DECODE), 0, True, compat=old_key)
    old_prefill = ObservedPod("p0", Role.PREFILL, role_revision(old_spec, Role.PREFILL), 0, True, compat=old_key)
    held = plan(OWNER, new_spec, Snapshot(pods=(decode, old_prefill), secret_exists=True))
    assert next(a.reason for a in held if a.kind is ActionKind.HOLD).startswith("decode revision holds")
    assert not pods_of(held, Role.DECODE)
    unscheduled = ObservedPod("p1", Role.PREFILL, role_revision(new_spec, Role.PREFILL), 1, False, compat=new_key,
                              scheduled=False)
    held = plan(OWNER, new_spec, Snapshot(pods=(decode, old_prefill, unscheduled), secret_exists=True))
    assert any(a.kind is ActionKind.HOLD for a in held)  # no node yet: nothing runs to pair with
    unreported = ObservedPod("p1", Role.PREFILL, role_revision(new_spec, Role.PREFILL), 1, False, compat=new_key)
    held = plan(OWNER, new_spec, Snapshot(pods=(decode, old_prefill, unreported), secret_exists=True))
    assert any(a.kind is ActionKind.HOLD for a in held)  # its runtime has not reported its gate yet
    failing = ObservedPod("p1", Role.PREFILL, role_revision(new_spec, Role.PREFILL), 1, False, compat=new_key,
                          gate="False", gate_problem=Problem.FAILING, gate_message="TransfersFailing: 3 in a row")
    held = plan(OWNER, new_spec, Snapshot(pods=(decode, old_prefill, failing), secret_exists=True))
    assert any(a.kind is ActionKind.HOLD for a in held)  # its gate failed: it cannot move state, no partner
    assert not pods_of(held, Role.DECODE)
    new_prefill = ObservedPod("p1", Role.PREFILL, role_revision(new_spec, Role.PREFILL), 1, False, compat=new_key,
                              gate="False", gate_problem=Problem.WAITING)  # waiting for a decode's canary: not yet
    moving = plan(OWNER, new_spec, Snapshot(pods=(decode, old_prefill, new_prefill), secret_exists=True))
    assert not [a for a in moving if a.kind is ActionKind.HOLD]
    assert pods_of(moving, Role.DECODE)[0]["metadata"]["labels"]["pdfleet.io/compat"] == new_key
