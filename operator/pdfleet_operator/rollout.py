"""The pure rollout step planner: one role's observed pods -> the steps of the next pass.

Invariants (shared/rollout.md):

* at most ``replicas + maxSurge`` pods of the role exist, counting draining and terminating pods
  (they still hold GPUs): a pass creates only into that room;
* routable ready pods never drop below ``replicas - maxUnavailable`` through our own drains: a
  ready, routable pod starts draining only while the rest stay at or above that floor (pods that
  are not ready can always drain: losing them costs no capacity);
* one side changes per pass: a pass either finishes drains (deletes), or creates new pods, or
  starts drains of old/surplus pods, never two of these; the next pass re-reads the cluster, so it
  acts only on observed results;
* a drain is: unroutable first (label), then in-flight transfers finish (the runtime reports the
  ``pdfleet.io/drained`` condition) or the drain deadline passes (recorded as forced), then the pod
  is deleted; a pod never scheduled (stuck Pending) ran nothing and is deleted without waiting; a
  drain of a pod that is wanted again is cancelled and the pod made routable;
* state lives on the pods (drain annotation and condition), so an operator restart resumes.

Paused: only committed drains finish. Both surge and unavailable 0 would deadlock; ``plan.budgets``
turns that into unavailable 1, as a Deployment does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["PodView", "Step", "StepKind", "plan_steps", "removal_order"]


class StepKind(StrEnum):
    CREATE = "create"
    START_DRAIN = "start-drain"
    CANCEL_DRAIN = "cancel-drain"
    DELETE = "delete"


@dataclass(frozen=True)
class PodView:
    """What the step planner needs to know about one pod of the role."""

    name: str
    revision: str
    index: int
    ready: bool
    deleting: bool = False
    drain_started: float | None = None  # epoch seconds; None: not draining
    drained: bool = False  # the runtime reported in-flight transfers done
    scheduled: bool = True  # False: no node yet, so no container ever ran (nothing can be in flight)

    @property
    def draining(self) -> bool:
        return self.drain_started is not None and not self.deleting

    @property
    def routable_ready(self) -> bool:
        return self.ready and not self.deleting and self.drain_started is None


@dataclass(frozen=True)
class Step:
    kind: StepKind
    pod: str | None = None  # None for CREATE
    index: int | None = None  # CREATE: the replica index to use
    reason: str = ""
    forced: bool = False  # DELETE: the drain deadline passed before the pod reported drained


def _finish(p: PodView) -> Step:
    if p.drained:
        return Step(StepKind.DELETE, p.name, reason="drained")
    if not p.scheduled:
        return Step(StepKind.DELETE, p.name, reason="never scheduled: nothing in flight")
    return Step(StepKind.DELETE, p.name, reason="drain deadline passed", forced=True)


def removal_order(pods: Iterable[PodView]) -> list[PodView]:
    """Not-ready pods first, then the highest index: the cheapest pods to lose."""
    return sorted(pods, key=lambda p: (p.ready, -p.index, p.name))


def plan_steps(
    pods: Sequence[PodView],
    *,
    replicas: int,
    revision: str,
    surge: int,
    unavailable: int,
    drain_timeout: float,
    now: float,
    paused: bool = False,
    canary: int | None = None,
    keep: frozenset[str] = frozenset(),
) -> list[Step]:
    """The steps of one pass for one role (see the module docstring for the rules).

    ``canary``: while pods of other revisions remain, at most this many pods of ``revision``; the
    old pods beyond ``replicas - canary`` are replaced and the rest kept (a canary hold). ``keep``: ready pods
    that start no drain in this pass (the router still pairs their generation: ``generations.kept``)."""
    draining = [p for p in pods if p.draining]
    # 1. Finish committed drains (allowed even when paused). A pod never scheduled has nothing to drain
    #    (no runtime will ever report it drained): it goes at once, not forced at the deadline.
    finished = [_finish(p) for p in draining
                if p.drained or not p.scheduled or now - (p.drain_started or now) >= drain_timeout]
    if finished:
        return finished

    live_new = [p for p in pods if p.revision == revision and not p.deleting and not p.draining]
    # 2. Cancel drains of pods that are wanted again (a revert, or a scale-up during a drain).
    shortfall = replicas - len(live_new)
    wanted_back = [p for p in draining if p.revision == revision and not p.drained]
    cancels = [Step(StepKind.CANCEL_DRAIN, p.name, reason="wanted again")
               for p in sorted(wanted_back, key=lambda p: (not p.ready, p.index))[: max(0, shortfall)]]
    if cancels:
        return cancels
    if paused:
        return []

    # 3. New side: create into the surge room (up to the canary while old pods remain).
    old = [p for p in pods if p.revision != revision and not p.deleting and not p.draining]
    new_cap = min(replicas, canary) if canary is not None and old else replicas
    missing = new_cap - len(live_new)
    room = replicas + surge - len(pods)
    if missing > 0 and room > 0:
        used = {p.index for p in pods}
        free = [i for i in range(len(pods) + replicas + 1) if i not in used]
        return [Step(StepKind.CREATE, index=i, reason=f"replica {i} of revision {revision}")
                for i in free[: min(missing, room)]]

    # 4. Old side: drain outdated pods and surplus new ones, keeping routable ready pods at the floor.
    surplus = removal_order(live_new)[: max(0, len(live_new) - replicas)]
    keep_old = max(0, replicas - max(new_cap, len(live_new)))
    outdated = removal_order(old)[: max(0, len(old) - keep_old)]
    budget = sum(p.routable_ready for p in pods) - (replicas - unavailable)
    steps = []
    for p in removal_order([*outdated, *surplus]):
        if p.ready and p.name in keep:
            continue
        if not p.ready:
            steps.append(Step(StepKind.START_DRAIN, p.name, reason="not ready"))
        elif budget > 0:
            budget -= 1
            why = "surplus" if p.revision == revision else f"outdated revision {p.revision}"
            steps.append(Step(StepKind.START_DRAIN, p.name, reason=why))
    return steps
