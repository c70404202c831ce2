"""Issue 25 item 2: no load wedges a prefill rank.

``PrefillWork`` used to carry every unacknowledged event plus every sibling in one reply with no
bound; past the rank's 4 MiB message limit the rank could never acknowledge and polled the same reply
forever. Now a reply is paged by count and bytes (``more`` says another page waits), siblings come only
when they changed, and every queued event (``Cancel`` too) counts against ``maxEvents``. Replies are
sealed with the real codec and opened with the rank's limit, as over the wire.
"""

from __future__ import annotations

import pytest

from pdfleet_runtime.protocol.auth import Codec, ProtocolError
from pdfleet_runtime.protocol.bootstrap import BootstrapLimits, BootstrapState
from pdfleet_runtime.protocol.messages import (
    MAX_MESSAGE_BYTES,
    Cancel,
    PrefillPoll,
    PrefillWork,
    RankKey,
    RefusalCode,
)
from pdfleet_runtime.records import ParallelShape as S
from tests.unit.protocol.helpers import SECRET, FakeClock, decode_register, prefill_register, transfer_request

ME = RankKey(tp=0, pp=0)


def drain_rank(st: BootstrapState, boot: Codec, rank: Codec) -> tuple[int, list[int]]:
    """Poll as the rank does (again at once while ``more``) until nothing is left; (events, reply sizes)."""
    ack, tag, seen, sizes = 0, "", 0, []
    for _ in range(10_000):
        work = st.handle(PrefillPoll(rank=ME, ack=ack, wait_s=0, **({"siblings_tag": tag} if tag else {})))
        assert isinstance(work, PrefillWork)
        raw, sig, _ = boot.seal(work)
        sizes.append(len(raw))
        rank.open(raw, sig)  # the rank's own limit: a reply it refuses is a wedged rank
        if work.events:
            ack = work.events[-1].seq
            seen += len(work.events)
        tag = getattr(work, "siblings_tag", "")  # getattr: the same helper ran on the unpaged code
        if not getattr(work, "more", False):
            return seen, sizes
    raise AssertionError("the rank never caught up")


def test_twice_the_queue_cap_pages_refuses_the_excess_and_the_rank_catches_up() -> None:
    clock = FakeClock()
    limits = BootstrapLimits(max_requests=4000, max_events=4000)
    st = BootstrapState(S(1, 1), clock=clock, limits=limits)
    st.handle(prefill_register(S(1, 1), 0, 0))
    st.handle(decode_register(S(1, 1), 0, 0))
    refused = []
    for i in range(2 * limits.max_requests):
        try:
            st.handle(transfer_request(f"r{i}"))
        except ProtocolError as e:
            refused.append(e)
    assert len(refused) == limits.max_requests + 1  # the decode registration is one queued event
    assert {e.code for e in refused} == {RefusalCode.BUSY} and "maxEvents" in str(refused[0]), refused[0]
    events, sizes = drain_rank(st, Codec(SECRET, "boot"), Codec(SECRET, "rank", max_bytes=MAX_MESSAGE_BYTES))
    assert events == limits.max_events
    assert len(sizes) > 1 and max(sizes) <= limits.page_bytes + 64 * 1024, sizes[:3]


def test_300_decode_ranks_against_a_restarting_prefill_rank() -> None:
    clock = FakeClock()
    st = BootstrapState(S(1, 1), clock=clock)
    st.handle(prefill_register(S(1, 1), 0, 0))
    for i in range(300):
        st.handle(decode_register(S(1, 1), 0, 0, instance=f"dec{i}"))
    st.handle(prefill_register(S(1, 1), 0, 0))  # restarted: it must learn all 300 anew
    events, sizes = drain_rank(st, Codec(SECRET, "boot"), Codec(SECRET, "rank"))
    assert events == 300 and max(sizes) <= MAX_MESSAGE_BYTES


def test_siblings_only_when_they_changed() -> None:
    st = BootstrapState(S(2, 1), clock=FakeClock())
    st.handle(prefill_register(S(2, 1), 0, 0))
    first = st.handle(PrefillPoll(rank=ME, ack=0, wait_s=0))
    assert isinstance(first, PrefillWork) and len(first.siblings) == 1
    again = st.handle(PrefillPoll(rank=ME, ack=0, wait_s=0, siblings_tag=first.siblings_tag))
    assert isinstance(again, PrefillWork) and again.siblings == ()
    st.handle(prefill_register(S(2, 1), 1, 0))
    changed = st.handle(PrefillPoll(rank=ME, ack=0, wait_s=0, siblings_tag=first.siblings_tag))
    assert isinstance(changed, PrefillWork) and len(changed.siblings) == 2


def test_cancel_events_count_against_max_events() -> None:
    st = BootstrapState(S(1, 1), clock=FakeClock(), limits=BootstrapLimits(max_events=3))
    st.handle(prefill_register(S(1, 1), 0, 0))
    st.handle(decode_register(S(1, 1), 0, 0))
    st.handle(transfer_request("a"))
    st.handle(transfer_request("b"))
    with pytest.raises(ProtocolError) as e:
        st.handle(Cancel(instance="dec", request_id="a"))
    assert e.value.code is RefusalCode.BUSY and "maxEvents" in str(e.value)
