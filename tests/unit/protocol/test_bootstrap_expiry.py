"""Issue 25 item 4: a heartbeat's cost does not grow with the pending requests.

The bootstrap used to walk every pending entry on every message (10.7 ms per heartbeat at 50k). The
expiry heap looks only at entries due; the test counts the entries a heartbeat touches (deterministic,
no timing: the figure is bench/bootstrap.py's), and checks expiry still happens on time.
"""

from __future__ import annotations

from typing import Any

from pdfleet_runtime.protocol.messages import PrefillPoll, RankKey
from pdfleet_runtime.records import ParallelShape as S
from tests.unit.protocol.helpers import FakeClock, ready_state, transfer_request


class CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts the entries its walks yield (items, values, keys, iteration)."""

    walked = 0

    def _count(self, it: Any) -> Any:
        for x in it:
            CountingDict.walked += 1
            yield x

    def items(self) -> Any:  # type: ignore[override]
        return self._count(super().items())

    def values(self) -> Any:  # type: ignore[override]
        return self._count(super().values())

    def keys(self) -> Any:  # type: ignore[override]
        return self._count(super().keys())

    def __iter__(self) -> Any:
        return self._count(super().__iter__())


def test_heartbeat_touches_no_pending_entry_and_expiry_still_happens() -> None:
    clock = FakeClock()
    st = ready_state(S(1, 1), S(1, 1), clock)
    for i in range(2000):
        st.handle(transfer_request(f"r{i}"))
    st.pending = CountingDict(st.pending)
    CountingDict.walked = 0
    poll = PrefillPoll(rank=RankKey(tp=0, pp=0), ack=0, wait_s=0)
    for _ in range(10):
        st.handle(poll)
    assert CountingDict.walked == 0, f"10 heartbeats walked {CountingDict.walked} pending entries"
    assert len(st.pending) == 2000 and st.unfinished == 2000
    # Expiry on time: each request's timeout (10 s) plus retention, nothing before.
    clock.advance(10.0 + st.limits.retain_s - 0.5)
    st.handle(poll)
    assert len(st.pending) == 2000
    clock.advance(1.0)
    st.handle(poll)
    assert len(st.pending) == 0 and st.unfinished == 0
