"""Per-role scale for outside autoscalers: the PDRoleScale CRD (one scale subresource per role), the
refusal of double control at admission, the object the operator makes, the count it hands to the
reconcile (drains on the way down, as an HPA writing /scale would cause), and the status the scale
subresource reads."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.crd import ROLESCALE_CRD_FILE, rolescale_crd_yaml
from pdfleet_operator.api.models import PDDeploymentSpec, PDDeploymentStatus, RoleStatus
from pdfleet_operator.api.rolescale import build_rolescale_crd, rolescale_name
from pdfleet_operator.api.schema import walk
from pdfleet_operator.autoscale.replicas import replicas_in_effect, with_replicas
from pdfleet_operator.autoscale.rolescale import (
    adapter_roles,
    external_counts,
    in_effect,
    rolescale_body,
    rolescale_status,
)
from pdfleet_operator.observed import ObservedPod
from pdfleet_operator.plan import ActionKind, Owner, Snapshot, plan
from pdfleet_operator.reconcile import Reconciler
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.validation import validate_object

VALID = Path(__file__).resolve().parents[3] / "examples" / "valid"
OWNER = Owner(name="demo", namespace="ns", uid="uid-1")


def obj_of(name: str) -> dict[str, Any]:
    return yaml.safe_load((VALID / name).read_text())


def adapter_spec(replicas: int = 4) -> PDDeploymentSpec:
    raw = obj_of("llama-dense.yaml")["spec"]
    raw["decode"].update(replicas=replicas, scalingAdapter=True)
    return PDDeploymentSpec.model_validate(raw)


def test_the_crd_has_one_scale_subresource_on_the_role_count_and_is_generated() -> None:
    crd = build_rolescale_crd()
    (version,) = crd["spec"]["versions"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert ROLESCALE_CRD_FILE.read_text() == rolescale_crd_yaml(), "run python -m pdfleet_operator.api.crd --write"
    for path, node in walk(version["schema"]["openAPIV3Schema"]):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["role"]["enum"] == ["prefill", "decode"]
    assert "oldSelf" in spec["x-kubernetes-validations"][0]["rule"]  # deployment and role are immutable


def test_autoscaling_and_an_outside_autoscaler_on_one_role_are_refused_at_admission() -> None:
    both = obj_of("autoscaling.yaml")
    both["spec"]["decode"]["scalingAdapter"] = True
    verdict = validate_object(copy.deepcopy(both))
    assert not verdict.admitted
    (v,) = [v for v in verdict.violations if v.rule == "autoscaling-double-control"]
    assert v.paths == ("spec.autoscaling",) and "scalingAdapter" in v.fix
    alone = obj_of("llama-dense.yaml")
    alone["spec"]["decode"]["scalingAdapter"] = True
    assert validate_object(alone).admitted


def test_the_adapter_flag_is_not_a_new_revision() -> None:
    plain = adapter_spec().model_copy(update={"decode": adapter_spec().decode.model_copy(
        update={"scaling_adapter": False})})
    assert role_revision(plain, Role.DECODE) == role_revision(adapter_spec(), Role.DECODE)


def scale_obj(spec: PDDeploymentSpec, role: Role = Role.DECODE, replicas: int | None = None,
              owned: bool = True) -> dict[str, Any]:
    body = rolescale_body(OWNER, spec, role)
    body["metadata"]["uid"] = "rs-1"
    if not owned:
        body["metadata"]["ownerReferences"] = []
    if replicas is not None:
        body["spec"]["replicas"] = replicas
    return body


def test_the_operator_makes_one_object_per_adapter_role_starting_from_the_spec() -> None:
    spec = adapter_spec(4)
    assert adapter_roles(spec) == [Role.DECODE]
    body = rolescale_body(OWNER, spec, Role.DECODE)
    assert body["metadata"]["name"] == rolescale_name("demo", Role.DECODE) == "demo-decode"
    assert body["spec"] == {"deployment": "demo", "role": "decode", "replicas": 4}
    assert body["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid  # goes with its deployment
    assert body["metadata"]["labels"]["pdfleet.io/deployment"] == "demo"  # watched like every child


def test_only_the_operators_object_for_an_adapter_role_drives_it() -> None:
    spec = adapter_spec(4)
    assert in_effect(spec, OWNER, scale_obj(spec))[0] is Role.DECODE
    role, why = in_effect(spec, OWNER, scale_obj(spec, owned=False))
    assert role is None and "not made by the operator" in why
    role, why = in_effect(spec, OWNER, scale_obj(spec, Role.PREFILL))
    assert role is None and "scalingAdapter is false" in why
    raw = obj_of("autoscaling.yaml")["spec"]
    raw["decode"]["scalingAdapter"] = True  # admission refuses it; if it is stored anyway, the autoscaler keeps it
    both = PDDeploymentSpec.model_validate(raw)
    role, why = in_effect(both, OWNER, scale_obj(both))
    assert role is None and "ignored" in why
    assert adapter_roles(both) == []


def test_a_role_driven_through_its_scale_follows_it_through_drains() -> None:
    """An HPA writes /scale (spec.replicas 4 -> 2): the reconcile drains two decode pods (the highest
    indices), deletes none before they report drained, and grows back by creating pods."""
    spec = adapter_spec(4)
    rev, rev_p = role_revision(spec, Role.DECODE), role_revision(spec, Role.PREFILL)
    pods = (ObservedPod("p0", Role.PREFILL, rev_p, 0, True),
            *(ObservedPod(f"d{i}", Role.DECODE, rev, i, True) for i in range(4)))
    snap = Snapshot(pods=pods, secret_exists=True, router_secret_exists=True, worker_secret_exists=True)
    counts = replicas_in_effect(spec, None, external_counts(spec, OWNER, [scale_obj(spec, replicas=2)]))
    assert counts[Role.DECODE] == 2
    actions = plan(OWNER, with_replicas(spec, counts), snap, now=100.0)
    assert sorted(a.name for a in actions if a.kind is ActionKind.PATCH_META) == ["d2", "d3"]
    assert not [a for a in actions if a.kind is ActionKind.DELETE and a.object_kind == "Pod"]
    up = replicas_in_effect(spec, None, external_counts(spec, OWNER, [scale_obj(spec, replicas=6)]))
    grown = plan(OWNER, with_replicas(spec, up), snap, now=100.0)
    assert [a for a in grown if a.kind is ActionKind.CREATE and a.object_kind == "Pod"]
    # A hand-made object drives nothing: the spec's count stays.
    assert replicas_in_effect(spec, None, external_counts(spec, OWNER, [scale_obj(spec, replicas=2, owned=False)])) == {
        Role.PREFILL: spec.prefill.replicas, Role.DECODE: 4}


def test_the_status_the_scale_subresource_reads() -> None:
    spec = adapter_spec(4)
    st = rolescale_status(spec, OWNER, scale_obj(spec), {Role.DECODE: (3, 2), Role.PREFILL: (1, 1)})
    assert st["replicas"] == 3 and st["ready"] == 2 and st["inEffect"] is True
    assert st["selector"] == "pdfleet.io/deployment=demo,pdfleet.io/role=decode"
    off = rolescale_status(spec, OWNER, scale_obj(spec, owned=False), {Role.DECODE: (3, 2)})
    assert off["inEffect"] is False and "drives nothing" in off["message"]


class _Api:
    def call_api(self, *a: Any, **kw: Any) -> Any:
        raise AssertionError("no API call expected")


class _Writer:
    def __init__(self) -> None:
        self.patches: list[tuple[str, dict]] = []

    def patch_status_of(self, api_version: str, kind: str, namespace: str, name: str, status: dict) -> dict:
        self.patches.append((name, status))
        return {"metadata": {"name": name, "resourceVersion": "7"}, "status": status}


def test_the_reconcile_writes_the_scale_status_only_when_it_changed() -> None:
    spec = adapter_spec(4)
    r = Reconciler(_Api(), lambda obj: ([], None))  # type: ignore[arg-type]
    writer = _Writer()
    r._writer = writer  # type: ignore[assignment]
    status = PDDeploymentStatus(prefill=RoleStatus(replicas=1, ready=1), decode=RoleStatus(replicas=4, ready=4))
    body = scale_obj(spec)
    r._write_scales(OWNER, spec, [body], status)
    ((name, st),) = writer.patches
    assert name == "demo-decode" and st["replicas"] == 4 and st["inEffect"]
    body["status"] = st
    r._write_scales(OWNER, spec, [body], status)
    assert len(writer.patches) == 1  # unchanged: nothing written
