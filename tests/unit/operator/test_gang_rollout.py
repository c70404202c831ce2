"""Gangs in scale and rollout (observe -> groups -> rollout_state/status over a simulated world): a gang
Kueue has not admitted (its pods carry Kueue's scheduling gate, no node) holds the role with a status naming
the gang, the queue and the gate, the progress deadline does not run while it waits and starts afresh once
it is admitted, the planner neither adds to nor tears down a gated gang, and without Kueue a group placed
in part is named with its placed count."""

from __future__ import annotations

from datetime import UTC, datetime

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.scheduling import KUEUE_ADMISSION_GATE, KUEUE_GROUP_NAME_LABEL
from pdfleet_operator.plan import ActionKind, plan
from pdfleet_operator.rollout_state import decide_rollouts, next_wake, rollout_status
from pdfleet_operator.status import compute_status, status_document
from tests.unit.operator.test_gang import KUEUE, spec_with
from tests.unit.operator.test_groups import OWNER, World

DEADLINE = 900.0  # the default progressDeadlineSeconds


class GatedWorld(World):
    """Kueue in front of the scheduler: a created pod is gated and unplaced until its gang is admitted."""

    def __init__(self, admit_all: bool = False) -> None:
        super().__init__()
        self.admit_all = admit_all

    def apply(self, actions, now: float) -> None:
        super().apply(actions, now)
        for a in actions:
            if a.kind is ActionKind.CREATE and a.object_kind == "Pod" and not self.admit_all:
                body = self.pods[a.name]
                body["spec"] = {**body["spec"], "schedulingGates": [{"name": KUEUE_ADMISSION_GATE}]}
                body["spec"].pop("nodeName")
                body["status"] = {"phase": "Pending", "conditions": []}

    def admit(self, gang: str) -> None:
        for body in self.pods.values():
            if body["metadata"]["labels"].get(KUEUE_GROUP_NAME_LABEL) == gang:
                body["spec"].pop("schedulingGates", None)
                body["spec"]["nodeName"] = "n"
                body["status"]["phase"] = "Running"

    def tick(self, ready: set[str] | None = None) -> None:
        placed = {n for n, b in self.pods.items() if b["spec"].get("nodeName")}
        super().tick(placed if ready is None else ready & placed)

    def gangs(self, role: str = "decode") -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, b in self.pods.items():
            labels = b["metadata"]["labels"]
            if labels["pdfleet.io/role"] == role:
                out.setdefault(labels[KUEUE_GROUP_NAME_LABEL], []).append(name)
        return out


def _decode(spec: PDDeploymentSpec, w: World, now: float, previous=None):
    decisions = decide_rollouts(spec, w.snapshot(), previous, now)
    return decisions, rollout_status(spec, decisions)


def test_a_gang_kueue_has_not_admitted_holds_the_scale_up_without_a_deadline() -> None:
    spec = spec_with(KUEUE)  # decode: 2 replicas of 2 nodes
    w = GatedWorld()
    w.apply(plan(OWNER, spec, w.snapshot()), 0.0)
    first, second = sorted(w.gangs())
    w.admit(first)
    w.admit(next(iter(w.gangs("prefill"))))
    w.tick()
    decisions, status = _decode(spec, w, 10.0)
    d = decisions[Role.DECODE]
    assert d.gang_hold and not d.failed
    assert second in d.message and "LocalQueue gpu-serving" in d.message and KUEUE_ADMISSION_GATE in d.message
    assert first not in d.message  # the admitted gang is running, not waiting
    # far past the progress deadline the waiting gang holds; nothing fails, no deadline wake-up is planned
    later, status = _decode(spec, w, 10.0 + 10 * DEADLINE, status)
    assert not later[Role.DECODE].failed and later[Role.DECODE].gang_hold
    assert next_wake(spec, w.snapshot(), later, 10.0 + 10 * DEADLINE) is None
    # the planner leaves the gated gang whole: nothing created beside it, nothing of it deleted
    actions = plan(OWNER, spec, w.snapshot(), now=10.0 + 10 * DEADLINE)
    assert not [a for a in actions if a.object_kind == "Pod" and a.kind in (ActionKind.CREATE, ActionKind.DELETE)]
    shown = status_document(compute_status(spec, "g", 1, w.snapshot().pods, None, [], datetime.now(UTC)))
    progressing = next(c for c in shown["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "GangNotAdmitted" and second in progressing["message"]
    # admitted: the hold ends and the deadline starts afresh from the pass that saw it
    w.admit(second)
    t = 20.0 + 10 * DEADLINE
    admitted, status = _decode(spec, w, t, status)
    assert not admitted[Role.DECODE].gang_hold and admitted[Role.DECODE].last_progress == t
    assert "Kueue" not in admitted[Role.DECODE].message
    w.tick()
    done, _ = _decode(spec, w, t + 1, status)
    assert done[Role.DECODE].complete


def test_a_rollout_to_gangs_kueue_holds_keeps_the_old_revision_serving() -> None:
    old, new = spec_with(KUEUE), spec_with(KUEUE, image="example.invalid/rt:2")
    w = GatedWorld(admit_all=True)
    w.apply(plan(OWNER, old, w.snapshot()), 0.0)
    w.tick()
    w.admit_all = False
    status = None
    for step in range(5):
        now = 1.0 + step * DEADLINE  # every pass a progress deadline later
        w.apply(plan(OWNER, new, w.snapshot(), now=now), now)
        w.tick()
        decisions, status = _decode(new, w, now, status)
    d = decisions[Role.DECODE]
    assert not d.failed and d.gang_hold and "holding: gang" in d.message, d.message
    gated = [g for g, names in w.gangs().items() if "schedulingGates" in w.pods[names[0]]["spec"]]
    assert len(gated) == 1 and len(w.gangs()[gated[0]]) == 2  # one surge gang, whole, and no more
    assert not w.drains  # maxUnavailable 0: no old group drains while its replacement waits
    assert status is not None and status.phase.value == "Progressing"


def test_without_kueue_a_partly_placed_group_is_named_with_its_placed_count() -> None:
    spec = spec_with({})
    w = World()
    w.apply(plan(OWNER, spec, w.snapshot()), 0.0)
    member = next(n for n in sorted(w.pods) if n.startswith("g-decode-") and n.endswith("-m1"))
    w.pods[member]["spec"].pop("nodeName")  # the scheduler found no node for this member
    w.tick(ready=set(w.pods) - {member})
    decisions, _ = _decode(spec, w, 5.0)
    d = decisions[Role.DECODE]
    leader = member.removesuffix("-m1")
    assert f"group {leader}: 1/2 pods placed" in d.message and not d.gang_hold
    # the deadline runs as for any pending pod: no gang scheduler holds it
    late, _ = _decode(spec, w, 5.0 + 2 * DEADLINE, rollout_status(spec, decisions))
    assert late[Role.DECODE].failed and "no progress" in (late[Role.DECODE].failure or "")
