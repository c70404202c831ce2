"""The operator matches ``pdfleet.io/drained`` to the drain it reports (issue 26, item 2): a True
condition left from an earlier drain (a cancel racing the report, or forged) does not end the current
drain, so the pod is not deleted while its in-flight transfers run."""

from __future__ import annotations

from pdfleet_operator.api.constants import Role
from pdfleet_operator.observe import observed_pod
from pdfleet_operator.plan import ActionKind, Snapshot, plan
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.resources.revision import role_revision
from pdfleet_runtime.config import (
    DRAIN_ANNOTATION,
    DRAINED_CONDITION,
    READINESS_GATE,
    SILENT_FALLBACK_CONDITION,
)
from tests.unit.operator.test_plan import OWNER, base_spec


def _pod(drain: str, drained_message: str | None) -> dict:
    spec = base_spec(replicas=1)
    body = runtime_pod("demo", "ns", spec, Role.DECODE, role_revision(spec, Role.DECODE), 0)
    body["metadata"]["ownerReferences"] = [OWNER.reference()]
    body["metadata"]["annotations"][DRAIN_ANNOTATION] = drain
    body["metadata"]["labels"]["pdfleet.io/routable"] = "false"
    conditions = [{"type": "Ready", "status": "False"}, {"type": READINESS_GATE, "status": "True"}]
    if drained_message is not None:
        conditions.append({"type": DRAINED_CONDITION, "status": "True", "reason": "Drained",
                           "message": drained_message})
    body["spec"]["nodeName"] = "kwok-gpu-0"
    body["status"] = {"phase": "Running", "conditions": conditions}
    return body


def test_a_drained_report_of_an_earlier_drain_does_not_end_this_one() -> None:
    spec = base_spec(replicas=1)
    # What runtimes wrote before the stamp (an unstamped report), and a forged one.
    for message in ("no transfer in flight", "set by someone"):
        seen = observed_pod(_pod("200.000", message), OWNER.uid)
        assert seen is not None and seen.drain_started == 200.0
        assert not seen.drained, message
        # Within the drain deadline: nothing is deleted.
        actions = plan(OWNER, spec, Snapshot(pods=(seen,), secret_exists=True), now=201.0)
        assert not [a for a in actions if a.kind is ActionKind.DELETE], message
    from pdfleet_runtime.config import drained_message

    earlier = observed_pod(_pod("200.000", drained_message("100.000", "no transfer in flight")), OWNER.uid)
    assert earlier is not None and not earlier.drained
    current = observed_pod(_pod("200.000", drained_message("200.000", "no transfer in flight")), OWNER.uid)
    assert current is not None and current.drained
    actions = plan(OWNER, spec, Snapshot(pods=(current,), secret_exists=True), now=201.0)
    assert [a.name for a in actions if a.kind is ActionKind.DELETE] == [current.name]


def test_the_silent_fallback_condition_is_read_only_while_true() -> None:
    body = _pod("200.000", None)
    conditions = body["status"]["conditions"]
    conditions.append({"type": SILENT_FALLBACK_CONDITION, "status": "False", "reason": "NoFallback", "message": "none"})
    seen = observed_pod(body, OWNER.uid)
    assert seen is not None and seen.fallback == ""
    conditions[-1] = {"type": SILENT_FALLBACK_CONDITION, "status": "True", "reason": "NoStateReceived",
                      "message": "silent fallbacks in the last 120 s"}
    seen = observed_pod(body, OWNER.uid)
    assert seen is not None and seen.fallback == "NoStateReceived: silent fallbacks in the last 120 s"
