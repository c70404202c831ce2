"""One role's observed metrics and fleet -> a replica recommendation per configured signal (pure).

A recommendation is the replica count the role needs by the time a replica asked for now would be
Ready (its measured start-up time, ``RoleFleet.startup_seconds``), counting the replicas already
starting as capacity that arrives when their start-up ends: a signal that stays high while pods
start asks for nothing more, which is what keeps the fleet from over-scaling during start-up.

Prefill, backlog (``target_seconds`` T, per-replica rate V declared or measured):

* arrivals: ``a = prompt tokens/s / V`` replicas keep up with what comes in;
* queue: in a busy pool the queue wait falls with the spare replicas (``wait ~ 1/(N - a)``, heavy
  traffic), and its tail is near exponential, so the planner holds the mean wait at T/3 (about 95%
  of prompts then wait less than T): spare replicas scale by ``wait / (T/3)``, the wait (queued
  tokens over the ready replicas' rate) counted up to T;
* recovery: a backlog beyond T seconds of arrivals, projected to the moment a replica started now
  would be Ready (starting replicas serve from their own Ready time on), is cleared within one
  start-up time.

Decode, KV-cache use (target u, K tokens per replica): the KV tokens the role will hold once the
prefill decision takes effect, over ``K * u``. Requests run for a lifetime ``L = running /
completions per second`` (Little's law), so the running set follows its inflow: decode's inflow
when the prefill recommendation is in place (prefill sized up means more prompts arriving: decode
follows prefill ahead of its own signal) times ``L``, plus the requests waiting for admission,
counted as the share of them a replica started now can take over its start-up (``L / H`` each:
a queue that built while pods start does not buy replicas for its whole length). Running
requests: the same concurrency over the target per replica; with an ITL signal as well, by
throughput instead (the role generates ``concurrency / ITL`` tokens/s whatever its size, and a
replica at its target batch generates ``target / ITL target``), which stays right as the pool
shrinks. Otherwise, shrinking, both take the geometric mean of their count and the serving replicas
(``_shrink_bound``: requests run longer on a smaller pool, so a reading taken on a larger one
undershoots). Latency percentiles (TTFT, ITL):
proportional to the ratio to the target, as an HPA on the same metric, inside a 10% tolerance and
at most halving or doubling per decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import TypeVar

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
    "sanitized",
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
    requests_per_second: float | None = None  # requests arriving per second
    prefill_tokens_per_second: float | None = None  # measured: tokens one busy replica prefills per second
    ttft_seconds: float | None = None  # the spec's TTFT percentile over the last window


@dataclass(frozen=True, slots=True)
class DecodeMetrics:
    """What the decode role's pods report, summed over the role (None: not reported)."""

    kv_used_tokens: float | None = None  # KV tokens in use
    kv_tokens_per_replica: float | None = None  # KV tokens one replica holds (its pool)
    running_requests: float | None = None
    queued_requests: float | None = None  # waiting for decode admission (KV or batch room)
    requests_per_second: float | None = None  # requests finishing per second (a counter's rate)
    itl_seconds: float | None = None  # the spec's ITL percentile over the last window


M = TypeVar("M", "PrefillMetrics", "DecodeMetrics")
MAX_RECOMMENDATION = 1 << 20


def sanitized(m: M) -> M:
    """The metrics with every value that is not a finite number >= 0 dropped (not reported): a
    scrape gone wrong holds the role instead of sizing it."""
    bad = {f.name: None for f in fields(m) if (v := getattr(m, f.name)) is not None
           and not (isinstance(v, int | float) and math.isfinite(v) and v >= 0)}
    return replace(m, **bad) if bad else m


def _ceil(x: float) -> int:
    """A replica count: x rounded up, within [0, MAX_RECOMMENDATION] (the bounds apply later)."""
    if not math.isfinite(x) or x >= MAX_RECOMMENDATION:
        return MAX_RECOMMENDATION
    return max(0, math.ceil(x - 1e-9))


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
    rec = fleet.replicas if abs(ratio - 1.0) <= TOLERANCE else _ceil(basis * min(2.0, max(0.5, ratio)))
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
    # A busy pool (spare replicas): seconds a newly queued prompt waits behind the queue, capped at the
    # target; a longer wait, or no spare replicas, is a backlog, which the recovery term (or the spare
    # replicas, when it clears before a replica started now could help) deals with.
    wait = min(target, backlog / (rate * max(1, fleet.ready)))
    queue = spare * wait / (target / TAIL_FACTOR) if backlog > 0 and spare > 0 else 0.0
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
            rec = _ceil(need)
            covered = _ceil(bare) > fleet.replicas >= rec
            seconds = m.queued_prompt_tokens / (rate * max(1, fleet.ready))
            out.append(Reading(SignalKind.BACKLOG, seconds, target, rec, covered))
    if signals.ttft is not None and (r := _latency(SignalKind.TTFT, signals.ttft, m.ttft_seconds, fleet)):
        out.append(r)
    return out


def _shrink_bound(need: float, serving: int) -> int:
    """Replicas for a decode load read on ``serving`` replicas. Growing: ``need``. Shrinking: a
    request holds its KV and batch slot longer on a smaller pool (its steps slow as KV use and batch
    rise), so a reading taken on the larger pool undershoots; bounding the step time as proportional
    to the load per replica (the pessimistic case of a memory- or compute-bound step) puts the count
    at the geometric mean of ``need`` and ``serving``."""
    if need >= serving:
        return _ceil(need)
    return _ceil(math.sqrt(max(need, 0.0) * serving))


def _concurrency(m: DecodeMetrics, fleet: RoleFleet, inflow: float | None) -> float | None:
    """Requests decode will run at once: the running set scaled to the coming inflow, plus the
    waiting ones a replica started now can take over its start-up."""
    running = m.running_requests
    if running is None:
        return None
    queued = m.queued_requests or 0.0
    rate = m.requests_per_second
    if not rate or running < 1:  # no lifetime known: every waiting request counts
        return running + queued
    lifetime = running / rate
    future = max(running, inflow * lifetime) if inflow else running
    return future + queued * min(1.0, lifetime / max(fleet.startup_seconds, 1.0))


def decode_readings(signals: DecodeSignals, m: DecodeMetrics, fleet: RoleFleet,
                    inflow: float | None = None) -> list[Reading]:
    """The decode role's readings; ``inflow`` is the requests/s prefill will send once its
    recommendation is in place (``planner`` computes it; None: unknown)."""
    out: list[Reading] = []
    serving = max(1, fleet.ready + fleet.draining)
    concurrency = _concurrency(m, fleet, inflow)
    running = m.running_requests
    if (signals.kv_cache is not None and m.kv_used_tokens is not None and m.kv_tokens_per_replica
            and concurrency is not None):
        per_request = m.kv_used_tokens / running if running and running >= 1 else 0.0
        demand = max(m.kv_used_tokens, per_request * concurrency)
        u = signals.kv_cache.target
        rec = _shrink_bound(demand / (m.kv_tokens_per_replica * u), serving)
        value = demand / (m.kv_tokens_per_replica * serving)
        out.append(Reading(SignalKind.KV_CACHE, value, u, rec, fleet.ready < rec <= fleet.replicas))
    if signals.running_requests is not None and concurrency is not None:
        target = signals.running_requests.target_per_replica
        if signals.itl is not None and m.itl_seconds:
            # Throughput: the role generates concurrency / ITL tokens/s whatever its size; a replica
            # at its target batch runs at the ITL target, so it generates target / ITL-target.
            rec = _ceil(concurrency * signals.itl.target_seconds / (m.itl_seconds * target))
        else:
            rec = _shrink_bound(concurrency / target, serving)
        out.append(Reading(SignalKind.RUNNING, concurrency / serving, target, rec,
                           fleet.ready < rec <= fleet.replicas))
    if signals.itl is not None and (r := _latency(SignalKind.ITL, signals.itl, m.itl_seconds, fleet)):
        out.append(r)
    return out
