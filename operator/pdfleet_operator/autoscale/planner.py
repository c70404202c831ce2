"""The pure autoscaling planner: both roles' metrics and fleets -> the desired replicas per role.

Like the rollout step planner it reads nothing and writes nothing; the clock is an argument and the
little it remembers (recent recommendations, when each role last grew or shrank) comes in and goes
out as ``PlannerState``, which the operator keeps in status. Rules, in the order they apply:

1. each role's signals give a recommendation (``signals``: the largest wins); decode's counts the
   inflow the prefill recommendation is about to send it;
2. stabilization, per role, as an HPA's behavior: grow only to the smallest recommendation of the
   scale-up window, shrink only to the largest of the scale-down window; never reverse within a
   window (no shrink within scaleDownStabilizationSeconds of a growth, no growth within
   scaleUpStabilizationSeconds of a shrink); shrink at most once per ``SHRINK_SPACING_S``;
3. the bounds: never outside [minReplicas, maxReplicas];
4. the GPU budget: never more than ``gpuBudget`` GPUs in the desired replicas, and no role grows
   while the desired replicas plus the draining ones (which still hold GPUs) would exceed it;
5. the ratio band: prefill / decode kept inside it whenever the bounds, the budget and the
   windows leave a pair that is, by growing the lagging role first (capacity is safe), else by
   holding back the leading one.

A role that shrinks is named in ``Decision.shrinking``: the reconcile removes its replicas through
the drain path (a pod leaves only once it holds no room or transfer), never by deleting a serving
pod. Every decision carries a typed reason and the signal readings behind it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

from pdfleet_operator.api.autoscaling import AutoscalingSpec, DecodeAutoscaling, PrefillAutoscaling
from pdfleet_operator.api.constants import Role
from pdfleet_operator.autoscale.signals import (
    DecodeMetrics,
    PrefillMetrics,
    Reading,
    RoleFleet,
    decode_readings,
    prefill_readings,
    project_backlog,
    sanitized,
)

__all__ = [
    "SHRINK_SPACING_S",
    "Decision",
    "PlannerState",
    "Reason",
    "RoleDecision",
    "RoleHistory",
    "plan",
]


SHRINK_SPACING_S = 30.0
"""A role shrinks at most once per 30 s, so each decision reads the smaller pool's load (a request
lifetime and the metrics' rate windows) before the next."""


class Reason(StrEnum):
    """Why a role's desired count is what it is (CamelCase: it becomes an event and status reason)."""

    SIGNAL_ABOVE_TARGET = "SignalAboveTarget"  # grows: a signal asks for more
    SIGNAL_BELOW_TARGET = "SignalBelowTarget"  # shrinks: every signal asks for less over the window
    WITHIN_TARGET = "WithinTarget"  # no change: the signals ask for what there is
    STARTING_REPLICAS_COVER = "StartingReplicasCover"  # a signal is high, the starting replicas cover it
    SCALE_UP_STABILIZING = "ScaleUpStabilizing"  # would grow, held by the scale-up window
    SCALE_DOWN_STABILIZING = "ScaleDownStabilizing"  # would shrink, held by the scale-down window
    AT_MIN = "AtMinReplicas"  # held (or raised) at minReplicas
    AT_MAX = "AtMaxReplicas"  # held (or lowered) at maxReplicas
    GPU_BUDGET = "GpuBudget"  # growth cut (or a shrink forced) by the GPU budget
    RATIO_BAND = "RatioBand"  # moved to keep prefill/decode inside the band
    NO_SIGNAL = "NoSignal"  # no configured signal's metrics were reported: hold


@dataclass(frozen=True, slots=True)
class RoleHistory:
    """What the planner remembers of one role (kept in status between passes)."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (time, recommendation), oldest first
    last_scale_up: float | None = None
    last_scale_down: float | None = None


@dataclass(frozen=True, slots=True)
class PlannerState:
    prefill: RoleHistory = field(default_factory=RoleHistory)
    decode: RoleHistory = field(default_factory=RoleHistory)

    def of(self, role: Role) -> RoleHistory:
        return self.prefill if role is Role.PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class RoleDecision:
    role: Role
    current: int  # the count in effect before this decision
    desired: int
    recommendation: int | None  # the signals' (before windows, bounds, budget and band); None: no signal
    reason: Reason
    message: str
    readings: tuple[Reading, ...] = ()

    @property
    def change(self) -> int:
        return self.desired - self.current


@dataclass(frozen=True, slots=True)
class Decision:
    prefill: RoleDecision
    decode: RoleDecision
    state: PlannerState  # to keep for the next pass
    gpus: int  # GPUs of the desired replicas
    ratio_in_band: bool | None  # None: no band

    @property
    def shrinking(self) -> tuple[Role, ...]:
        """Roles that shrink: the reconcile drains that many of their replicas."""
        return tuple(d.role for d in (self.prefill, self.decode) if d.desired < d.current)

    def of(self, role: Role) -> RoleDecision:
        return self.prefill if role is Role.PREFILL else self.decode


@dataclass
class _Role:
    """Working values of one role inside one ``plan`` call."""

    role: Role
    current: int
    lo: int  # the bounds
    hi: int
    floor: int  # the lowest count the windows allow now (>= lo unless current is below lo)
    ceiling: int  # the highest the windows allow now
    gpus: int
    draining: int
    rec: int | None
    target: int
    reason: Reason
    message: str
    readings: tuple[Reading, ...]


def _window(history: tuple[tuple[float, int], ...], now: float, seconds: float) -> list[int]:
    return [r for t, r in history if now - t <= seconds]


def _stabilize(window_up: int, window_down: int, hist: RoleHistory, now: float, current: int,
               rec: int | None) -> tuple[int, Reason, str, bool, bool]:
    """(target, reason, message, may_shrink, may_grow) of one role from its recommendations and windows;
    the last two say whether any later rule (the band) may move the role down or up this pass."""
    may_shrink = hist.last_scale_up is None or now - hist.last_scale_up >= window_down
    may_grow = hist.last_scale_down is None or now - hist.last_scale_down >= window_up
    if rec is None:
        return current, Reason.NO_SIGNAL, "no configured signal is reported: holding", may_shrink, may_grow
    up = min(_window(hist.recommendations, now, window_up), default=rec)
    down = max(_window(hist.recommendations, now, window_down), default=rec)
    if up > current:
        if not may_grow:
            return current, Reason.SCALE_UP_STABILIZING, (
                f"would grow to {up}; shrank {now - (hist.last_scale_down or now):.0f}s ago, inside the "
                f"{window_up}s scale-up window"), may_shrink, may_grow
        return up, Reason.SIGNAL_ABOVE_TARGET, (
            f"signals ask for {up} (the lowest over the {window_up}s scale-up window)"), may_shrink, may_grow
    if down < current:
        if not may_shrink:
            return current, Reason.SCALE_DOWN_STABILIZING, (
                f"would shrink to {down}; grew {now - (hist.last_scale_up or now):.0f}s ago, inside the "
                f"{window_down}s scale-down window"), may_shrink, may_grow
        return down, Reason.SIGNAL_BELOW_TARGET, (
            f"signals ask for {down} (the highest over the {window_down}s scale-down window)"), may_shrink, may_grow
    if rec < current:
        return current, Reason.SCALE_DOWN_STABILIZING, (
            f"signals ask for {rec}; {down} over the {window_down}s scale-down window"), may_shrink, may_grow
    if rec > current:
        return current, Reason.SCALE_UP_STABILIZING, (
            f"signals ask for {rec}; {up} over the {window_up}s scale-up window"), may_shrink, may_grow
    return current, Reason.WITHIN_TARGET, f"signals ask for {rec}, as there is", may_shrink, may_grow


def _in_band(p: int, d: int, band: tuple[float, float] | None) -> bool:
    return band is None or (d > 0 and band[0] * d - 1e-9 <= p <= band[1] * d + 1e-9)


def _decode_inflow(spec: AutoscalingSpec, m: PrefillMetrics, fleet: RoleFleet, rec: int | None) -> float | None:
    """Requests/s prefill will send decode once it runs ``rec`` replicas: what they serve of the
    arrivals and of the backlog they clear (None when the rates are not reported)."""
    b = spec.prefill.signals.backlog
    rate = (b.prefill_tokens_per_second if b else None) or m.prefill_tokens_per_second
    if rate is None or rec is None or not m.prompt_tokens_per_second or not m.requests_per_second:
        return None
    arrivals = m.prompt_tokens_per_second
    horizon = max(fleet.startup_seconds, b.target_seconds if b else 0.0)
    backlog = project_backlog(m.queued_prompt_tokens or 0.0, arrivals, rate, fleet.ready, fleet.arrivals_in(), horizon)
    tokens = min(arrivals + backlog / horizon, min(rec, spec.prefill.max_replicas) * rate)
    prompt = arrivals / m.requests_per_second
    return tokens / prompt if prompt >= 1 else None  # a prompt has a token at least


def _role(role: Role, rs: PrefillAutoscaling | DecodeAutoscaling, hist: RoleHistory, fleet: RoleFleet,
          readings: list[Reading], now: float) -> _Role:
    rec = max((r.recommendation for r in readings), default=None)
    current = fleet.replicas
    target, reason, message, may_shrink, may_grow = _stabilize(
        rs.scale_up_stabilization_seconds, rs.scale_down_stabilization_seconds, hist, now, current, rec)
    if reason is Reason.WITHIN_TARGET and any(r.covered_by_starting for r in readings):
        reason, message = Reason.STARTING_REPLICAS_COVER, (
            f"{len(fleet.starting)} starting replicas cover the signals (Ready in about "
            f"{max(fleet.arrivals_in(), default=0):.0f}s)")
    if target < current and hist.last_scale_down is not None and now - hist.last_scale_down < SHRINK_SPACING_S:
        message = f"would shrink to {target}; shrank {now - hist.last_scale_down:.0f}s ago: its effect shows first"
        target, reason = current, Reason.SCALE_DOWN_STABILIZING
    lo, hi = rs.min_replicas, rs.max_replicas
    if target < lo:
        target, reason, message = lo, Reason.AT_MIN, f"held at minReplicas {lo} ({message})"
    elif target > hi:
        target, reason, message = hi, Reason.AT_MAX, f"held at maxReplicas {hi} ({message})"
    # How far the band may move the role: the windows' limits, inside the bounds (a moved bound wins).
    held = min(max(current, lo), hi)
    floor = min(lo if may_shrink else held, target)
    ceiling = max(hi if may_grow else held, target)
    return _Role(role, current, lo, hi, floor, ceiling, fleet.gpus_per_replica, fleet.draining, rec, target,
                 reason, message, tuple(readings))


def _apply_budget(p: _Role, d: _Role, budget: int | None) -> None:
    """Cut growth to the budget (draining replicas' GPUs count against growth), then, if the desired
    counts alone exceed it (the budget was lowered), shrink towards it, least pressed role first."""
    if budget is None:
        return
    roles = (p, d)
    held = sum(r.draining * r.gpus for r in roles)
    growing = [r for r in roles if r.target > r.current]
    if growing and sum(r.target * r.gpus for r in roles) + held > budget:
        base = sum((r.current if r in growing else r.target) * r.gpus for r in roles)
        room = max(0, budget - held - base)
        want = sum((r.target - r.current) * r.gpus for r in growing)
        for r in growing:
            new = max(r.current + math.floor((r.target - r.current) * room / want), r.lo)
            if new < r.target:
                r.message = (f"{r.message}; growth cut from {r.target} to {new} by the GPU budget {budget} "
                             f"({held} GPUs still draining)")
                r.target, r.reason = new, Reason.GPU_BUDGET
    total = sum(r.target * r.gpus for r in roles)
    while total > budget:
        movable = [r for r in roles if r.target > r.lo]
        if not movable:
            break  # the minimums exceed it: admission refuses such a spec
        r = min(movable, key=lambda x: (_pressure(x), x.role.value))
        r.target -= 1
        r.reason, r.message = Reason.GPU_BUDGET, f"shrunk to fit the GPU budget {budget}"
        r.floor, total = min(r.floor, r.target), total - r.gpus


def _pressure(r: _Role) -> float:
    return (r.rec or r.current) / max(1, r.target)


def _apply_band(p: _Role, d: _Role, band: tuple[float, float] | None, budget: int | None) -> None:
    """Move the pair into the band when a pair the windows, bounds and budget allow exists: the closest
    to the signals' targets, growing a role rather than shrinking the other (capacity is safe)."""
    if band is None or _in_band(p.target, d.target, band):
        return
    held = sum(r.draining * r.gpus for r in (p, d))

    def allowed(pp: int, dd: int) -> bool:
        if not (p.floor <= pp <= p.ceiling and d.floor <= dd <= d.ceiling and _in_band(pp, dd, band)):
            return False
        if budget is None:
            return True
        gpus = pp * p.gpus + dd * d.gpus
        grows = pp > p.current or dd > d.current
        return gpus <= budget and (not grows or gpus + held <= budget)

    lo, hi = band
    cands: list[tuple[int, int]] = [(p.current, d.current)]  # allowed whenever the fleet is in the band
    for dd in (d.target, math.ceil(p.target / hi - 1e-9), math.floor(p.target / lo + 1e-9)):
        cands.append((p.target, dd))
    for pp in (math.ceil(lo * d.target - 1e-9), math.floor(hi * d.target + 1e-9)):
        cands.append((pp, d.target))
    # Failing those, the nearest allowed pairs along decode's range (up to 512 counts either side).
    for dd in range(max(d.floor, d.target - 512), min(d.ceiling, d.target + 512) + 1):
        for pp in (math.ceil(lo * dd - 1e-9), math.floor(hi * dd + 1e-9)):
            cands.append((min(max(pp, p.floor), p.ceiling), dd))
    ok = [c for c in cands if allowed(*c)]
    if not ok:
        for r in (p, d):
            r.message += f"; ratio band [{lo:g}, {hi:g}] cannot be kept within the bounds, budget and windows"
        return

    def cost(c: tuple[int, int]) -> tuple[int, int, int]:
        short = max(0, p.target - c[0]) + max(0, d.target - c[1])  # capacity below what the signals ask
        return short, abs(c[0] - p.target) + abs(c[1] - d.target), c[0] * p.gpus + c[1] * d.gpus

    best = min(ok, key=cost)
    for r, v in ((p, best[0]), (d, best[1])):
        if v != r.target:
            r.message = f"moved from {r.target} to {v} to keep prefill/decode in [{lo:g}, {hi:g}] ({r.message})"
            r.target, r.reason = v, Reason.RATIO_BAND


def _history(hist: RoleHistory, r: _Role, now: float, keep: float) -> RoleHistory:
    recs = tuple((t, v) for t, v in hist.recommendations if now - t < keep)
    if r.rec is not None:
        recs = (*recs, (now, r.rec))
    up = now if r.target > r.current else hist.last_scale_up
    down = now if r.target < r.current else hist.last_scale_down
    return replace(hist, recommendations=recs, last_scale_up=up, last_scale_down=down)


def plan(spec: AutoscalingSpec, now: float, prefill: tuple[PrefillMetrics, RoleFleet],
         decode: tuple[DecodeMetrics, RoleFleet], state: PlannerState | None = None) -> Decision:
    """One decision for both roles at time ``now`` (seconds, any monotonic origin)."""
    state = state or PlannerState()
    (pm, pf), (dm, df) = prefill, decode
    pm, dm = sanitized(pm), sanitized(dm)
    p_read = prefill_readings(spec.prefill.signals, pm, pf)
    p_rec = max((r.recommendation for r in p_read), default=None)
    d_read = decode_readings(spec.decode.signals, dm, df, _decode_inflow(spec, pm, pf, p_rec))
    # This pass's recommendation takes part in its own windows, as in an HPA.
    hp, hd = state.prefill, state.decode
    if p_rec is not None:
        hp = replace(hp, recommendations=(*hp.recommendations, (now, p_rec)))
    d_rec = max((r.recommendation for r in d_read), default=None)
    if d_rec is not None:
        hd = replace(hd, recommendations=(*hd.recommendations, (now, d_rec)))
    p = _role(Role.PREFILL, spec.prefill, hp, pf, p_read, now)
    d = _role(Role.DECODE, spec.decode, hd, df, d_read, now)
    band = (spec.prefill_decode_ratio.min, spec.prefill_decode_ratio.max) if spec.prefill_decode_ratio else None
    _apply_budget(p, d, spec.gpu_budget)
    _apply_band(p, d, band, spec.gpu_budget)
    keep = {Role.PREFILL: max(spec.prefill.scale_up_stabilization_seconds, spec.prefill.scale_down_stabilization_seconds),
            Role.DECODE: max(spec.decode.scale_up_stabilization_seconds, spec.decode.scale_down_stabilization_seconds)}
    new_state = PlannerState(_history(state.prefill, p, now, keep[Role.PREFILL]),
                             _history(state.decode, d, now, keep[Role.DECODE]))
    out = [RoleDecision(r.role, r.current, r.target, r.rec, r.reason, r.message, r.readings) for r in (p, d)]
    return Decision(out[0], out[1], new_state, p.target * p.gpus + d.target * d.gpus,
                    None if band is None else _in_band(p.target, d.target, band))
