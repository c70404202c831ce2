"""The status a reconcile pass writes, as JSON, for representative passes: it must stay what the operator
has always written (``status_wire/*.json``, recorded from the dict-built status before the typed status
models built it). Keys are compared sorted: the apiserver keeps a custom object as a Go map, so what it
stores and serves is sorted whatever the order of the patch; values, nulls (a merge patch's deletes) and
absent keys must match exactly.

A case is the pass's inputs: the spec, the observed pods, the stored status (raw, as the apiserver
returns it), the admission's conditions, the holds and the clock. Cases chain: a later pass reads the
status an earlier one wrote, as a deployment's passes do.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import Condition, PDDeploymentSpec, PDDeploymentStatus
from pdfleet_operator.placement import NodeFacts, check_placement
from pdfleet_operator.plan import ObservedPod, Snapshot
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.secret import AUTH_SECRET_MISSING
from pdfleet_operator.rollout_state import decide_rollouts, with_rollout_failures
from pdfleet_operator.status import (
    pass_status,
    spec_unreadable_status,
    status_document,
    with_degraded,
    with_placement,
    with_transfer_health,
)
from pdfleet_runtime.readiness_problems import Problem

GOLDEN = Path(__file__).with_name("status_wire")
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "valid"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
ADMITTED = [
    {"type": "Admitted", "status": "True", "observedGeneration": 1, "reason": "MatrixAdmits",
     "message": "admitted by matrix 2026.12"},
    {"type": "Degraded", "status": "False", "observedGeneration": 1, "reason": "MatrixAdmits",
     "message": "matrix 2026.12 admits the spec"},
]
MATRIX = "2026.12"


def spec_of(*, decode_image: str | None = None, router: bool = False, canary: int | None = None,
            replicas: int = 2) -> PDDeploymentSpec:
    raw = yaml.safe_load((EXAMPLES / "llama-dense.yaml").read_text())["spec"]
    raw["decode"]["replicas"] = replicas
    if decode_image is not None:
        raw["decode"]["image"] = decode_image
    if canary is not None:
        raw.setdefault("rollout", {})["canaryReplicas"] = canary
    if router:
        raw["router"] = {"image": "ghcr.io/pdfleet/runtime:0.1.0"}
    else:
        raw.pop("router", None)
    return PDDeploymentSpec.model_validate(raw)


def pods(spec: PDDeploymentSpec, *, ready: bool = True, decode_revision: str | None = None, n: int = 2,
         start: int = 0, **kw: Any) -> list[ObservedPod]:
    rev_p, rev_d = role_revision(spec, Role.PREFILL), decode_revision or role_revision(spec, Role.DECODE)
    return [ObservedPod("p-0", Role.PREFILL, rev_p, 0, True, gate="True")] + [
        ObservedPod(f"d-{start + i}", Role.DECODE, rev_d, start + i, ready, gate="True" if ready else None, **kw)
        for i in range(n)]


def run_pass(spec: PDDeploymentSpec, observed: list[ObservedPod], old: dict[str, Any], now: datetime, *,
             admission: list[dict[str, Any]] | None = None, holds: tuple[str, ...] = (),
             revisions: tuple[PDDeploymentSpec, ...] = (), namespace: str | None = "ns",
             nodes: tuple[NodeFacts, ...] | None = None, secret_missing: str | None = None) -> dict[str, Any]:
    """One pass's status as ``reconcile._pass`` builds it (the pure part: no API calls)."""
    stored = {(role, role_revision(s, role)): s for s in (spec, *revisions) for role in Role}
    snapshot = Snapshot(pods=tuple(observed), secret_exists=True, revisions=stored)
    conditions = [Condition.model_validate(c) for c in (ADMITTED if admission is None else admission)]
    stored_status = PDDeploymentStatus.model_validate(old)
    if nodes is not None:
        conditions = with_placement(conditions, check_placement(spec, list(nodes)), 1)
    if secret_missing is not None:
        conditions = with_degraded(conditions, AUTH_SECRET_MISSING, secret_missing, 1)
    decisions = decide_rollouts(spec, snapshot, stored_status.rollout, now.timestamp())
    conditions = with_rollout_failures(conditions, decisions, spec, 1)
    conditions = with_transfer_health(conditions, observed, now.timestamp(), 1)
    return status_document(pass_status(spec, "demo", 1, observed, stored_status, conditions, decisions, list(holds),
                                       now, namespace=namespace, matrix_version=MATRIX))


def cases() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    a = spec_of()
    out["fresh"] = first = run_pass(a, [], {}, T0)
    out["ready"] = ready = run_pass(a, pods(a), first, datetime(2026, 1, 1, 0, 1, 30, 250000, tzinfo=UTC))
    out["ready-again"] = run_pass(a, pods(a), ready, datetime(2026, 1, 1, 0, 2, tzinfo=UTC))
    b = spec_of(decode_image="runtime:next")
    rev_a = role_revision(a, Role.DECODE)
    rolling = [*pods(b, decode_revision=rev_a),
               ObservedPod("d-2", Role.DECODE, role_revision(b, Role.DECODE), 2, False,
                           running_since=T0.timestamp() + 100)]
    out["rolling"] = roll = run_pass(b, rolling, ready, datetime(2026, 1, 1, 0, 3, tzinfo=UTC), revisions=(a,),
                                     holds=("decode revision holds: no ready prefill shares its key",))
    failing = [*rolling[:-1], ObservedPod("d-2", Role.DECODE, role_revision(b, Role.DECODE), 2, False, gate="False",
                                          gate_problem=Problem.CORRUPT, gate_message="BytesMismatched: 3 pages",
                                          running_since=T0.timestamp() + 100)]
    out["failed"] = failed = run_pass(b, failing, roll, datetime(2026, 1, 1, 0, 4, tzinfo=UTC), revisions=(a,))
    out["rolled-back"] = run_pass(b, pods(b, decode_revision=rev_a), failed, datetime(2026, 1, 1, 0, 5, tzinfo=UTC),
                                  revisions=(a,))
    c = spec_of(decode_image="runtime:canary", canary=1)
    canary = pods(c, decode_revision=rev_a, n=1) + pods(c, start=1, n=1)[1:]
    out["canary"] = run_pass(c, canary, ready, datetime(2026, 1, 1, 0, 6, tzinfo=UTC), revisions=(a,))
    r = spec_of(router=True)
    out["router"] = routed = run_pass(r, pods(r), ready, datetime(2026, 1, 1, 0, 7, tzinfo=UTC))
    out["router-removed"] = run_pass(a, pods(a), routed, datetime(2026, 1, 1, 0, 8, tzinfo=UTC))
    out["router-no-namespace"] = run_pass(r, pods(r), ready, datetime(2026, 1, 1, 0, 8, tzinfo=UTC), namespace=None)
    out["placement-and-secret"] = run_pass(
        a, pods(a, ready=False), ready, datetime(2026, 1, 1, 0, 9, tzinfo=UTC),
        nodes=(NodeFacts(name="n1", gpus=1),),
        secret_missing="pods run but the key Secret is gone")
    rejected = [{**ADMITTED[0], "status": "False", "reason": "MatrixRejects", "message": "rule x"},
                {**ADMITTED[1], "status": "True", "reason": "MatrixRejects", "message": "rule x"}]
    out["rejected"] = run_pass(a, pods(a), ready, datetime(2026, 1, 1, 0, 10, tzinfo=UTC), admission=rejected)
    out["spec-unreadable"] = status_document(spec_unreadable_status(
        [Condition.model_validate(c) for c in ADMITTED], "spec.decode: field required", 1))
    return out


def canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, indent=1) + "\n"


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.json")))
def test_status_on_the_wire_is_unchanged(name: str) -> None:
    assert canonical(cases()[name]) == canonical(json.loads((GOLDEN / f"{name}.json").read_text()))


def test_every_case_has_its_recording() -> None:
    assert sorted(cases()) == sorted(p.stem for p in GOLDEN.glob("*.json"))


if __name__ == "__main__":  # record the cases (only when the status's wire form changes on purpose)
    GOLDEN.mkdir(exist_ok=True)
    for case, doc in cases().items():
        (GOLDEN / f"{case}.json").write_text(json.dumps(doc, indent=1) + "\n")
