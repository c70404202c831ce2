"""The pod's drain: serving -> draining -> drained, back to serving when cancelled (one owner of the phase).

A drain first leaves the routers (``on_change(True)``: readiness and the metric go at once, and the
worker API's ``/health`` answers 503 from then on, which is what takes a worker out of an
sglang-router's set), keeps admitting while the routers drop it, then stops admission
(``on_admit(False)``: new requests refused; prefill: the bootstrap refuses new transfers too) and waits
until nothing is in flight or the budget (``drainTimeoutSeconds``, from the drain's start) passes; past
the budget it is *forced*. A cancel (the operator took its request back) makes the pod take requests again.

The routers' window ends when every router checking the pod has failed its health checks (``routers``,
``RouterChecks``: counted from the 503s the pod answered) plus ``grace_s`` for a request a router picked
just before, and at the latest after ``leave_s`` (``routerDropSeconds``: the bound for the slowest
router's rounds, docs/router.md). With no router known, the bound decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum

from .router_checks import RouterChecks

__all__ = ["ROUTER_GRACE_S", "Drain", "DrainPhase", "WindowEnd"]

log = logging.getLogger("pdfleet_runtime.server")


class DrainPhase(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"


ROUTER_GRACE_S = 1.0
"""Admission goes on this long after the last router failed its checks: a request it picked just before its
second failed check still reaches the pod on a loaded host."""


class WindowEnd(StrEnum):
    """What ended the routers' window."""

    NONE = "none"  # no routers (leave_s 0): admission stops at once
    ROUTERS = "routers"  # every router's health checks failed (then the grace)
    BOUND = "bound"  # the fixed bound, routerDropSeconds
    BUDGET = "budget"  # the drain's budget ran out first


class Drain:
    """``in_flight()``: transfers not finished (polled every 50 ms); ``on_done(forced)`` once drained."""

    def __init__(self, budget_s: float, in_flight: Callable[[], Awaitable[int]], *,
                 on_change: Callable[[bool], None], on_done: Callable[[bool], None],
                 on_admit: Callable[[bool], None] = lambda admitting: None, leave_s: float = 0.0,
                 routers: RouterChecks | None = None, grace_s: float = ROUTER_GRACE_S,
                 poll_s: float = 0.05) -> None:
        self.budget_s, self._in_flight, self._on_change, self._on_done = budget_s, in_flight, on_change, on_done
        self._on_admit, self.leave_s = on_admit, leave_s
        self.routers, self.grace_s = routers, grace_s
        self._poll_s = poll_s
        self.window: tuple[float, WindowEnd] | None = None
        """The last routers' window: (seconds from the drain's start, what ended it); None before one ended."""
        self.phase = DrainPhase.SERVING
        self.admitting = True
        """New requests taken: serving, or draining and still inside the ``leave_s`` window."""
        self.started: float | None = None
        self.forced = False
        self._drained = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def serving(self) -> bool:
        return self.phase is DrainPhase.SERVING

    def start(self) -> bool:
        """Leave the routers, stop admitting ``leave_s`` later and watch in-flight transfers; False when a
        drain already runs (idempotent)."""
        if self.phase is not DrainPhase.SERVING:
            return False
        self.phase = DrainPhase.DRAINING
        self.started = time.monotonic()
        self.forced = False
        self.window = None
        if self.routers is not None:
            self.routers.begin(self.started)
        self._drained.clear()
        self._on_change(True)
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return True

    def cancel(self) -> bool:
        """Take requests again; False when the pod was serving anyway."""
        if self.phase is DrainPhase.SERVING:
            return False
        if self._task is not None:
            self._task.cancel()
        self.phase = DrainPhase.SERVING
        self.started = None
        self._drained.clear()
        if self.routers is not None:
            self.routers.end()
        if not self.admitting:
            self.admitting = True
            self._on_admit(True)
        self._on_change(False)
        return True

    async def wait(self) -> None:
        """Until drained, or the budget (from the drain's start) has passed; at once when serving."""
        if self.phase is DrainPhase.SERVING or self.started is None:
            return
        left = self.started + self.budget_s - time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), max(0.0, left) + 0.5)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        assert self.started is not None
        deadline = self.started + self.budget_s
        end = await self._leave_routers(deadline)
        self.window = (time.monotonic() - self.started, end)
        self.admitting = False
        self._on_admit(False)
        while True:
            n = await self._in_flight()
            if n == 0 or time.monotonic() >= deadline:
                break
            await asyncio.sleep(self._poll_s)
        self.forced = n > 0
        self.phase = DrainPhase.DRAINED
        log.info("drain %s after %.2fs%s", "forced" if self.forced else "finished",
                 time.monotonic() - self.started, f": {n} transfers still in flight" if n else "")
        self._on_done(self.forced)
        self._drained.set()

    async def _leave_routers(self, deadline: float) -> WindowEnd:
        """Keep admitting until every router has dropped the pod (nothing new is refused), at most ``leave_s``."""
        assert self.started is not None
        if self.leave_s <= 0:
            return WindowEnd.NONE
        until = min(self.started + self.leave_s, deadline)
        while (now := time.monotonic()) < until:
            routers = self.routers.dropped() if self.routers is not None else None
            if routers is not None:
                log.info("every router failed its health checks %.2fs into the drain (%s): admitting for %gs more",
                         now - self.started, ", ".join(routers), self.grace_s)
                await asyncio.sleep(max(0.0, min(self.grace_s, until - now)))
                return WindowEnd.ROUTERS
            await asyncio.sleep(min(self._poll_s, until - now))
        if self.routers is not None and self.routers.counting:
            log.info("the routers' bound (%gs) passed; their failed checks: %s", self.leave_s,
                     self.routers.pending() or "no router checked the pod")
        return WindowEnd.BUDGET if until < self.started + self.leave_s else WindowEnd.BOUND
