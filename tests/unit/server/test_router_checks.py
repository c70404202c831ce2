"""``RouterChecks``: which routers have dropped a draining pod, from the health checks it answered 503."""

from __future__ import annotations

from pdfleet_runtime.pod.router_checks import MAX_CALLERS, RouterChecks

A, B, C = "10.64.0.7", "10.64.0.8", "10.64.0.9"


def test_every_router_seen_before_the_drain_must_fail_its_threshold() -> None:
    rc = RouterChecks(failures=2, recent_s=6)
    rc.answered(A, True, 100.0)
    rc.answered(B, True, 101.0)
    rc.answered(C, True, 90.0)  # silent for 13 s when the drain begins: not a router holding the pod
    assert rc.begin(103.0) == [A, B]
    assert rc.dropped() is None
    rc.answered(A, False, 103.5)
    rc.answered(A, False, 104.5)
    assert rc.dropped() is None  # B has failed none yet
    rc.answered(B, False, 104.6)
    assert rc.dropped() is None and rc.pending() == {A: 2, B: 1}
    rc.answered(B, False, 105.6)
    assert rc.dropped() == [A, B]


def test_a_caller_first_seen_during_the_drain_is_waited_for_too() -> None:
    rc = RouterChecks(failures=2, recent_s=6)
    rc.answered(A, True, 10.0)
    rc.begin(11.0)
    rc.answered(A, False, 11.5)
    rc.answered(B, False, 11.6)  # a router the pod had not heard from before
    rc.answered(A, False, 12.5)
    assert rc.dropped() is None and rc.pending() == {A: 2, B: 1}
    rc.answered(B, False, 12.6)
    assert rc.dropped() == [A, B]


def test_nothing_to_count_leaves_the_bound_to_decide() -> None:
    none_known = RouterChecks(failures=2, recent_s=6)
    assert none_known.begin(50.0) == [] and none_known.dropped() is None  # no router ever checked the pod
    off = RouterChecks(failures=0, recent_s=6)  # not configured (no spec.router): never counted
    off.answered(A, True, 1.0)
    off.begin(2.0)
    for t in range(5):
        off.answered(A, False, 3.0 + t)
    assert off.dropped() is None and not off.counting
    unknown = RouterChecks(failures=2, recent_s=6)
    unknown.answered(None, True, 1.0)  # an answer without a caller address counts for no one
    assert unknown.begin(2.0) == []


def test_serving_again_forgets_the_drain_and_a_new_drain_counts_from_zero() -> None:
    rc = RouterChecks(failures=2, recent_s=6)
    rc.answered(A, True, 1.0)
    rc.begin(2.0)
    rc.answered(A, False, 2.5)
    rc.end()  # cancelled
    assert rc.dropped() is None and rc.pending() == {}
    rc.answered(A, True, 3.0)
    rc.begin(4.0)
    rc.answered(A, False, 4.5)
    assert rc.dropped() is None  # one failure of this drain, not two
    rc.answered(A, False, 5.5)
    assert rc.dropped() == [A]


def test_a_healthy_answer_inside_a_drain_restarts_that_routers_count() -> None:
    rc = RouterChecks(failures=2, recent_s=6)
    rc.answered(A, True, 1.0)
    rc.begin(2.0)
    rc.answered(A, False, 2.5)
    rc.answered(A, True, 3.0)  # the router's consecutive failures start over too
    rc.answered(A, False, 3.5)
    assert rc.dropped() is None
    rc.answered(A, False, 4.5)
    assert rc.dropped() == [A]


def test_callers_are_bounded() -> None:
    rc = RouterChecks(failures=2, recent_s=1e9)
    for i in range(MAX_CALLERS + 50):
        rc.answered(f"10.1.{i // 256}.{i % 256}", True, float(i))
    known = rc.begin(1e6)
    assert len(known) == MAX_CALLERS and "10.1.0.0" not in known  # the longest-silent were forgotten
