"""The request state machine: Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed.

Both sides track each request with a ``RequestTracker``. Every non-terminal state has a deadline
(``StateTimeouts``); ``expire`` fails whatever overstayed, with ``FailureReason.TIMEOUT`` and a
reason naming the state and the budget. A failure always carries a kind and a human reason.
Transitions are checked: an illegal one raises ``IllegalTransition`` rather than silently moving
a request backwards (a late status must never resurrect a failed request).

Pure (no I/O); the clock is injected so tests drive time.

On decode: Bootstrapping (finding and handshaking the prefill pod) -> WaitingForInput (handshake
done, destination indices being sent) -> Transferring (indices accepted, waiting for every
source's status) -> Success (all sources Success) | Failed.
On prefill: Bootstrapping (known on one side only: local input or the decode's request) ->
WaitingForInput (destination known, local state not ready) -> Transferring -> Success | Failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "TERMINAL",
    "TRANSITIONS",
    "FailureReason",
    "IllegalTransition",
    "RequestRecord",
    "RequestState",
    "RequestTracker",
    "StateTimeouts",
    "UnknownRequest",
]


class RequestState(StrEnum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


class FailureReason(StrEnum):
    """The kind of a failure; the free-text reason says the rest.

    One vocabulary from the prefill rank (a ``StatusReport`` on the wire) through the decode rank, the
    rank pipe and the pod server to readiness, which decides on the kind alone (``pod.readiness``).
    The first nine are a request's kinds in the state machine; the rest name what a pod adds around it.
    """

    TIMEOUT = "timeout"
    PEER_UNREACHABLE = "peer_unreachable"
    PEER_RESTARTED = "peer_restarted"
    PEER_LOST = "peer_lost"
    REFUSED = "refused"
    ENGINE = "engine"
    PLAN = "plan"
    CANCELLED = "cancelled"
    SOURCE_FAILED = "source_failed"
    BUSY = "busy"
    """No room: a rank's pools had no free items for the request (load, not the path)."""
    DRAINING = "draining"
    """The prefill pod refused the request as draining (another pod may take it)."""
    VERIFY = "verify"
    """Every source reported success but bytes arrived different from the seeded state."""
    NO_PEER = "no_peer"
    """The decode pod knows no prefill pod to send the request to."""
    RANK = "rank"
    """A rank process of the pod failed the call, died or did not answer."""
    GROUP_MEMBER_LOST = "group_member_lost"
    """A rank of the replica lives on another pod of its group (``nodesPerReplica`` > 1), and that pod went away."""
    CONFLICT = "conflict"
    """The request id is already in flight on this rank."""


TERMINAL = frozenset({RequestState.SUCCESS, RequestState.FAILED})
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.BOOTSTRAPPING: frozenset({RequestState.WAITING_FOR_INPUT, RequestState.FAILED}),
    RequestState.WAITING_FOR_INPUT: frozenset({RequestState.TRANSFERRING, RequestState.FAILED}),
    RequestState.TRANSFERRING: frozenset({RequestState.SUCCESS, RequestState.FAILED}),
    RequestState.SUCCESS: frozenset(),
    RequestState.FAILED: frozenset(),
}


class IllegalTransition(ValueError):
    """A move the state machine does not allow (for example Failed -> Success)."""


class UnknownRequest(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class StateTimeouts:
    """Seconds a request may stay in each non-terminal state; ``retain_s`` keeps terminal records for queries.

    Defaults: 30 s to find a peer, 60 s for the other side's input, 60 s for a transfer; real
    deployments set them from their prefill latency.
    """

    bootstrapping_s: float = 30.0
    waiting_for_input_s: float = 60.0
    transferring_s: float = 60.0
    retain_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("bootstrapping_s", "waiting_for_input_s", "transferring_s", "retain_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")

    def budget(self, state: RequestState) -> float:
        return {
            RequestState.BOOTSTRAPPING: self.bootstrapping_s,
            RequestState.WAITING_FOR_INPUT: self.waiting_for_input_s,
            RequestState.TRANSFERRING: self.transferring_s,
        }.get(state, self.retain_s)


@dataclass
class RequestRecord:
    request_id: str
    state: RequestState
    since: float
    deadline: float
    failure: FailureReason | None = None
    reason: str = ""
    history: list[RequestState] = field(default_factory=list)


class RequestTracker:
    """Request records of one side, with checked transitions and per-state deadlines."""

    def __init__(self, timeouts: StateTimeouts, clock: Callable[[], float] = time.monotonic,
                 limit: int = 100_000) -> None:
        self.timeouts, self._clock, self._limit = timeouts, clock, limit
        self._records: dict[str, RequestRecord] = {}
        self._purged_at = clock()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def get(self, request_id: str) -> RequestRecord:
        try:
            return self._records[request_id]
        except KeyError:
            raise UnknownRequest(f"request {request_id!r} is not tracked") from None

    def start(self, request_id: str, state: RequestState = RequestState.BOOTSTRAPPING,
              *, deadline: float | None = None) -> RequestRecord:
        """Track a new request; ``deadline`` (absolute, clock's time) caps the state's budget."""
        if self._clock() - self._purged_at >= self.timeouts.retain_s:
            self.purge()  # terminal records go after retain_s, not only at the limit
        if request_id in self._records:
            raise IllegalTransition(f"request {request_id!r} is already tracked")
        if len(self._records) >= self._limit:
            self.purge()
            if len(self._records) >= self._limit:
                raise OverflowError(f"{self._limit} requests tracked; refusing more")
        now = self._clock()
        end = now + self.timeouts.budget(state)
        rec = RequestRecord(request_id, state, now, min(end, deadline) if deadline else end, history=[state])
        self._records[request_id] = rec
        return rec

    def advance(self, request_id: str, state: RequestState, *, deadline: float | None = None) -> RequestRecord:
        rec = self.get(request_id)
        if state not in TRANSITIONS[rec.state]:
            raise IllegalTransition(f"request {request_id!r}: {rec.state.value} -> {state.value} is not allowed")
        now = self._clock()
        end = now + self.timeouts.budget(state)
        rec.state, rec.since = state, now
        rec.deadline = min(end, deadline) if deadline and not state.terminal else end
        rec.history.append(state)
        return rec

    def fail(self, request_id: str, failure: FailureReason, reason: str) -> RequestRecord | None:
        """Fail a request unless it is already terminal (then the first outcome stands; returns None)."""
        rec = self.get(request_id)
        if rec.state.terminal:
            return None
        if not reason:
            raise ValueError("a failure needs a reason")
        self.advance(request_id, RequestState.FAILED)
        rec.failure, rec.reason = failure, reason
        return rec

    def expire(self) -> list[RequestRecord]:
        """Fail every request whose state's deadline passed; returns them."""
        now = self._clock()
        out = []
        for rec in list(self._records.values()):
            if not rec.state.terminal and now > rec.deadline:
                budget = now - rec.since
                self.fail(rec.request_id, FailureReason.TIMEOUT,
                          f"no progress in state {rec.state.value} for {budget:.1f}s (deadline passed)")
                out.append(rec)
        return out

    def forget(self, request_id: str) -> None:
        """Drop an ended request's record at once, so its id may start again (one that never reached a peer)."""
        if not self.get(request_id).state.terminal:
            raise IllegalTransition(f"request {request_id!r} has not ended; only an ended request is forgotten")
        del self._records[request_id]

    def purge(self) -> list[str]:
        """Drop terminal records older than ``retain_s``."""
        now = self._purged_at = self._clock()
        gone = [k for k, r in self._records.items() if r.state.terminal and now > r.deadline]
        for k in gone:
            del self._records[k]
        return gone

    def active(self) -> list[RequestRecord]:
        return [r for r in self._records.values() if not r.state.terminal]
