"""Silent fallbacks: PD that stopped happening while every request still gets an answer.

A decode that answers without receiving state (it recomputed the prompt), a prefill whose state no decode
claimed, a transfer that moved fewer bytes than the layout says, a canary below the link's floor: none of
them fails a request, so nothing else reports them. Each is counted with its reason
(``pdfleet_silent_fallbacks_total{role, reason}``), and while any reason counted ``threshold`` times within
``window_s`` the pod's condition ``pdfleet.io/silent-fallback`` is True with the counts and the likely cause;
the operator folds it into the PDDeployment's ``Degraded`` condition and posts an event (docs/doctor.md).
Pure but for the counter: the server writes the condition when ``verdict`` changes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel

__all__ = ["FALLBACK_THRESHOLD", "FALLBACK_WINDOW_S", "FallbackReason", "FallbackVerdict", "SilentFallbacks"]

FALLBACK_THRESHOLD = 3
"""Fallbacks of one reason within the window that raise the condition (one is a race, three a pattern)."""
FALLBACK_WINDOW_S = 120.0


class FallbackReason(StrEnum):
    NO_STATE_RECEIVED = "no_state_received"
    UNCLAIMED_STATE = "unclaimed_state"
    SHORT_TRANSFER = "short_transfer"
    BELOW_FLOOR = "below_floor"


CAUSES: dict[FallbackReason, str] = {
    FallbackReason.NO_STATE_RECEIVED: "answered requests with no prefilled state received: the decode recomputes "
    "prompts (its KV connector is off, or the router is not in PD mode)",
    FallbackReason.UNCLAIMED_STATE: "prefilled state expired with no decode claiming it: the prefill computes "
    "prompts no decode uses (a decode that recomputes, or one whose claims fail)",
    FallbackReason.SHORT_TRANSFER: "transfers moved fewer bytes than the layout gives their tokens: state is "
    "missing on the decode",
    FallbackReason.BELOW_FLOOR: "canaries ran below the link's floor: the engine runs a slower path than the "
    "one asked for",
}


class FallbackVerdict(BaseModel):
    """What the pod condition says: ``active`` True while a reason crossed the threshold in the window."""

    active: bool
    reason: str
    message: str


class SilentFallbacks:
    """The counter, and the recent fallbacks of each reason (for the condition)."""

    def __init__(self, registry: CollectorRegistry, role: str, *, threshold: int = FALLBACK_THRESHOLD,
                 window_s: float = FALLBACK_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.role, self.threshold, self.window_s, self.clock = role, threshold, window_s, clock
        self.counter = Counter("pdfleet_silent_fallbacks", "Requests or transfers that fell back silently (the "
                               "answer still came), by reason: no_state_received (a decode recomputed the prompt), "
                               "unclaimed_state (a prefill's state expired unclaimed), short_transfer (fewer bytes "
                               "than the layout), below_floor (a canary below the link's floor)",
                               ["role", "reason"], registry=registry)
        for reason in FallbackReason:  # at 0 from the start: an alert's rate() needs the series before the first
            self.counter.labels(role, reason.value)
        self._recent: dict[FallbackReason, deque[float]] = {r: deque() for r in FallbackReason}

    def count(self, reason: FallbackReason, n: int = 1) -> None:
        if n <= 0:
            return
        self.counter.labels(self.role, reason.value).inc(n)
        now, recent = self.clock(), self._recent[reason]
        recent.extend([now] * min(n, self.threshold))
        while len(recent) > self.threshold:
            recent.popleft()

    def verdict(self) -> FallbackVerdict:
        since = self.clock() - self.window_s
        hot = {r: sum(1 for t in q if t >= since) for r, q in self._recent.items()}
        hot = {r: n for r, n in hot.items() if n >= self.threshold}
        if not hot:
            return FallbackVerdict(active=False, reason="NoFallback",
                                   message=f"no reason counted {self.threshold} times in the last {self.window_s:g} s")
        said = "; ".join(f"{r.value}: {CAUSES[r]}" for r in sorted(hot))
        first = min(hot)
        return FallbackVerdict(active=True, reason="".join(w.title() for w in first.value.split("_")),
                               message=f"silent fallbacks in the last {self.window_s:g} s ({said}); "
                                       "pdfleet_silent_fallbacks_total counts them")
