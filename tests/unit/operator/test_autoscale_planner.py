"""The autoscaling planner: its invariants on every decision, over random specs, metrics and fleets,
and over sequences of decisions under an injected clock (hypothesis), plus the scenarios its rules
name (starting replicas, the lifetime effect, missing metrics).

Invariants (operator/pdfleet_operator/autoscale/planner.py): never outside [min, max]; never over
the GPU budget, and no growth while the desired replicas plus the draining ones would exceed it;
the ratio band kept whenever an allowed pair exists (always, when the fleet already is in it); no
shrink within the scale-down window of a growth and no growth within the scale-up window of a
shrink; a shrinking role is named as such (the reconcile drains it).
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdfleet_operator.api.autoscaling import AutoscalingSpec, cheapest_in_band
from pdfleet_operator.api.constants import Role
from pdfleet_operator.autoscale.planner import SHRINK_SPACING_S, Decision, PlannerState, Reason, plan
from pdfleet_operator.autoscale.signals import DecodeMetrics, PrefillMetrics, RoleFleet, project_backlog

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEQUENCES = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def specs(draw) -> tuple[AutoscalingSpec, tuple[int, int]]:
    gpus = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    bounds = []
    for _ in range(2):
        lo = draw(st.integers(1, 6))
        bounds.append((lo, draw(st.integers(lo, 14))))
    band = None
    if draw(st.booleans()):
        lo = draw(st.sampled_from([0.1, 0.25, 0.5, 1.0, 1.5, 2.0]))
        band = (lo, lo * draw(st.sampled_from([1.0, 1.5, 2.0, 4.0, 10.0])))
    best = cheapest_in_band(bounds[0], bounds[1], band, gpus)
    assume(best is not None)
    need = best[0] * gpus[0] + best[1] * gpus[1]
    budget = draw(st.one_of(st.none(), st.integers(need, need + 60)))
    windows = [draw(st.sampled_from([0, 15, 60, 300])) for _ in range(4)]
    spec = AutoscalingSpec.model_validate({
        "prefill": {"minReplicas": bounds[0][0], "maxReplicas": bounds[0][1],
                    "scaleUpStabilizationSeconds": windows[0], "scaleDownStabilizationSeconds": windows[1],
                    "signals": {"backlog": {"targetSeconds": draw(st.sampled_from([0.5, 1.5, 5.0])),
                                            "prefillTokensPerSecond": 10000},
                                "ttft": {"targetSeconds": 2.0}}},
        "decode": {"minReplicas": bounds[1][0], "maxReplicas": bounds[1][1],
                   "scaleUpStabilizationSeconds": windows[2], "scaleDownStabilizationSeconds": windows[3],
                   "signals": {"kvCache": {"target": 0.8}, "runningRequests": {"targetPerReplica": 64},
                               "itl": {"targetSeconds": 0.05}}},
        **({"prefillDecodeRatio": {"min": band[0], "max": band[1]}} if band else {}),
        **({"gpuBudget": budget} if budget is not None else {}),
    })
    return spec, gpus


def maybe(strategy):
    return st.one_of(st.none(), strategy)


prefill_metrics = st.builds(
    PrefillMetrics,
    queued_prompt_tokens=maybe(st.floats(0, 5e6)),
    prompt_tokens_per_second=maybe(st.floats(0, 2e5)),
    requests_per_second=maybe(st.floats(0.01, 100)),
    ttft_seconds=maybe(st.floats(0.01, 20)),
)
decode_metrics = st.builds(
    DecodeMetrics,
    kv_used_tokens=maybe(st.floats(0, 4e6)),
    kv_tokens_per_replica=st.just(100000.0),
    running_requests=maybe(st.floats(0, 2000)),
    queued_requests=maybe(st.floats(0, 500)),
    requests_per_second=maybe(st.floats(0.01, 200)),
    itl_seconds=maybe(st.floats(0.005, 0.5)),
)


@st.composite
def fleet(draw, lo: int, hi: int, gpus: int) -> RoleFleet:
    replicas = draw(st.integers(lo, hi))
    ready = draw(st.integers(0, replicas))
    starting = tuple(draw(st.lists(st.floats(0, 400), min_size=replicas - ready, max_size=replicas - ready)))
    return RoleFleet(replicas, ready, starting, draw(st.integers(0, 3)), draw(st.sampled_from([30.0, 180.0])), gpus)


def in_band(spec: AutoscalingSpec, p: int, d: int) -> bool:
    b = spec.prefill_decode_ratio
    return b is None or b.min * d - 1e-9 <= p <= b.max * d + 1e-9


def gpus_of(p: int, d: int, gpus: tuple[int, int]) -> int:
    return p * gpus[0] + d * gpus[1]


def check(spec: AutoscalingSpec, gpus: tuple[int, int], pf: RoleFleet, df: RoleFleet, dec: Decision) -> None:
    """The invariants of one decision."""
    p, d = dec.prefill.desired, dec.decode.desired
    for r, rs in ((dec.prefill, spec.prefill), (dec.decode, spec.decode)):
        assert rs.min_replicas <= r.desired <= rs.max_replicas, r
        assert (r.role in dec.shrinking) == (r.desired < r.current)
    assert dec.gpus == gpus_of(p, d, gpus)
    if spec.gpu_budget is not None:
        assert dec.gpus <= spec.gpu_budget, dec
        held = pf.draining * gpus[0] + df.draining * gpus[1]
        forced = pf.replicas < spec.prefill.min_replicas or df.replicas < spec.decode.min_replicas
        if (p > pf.replicas or d > df.replicas) and not forced:
            assert dec.gpus + held <= spec.gpu_budget, (dec, held)
    if in_band(spec, pf.replicas, df.replicas) and (
            spec.gpu_budget is None or gpus_of(pf.replicas, df.replicas, gpus) <= spec.gpu_budget):
        assert in_band(spec, p, d), (pf.replicas, df.replicas, p, d, dec.prefill.message, dec.decode.message)
    assert dec.ratio_in_band == (None if spec.prefill_decode_ratio is None else in_band(spec, p, d))


@SETTINGS
@given(data=st.data(), sg=specs(), pm=prefill_metrics, dm=decode_metrics, now=st.floats(0, 1e6))
def test_every_decision_keeps_bounds_budget_and_band(data, sg, pm, dm, now) -> None:
    spec, gpus = sg
    pf = data.draw(fleet(spec.prefill.min_replicas, spec.prefill.max_replicas, gpus[0]))
    df = data.draw(fleet(spec.decode.min_replicas, spec.decode.max_replicas, gpus[1]))
    assume(spec.gpu_budget is None or gpus_of(pf.replicas, df.replicas, gpus) <= spec.gpu_budget)
    dec = plan(spec, now, (pm, pf), (dm, df))
    check(spec, gpus, pf, df, dec)
    assert plan(spec, now, (pm, pf), (dm, df)) == dec  # pure: the same inputs, the same decision


@SETTINGS
@given(data=st.data(), sg=specs(), pm=prefill_metrics, dm=decode_metrics)
def test_the_band_is_reached_whenever_an_allowed_pair_exists(data, sg, pm, dm) -> None:
    """From outside the band (no history: the windows allow any move), a pair in the band inside the
    bounds and the budget is always found when one exists."""
    spec, gpus = sg
    assume(spec.prefill_decode_ratio is not None)
    pf = data.draw(fleet(spec.prefill.min_replicas, spec.prefill.max_replicas, gpus[0]))
    df = data.draw(fleet(spec.decode.min_replicas, spec.decode.max_replicas, gpus[1]))
    pf, df = replace(pf, draining=0), replace(df, draining=0)
    dec = plan(spec, 0.0, (pm, pf), (dm, df))
    assert in_band(spec, dec.prefill.desired, dec.decode.desired), (pf.replicas, df.replicas, dec)


@SEQUENCES
@given(sg=specs(), steps=st.lists(st.tuples(prefill_metrics, decode_metrics, st.floats(1, 120),
                                            st.integers(0, 2), st.integers(0, 2)), min_size=2, max_size=25))
def test_no_flapping_inside_the_windows_over_a_sequence(sg, steps) -> None:
    """Decisions under an injected clock, the fleet following each one (its new replicas start and
    some become ready, its removed ones drain): the invariants hold at every step, and a role never
    reverses inside the window that follows its last move."""
    spec, gpus = sg
    now = 0.0
    state = PlannerState()
    pf = RoleFleet(spec.prefill.min_replicas, spec.prefill.min_replicas, (), 0, 60.0, gpus[0])
    df = RoleFleet(spec.decode.min_replicas, spec.decode.min_replicas, (), 0, 60.0, gpus[1])
    if spec.prefill_decode_ratio is not None:
        best = cheapest_in_band((spec.prefill.min_replicas, spec.prefill.max_replicas),
                                (spec.decode.min_replicas, spec.decode.max_replicas),
                                (spec.prefill_decode_ratio.min, spec.prefill_decode_ratio.max), gpus)
        assert best is not None
        pf, df = replace(pf, replicas=best[0], ready=best[0]), replace(df, replicas=best[1], ready=best[1])
    last: dict[Role, tuple[float, int]] = {}  # role -> (time, direction) of its last move
    windows = {Role.PREFILL: (spec.prefill.scale_up_stabilization_seconds, spec.prefill.scale_down_stabilization_seconds),
               Role.DECODE: (spec.decode.scale_up_stabilization_seconds, spec.decode.scale_down_stabilization_seconds)}
    for pm, dm, dt, p_drain, d_drain in steps:
        pf, df = replace(pf, draining=p_drain), replace(df, draining=d_drain)
        if spec.gpu_budget is not None and gpus_of(pf.replicas + p_drain, df.replicas + d_drain, gpus) > spec.gpu_budget:
            pf, df = replace(pf, draining=0), replace(df, draining=0)
        dec = plan(spec, now, (pm, pf), (dm, df), state)
        check(spec, gpus, pf, df, dec)
        for r in (dec.prefill, dec.decode):
            if r.change:
                up, down = windows[r.role]
                direction = 1 if r.change > 0 else -1
                if r.role in last and last[r.role][1] != direction:
                    t, _ = last[r.role]
                    window = down if direction < 0 else up
                    assert now - t >= window, (r.role, now, t, window, r)
                if direction < 0 and r.role in last and last[r.role][1] < 0:
                    assert now - last[r.role][0] >= SHRINK_SPACING_S
                last[r.role] = (now, direction)
        state = dec.state
        # The fleet follows: new replicas start, half of them become ready now, removed ones leave.
        pf = _follow(pf, dec.prefill.desired)
        df = _follow(df, dec.decode.desired)
        now += dt


def _follow(f: RoleFleet, desired: int) -> RoleFleet:
    if desired > f.replicas:
        new = desired - f.replicas
        return replace(f, replicas=desired, ready=f.ready + new // 2, starting=f.starting + (0.0,) * (new - new // 2))
    return replace(f, replicas=desired, ready=min(f.ready, desired), starting=f.starting[: max(0, desired - f.ready)])


# -- the rules, one scenario each ---------------------------------------------------------------------

SPEC = AutoscalingSpec.model_validate({
    "prefill": {"minReplicas": 1, "maxReplicas": 4096,
                "signals": {"backlog": {"targetSeconds": 1.5, "prefillTokensPerSecond": 10000}}},
    "decode": {"minReplicas": 1, "maxReplicas": 4096, "signals": {"kvCache": {"target": 0.8}}},
})
V = 10000.0


@settings(max_examples=200, deadline=None)
@given(ready=st.integers(1, 50), load=st.floats(1.5, 6.0), startup=st.sampled_from([60.0, 180.0, 300.0]),
       backlog=st.floats(0, 2e6))
def test_no_over_scaling_while_replicas_start(ready, load, startup, backlog) -> None:
    """A load step above capacity: the first decision asks for replicas; while they start, the backlog
    keeps growing exactly as the planner projected, and no later decision asks for more (one replica
    of rounding aside)."""
    arrivals = load * ready * V
    pm = PrefillMetrics(queued_prompt_tokens=backlog, prompt_tokens_per_second=arrivals, requests_per_second=10.0)
    dm = DecodeMetrics()
    pf = RoleFleet(ready, ready, (), 0, startup, 1)
    df = RoleFleet(1, 1, (), 0, startup, 1)
    first = plan(SPEC, 0.0, (pm, pf), (dm, df))
    asked = first.prefill.desired
    assert asked > ready and first.prefill.reason is Reason.SIGNAL_ABOVE_TARGET
    state, t = first.state, 0.0
    while t + 15 < startup:
        t += 15
        backlog = project_backlog(backlog, arrivals, V, ready, [], 15)  # the started ones are not Ready yet
        pm = replace(pm, queued_prompt_tokens=backlog)
        pf = RoleFleet(asked, ready, (t,) * (asked - ready), 0, startup, 1)
        dec = plan(SPEC, t, (pm, pf), (dm, df), state)
        assert dec.prefill.desired <= asked + 1, (t, dec.prefill)
        if dec.prefill.desired == asked:
            assert dec.prefill.reason in (Reason.WITHIN_TARGET, Reason.STARTING_REPLICAS_COVER,
                                          Reason.SCALE_DOWN_STABILIZING), dec.prefill
        state = dec.state


def test_arrivals_size_the_prefill_role_and_the_start_up_backlog_is_counted() -> None:
    """No backlog and spare replicas: prefill is sized to keep up with what arrives. Short of
    replicas: what arrives plus the backlog that builds while new ones start (180 s here), cleared
    within one start-up time."""
    pm = PrefillMetrics(queued_prompt_tokens=0.0, prompt_tokens_per_second=42 * V, requests_per_second=40.0)
    dec = plan(SPEC, 0.0, (pm, RoleFleet(50, 50, (), 0, 180.0, 1)), (DecodeMetrics(), RoleFleet(1, 1)))
    assert dec.prefill.desired == 42 and dec.prefill.reason is Reason.SIGNAL_BELOW_TARGET
    (reading,) = dec.prefill.readings
    assert reading.recommendation == 42 and reading.value == 0.0 and reading.target == 1.5
    short = plan(SPEC, 0.0, (pm, RoleFleet(10, 10, (), 0, 180.0, 1)), (DecodeMetrics(), RoleFleet(1, 1)))
    built = (42 - 10) * V * 180  # the backlog when a replica asked for now is Ready
    assert short.prefill.desired == math.ceil(42 + (built - 42 * V * 1.5) / (V * 180))
    assert short.prefill.reason is Reason.SIGNAL_ABOVE_TARGET


def test_decode_follows_prefill_ahead_of_its_own_signal() -> None:
    """Prefill is about to triple its output: decode is sized for the inflow that follows, not for the
    KV it holds now."""
    dm = DecodeMetrics(kv_used_tokens=80000.0 * 4, kv_tokens_per_replica=100000.0, running_requests=400.0,
                       queued_requests=0.0, requests_per_second=40.0)
    calm = PrefillMetrics(queued_prompt_tokens=0.0, prompt_tokens_per_second=10 * V, requests_per_second=40.0)
    steady = plan(SPEC, 0.0, (calm, RoleFleet(10, 10, (), 0, 180.0, 1)), (dm, RoleFleet(4, 4, (), 0, 180.0, 1)))
    assert steady.decode.desired == 4
    surge = replace(calm, prompt_tokens_per_second=30 * V, requests_per_second=120.0)
    ahead = plan(SPEC, 0.0, (surge, RoleFleet(10, 10, (), 0, 180.0, 1)), (dm, RoleFleet(4, 4, (), 0, 180.0, 1)))
    assert ahead.prefill.desired >= 30 and ahead.decode.desired >= 12, ahead


def test_decode_shrinks_by_the_geometric_mean_not_the_naive_count() -> None:
    """A KV reading on 16 replicas that would fit 4: requests run longer on a smaller pool, so the
    planner goes to sqrt(4 x 16) = 8, not 4."""
    dm = DecodeMetrics(kv_used_tokens=4 * 0.8 * 100000.0, kv_tokens_per_replica=100000.0, running_requests=100.0,
                       queued_requests=0.0, requests_per_second=10.0)
    spec = SPEC.model_copy(update={"decode": SPEC.decode.model_copy(update={"scale_down_stabilization_seconds": 0})})
    dec = plan(spec, 0.0, (PrefillMetrics(), RoleFleet(1, 1)), (dm, RoleFleet(16, 16, (), 0, 180.0, 1)))
    assert dec.decode.desired == 8 and dec.shrinking == (Role.DECODE,)
    assert dec.decode.reason is Reason.SIGNAL_BELOW_TARGET


def test_missing_metrics_hold_the_fleet() -> None:
    dec = plan(SPEC, 0.0, (PrefillMetrics(), RoleFleet(3, 3)), (DecodeMetrics(), RoleFleet(2, 2)))
    assert (dec.prefill.desired, dec.decode.desired) == (3, 2)
    assert dec.prefill.reason is dec.decode.reason is Reason.NO_SIGNAL
    below = plan(SPEC, 0.0, (PrefillMetrics(), RoleFleet(0, 0)), (DecodeMetrics(), RoleFleet(0, 0)))
    assert (below.prefill.desired, below.decode.desired) == (1, 1) and below.prefill.reason is Reason.AT_MIN


def test_scale_down_waits_for_its_window_after_a_growth() -> None:
    spec = SPEC
    busy = PrefillMetrics(queued_prompt_tokens=0.0, prompt_tokens_per_second=20 * V, requests_per_second=20.0)
    idle = replace(busy, prompt_tokens_per_second=2 * V)
    dec = plan(spec, 0.0, (busy, RoleFleet(10, 10)), (DecodeMetrics(), RoleFleet(1, 1)))
    grown = dec.prefill.desired
    assert grown > 20 and dec.prefill.reason is Reason.SIGNAL_ABOVE_TARGET
    held = plan(spec, 200.0, (idle, RoleFleet(grown, grown)), (DecodeMetrics(), RoleFleet(1, 1)), dec.state)
    assert held.prefill.desired == grown and held.prefill.reason is Reason.SCALE_DOWN_STABILIZING
    later = plan(spec, 301.0, (idle, RoleFleet(grown, grown)), (DecodeMetrics(), RoleFleet(1, 1)), held.state)
    assert later.prefill.desired == 2 and later.prefill.reason is Reason.SIGNAL_BELOW_TARGET
    assert later.shrinking == (Role.PREFILL,)


def test_growth_waits_for_draining_gpus_under_the_budget() -> None:
    spec = SPEC.model_copy(update={"gpu_budget": 24})
    busy = PrefillMetrics(queued_prompt_tokens=0.0, prompt_tokens_per_second=30 * V, requests_per_second=30.0)
    dec = plan(spec, 0.0, (busy, RoleFleet(10, 10, (), 6)), (DecodeMetrics(), RoleFleet(2, 2)))
    # 24 GPUs: 2 decode + 6 draining prefill leave 16 for prefill replicas.
    assert dec.prefill.desired == 16 and dec.prefill.reason is Reason.GPU_BUDGET and dec.gpus == 18
    assert dec.prefill.recommendation is not None and dec.prefill.recommendation > 16
