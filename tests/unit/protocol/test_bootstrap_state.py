"""The prefill pod's registry as a pure function of messages: readiness, fan-out, fan-in, leases, refusals.

A refused message must leave the state exactly as it was (compared by deep snapshot), also for
hypothesis-generated sequences of valid and invalid messages.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfleet_runtime.protocol.auth import ProtocolError
from pdfleet_runtime.protocol.bootstrap import BootstrapLimits, BootstrapState
from pdfleet_runtime.protocol.messages import (
    WIRE,
    Ack,
    Cancel,
    DecodeRegistered,
    Hello,
    IndicesModel,
    PrefillPoll,
    PrefillWork,
    RankKey,
    RefusalCode,
    Role,
    StatusQuery,
    StatusReply,
    StatusReport,
    StatusReports,
    Welcome,
)
from pdfleet_runtime.protocol.states import FailureReason, RequestState
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.records import RequestIndices
from tests.unit.protocol.helpers import (
    FakeClock,
    decode_register,
    prefill_register,
    ready_state,
    snapshot,
    transfer_request,
)


def refused(st: BootstrapState, msg: object, code: RefusalCode) -> ProtocolError:
    before = snapshot(st)
    with pytest.raises(ProtocolError) as e:
        st.handle(msg)  # type: ignore[arg-type]
    assert e.value.code is code, e.value
    assert snapshot(st) == before, "a refused message changed the state"
    return e.value


def report(rid: str, src: tuple[int, int], dst: tuple[int, int] = (0, 0),
           state: RequestState = RequestState.SUCCESS) -> StatusReport:
    failed = state is RequestState.FAILED
    return StatusReport(request_id=rid, instance="dec", src=RankKey(tp=src[0], pp=src[1]),
                        dst=RankKey(tp=dst[0], pp=dst[1]), state=state,
                        failure=FailureReason.ENGINE if failed else None, reason="boom" if failed else "")


def poll(st: BootstrapState, tp: int, pp: int = 0, ack: int = 0) -> PrefillWork:
    work = st.handle(PrefillPoll(rank=RankKey(tp=tp, pp=pp), ack=ack))
    assert isinstance(work, PrefillWork)
    return work


def test_hello_welcomes_a_compatible_peer_and_refuses_another_major_naming_both() -> None:
    st = BootstrapState(S(2))
    w = st.handle(Hello(role=Role.DECODE, runtime_version="0.1.0", wire=str(WIRE), instance="d"))
    assert isinstance(w, Welcome) and not w.ready and (w.prefill_tp, w.prefill_pp) == (2, 1)
    e = refused(st, Hello(role=Role.DECODE, runtime_version="9.0.0", wire=f"{WIRE.major + 1}.3", instance="d"),
                RefusalCode.VERSION)
    assert f"{WIRE.major + 1}.3" in e.reason and str(WIRE) in e.reason and "9.0.0" in e.reason


def test_decode_waits_until_every_prefill_rank_registered() -> None:
    st = BootstrapState(S(2), clock=FakeClock())
    st.handle(prefill_register(S(2), 0, 0))
    refused(st, decode_register(S(1), 0, 0), RefusalCode.NOT_READY)
    st.handle(prefill_register(S(2), 1, 0))
    reply = st.handle(decode_register(S(1), 0, 0))
    assert isinstance(reply, DecodeRegistered) and [s.pair for s in reply.sources] == [(0, 0), (1, 0)]


def test_shape_conflicts_are_refused() -> None:
    clock = FakeClock()
    st = ready_state(S(4), S(2), clock)
    refused(st, prefill_register(S(2), 0, 0), RefusalCode.CONFLICT)  # another prefill shape
    refused(st, decode_register(S(2, 2), 0, 0, instance="other"), RefusalCode.CONFLICT)  # decode pp 2 > prefill pp 1
    refused(st, decode_register(S(4), 0, 0), RefusalCode.CONFLICT)  # instance "dec" registered tp=2


def test_requests_fan_out_to_every_source_and_statuses_fan_in() -> None:
    clock = FakeClock()
    st = ready_state(S(4), S(2), clock)
    assert st.handle(transfer_request("r1", tp=1)) == Ack()
    for src in range(4):
        events = poll(st, src).events
        reqs = [e.request for e in events if e.request is not None]
        assert [r.request_id for r in reqs] == (["r1"] if src in (2, 3) else []), src
    q = StatusQuery(instance="dec", dst=RankKey(tp=1, pp=0), request_ids=("r1",))
    st.handle(StatusReports(reports=(report("r1", (2, 0), (1, 0)),)))
    got = st.handle(q)
    assert isinstance(got, StatusReply) and [r.src.pair for r in got.reports] == [(2, 0)]
    refused(st, StatusReports(reports=(report("r1", (0, 0), (1, 0)),)), RefusalCode.UNEXPECTED)  # not a source
    st.handle(StatusReports(reports=(report("r1", (3, 0), (1, 0)),)))
    got = st.handle(q)
    assert isinstance(got, StatusReply) and {r.src.pair for r in got.reports} == {(2, 0), (3, 0)}
    assert all(r.state is RequestState.SUCCESS for r in got.reports)


def test_events_are_resent_until_acknowledged() -> None:
    st = ready_state(S(1), S(1), FakeClock())
    first = poll(st, 0).events
    assert first and first[0].decode is not None
    st.handle(transfer_request("r1"))
    again = poll(st, 0).events  # nothing acknowledged yet: the decode event is re-sent with the request
    assert [e.seq for e in again] == [first[0].seq, first[0].seq + 1]
    assert [e.seq for e in poll(st, 0, ack=again[-1].seq).events] == []


def test_duplicate_request_is_idempotent_and_a_changed_one_conflicts() -> None:
    st = ready_state(S(1), S(1), FakeClock())
    st.handle(transfer_request("r1"))
    assert st.handle(transfer_request("r1")) == Ack()
    # a resend carries less time left: the same request (the first deadline stands)
    assert st.handle(transfer_request("r1").model_copy(update={"timeout_s": 3.0})) == Ack()
    other = transfer_request("r1").model_copy(update={"indices": IndicesModel.of(RequestIndices([0, 2], [], 0, 0))})
    refused(st, other, RefusalCode.CONFLICT)
    refused(st, transfer_request("r2", tp=0, instance="ghost"), RefusalCode.UNKNOWN_PEER)


def test_first_terminal_status_stands() -> None:
    st = ready_state(S(1), S(1), FakeClock())
    st.handle(transfer_request("r1"))
    st.handle(StatusReports(reports=(report("r1", (0, 0), state=RequestState.FAILED),)))
    st.handle(StatusReports(reports=(report("r1", (0, 0)),)))
    got = st.handle(StatusQuery(instance="dec", dst=RankKey(tp=0, pp=0), request_ids=("r1",)))
    assert isinstance(got, StatusReply) and got.reports[0].state is RequestState.FAILED


def test_silent_prefill_rank_is_reported_lost_after_its_lease() -> None:
    clock = FakeClock()
    st = BootstrapState(S(2), limits=BootstrapLimits(lease_s=2.0), clock=clock)
    for t in range(2):
        st.handle(prefill_register(S(2), t, 0))
    st.handle(decode_register(S(1), 0, 0))
    st.handle(transfer_request("r1"))
    st.handle(StatusReports(reports=(report("r1", (0, 0)),)))
    clock.advance(1.5)
    poll(st, 0)  # rank 0 keeps polling, rank 1 went silent
    clock.advance(1.0)
    got = st.handle(StatusQuery(instance="dec", dst=RankKey(tp=0, pp=0), request_ids=("r1",)))
    assert isinstance(got, StatusReply)
    by_src = {r.src.pair: r for r in got.reports}
    assert by_src[(0, 0)].state is RequestState.SUCCESS
    assert by_src[(1, 0)].state is RequestState.FAILED and by_src[(1, 0)].failure is FailureReason.PEER_LOST
    assert "(1, 0)" in by_src[(1, 0)].reason


def test_a_lost_group_members_ranks_fail_what_they_owed_at_once() -> None:
    """A leader's prefill group lost a member (pipeline stage 1 here): its ranks' unfinished legs fail now,
    before any lease runs out; what the others reported stands."""
    st = ready_state(S(1, 2), S(1), FakeClock())
    st.handle(transfer_request("r1"))
    st.handle(StatusReports(reports=(report("r1", (0, 0)),)))
    st.fail_sources([(0, 1)], "group member 1 lost: closed the group connection")
    got = st.handle(StatusQuery(instance="dec", dst=RankKey(tp=0, pp=0), request_ids=("r1",)))
    assert isinstance(got, StatusReply)
    by_src = {r.src.pair: r for r in got.reports}
    assert by_src[(0, 0)].state is RequestState.SUCCESS
    assert by_src[(0, 1)].failure is FailureReason.PEER_LOST and "group member 1" in by_src[(0, 1)].reason
    assert st.unfinished == 0
    e = refused(st, transfer_request("r2"), RefusalCode.DRAINING)  # the replica cannot serve: another pod may
    assert "group member 1 lost" in e.reason


def test_restarted_prefill_rank_fails_what_it_owed() -> None:
    st = ready_state(S(1), S(1), FakeClock())
    st.handle(transfer_request("r1"))
    st.handle(prefill_register(S(1), 0, 0))  # the same name: a new coordinator of the same process
    got = st.handle(StatusQuery(instance="dec", dst=RankKey(tp=0, pp=0), request_ids=("r1",)))
    assert isinstance(got, StatusReply) and got.reports[0].failure is FailureReason.PEER_RESTARTED
    assert any(e.decode is not None for e in poll(st, 0).events)  # the new process learns the decodes again


def test_cancel_reaches_every_source_and_unknown_cancel_is_refused() -> None:
    st = ready_state(S(2), S(1), FakeClock())
    st.handle(transfer_request("r1"))
    st.handle(Cancel(request_id="r1", instance="dec", reason="decode gave up"))
    for t in range(2):
        assert any(e.cancel is not None for e in poll(st, t).events)
    refused(st, Cancel(request_id="nope", instance="dec"), RefusalCode.UNEXPECTED)


def test_bounded_pending_requests() -> None:
    st = BootstrapState(S(1), limits=BootstrapLimits(max_requests=2), clock=FakeClock())
    st.handle(prefill_register(S(1), 0, 0))
    st.handle(decode_register(S(1), 0, 0))
    st.handle(transfer_request("a"))
    st.handle(transfer_request("b"))
    refused(st, transfer_request("c"), RefusalCode.BUSY)


def test_finished_requests_are_purged_after_retention() -> None:
    clock = FakeClock()
    st = BootstrapState(S(1), limits=BootstrapLimits(retain_s=5), clock=clock)
    st.handle(prefill_register(S(1), 0, 0))
    st.handle(decode_register(S(1), 0, 0))
    st.handle(transfer_request("a"))
    st.handle(StatusReports(reports=(report("a", (0, 0)),)))
    clock.advance(6)
    poll(st, 0)
    assert not st.pending


messages = st.one_of(
    st.builds(transfer_request, st.sampled_from(["r1", "r2", "r3"]), st.integers(0, 1), st.just(0),
              st.sampled_from(["dec", "ghost"])),
    st.builds(lambda rid, s, ok: StatusReports(reports=(report(rid, (s, 0), (0, 0),
                                                               RequestState.SUCCESS if ok else RequestState.FAILED),)),
              st.sampled_from(["r1", "r2"]), st.integers(0, 2), st.booleans()),
    st.builds(lambda rid: Cancel(request_id=rid, instance="dec"), st.sampled_from(["r1", "r9"])),
    st.builds(lambda t: PrefillPoll(rank=RankKey(tp=t, pp=0), ack=0), st.integers(0, 3)),
    st.builds(lambda t, inst: decode_register(S(2), t, 0, instance=inst), st.integers(0, 1),
              st.sampled_from(["dec", "dec2"])),
    st.builds(lambda t: decode_register(S(2, 2), 0, 0, instance="bad"), st.just(0)),
    st.builds(lambda t, n: prefill_register(S(2), t, 0, name=n), st.integers(0, 1), st.sampled_from(["p", "q"])),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=st.lists(messages, max_size=15))
def test_any_sequence_of_messages_never_crashes_and_refusals_change_nothing(seq: list[object]) -> None:
    clock = FakeClock()
    st_ = ready_state(S(2), S(2), clock)
    for msg in seq:
        before = snapshot(st_)
        try:
            st_.handle(msg)  # type: ignore[arg-type]
        except ProtocolError:
            assert snapshot(st_) == before
        clock.advance(0.1)
