"""Pure rollout bookkeeping per role: target, stable and failed revisions, progress, failure.

Each pass computes, from the role's previous ``status.rollout.<role>`` and its observed pods:

* the target revision: the spec's, unless the spec's revision failed, then the stable one (a
  rollback within the same budgets: the step planner simply rolls towards the target);
* failure of a rollout towards the spec's revision: a target pod's transfer-path gate is False
  with a failure reason (``readiness_problems.GATE_FAILURES``; "not yet" reasons such as WaitingForCanary
  are not failures), or not True for longer than the gate timeout after it started running, or its containers
  restarted too often, or no progress (a target pod became ready, or an old pod went) for
  ``progressDeadlineSeconds``;
* the stable revision, committed only when every pod is on the target, ready and not draining
  (the commit point; until then the previous stable revision stays);
* canary hold: with ``canaryReplicas`` set and old pods left, the new revision stops there.

A replica group counts as one unit (``groups.units``: ready when every member is); failures are
read from every member, except a leader's lost member (``Problem.GROUP_MEMBER_LOST``), which restarts its
group rather than failing the revision.

A gang Kueue has not admitted (its pods still carry Kueue's scheduling gate) holds the rollout: the message
names the gang and the queue, and the progress deadline does not run while it waits (no member holds a GPU;
waiting for quota is the cluster being busy, not the revision failing). A group that is partly placed
(no gang scheduler) is named in the message too, and the deadline runs as for any pending pod.

Failed revisions are remembered only while the spec still names them: a spec change clears the
memory, so a revision is not tried again until the spec changes. The stable revision is never marked
failed (there is no rollout towards it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from pdfleet_operator.api.constants import Role, RolloutPhase
from pdfleet_operator.api.models import Condition, PDDeploymentSpec, RoleRollout, RolloutStatus
from pdfleet_operator.conditions import with_degraded
from pdfleet_operator.groups import PlacementWait, placement_wait, units
from pdfleet_operator.observed import ObservedPod, Snapshot
from pdfleet_operator.plan import DRAIN_CANCEL_SETTLE_S
from pdfleet_operator.resources.pods import role_spec
from pdfleet_operator.resources.revision import role_revision
from pdfleet_runtime.readiness_problems import GATE_FAILURES, Problem

__all__ = [
    "MAX_RESTARTS",
    "RoleDecision",
    "decide",
    "decide_rollouts",
    "next_wake",
    "rollout_status",
    "rollout_targets",
    "with_rollout_failures",
]

MAX_RESTARTS = 3
GATE_TIMEOUT_CAP = 300.0


@dataclass(frozen=True)
class RoleDecision:
    target: str
    stable: str | None
    failed: tuple[str, ...]
    rolling_back: bool
    canary_hold: bool
    complete: bool
    failure: str | None  # set on the pass that marks the spec's revision failed
    failure_reason: str | None  # why the spec's revision failed, kept while it stays failed
    last_progress: float
    progress_mark: str
    updated: int
    ready: int
    draining: int
    message: str
    gang_hold: bool = False  # a gang of the target waits for Kueue: the progress deadline does not run

    def status(self, current: str) -> RoleRollout:
        """``status.rollout.<role>``: every field set, so a None clears a field the last pass wrote."""
        return RoleRollout(
            current_revision=current,
            target_revision=self.target,
            stable_revision=self.stable,
            failed_revisions=list(self.failed) or None,
            failure_reason=self.failure_reason,
            updated=self.updated,
            ready=self.ready,
            draining=self.draining,
            last_progress_time=datetime.fromtimestamp(self.last_progress, UTC),
            progress=self.progress_mark,
            message=self.message,
        )


def _failure(pods: Sequence[ObservedPod], revision: str, now: float, gate_timeout: float) -> str | None:
    for p in pods:
        if p.revision != revision or p.deleting:
            continue
        if p.gate == "False" and p.gate_problem in GATE_FAILURES and p.gate_problem is not Problem.GROUP_MEMBER_LOST:
            return f"pod {p.name} failed its transfer-path gate" + (f" ({p.gate_message})" if p.gate_message else "")
        if p.gate != "True" and p.running_since is not None and now - p.running_since > gate_timeout:
            return f"pod {p.name}'s transfer-path gate stayed unknown for {now - p.running_since:.0f}s"
        if p.restarts >= MAX_RESTARTS:
            return f"pod {p.name} restarted {p.restarts} times"
    return None


def decide(
    previous: RoleRollout | None,
    *,
    spec_revision: str,
    replicas: int,
    pods: Sequence[ObservedPod],
    now: float,
    progress_deadline: float,
    canary: int | None,
    can_roll_back_to: set[str],
    members: Sequence[ObservedPod] | None = None,
    queue: str | None = None,
) -> RoleDecision:
    """One role's bookkeeping for this pass; ``can_roll_back_to`` are revisions whose spec is stored.
    ``pods`` are the role's replicas (groups as units); ``members`` every pod, for failures and placement
    (default: pods); ``queue`` the Kueue LocalQueue of the gangs (spec.scheduling.queueName), for messages."""
    prev = previous or RoleRollout()
    stable = prev.stable_revision
    failed = tuple(r for r in prev.failed_revisions or () if r == spec_revision)
    live = [p for p in pods if not p.deleting]
    # the stable revision, where a failed rollout can go back to (its spec is stored)
    rollback = stable if stable is not None and stable != spec_revision and stable in can_roll_back_to else None
    target = rollback if spec_revision in failed and rollback is not None else spec_revision
    on_target = [p for p in live if p.revision == target and p.drain_started is None]
    updated_ready = sum(p.ready for p in on_target)
    others = [p for p in live if p.revision != target]
    draining = sum(p.drain_started is not None for p in live)
    ready = sum(p.ready and p.drain_started is None for p in live)
    complete = (len(on_target) == replicas and updated_ready == replicas and not others and not draining)

    waiting = placement_wait(pods if members is None else members, target)
    # a gang admitted (or newly gated) is progress too: the deadline starts afresh once Kueue lets it run
    mark = f"{updated_ready}/{len(others)}" + (f", {len(waiting.gated)} gated" if waiting.gated else "")
    last_progress = (prev.last_progress_time.timestamp() if prev.last_progress_time is not None else None) or now
    if prev.target_revision != target or prev.progress != mark:
        last_progress = now  # the target changed, or a pod became ready or went: progress
    failure = None
    # Only a rollout fails: once the spec's revision is the stable one (committed), a pod of it that later
    # fails its gate or restarts is an outage of the running revision (not ready, counted as such), not a
    # failed revision, which would stay Degraded and block nothing but the user's next spec change.
    if target == spec_revision and spec_revision != stable and spec_revision not in failed and not complete:
        failure = _failure(pods if members is None else members, spec_revision, now,
                           min(GATE_TIMEOUT_CAP, progress_deadline))
        # a gang waiting for Kueue's quota holds the rollout: no member holds a GPU, the deadline does not run
        if failure is None and not waiting.gated and now - last_progress > progress_deadline:
            failure = f"no progress for {now - last_progress:.0f}s (progressDeadlineSeconds {progress_deadline:.0f})"
        if failure is not None:
            failed = (*failed, spec_revision)
            if rollback is not None:
                target, last_progress = rollback, now
    if complete:
        stable = target
    failure_reason = failure or (prev.failure_reason if spec_revision in failed else None)
    canary_hold = (canary is not None and target == spec_revision and bool(others)
                   and len(on_target) >= canary)
    rolling_back = target != spec_revision
    if complete and not rolling_back:
        message = f"revision {target} rolled out"
    elif complete:
        message = f"rolled back to {target}; revision {spec_revision} failed"
    elif rolling_back:
        message = f"rolling back to {target}: revision {spec_revision} failed"
    elif spec_revision in failed:
        message = f"revision {spec_revision} failed and there is no stable revision to roll back to"
    elif canary_hold:
        message = f"canary: {len(on_target)} pods on {target}, holding until canaryReplicas is raised or cleared"
    else:
        message = f"rolling out {target}: {updated_ready}/{replicas} ready, {len(others)} old left"
    if failure_reason:
        message = f"{message}: {failure_reason}"
    elif not complete and (wait := _wait_text(waiting, queue)):
        message = f"{message}; {wait}"
    return RoleDecision(
        target=target, stable=stable, failed=failed, rolling_back=rolling_back, canary_hold=canary_hold,
        complete=complete, failure=failure, failure_reason=failure_reason, last_progress=last_progress, progress_mark=mark,
        updated=len(on_target), ready=ready, draining=draining, message=message,
        gang_hold=bool(waiting.gated) and not complete,
    )


def _wait_text(waiting: PlacementWait, queue: str | None) -> str:
    """Why groups of the target are not running: Kueue's gate, or members left pending."""
    parts = []
    if waiting.gated:
        names = ", ".join(g.unit.name for g in waiting.gated)
        gates = ", ".join(sorted({x for g in waiting.gated for x in g.unit.gates}))
        size = max(g.unit.group_size for g in waiting.gated)
        gang = "gang" if len(waiting.gated) == 1 else "gangs"
        where = f" in LocalQueue {queue}" if queue else ""
        parts.append(f"holding: {gang} {names} ({size} pod(s) each) wait(s) for Kueue to admit them{where} "
                     f"(scheduling gate {gates}): no member holds a GPU until the whole group is admitted")
    for g in waiting.partial:
        placed = sum(m.scheduled for m in g.live)
        parts.append(f"group {g.unit.name}: {placed}/{g.unit.group_size} pods placed, the rest pending: its placed "
                     "pods hold GPUs while it serves nothing (spec.scheduling.gang kueue admits groups whole)")
    return "; ".join(parts)


# -- glue for a reconcile pass (pure) ----------------------------------------------------------


def decide_rollouts(spec: PDDeploymentSpec, snapshot: Snapshot, previous: RolloutStatus | None,
                    now: float) -> dict[Role, RoleDecision]:
    out = {}
    for role in Role:
        rs = role_spec(spec, role)
        pods = [p for p in snapshot.pods if p.role is role]
        out[role] = decide(
            _role_rollout(previous, role),
            spec_revision=role_revision(spec, role),
            replicas=rs.replicas,
            pods=units(pods),
            members=pods,
            now=now,
            progress_deadline=float(spec.rollout.progress_deadline_seconds),
            canary=spec.rollout.canary_replicas,
            can_roll_back_to={rev for (r, rev) in snapshot.revisions if r is role},
            queue=spec.scheduling.queue_name,
        )
    return out


def next_wake(spec: PDDeploymentSpec, snapshot: Snapshot, decisions: Mapping[Role, RoleDecision],
              now: float) -> float | None:
    """Seconds until the earliest decision that only time can bring (no event will wake it): a drain
    deadline, a cancelled drain's settle window, a gate timeout, the progress deadline. None: none."""
    deadline = float(spec.rollout.progress_deadline_seconds)
    gate_timeout = min(GATE_TIMEOUT_CAP, deadline)
    due: list[float] = []
    for p in snapshot.pods:
        if p.deleting:
            continue
        if p.drain_started is not None:
            due.append(p.drain_started + spec.rollout.drain_timeout_seconds)
        if p.drain_cancelled is not None:
            due.append(p.drain_cancelled + DRAIN_CANCEL_SETTLE_S)
        if p.gate != "True" and p.running_since is not None:
            due.append(p.running_since + gate_timeout)
    due += [d.last_progress + deadline for d in decisions.values()
            if not d.complete and not d.failed and not d.gang_hold]
    ahead = [t - now for t in due if t > now]
    return max(0.05, min(ahead) + 0.05) if ahead else None


def _role_rollout(status: RolloutStatus | None, role: Role) -> RoleRollout | None:
    if status is None:
        return None
    return status.prefill if role is Role.PREFILL else status.decode


def rollout_targets(spec: PDDeploymentSpec, snapshot: Snapshot,
                    decisions: Mapping[Role, RoleDecision]) -> dict[Role, tuple[str, PDDeploymentSpec]]:
    """The revision each role's new pods are built from, with the spec that revision came from."""
    targets = {}
    for role, d in decisions.items():
        stored = snapshot.revisions.get((role, d.target))
        targets[role] = (d.target, spec if d.target == role_revision(spec, role) or stored is None else stored)
    return targets


def _phase(spec: PDDeploymentSpec, decisions: Mapping[Role, RoleDecision]) -> RolloutPhase:
    ds = decisions.values()
    if any(d.rolling_back and not d.complete for d in ds):
        return RolloutPhase.ROLLING_BACK
    if any(d.failed and not d.rolling_back for d in ds):
        return RolloutPhase.FAILED
    if all(d.complete for d in ds):
        return RolloutPhase.COMPLETE
    if spec.rollout.paused:
        return RolloutPhase.PAUSED
    if any(d.canary_hold for d in ds):
        return RolloutPhase.CANARY_HOLD
    return RolloutPhase.PROGRESSING


def rollout_status(spec: PDDeploymentSpec, decisions: Mapping[Role, RoleDecision]) -> RolloutStatus:
    """``status.rollout`` (``decisions`` holds both roles, as ``decide_rollouts`` makes them)."""
    return RolloutStatus(
        phase=_phase(spec, decisions),
        message="; ".join(f"{role.value}: {d.message}" for role, d in decisions.items()),
        prefill=decisions[Role.PREFILL].status(role_revision(spec, Role.PREFILL)),
        decode=decisions[Role.DECODE].status(role_revision(spec, Role.DECODE)),
    )


def with_rollout_failures(admission: Sequence[Condition], decisions: Mapping[Role, RoleDecision],
                          spec: PDDeploymentSpec, generation: int) -> list[Condition]:
    """``Degraded`` while a role's spec revision is marked failed (rolled back, or nowhere to go)."""
    failed = [(role, d) for role, d in decisions.items() if role_revision(spec, role) in d.failed]
    if not failed:
        return list(admission)
    return with_degraded(admission, "RolloutFailed", "; ".join(f"{role.value}: {d.message}" for role, d in failed),
                         generation)
