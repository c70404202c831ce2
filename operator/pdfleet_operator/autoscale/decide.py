"""One autoscaling pass, pure: (spec, observed metrics and fleets, the last status, a rollout) ->
the new ``status.autoscaling`` and the events that say why.

The planner's memory lives in status (its recommendations and each role's last growth and shrink),
so an operator restart resumes its windows. Which wins when a rollout is in progress: the rollout.
The autoscaler holds both counts (reason ``RolloutInProgress``) until no pod of another revision
is left, then decides again from fresh readings: a rollout replaces pods by the count it started
with, its surge and its drains already move capacity, and a count changing under it would make its
progress (target pods ready against the count) and its failure deadline judge a moving target. The
readings and the recommendation are still recorded while it holds, so status shows what the
autoscaler would do.

Events: one per role whose count changes (reason: the planner's), and one whenever a role's reason
changes without a change of count (e.g. into ``ScaleDownStabilizing`` or ``RolloutInProgress``), so
the event stream explains every step without repeating itself every pass; status carries every pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime

from pdfleet_operator.api.autoscaling import (
    AutoscalingSpec,
    AutoscalingStatus,
    Recommendation,
    RoleAutoscalingStatus,
    SignalReading,
)
from pdfleet_operator.api.constants import Role
from pdfleet_operator.autoscale.planner import Decision, PlannerState, RoleDecision, RoleHistory, plan
from pdfleet_operator.autoscale.signals import DecodeMetrics, PrefillMetrics, RoleFleet

__all__ = ["ROLLOUT_IN_PROGRESS", "AutoscaleEvent", "Outcome", "decide", "planner_state"]

ROLLOUT_IN_PROGRESS = "RolloutInProgress"


@dataclass(frozen=True, slots=True)
class AutoscaleEvent:
    role: Role
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Outcome:
    status: AutoscalingStatus
    events: tuple[AutoscaleEvent, ...]
    decision: Decision

    def desired(self, role: Role) -> int:
        s = self.status.prefill if role is Role.PREFILL else self.status.decode
        assert s is not None
        return s.desired


def _history(s: RoleAutoscalingStatus | None) -> RoleHistory:
    if s is None:
        return RoleHistory()
    return RoleHistory(tuple((r.at, r.replicas) for r in s.recommendations or ()), s.last_scale_up, s.last_scale_down)


def planner_state(status: AutoscalingStatus | None) -> PlannerState:
    """The planner's memory as status keeps it."""
    if status is None:
        return PlannerState()
    return PlannerState(_history(status.prefill), _history(status.decode))


def _role_status(d: RoleDecision, hist: RoleHistory, fleet: RoleFleet, scraped: int) -> RoleAutoscalingStatus:
    return RoleAutoscalingStatus(
        desired=d.desired, current=d.current, recommendation=d.recommendation, reason=d.reason.value,
        message=d.message[:4096],
        readings=[SignalReading(signal=r.kind.value, value=round(r.value, 6), target=r.target,
                                recommendation=r.recommendation, covered_by_starting=r.covered_by_starting)
                  for r in d.readings] or None,
        ready=fleet.ready, starting=len(fleet.starting), draining=fleet.draining,
        startup_seconds=round(fleet.startup_seconds, 3), scraped=scraped,
        last_scale_up=hist.last_scale_up, last_scale_down=hist.last_scale_down,
        recommendations=[Recommendation(at=t, replicas=r) for t, r in hist.recommendations[-512:]] or None,
    )


def _held(d: RoleDecision, why: str) -> RoleDecision:
    what = (f"would go {d.current} -> {d.desired} ({d.reason.value}: {d.message})" if d.desired != d.current
            else f"the signals ask for {d.recommendation}")
    return replace(d, desired=d.current, message=f"holding at {d.current} while {why}; {what}")


def decide(spec: AutoscalingSpec, now: float, prefill: tuple[PrefillMetrics, RoleFleet],
           decode: tuple[DecodeMetrics, RoleFleet], previous: AutoscalingStatus | None,
           rollout: str | None = None, scraped: tuple[int, int] = (0, 0)) -> Outcome:
    """One pass at ``now`` (epoch seconds). ``rollout``: why a rollout is in progress (None: none)."""
    old = planner_state(previous)
    decision = plan(spec, now, prefill, decode, old)
    state = decision.state
    p, d = decision.prefill, decision.decode
    reasons = {Role.PREFILL: p.reason.value, Role.DECODE: d.reason.value}
    if rollout is not None:
        # The rollout wins: keep the counts and the last growth/shrink; the recommendations still count.
        p, d = _held(p, rollout), _held(d, rollout)
        reasons = dict.fromkeys(Role, ROLLOUT_IN_PROGRESS)
        state = PlannerState(
            replace(state.prefill, last_scale_up=old.prefill.last_scale_up, last_scale_down=old.prefill.last_scale_down),
            replace(state.decode, last_scale_up=old.decode.last_scale_up, last_scale_down=old.decode.last_scale_down))
        decision = replace(decision, prefill=p, decode=d, state=state,
                           gpus=p.desired * prefill[1].gpus_per_replica + d.desired * decode[1].gpus_per_replica)
    roles = {}
    for role, rd, hist, fleet, n in ((Role.PREFILL, p, state.prefill, prefill[1], scraped[0]),
                                     (Role.DECODE, d, state.decode, decode[1], scraped[1])):
        roles[role] = _role_status(rd, hist, fleet, n).model_copy(update={"reason": reasons[role]})
    band = spec.prefill_decode_ratio
    status = AutoscalingStatus(
        last_decision_time=datetime.fromtimestamp(now, UTC), held_by_rollout=rollout is not None, gpus=decision.gpus,
        ratio_in_band=None if band is None else band.min * d.desired - 1e-9 <= p.desired <= band.max * d.desired + 1e-9,
        prefill=roles[Role.PREFILL], decode=roles[Role.DECODE])
    events = []
    for role, rd in ((Role.PREFILL, p), (Role.DECODE, d)):
        before = (previous.prefill if role is Role.PREFILL else previous.decode) if previous else None
        if rd.desired != rd.current:
            verb = "scale up" if rd.desired > rd.current else "scale down (through drains)"
            events.append(AutoscaleEvent(role, reasons[role], f"{role.value} {verb} {rd.current} -> {rd.desired}: "
                                         f"{rd.message}{_readings(rd)}"))
        elif before is None or before.reason != reasons[role]:
            events.append(AutoscaleEvent(role, reasons[role], f"{role.value} holds at {rd.desired}: {rd.message}"
                                         f"{_readings(rd)}"))
    return Outcome(status, tuple(events), decision)


def _readings(d: RoleDecision) -> str:
    if not d.readings:
        return ""
    return " [" + ", ".join(f"{r.kind.value} {r.value:.3g} (target {r.target:g}) -> {r.recommendation}"
                            for r in d.readings) + "]"
