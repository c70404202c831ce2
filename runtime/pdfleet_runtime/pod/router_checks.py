"""Which routers have dropped this pod, counted from their health checks of ``/health``.

sglang-router marks a worker unhealthy after ``--health-failure-threshold`` failed health checks in a row
and sends it no new request from then on (0.3.2, measured in tests/cluster/test_router.py). A draining pod
answers every check 503, so once each router that checks the pod has been answered 503 that many times, the
routers have all dropped it: the drain's window may end then, not only at the fixed bound
(``routerDropSeconds``), which must allow for the slowest round. The bound stays the upper limit.

A router is known by its address: every caller of ``/health`` seen within ``recent_s`` before the drain
began (a router holding the pod checks it every round, and a round is shorter than the bound), and every
caller that checks during the drain. Nothing here reads a clock: the caller passes ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RouterChecks"]

MAX_CALLERS = 256
"""Callers remembered; beyond it the longest-silent is forgotten (a pod has a few routers, not hundreds)."""


@dataclass
class RouterChecks:
    """``failures``: the routers' failure threshold (0: not counted, the bound decides alone)."""

    failures: int
    recent_s: float
    _last: dict[str, float] = field(default_factory=dict)
    _failed: dict[str, int] | None = None
    """Since the drain began: each router's 503 answers; None while serving."""

    @property
    def counting(self) -> bool:
        return self.failures > 0 and self._failed is not None

    def answered(self, caller: str | None, healthy: bool, now: float) -> None:
        """``/health`` answered ``caller`` (its address; None when unknown) healthy or not."""
        if not caller or self.failures <= 0:
            return
        self._last.pop(caller, None)
        self._last[caller] = now  # insertion order = last answer order
        if len(self._last) > MAX_CALLERS:
            del self._last[next(iter(self._last))]
        if self._failed is not None and not healthy:
            self._failed[caller] = self._failed.get(caller, 0) + 1
        elif self._failed is not None:  # a healthy answer during a drain cannot happen; reset, to be safe
            self._failed[caller] = 0

    def begin(self, now: float) -> list[str]:
        """The drain began: the routers to wait for (callers seen within ``recent_s``), sorted."""
        self._failed = {c: 0 for c, t in self._last.items() if now - t <= self.recent_s}
        return sorted(self._failed)

    def end(self) -> None:
        """The drain was cancelled: serving again, nothing counted."""
        self._failed = None

    def dropped(self) -> list[str] | None:
        """Every known router has failed ``failures`` checks: those routers, sorted; None while some have not,
        when none is known (nothing to count: the bound decides) or when not counting."""
        if not self.counting or not self._failed:
            return None
        assert self._failed is not None
        if all(n >= self.failures for n in self._failed.values()):
            return sorted(self._failed)
        return None

    def pending(self) -> dict[str, int]:
        """Each known router's 503 answers so far, for the log when the bound ends the window instead."""
        return dict(self._failed or {})
