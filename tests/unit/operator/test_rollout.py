"""The rollout step planner: invariants on every pass and convergence from any state.

A small simulated world stands in for the cluster: created pods appear not ready and become ready
on a later tick (unless the scenario says they never do), draining pods report drained after a
tick, deleted pods vanish. Each pass is checked against the budgets of shared/rollout.md.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfleet_operator.rollout import PodView, StepKind, plan_steps

NEW, OLD = "new", "old"


def world_pass(pods: list[PodView], steps, now: float) -> list[PodView]:
    """Apply one pass's steps to the simulated world."""
    by_name = {p.name: p for p in pods}
    for s in steps:
        if s.kind is StepKind.CREATE:
            name = f"p{s.index}-{now}"
            by_name[name] = PodView(name, NEW, s.index, ready=False)
        elif s.kind is StepKind.START_DRAIN:
            by_name[s.pod] = replace(by_name[s.pod], drain_started=now)
        elif s.kind is StepKind.CANCEL_DRAIN:
            by_name[s.pod] = replace(by_name[s.pod], drain_started=None, drained=False)
        elif s.kind is StepKind.DELETE:
            del by_name[s.pod]
    return list(by_name.values())


def world_tick(pods: list[PodView], rng: random.Random, new_ready: bool) -> list[PodView]:
    out = []
    for p in pods:
        if p.draining and not p.drained and rng.random() < 0.7:
            p = replace(p, drained=True)
        if not p.ready and p.revision == NEW and new_ready and rng.random() < 0.7:
            p = replace(p, ready=True)
        out.append(p)
    return out


def check_pass(before: list[PodView], steps, replicas: int, surge: int, unavailable: int) -> None:
    kinds = {s.kind for s in steps}
    # One side per pass.
    assert len(kinds - {StepKind.CANCEL_DRAIN}) <= 1, kinds
    creates = sum(s.kind is StepKind.CREATE for s in steps)
    if creates:
        assert len(before) + creates <= replicas + surge
    drained_now = {s.pod for s in steps if s.kind is StepKind.START_DRAIN}
    ready_before = sum(p.routable_ready for p in before)
    ready_after = sum(p.routable_ready and p.name not in drained_now for p in before)
    assert ready_after >= min(ready_before, replicas - unavailable)
    # Only drained pods or pods past their deadline are deleted.
    for s in steps:
        if s.kind is StepKind.DELETE:
            pod = next(p for p in before if p.name == s.pod)
            assert pod.draining and (pod.drained or s.forced)


def budgets(replicas: int, surge: int, unavailable: int) -> tuple[int, int]:
    return (surge, 1) if surge == 0 and unavailable == 0 else (surge, unavailable)


@settings(max_examples=300, deadline=None)
@given(
    replicas=st.integers(0, 8),
    surge=st.integers(0, 3),
    unavailable=st.integers(0, 3),
    start=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), max_size=10),
    seed=st.integers(0, 2**16),
)
def test_invariants_hold_and_rollouts_converge(replicas, surge, unavailable, start, seed) -> None:
    surge, unavailable = budgets(replicas, surge, unavailable)
    rng = random.Random(seed)
    pods = [
        PodView(f"s{i}", NEW if is_new else OLD, i, ready=ready, drain_started=0.0 if draining else None)
        for i, (is_new, ready, draining) in enumerate(start)
    ]
    for tick in range(1, 200):
        steps = plan_steps(pods, replicas=replicas, revision=NEW, surge=surge, unavailable=unavailable,
                           drain_timeout=50.0, now=float(tick))
        check_pass(pods, steps, replicas, surge, unavailable)
        pods = world_tick(world_pass(pods, steps, float(tick)), rng, new_ready=True)
        done = (len(pods) == replicas and all(p.revision == NEW and p.ready and not p.draining for p in pods))
        if done:
            break
    else:
        pytest.fail(f"no convergence: {pods}")


@pytest.mark.parametrize("surge", [0, 1])
def test_single_replica_rolls_with_surge_0_or_1(surge: int) -> None:
    s, u = budgets(1, surge, 0)
    pods = [PodView("old", OLD, 0, ready=True)]
    seen_total = []
    for tick in range(1, 50):
        steps = plan_steps(pods, replicas=1, revision=NEW, surge=s, unavailable=u, drain_timeout=10.0,
                           now=float(tick))
        pods = world_tick(world_pass(pods, steps, float(tick)), random.Random(tick), new_ready=True)
        seen_total.append(len(pods))
        if [p.revision for p in pods] == [NEW] and pods[0].ready:
            break
    assert max(seen_total) <= 1 + s
    assert [p.revision for p in pods] == [NEW]


def test_stuck_new_pods_never_cost_capacity() -> None:
    """New pods that never pass the gate: old ready pods stay at the floor (rollback is part 2)."""
    pods = [PodView(f"o{i}", OLD, i, ready=True) for i in range(4)]
    for tick in range(1, 30):
        steps = plan_steps(pods, replicas=4, revision=NEW, surge=2, unavailable=0, drain_timeout=5.0,
                           now=float(tick))
        check_pass(pods, steps, 4, 2, 0)
        pods = world_tick(world_pass(pods, steps, float(tick)), random.Random(tick), new_ready=False)
    assert sum(p.routable_ready for p in pods) == 4
    assert len(pods) == 6


def test_paused_finishes_committed_drains_only() -> None:
    pods = [PodView("a", OLD, 0, ready=True, drain_started=1.0, drained=True), PodView("b", OLD, 1, ready=True)]
    steps = plan_steps(pods, replicas=2, revision=NEW, surge=1, unavailable=0, drain_timeout=5.0, now=2.0,
                       paused=True)
    assert [(s.kind, s.pod) for s in steps] == [(StepKind.DELETE, "a")]
    pods = [pods[1]]
    assert plan_steps(pods, replicas=2, revision=NEW, surge=1, unavailable=0, drain_timeout=5.0, now=3.0,
                      paused=True) == []


def test_revert_cancels_drains_of_wanted_pods() -> None:
    pods = [PodView("a", NEW, 0, ready=True, drain_started=1.0), PodView("b", NEW, 1, ready=True)]
    steps = plan_steps(pods, replicas=2, revision=NEW, surge=1, unavailable=0, drain_timeout=60.0, now=2.0)
    assert [(s.kind, s.pod) for s in steps] == [(StepKind.CANCEL_DRAIN, "a")]


def test_a_pod_never_scheduled_is_deleted_without_waiting_for_the_drain_deadline() -> None:
    """Stuck Pending (rolled back): no runtime ever ran in it, so none will report it drained."""
    pods = [PodView("a", NEW, 0, ready=False, drain_started=1.0, scheduled=False), PodView("b", OLD, 1, ready=True)]
    steps = plan_steps(pods, replicas=1, revision=OLD, surge=1, unavailable=0, drain_timeout=600.0, now=2.0)
    assert [(s.kind, s.pod, s.forced, s.reason) for s in steps] == [
        (StepKind.DELETE, "a", False, "never scheduled: nothing in flight")]
    scheduled = [replace(pods[0], scheduled=True), pods[1]]  # a pod that may have run waits for its drain
    assert plan_steps(scheduled, replicas=1, revision=OLD, surge=1, unavailable=0, drain_timeout=600.0, now=2.0) == []


def test_forced_delete_after_deadline() -> None:
    pods = [PodView("a", OLD, 0, ready=True, drain_started=1.0), PodView("b", NEW, 1, ready=True)]
    steps = plan_steps(pods, replicas=1, revision=NEW, surge=1, unavailable=0, drain_timeout=10.0, now=11.0)
    assert [(s.kind, s.pod, s.forced) for s in steps] == [(StepKind.DELETE, "a", True)]
