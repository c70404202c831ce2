"""The request state machine: legal paths, refused moves, a deadline on every wait, first outcome stands."""

from __future__ import annotations

import pytest

from pdfleet_runtime.protocol.states import (
    TERMINAL,
    TRANSITIONS,
    FailureReason,
    IllegalTransition,
    RequestState,
    RequestTracker,
    StateTimeouts,
)
from tests.unit.protocol.helpers import FakeClock

S = RequestState


def tracker(clock: FakeClock) -> RequestTracker:
    return RequestTracker(StateTimeouts(bootstrapping_s=1, waiting_for_input_s=2, transferring_s=3, retain_s=5), clock)


def test_happy_path_and_history() -> None:
    t = tracker(FakeClock())
    t.start("r")
    for s in (S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS):
        t.advance("r", s)
    assert t.get("r").history == [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS]


@pytest.mark.parametrize("src", list(S))
@pytest.mark.parametrize("dst", list(S))
def test_only_listed_transitions_are_allowed(src: RequestState, dst: RequestState) -> None:
    t = tracker(FakeClock())
    t.start("r")
    path = {S.BOOTSTRAPPING: [], S.WAITING_FOR_INPUT: [S.WAITING_FOR_INPUT],
            S.TRANSFERRING: [S.WAITING_FOR_INPUT, S.TRANSFERRING],
            S.SUCCESS: [S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS], S.FAILED: [S.FAILED]}[src]
    for s in path:
        t.advance("r", s)
    if dst in TRANSITIONS[src]:
        t.advance("r", dst)
        assert t.get("r").state is dst
    else:
        with pytest.raises(IllegalTransition):
            t.advance("r", dst)
        assert t.get("r").state is src


def test_terminal_states_have_no_way_out() -> None:
    assert all(not TRANSITIONS[s] for s in TERMINAL)
    assert all(TRANSITIONS[s] for s in S if s not in TERMINAL)


@pytest.mark.parametrize(("state", "budget"), [(S.BOOTSTRAPPING, 1), (S.WAITING_FOR_INPUT, 2), (S.TRANSFERRING, 3)])
def test_every_wait_expires_with_a_reason(state: RequestState, budget: float) -> None:
    clock = FakeClock()
    t = tracker(clock)
    t.start("r")
    for s in [S.WAITING_FOR_INPUT, S.TRANSFERRING][: list(S).index(state)]:
        t.advance("r", s)
    clock.advance(budget - 0.01)
    assert t.expire() == []
    clock.advance(0.02)
    [rec] = t.expire()
    assert rec.state is S.FAILED and rec.failure is FailureReason.TIMEOUT and state.value in rec.reason


def test_request_deadline_caps_the_state_budget() -> None:
    clock = FakeClock()
    t = tracker(clock)
    t.start("r", deadline=clock() + 0.5)
    clock.advance(0.6)
    assert [r.request_id for r in t.expire()] == ["r"]


def test_first_outcome_stands_and_failure_needs_reason() -> None:
    t = tracker(FakeClock())
    t.start("r")
    with pytest.raises(ValueError, match="reason"):
        t.fail("r", FailureReason.ENGINE, "")
    assert t.fail("r", FailureReason.PEER_LOST, "gone") is not None
    assert t.fail("r", FailureReason.ENGINE, "later") is None
    assert t.get("r").failure is FailureReason.PEER_LOST and t.get("r").reason == "gone"
    with pytest.raises(IllegalTransition):
        t.advance("r", S.SUCCESS)


def test_terminal_records_are_purged_after_retention_and_the_tracker_is_bounded() -> None:
    clock = FakeClock()
    t = RequestTracker(StateTimeouts(retain_s=5), clock, limit=2)
    t.start("a")
    t.fail("a", FailureReason.CANCELLED, "x")
    t.start("b")
    with pytest.raises(OverflowError):
        t.start("c")
    clock.advance(6)
    t.start("c")  # purges "a"
    assert "a" not in t and "c" in t
    with pytest.raises(IllegalTransition):
        t.start("c")


def test_only_an_ended_request_is_forgotten_and_its_id_may_start_again() -> None:
    t = tracker(FakeClock())
    t.start("r")
    with pytest.raises(IllegalTransition):
        t.forget("r")  # in flight: kept
    t.fail("r", FailureReason.PEER_UNREACHABLE, "no connection")
    with pytest.raises(IllegalTransition):
        t.start("r")  # ended moments ago: refused while retained
    t.forget("r")
    assert "r" not in t
    t.start("r")


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ValueError):
        StateTimeouts(transferring_s=0)
