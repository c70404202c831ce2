"""Rollout bookkeeping (pure): when a revision counts as failed."""

from __future__ import annotations

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import RoleRollout
from pdfleet_operator.plan import ObservedPod
from pdfleet_operator.rollout_state import decide
from pdfleet_runtime.readiness_problems import gate_problem

NOW = 1_000.0


def pod(name: str, revision: str, *, ready: bool = True, gate: str = "True", reason: str = "") -> ObservedPod:
    return ObservedPod(name, Role.DECODE, revision, int(name[-1]), ready=ready, gate=gate, gate_problem=gate_problem(reason),
                       gate_message=reason,
                       running_since=NOW - 100)


def test_a_pod_of_the_stable_revision_failing_its_gate_is_an_outage_not_a_failed_revision() -> None:
    prev = RoleRollout.model_validate({"stableRevision": "a", "targetRevision": "a", "progress": "2/0",
                                       "lastProgressTime": "1970-01-01T00:16:00Z"})
    pods = [pod("p0", "a"), pod("p1", "a", ready=False, gate="False", reason="TransfersFailing")]
    d = decide(prev, spec_revision="a", replicas=2, pods=pods, now=NOW, progress_deadline=10, canary=None,
               can_roll_back_to={"a"})
    assert d.failure is None and d.failed == () and not d.complete and d.stable == "a"
    d = decide(prev, spec_revision="a", replicas=2, pods=pods, now=NOW + 60, progress_deadline=10, canary=None,
               can_roll_back_to={"a"})
    assert d.failure is None and d.failed == ()  # no deadline either: nothing is rolling out


def test_a_new_revision_failing_its_gate_fails_and_rolls_back() -> None:
    prev = RoleRollout.model_validate({"stableRevision": "a", "targetRevision": "b", "progress": "0/2",
                                       "lastProgressTime": "1970-01-01T00:16:40Z"})
    pods = [pod("p0", "a"), pod("p1", "a"), pod("p2", "b", ready=False, gate="False", reason="BytesMismatched")]
    d = decide(prev, spec_revision="b", replicas=2, pods=pods, now=NOW, progress_deadline=10, canary=None,
               can_roll_back_to={"a", "b"})
    assert d.failed == ("b",) and d.target == "a" and d.rolling_back
    assert d.failure is not None and "BytesMismatched" in d.failure
