"""Readiness: is this pod's transfer path proven, and if not, why not (pure; the server feeds it facts).

A decode pod is ready when, for at least one prefill pod, a canary went through every rank of the
pod: handshake, a synthetic request whose bytes were all verified, and an engine write throughput
at or above the floor of the configured protocol, unless canaries fail against most of the prefill pods it
checked (two at least: then the decode is the likelier broken end); one failing pair is named in the reason,
not acted on. The canaries are re-run periodically and after failures; ``failures_not_ready`` real transfers failing in a row also make the pod not ready until
a canary passes again. A prefill pod is ready when every rank registered with its bootstrap and it
has written a canary of some decode pod without failure (so a pod never counts as ready before the
peers that will use it have found it, Dynamo #13622), unless its writes keep failing. A draining
pod, or one with a dead rank, is never ready. The verdict carries a ``Problem`` and a sentence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pdfleet_runtime.protocol.states import FailureReason
from pdfleet_runtime.readiness_problems import Problem

__all__ = ["FAILING_PEERS_NOT_READY", "PEER_SIDE", "CanaryResult", "PeerCheck", "Problem", "Readiness", "Verdict", "busy",
           "classify", "pools_held"]


@dataclass(frozen=True)
class CanaryResult:
    """One canary through every rank of the pod towards one prefill pod."""

    ok: bool
    failure: FailureReason | None = None
    reason: str = ""
    bytes: int = 0
    write_s: float = 0.0
    mismatched: int = 0
    cause: FailureReason | None = None

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.write_s / 1e9 if self.ok and self.write_s > 0 and self.bytes else None


def busy(failure: FailureReason | None, cause: FailureReason | None = None) -> bool:
    """A transfer that failed for room on either side (pools full of other requests): it says nothing
    about the path, so it is no verdict either way (a canary then waits for its next round)."""
    return FailureReason.BUSY in (failure, cause)


def pools_held(held_by: list[dict[str, int]], free: list[dict[str, int]], need: dict[str, int],
               active: int) -> str:
    """The ``PoolsHeld`` fact from every rank's accounting (``RankStats.held_by``, ``free``): some rank lacks
    the items of one request (``need``, per index kind) while nothing runs on the pod (``active`` requests
    admitted, and no rank holds a running one). '' when there is room or work runs."""
    running = sum(h.get("running", 0) for h in held_by)
    short = sorted({k for f in free for k, n in need.items() if k in f and f[k] < n})
    if not short or active or running:
        return ""
    fencing = sum(h.get("fencing", 0) for h in held_by)
    orphaned = sum(h.get("orphaned", 0) for h in held_by)
    return (f"pools full with no request running: no free {', '.join(short)} for one request; {fencing} "
            f"requests held while their writes are fenced, {orphaned} held by no request (given back after the "
            "rank's grace)")


_PROBLEMS: MappingProxyType[tuple[FailureReason | None, FailureReason | None], Problem] = MappingProxyType({
    (FailureReason.PEER_UNREACHABLE, None): Problem.UNREACHABLE,
    (FailureReason.PEER_LOST, None): Problem.UNREACHABLE,
    (FailureReason.PEER_RESTARTED, None): Problem.UNREACHABLE,
    (FailureReason.REFUSED, None): Problem.INCOMPATIBLE,
    (FailureReason.REFUSED, FailureReason.DRAINING): Problem.PEER_DRAINING,
    (FailureReason.DRAINING, None): Problem.PEER_DRAINING,
    # The prefill cannot plan into these buffers: another layout or shape.
    (FailureReason.SOURCE_FAILED, FailureReason.PLAN): Problem.INCOMPATIBLE,
    (FailureReason.VERIFY, None): Problem.CORRUPT,
    (FailureReason.GROUP_MEMBER_LOST, None): Problem.GROUP_MEMBER_LOST,
})
"""(kind, cause) -> problem; a kind is looked up with its cause first, then alone; the rest is ``FAILING``."""


def classify(failure: FailureReason | None, cause: FailureReason | None = None) -> Problem:
    """A failed transfer's kind (and, for ``SOURCE_FAILED`` or ``REFUSED``, its cause) as a readiness problem."""
    return _PROBLEMS.get((failure, cause)) or _PROBLEMS.get((failure, None)) or Problem.FAILING


@dataclass
class PeerCheck:
    endpoint: str
    ok: bool
    problem: Problem
    reason: str
    gbps: float | None
    checked_at: float

    def as_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "ok": self.ok, "problem": self.problem.value, "reason": self.reason,
                "gbps": None if self.gbps is None else round(self.gbps, 4), "checkedAt": self.checked_at}


RATE_MIN_BYTES = 1 << 20
"""Below this a canary's write rate is its fixed cost (a round trip, a notification), not the link's: a model pod's
canary moves its prompt's real state, a few kilobytes for a small model. Such a canary's bytes are still verified
(or its tokens checked); its rate is reported, not held to the floor."""


FAILING_PEERS_NOT_READY = 2
"""A decode with a passing canary still leaves the routers once this many prefill pods (and more than pass) fail
its canaries: then the decode, not one prefill, is the likelier broken end."""

PEER_SIDE: frozenset[Problem] = frozenset({Problem.INCOMPATIBLE, Problem.PEER_DRAINING})
"""Failed canaries that say something of the prefill (another generation, a drain), nothing of this pod."""


@dataclass(frozen=True)
class Verdict:
    ready: bool
    problem: Problem
    reason: str


@dataclass
class Readiness:
    """Facts about one pod and the verdict they give. ``role`` is ``prefill`` or ``decode``."""

    role: str
    floor_gbps: float
    failures_not_ready: int = 3
    clock: Callable[[], float] = time.time
    ranks_total: int = 1
    ranks_up: int = 0
    died: list[str] = field(default_factory=list)
    draining: bool = False
    peers: dict[str, PeerCheck] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)
    """The prefill endpoints discovery gave last (``forget_peers``): those without a check are still to canary."""
    discovery_error: str = ""
    failed_in_row: int = 0
    last_failure: str = ""
    bootstrap_registered: int = 0
    canaries_served: int = 0
    group_lost: list[str] = field(default_factory=list)
    """A group leader's members that went away (``pod.group.GroupRanks.lost``)."""
    group_waiting: str = ""
    """A group leader's members not joined yet, in a sentence; '' when complete (or no group)."""
    pools_held: str = ""
    """Why the pools have no room with nothing running, in a sentence; '' when they have room or run work."""
    warming: Callable[[], str] = lambda: ""
    """The declared start-up left (``compute_cost.warming``), in a sentence; '' once over or undeclared."""

    # ------------------------------------------------------------------ facts

    def record_canary(self, endpoint: str, result: CanaryResult) -> PeerCheck:
        gbps = result.gbps
        if not result.ok:
            problem = Problem.CORRUPT if result.mismatched > 0 else classify(result.failure, result.cause)
            check = PeerCheck(endpoint, False, problem, result.reason, None, self.clock())
        elif gbps is not None and gbps < self.floor_gbps and result.bytes >= RATE_MIN_BYTES:
            check = PeerCheck(endpoint, False, Problem.SLOW, f"canary write throughput {gbps:.4f} GB/s is below the "
                              f"floor {self.floor_gbps:g} GB/s of the configured protocol ({result.bytes} bytes in "
                              f"{result.write_s:.3f}s)", gbps, self.clock())
        else:
            floor = (f"floor {self.floor_gbps:g}" if result.bytes >= RATE_MIN_BYTES or gbps is None
                     or gbps >= self.floor_gbps else f"too few bytes to hold the link to the floor {self.floor_gbps:g}")
            check = PeerCheck(endpoint, True, Problem.NONE, f"canary of {result.bytes} bytes verified at "
                              f"{gbps or 0:.3f} GB/s ({floor})", gbps, self.clock())
            self.failed_in_row = 0
        self.peers[endpoint] = check
        self.discovery_error = ""
        return check

    def forget_peers(self, keep: set[str]) -> None:
        self.known = set(keep)
        for ep in [e for e in self.peers if e not in keep]:
            del self.peers[ep]

    def record_leg(self, ok: bool, failure: FailureReason | None, reason: str, *, canary: bool) -> None:
        """A prefill rank's status of one leg it wrote (or failed to). A leg the decode cancelled, or one
        this pod had no room for, says nothing about this pod's path."""
        if failure is FailureReason.CANCELLED or busy(failure):
            return
        self.record_transfer(ok, reason)
        if ok and canary:
            self.canaries_served += 1

    def record_transfer(self, ok: bool, reason: str = "") -> None:
        if ok:
            self.failed_in_row = 0
        else:
            self.failed_in_row += 1
            self.last_failure = reason

    # ------------------------------------------------------------------ verdict

    def verdict(self) -> Verdict:
        if self.died:
            return Verdict(False, Problem.RANK_DIED, "; ".join(self.died))
        if self.group_lost:
            return Verdict(False, Problem.GROUP_MEMBER_LOST, "; ".join(self.group_lost))
        if self.draining:
            return Verdict(False, Problem.DRAINING, "the pod is draining: it finishes in-flight transfers and "
                           "takes no new ones")
        if self.ranks_up < self.ranks_total and self.group_waiting:
            return Verdict(False, Problem.WAITING_FOR_GROUP, f"{self.ranks_up} of {self.ranks_total} ranks up: "
                           f"{self.group_waiting}")
        if self.ranks_up < self.ranks_total:
            return Verdict(False, Problem.STARTING, f"{self.ranks_up} of {self.ranks_total} rank processes are up")
        if warm := self.warming():
            return Verdict(False, Problem.STARTING, warm)
        if self.failed_in_row >= self.failures_not_ready:
            return Verdict(False, Problem.FAILING, f"{self.failed_in_row} transfers failed in a row, the last: "
                           f"{self.last_failure}")
        if self.pools_held:
            return Verdict(False, Problem.POOLS_HELD, self.pools_held)
        return self._decode() if self.role == "decode" else self._prefill()

    def _decode(self) -> Verdict:
        ok = [c for c in self.peers.values() if c.ok]
        # Routers pair pods, not pairs: a decode whose canaries fail against most of the prefills it checked (two
        # at least) is the broken part and leaves the routers; one failing pair is reported, never acted on, so a
        # single bad prefill cannot take every decode out (that prefill fails its own writes instead).
        failing = sorted((c for c in self.peers.values() if not c.ok and c.problem not in PEER_SIDE),
                         key=lambda c: c.endpoint)
        if ok and len(failing) >= FAILING_PEERS_NOT_READY and len(failing) > len(ok):
            return Verdict(False, failing[0].problem, f"canaries fail against {len(failing)} of "
                           f"{len(ok) + len(failing)} prefill pods: " + "; ".join(
                               f"prefill pod {c.endpoint}: {c.reason}" for c in failing))
        if ok:
            best = max(ok, key=lambda c: c.gbps or 0.0)
            reported = "".join(f"; reported, not acted on: prefill pod {c.endpoint}: {c.reason}" for c in failing)
            return Verdict(True, Problem.NONE, f"prefill pod {best.endpoint}: {best.reason}{reported}")
        if not self.peers:
            if self.discovery_error:
                return Verdict(False, Problem.NO_PEER, self.discovery_error)
            return Verdict(False, Problem.WAITING, "no canary has run yet")
        # A peer of another generation (its handshake or its plan refuses this pod's layout, model or shape) says
        # nothing of this pod's path while other peers remain: during a rollout a decode sees both generations,
        # and judging it by the old prefill would fail the new revision before it canaried the new one.
        mine = [c for c in self.peers.values() if c.problem is not Problem.INCOMPATIBLE]
        unchecked = sorted(self.known - set(self.peers))
        if not mine and unchecked:
            return Verdict(False, Problem.WAITING, f"prefill pod {unchecked[0]} not canaried yet" + "".join(
                f"; prefill pod {c.endpoint}: {c.reason}" for c in sorted(self.peers.values(), key=lambda c: c.endpoint)))
        worst = sorted(mine, key=lambda c: c.endpoint) or sorted(self.peers.values(), key=lambda c: c.endpoint)
        every = sorted(self.peers.values(), key=lambda c: c.endpoint)
        return Verdict(False, worst[0].problem, "; ".join(f"prefill pod {c.endpoint}: {c.reason}" for c in every))

    def _prefill(self) -> Verdict:
        if self.bootstrap_registered < self.ranks_total:
            return Verdict(False, Problem.STARTING, f"{self.bootstrap_registered} of {self.ranks_total} ranks "
                           "registered with the bootstrap endpoint")
        if self.canaries_served == 0:
            return Verdict(False, Problem.WAITING, "no decode pod's canary has been written yet (a prefill pod is "
                           "ready once a compatible decode pod found it and a transfer went through)")
        return Verdict(True, Problem.NONE, f"{self.canaries_served} canary legs written, every rank registered")

    def as_json(self) -> dict[str, Any]:
        v = self.verdict()
        return {"ready": v.ready, "problem": v.problem.value, "reason": v.reason, "role": self.role,
                "ranksUp": self.ranks_up, "ranks": self.ranks_total, "draining": self.draining,
                "floorGbps": self.floor_gbps, "failedInRow": self.failed_in_row,
                "peers": [c.as_json() for c in sorted(self.peers.values(), key=lambda c: c.endpoint)]}
