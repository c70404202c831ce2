"""The readiness verdict (pure): which facts make a pod ready, which problem and reason it names otherwise."""

from __future__ import annotations

import pytest

from pdfleet_runtime.pod.readiness import RATE_MIN_BYTES, CanaryResult, Problem, Readiness, busy, classify
from pdfleet_runtime.protocol.states import FailureReason as F


def decode(**kw: object) -> Readiness:
    r = Readiness("decode", floor_gbps=1.0, failures_not_ready=3, clock=lambda: 0.0, ranks_total=2, ranks_up=2)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


GOOD = CanaryResult(True, bytes=8_000_000, write_s=0.004)  # 2 GB/s


def test_a_decode_is_ready_only_after_a_verified_canary_above_the_floor() -> None:
    r = decode()
    assert r.verdict() == r.verdict() and r.verdict().problem is Problem.WAITING and not r.verdict().ready
    check = r.record_canary("10.0.0.1:8998", GOOD)
    assert check.ok and check.gbps == pytest.approx(2.0)
    v = r.verdict()
    assert v.ready and v.problem is Problem.NONE and "10.0.0.1:8998" in v.reason


def test_below_the_floor_is_not_ready_and_names_both_numbers() -> None:
    r = decode()
    r.record_canary("p:1", CanaryResult(True, bytes=8_000_000, write_s=0.016))  # 0.5 GB/s
    v = r.verdict()
    assert not v.ready and v.problem is Problem.SLOW and "0.5000 GB/s" in v.reason and "floor 1 GB/s" in v.reason


def test_a_canary_too_small_to_measure_the_link_is_verified_but_not_held_to_the_floor() -> None:
    """A model pod's canary moves its prompt's real state (kilobytes): its rate is a write's fixed cost."""
    r = decode()
    r.record_canary("p:1", CanaryResult(True, bytes=48_000, write_s=0.004))  # 0.012 GB/s, floor 1
    v = r.verdict()
    assert v.ready and "too few bytes to hold the link to the floor 1" in v.reason, v.reason
    r.record_canary("p:1", CanaryResult(True, bytes=RATE_MIN_BYTES, write_s=0.004))  # 0.26 GB/s: measured
    assert r.verdict().problem is Problem.SLOW


@pytest.mark.parametrize(("failure", "cause", "reason", "problem"), [
    (F.PEER_UNREACHABLE, None, "bootstrap 1.2.3.4:8998 unreachable", Problem.UNREACHABLE),
    (F.PEER_LOST, None, "prefill rank (0, 0) stopped polling", Problem.UNREACHABLE),
    (F.PEER_RESTARTED, None, "prefill pod restarted", Problem.UNREACHABLE),
    (F.REFUSED, None, "prefill pod speaks wire protocol 2.0; this decode rank speaks 1.0", Problem.INCOMPATIBLE),
    (F.REFUSED, F.DRAINING, "prefill pod refused: draining: prefill pod is draining", Problem.PEER_DRAINING),
    (F.DRAINING, None, "prefill pod refused: draining: prefill pod is draining", Problem.PEER_DRAINING),
    (F.SOURCE_FAILED, F.PLAN, "prefill rank (0, 0) reported plan: buffers differ", Problem.INCOMPATIBLE),
    (F.SOURCE_FAILED, F.ENGINE, "prefill rank (0, 0) reported engine: write failed", Problem.FAILING),
    (F.VERIFY, None, "12 bytes arrived different from the seeded state", Problem.CORRUPT),
    (F.TIMEOUT, None, "deadline passed", Problem.FAILING),
    # The kind decides, never the text: a reason that reads like another kind changes nothing.
    (F.REFUSED, None, "prefill pod refused: draining: prefill pod is draining", Problem.INCOMPATIBLE),
    (F.SOURCE_FAILED, F.ENGINE, "prefill rank (0, 0) reported plan: buffers differ", Problem.FAILING),
])
def test_failed_canaries_are_classified(failure: F, cause: F | None, reason: str, problem: Problem) -> None:
    assert classify(failure, cause) is problem
    r = decode()
    r.record_canary("p:1", CanaryResult(False, failure, reason, cause=cause))
    v = r.verdict()
    assert not v.ready and v.problem is problem and reason in v.reason


@pytest.mark.parametrize(("failure", "cause", "is_busy"), [
    (F.BUSY, None, True),  # decode pools are full
    (F.SOURCE_FAILED, F.BUSY, True),  # a prefill rank reported its pools full
    (F.BUSY, F.BUSY, True),  # the pod's own answer for the one above
    (F.SOURCE_FAILED, F.PLAN, False),
    (F.VERIFY, None, False),
    (None, None, False),
])
def test_a_transfer_refused_for_room_is_load_not_a_path_problem(failure: F | None, cause: F | None,
                                                                  is_busy: bool) -> None:
    """A busy prefill must not make a decode's canary name it incompatible (a gate failure: a rollback)."""
    assert busy(failure, cause) is is_busy
    if is_busy:
        assert classify(failure, cause) is not Problem.INCOMPATIBLE


def test_one_good_prefill_pod_is_enough_and_bytes_that_differ_never_are() -> None:
    r = decode()
    r.record_canary("a:1", CanaryResult(False, F.PEER_UNREACHABLE, "gone"))
    r.record_canary("b:1", GOOD)
    assert r.verdict().ready
    r.record_canary("b:1", CanaryResult(False, F.VERIFY, "12 bytes differ", mismatched=12))
    assert r.verdict().problem is Problem.UNREACHABLE  # the first endpoint's problem leads; both are listed
    assert "12 bytes differ" in r.verdict().reason and r.peers["b:1"].problem is Problem.CORRUPT


def test_a_prefill_of_another_generation_does_not_fail_a_decode_that_has_others_to_canary() -> None:
    """During a rollout a new decode discovers the old prefill (its handshake refuses the new layout) and the new
    one: it waits for the new one's canary rather than report the old one's refusal (which fails its revision);
    with nothing else to try the refusal is its problem; another peer's failure leads over the refusal."""
    refused = CanaryResult(False, F.REFUSED, "prefill pod refused the handshake: conflict: two layout generations")
    r = decode()
    r.forget_peers({"old:1", "new:1"})
    r.record_canary("old:1", refused)
    v = r.verdict()
    assert not v.ready and v.problem is Problem.WAITING and "new:1 not canaried yet" in v.reason
    assert "two layout generations" in v.reason
    r.record_canary("new:1", GOOD)
    assert r.verdict().ready
    r.record_canary("new:1", CanaryResult(False, F.PEER_UNREACHABLE, "gone"))
    assert r.verdict().problem is Problem.UNREACHABLE  # the peer of its own generation's problem
    r.forget_peers({"old:1"})
    assert r.verdict().problem is Problem.INCOMPATIBLE  # nobody else: pairing with nobody is its problem


def test_transfers_failing_in_a_row_make_it_not_ready_until_a_canary_passes() -> None:
    r = decode()
    r.record_canary("p:1", GOOD)
    for _ in range(2):
        r.record_transfer(False, "prefill rank (0, 0) reported engine: boom")
    assert r.verdict().ready
    r.record_transfer(False, "prefill rank (0, 0) reported engine: boom")
    v = r.verdict()
    assert not v.ready and v.problem is Problem.FAILING and "3 transfers failed in a row" in v.reason
    r.record_canary("p:1", GOOD)
    assert r.verdict().ready


def test_draining_starting_and_dead_ranks_override_a_good_canary() -> None:
    r = decode()
    r.record_canary("p:1", GOOD)
    assert decode(peers=r.peers, draining=True).verdict().problem is Problem.DRAINING
    assert decode(peers=r.peers, ranks_up=1).verdict().problem is Problem.STARTING
    died = decode(peers=r.peers, died=["decode[1,0] exited (killed; exit code -9)"]).verdict()
    assert died.problem is Problem.RANK_DIED and "decode[1,0]" in died.reason


def test_a_group_leader_waits_for_its_members_and_a_lost_member_is_a_failure_over_a_good_canary() -> None:
    r = decode()
    r.record_canary("p:1", GOOD)
    waiting = decode(peers=r.peers, ranks_up=1, group_waiting="group members 1 of 1 have not joined").verdict()
    assert waiting.problem is Problem.WAITING_FOR_GROUP and "1 of 2 ranks up" in waiting.reason
    lost = decode(peers=r.peers, group_lost=["group member 1: closed the group connection"]).verdict()
    assert lost.problem is Problem.GROUP_MEMBER_LOST and "group member 1" in lost.reason and not lost.ready
    from pdfleet_runtime.readiness_problems import GATE_FAILURES

    assert Problem.GROUP_MEMBER_LOST in GATE_FAILURES and Problem.WAITING_FOR_GROUP not in GATE_FAILURES


def test_discovery_failure_is_the_reason_when_no_peer_is_known() -> None:
    r = decode(discovery_error="cannot find prefill pods: NXDOMAIN")
    assert r.verdict().problem is Problem.NO_PEER and "NXDOMAIN" in r.verdict().reason


def test_a_prefill_is_ready_once_every_rank_registered_and_a_canary_was_written() -> None:
    r = Readiness("prefill", floor_gbps=1.0, ranks_total=2, ranks_up=2)
    assert r.verdict().problem is Problem.STARTING
    r.bootstrap_registered = 2
    assert r.verdict().problem is Problem.WAITING
    r.canaries_served = 1
    assert r.verdict().ready
    for _ in range(3):
        r.record_transfer(False, "write to decode rank (0, 0): peer unreachable")
    assert r.verdict().problem is Problem.FAILING


def test_gate_failure_reasons_are_readiness_problems() -> None:
    """The operator fails rollouts on these reasons: one vocabulary, read back from the condition's reason."""
    from pdfleet_runtime.readiness_problems import GATE_FAILURES, gate_problem

    assert Problem.WAITING not in GATE_FAILURES and Problem.STARTING not in GATE_FAILURES
    assert all(gate_problem(p.value) is p for p in Problem)  # the reason the runtime writes reads back as itself
    assert gate_problem("EngineStarting") is None and gate_problem("") is None  # the agent's own, or none


def test_a_decode_failing_most_of_its_prefills_leaves_the_routers_and_one_failing_pair_is_only_reported() -> None:
    """Routers pair pods, not pairs: one bad prefill (every decode fails against it) must not take every decode
    out, while a decode that fails against most prefills (two at least) is the broken end."""
    corrupt = CanaryResult(False, F.VERIFY, "12 bytes differ", mismatched=12)
    r = decode()
    r.record_canary("a:1", GOOD)
    r.record_canary("b:1", GOOD)
    r.record_canary("c:1", corrupt)
    v = r.verdict()
    assert v.ready and "reported, not acted on: prefill pod c:1: 12 bytes differ" in v.reason
    r.record_canary("b:1", CanaryResult(False, F.PEER_UNREACHABLE, "gone"))
    v = r.verdict()  # 2 of 3 fail: the decode is the likelier broken end
    assert not v.ready and v.problem is Problem.UNREACHABLE and "fail against 2 of 3 prefill pods" in v.reason
    assert "b:1" in v.reason and "c:1" in v.reason and "a:1" not in v.reason
    r.record_canary("b:1", GOOD)
    assert r.verdict().ready


def test_a_prefill_of_another_generation_or_draining_never_counts_against_a_decode() -> None:
    r = decode()
    r.record_canary("a:1", GOOD)
    r.record_canary("old:1", CanaryResult(False, F.REFUSED, "conflict: two layout generations"))
    r.record_canary("old:2", CanaryResult(False, F.DRAINING, "draining"))
    v = r.verdict()
    assert v.ready and "old:1" not in v.reason and "old:2" not in v.reason
