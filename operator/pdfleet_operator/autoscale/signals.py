"""One role's observed metrics and fleet -> a replica recommendation per configured signal (pure).

A recommendation is the replica count the role needs by the time a replica asked for now would be
Ready (its measured start-up time, ``RoleFleet.startup_seconds``), counting the replicas already
starting as capacity that arrives when their start-up ends: a signal that stays high while pods
start asks for nothing more, which is what keeps the fleet from over-scaling during start-up.

Prefill, backlog (``target_seconds`` T, per-replica rate V declared or measured):

* arrivals: ``a = prompt tokens/s / V`` replicas keep up with what comes in;
* queue: in a busy pool the queue wait falls with the spare replicas (``wait ~ 1/(N - a)``, heavy
  traffic), and its tail is near exponential, so the planner holds the mean wait at T/3 (about 95%
  of prompts then wait less than T): spare replicas scale by ``mean wait / (T/3)``;
* recovery: a backlog beyond T seconds of arrivals, projected to the moment a replica started now
  would be Ready (starting replicas serve from their own Ready time on), is cleared within one
  start-up time.

Decode, KV-cache use (target u, K tokens per replica): the KV tokens in use, those of requests
waiting for admission, and the growth prefill is about to cause (prefill sized up means more
prompts arriving at decode: decode follows prefill ahead of its own signal) over ``K * u``.
Running requests: running plus waiting over the target per replica. Latency percentiles (TTFT,
ITL): proportional to the ratio to the target, as an HPA on the same metric, inside a 10%
tolerance and at most halving or doubling per decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from pdfleet_operator.api.autoscaling import DecodeSignals, LatencySignal, PrefillSignals

__all__ = [
    "TOLERANCE",
    "DecodeMetrics",
    "PrefillMetrics",
    "Reading",
    "RoleFleet",
    "SignalKind",
    "decode_readings",
    "prefill_readings",
    "project_backlog",
]

TOLERANCE = 0.1
"""A latency within 10% of its target changes nothing (an HPA's default tolerance)."""
TAIL_FACTOR = 3.0
"""Mean queue wait = target / 3: with a near-exponential wait, about e^-3 = 5% of prompts wait past it."""


class SignalKind(StrEnum):
    BACKLOG = "backlogSeconds"
    TTFT = "ttftSeconds"
    KV_CACHE = "kvCacheUsage"
    RUNNING = "runningRequestsPerReplica"
    ITL = "itlSeconds"


@dataclass(frozen=True, slots=True)
class PrefillMetrics:
    """What the prefill role's pods and the router report (None: not reported)."""

    queued_prompt_tokens: float | None = None  # prompt tokens waiting for a prefill to start, whole role
    prompt_tokens_per_second: float | None = None  # prompt tokens arriving per second (a counter's rate)
    prefill_tokens_per_second: float | None = None  # measured: tokens one busy replica prefills per second
    ttft_seconds: float | None = None  # the spec's TTFT percentile over the last window


@dataclass(frozen=True, slots=True)
class DecodeMetrics:
    """What the decode role's pods report, summed over the role (None: not reported)."""

    kv_used_tokens: float | None = None  # KV tokens in use
    kv_tokens_per_replica: float | None = None  # KV tokens one replica holds (its pool)
    running_requests: float | None = None
    queued_requests: float | None = None  # waiting for decode admission (KV or batch room)
    itl_seconds: float | None = None  # the spec's ITL percentile over the last window


@dataclass(frozen=True, slots=True)
class RoleFleet:
    """One role's replicas as the reconcile sees them."""

    replicas: int  # the count in effect (the last decision, or spec.<role>.replicas before the first)
    ready: int  # routable ready replicas
    starting: tuple[float, ...] = ()  # seconds each starting replica has been starting (created, not Ready)
    draining: int = 0  # replicas draining: they still hold GPUs
    startup_seconds: float = 120.0  # measured create -> Ready time of the role (start-up included)
    gpus_per_replica: int = 1

    def arrivals_in(self) -> list[float]:
        """Seconds until each starting replica is expected Ready (0: due now)."""
        return sorted(max(0.0, self.startup_seconds - age) for age in self.starting)


@dataclass(frozen=True, slots=True)
class Reading:
    """One signal's value against its target and the replicas it asks for."""

    kind: SignalKind
    value: float
    target: float
    recommendation: int
    covered_by_starting: bool = False  # without the starting replicas' capacity it would ask for more


def project_backlog(backlog: float, arrivals: float, rate: float, ready: int, joins: list[float],
                    horizon: float) -> float:
    """The queued tokens ``horizon`` seconds ahead (a fluid queue): arrivals at a constant rate, served
    by ``ready`` replicas and by each starting one from its expected Ready time in ``joins`` on."""
    t, served_by, b = 0.0, ready, backlog
    for when in [*(j for j in joins if j < horizon), horizon]:
        b = max(0.0, b + (arrivals - served_by * rate) * (when - t))
        t, served_by = when, served_by + 1
    return b


def _latency(kind: SignalKind, signal: LatencySignal, value: float | None, fleet: RoleFleet) -> Reading | None:
    if value is None:
        return None
    ratio = value / signal.target_seconds
    basis = max(1, fleet.ready)
    if abs(ratio - 1.0) <= TOLERANCE:
        rec = fleet.replicas
    else:
        rec = math.ceil(basis * min(2.0, max(0.5, ratio)) - 1e-9)
    covered = ratio > 1 + TOLERANCE and rec <= fleet.replicas and rec > fleet.ready
    return Reading(kind, value, signal.target_seconds, rec, covered)


def _backlog_need(m: PrefillMetrics, rate: float, target: float, fleet: RoleFleet, joins: list[float]) -> float:
    backlog = m.queued_prompt_tokens or 0.0
    if m.prompt_tokens_per_second is None:  # no arrival rate: the backlog alone, cleared within the target
        return backlog / (rate * target)
    arrivals = m.prompt_tokens_per_second
    a = arrivals / rate
    horizon = max(fleet.startup_seconds, target)
    projected = project_backlog(backlog, arrivals, rate, fleet.ready, joins, horizon)
    recovery = max(0.0, projected - arrivals * target) / (rate * horizon)
    spare = fleet.ready - a
    wait = backlog / (rate * max(1, fleet.ready))  # seconds a newly queued prompt waits behind the queue
    queue = 0.0
    if backlog > 0 and projected <= arrivals * target:  # a busy pool, not an overload
        queue = max(spare, 1.0) * wait / (target / TAIL_FACTOR)
    return a + queue + recovery


def prefill_readings(signals: PrefillSignals, m: PrefillMetrics, fleet: RoleFleet) -> list[Reading]:
    """The prefill role's readings, one per configured signal whose metrics are reported."""
    out: list[Reading] = []
    if signals.backlog is not None:
        rate = signals.backlog.prefill_tokens_per_second or m.prefill_tokens_per_second
        target = signals.backlog.target_seconds
        if rate and m.queued_prompt_tokens is not None:
            need = _backlog_need(m, rate, target, fleet, fleet.arrivals_in())
            bare = _backlog_need(m, rate, target, RoleFleet(fleet.replicas, fleet.ready, (), fleet.draining,
                                                            fleet.startup_seconds), [])
            rec = math.ceil(need - 1e-9)
            covered = math.ceil(bare - 1e-9) > fleet.replicas >= rec
            seconds = m.queued_prompt_tokens / (rate * max(1, fleet.ready))
            out.append(Reading(SignalKind.BACKLOG, seconds, target, rec, covered))
    if signals.ttft is not None and (r := _latency(SignalKind.TTFT, signals.ttft, m.ttft_seconds, fleet)):
        out.append(r)
    return out


def decode_readings(signals: DecodeSignals, m: DecodeMetrics, fleet: RoleFleet, growth: float = 1.0) -> list[Reading]:
    """The decode role's readings; ``growth`` (>= 1) is how much more prefill output the prefill
    decision will send decode once it takes effect (``planner`` computes it)."""
    out: list[Reading] = []
    serving = max(1, fleet.ready + fleet.draining)
    running = m.running_requests
    per_request = (m.kv_used_tokens / running) if (m.kv_used_tokens is not None and running) else 0.0
    queued = m.queued_requests or 0.0
    if signals.kv_cache is not None and m.kv_used_tokens is not None and m.kv_tokens_per_replica:
        demand = m.kv_used_tokens * growth + queued * per_request
        u = signals.kv_cache.target
        rec = math.ceil(demand / (m.kv_tokens_per_replica * u) - 1e-9)
        value = demand / (m.kv_tokens_per_replica * serving)
        out.append(Reading(SignalKind.KV_CACHE, value, u, rec, rec <= fleet.replicas and rec > fleet.ready))
    if signals.running_requests is not None and running is not None:
        target = signals.running_requests.target_per_replica
        demand = running * growth + queued
        rec = math.ceil(demand / target - 1e-9)
        out.append(Reading(SignalKind.RUNNING, demand / serving, target, rec,
                           rec <= fleet.replicas and rec > fleet.ready))
    if signals.itl is not None and (r := _latency(SignalKind.ITL, signals.itl, m.itl_seconds, fleet)):
        out.append(r)
    return out
