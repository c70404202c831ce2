"""The planner's inputs from what the operator observed (pure): two scrapes of a role's pods -> its
metrics (rates over the interval between them, histogram percentiles over the same interval, as
Prometheus' ``rate`` and ``histogram_quantile`` would give), and its pods -> its fleet.

Counters are read per pod and only for pods present in both scrapes (a pod that joined or left in
between adds no rate); a counter that went down restarted, and counts from zero. Where an engine
lacks a value the table of ``sources`` names how it is derived, else the value is not reported and
the signal that needs it holds (``NoSignal``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdfleet_operator.api.autoscaling import Percentile
from pdfleet_operator.autoscale.signals import DecodeMetrics, PrefillMetrics, RoleFleet
from pdfleet_operator.autoscale.sources import Buckets, Key, PodSample
from pdfleet_operator.groups import units
from pdfleet_operator.observed import ObservedPod

__all__ = [
    "DEFAULT_STARTUP_S",
    "MIN_BUSY_S",
    "RoleScrape",
    "decode_metrics",
    "histogram_quantile",
    "prefill_metrics",
    "role_fleet",
]

DEFAULT_STARTUP_S = 120.0
"""A role's start-up time until one of its pods has been seen Ready (then: measured)."""
MIN_BUSY_S = 0.5
"""Seconds of prefill work over an interval below which its measured rate is not trusted."""
_QUANTILES = {Percentile.P50: 0.5, Percentile.P90: 0.9, Percentile.P95: 0.95, Percentile.P99: 0.99}


@dataclass(frozen=True, slots=True)
class RoleScrape:
    """One role's pods' samples at one moment (epoch seconds); a pod that did not answer is absent."""

    at: float
    pods: Mapping[str, PodSample] = field(default_factory=dict)
    router: PodSample | None = None  # the router's, when one was scraped


def _total(scrape: RoleScrape, key: Key) -> float | None:
    """The sum over pods, or None unless every pod that answered reports it."""
    vals = [s.values.get(key) for s in scrape.pods.values()]
    if not vals or any(v is None for v in vals):
        return None
    return float(sum(v for v in vals if v is not None))


def _delta(prev: RoleScrape | None, cur: RoleScrape, key: Key) -> float | None:
    """A counter's increase over the interval, over the pods present in both scrapes."""
    if prev is None:
        return None
    out, seen = 0.0, False
    for name, s in cur.pods.items():
        before = prev.pods.get(name)
        if before is None or key not in s.values or key not in before.values:
            continue
        now, then = s.values[key], before.values[key]
        out += now - then if now >= then else now  # a restart counts from zero
        seen = True
    return out if seen else None


def _router_delta(prev: RoleScrape | None, cur: RoleScrape) -> float | None:
    if prev is None or prev.router is None or cur.router is None:
        return None
    now, then = cur.router.values.get(Key.ROUTER_REQUESTS), prev.router.values.get(Key.ROUTER_REQUESTS)
    if now is None or then is None:
        return None
    return now - then if now >= then else now


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket holding rank ``q * count``; the
    +Inf bucket answers the highest finite bound. None when the histogram is empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _hist_delta(prev: RoleScrape | None, cur: RoleScrape, key: Key) -> Buckets | None:
    """The role's histogram of the interval: each pod's buckets now less before, summed per bound."""
    if prev is None:
        return None
    sums: dict[float, float] = {}
    for name, s in cur.pods.items():
        now, then = s.histograms.get(key), (prev.pods[name].histograms.get(key) if name in prev.pods else None)
        if now is None or then is None:
            continue
        before = dict(then)
        reset = any(c < before.get(b, 0.0) for b, c in now)
        for b, c in now:
            sums[b] = sums.get(b, 0.0) + (c if reset else c - before.get(b, 0.0))
    return tuple(sorted(sums.items())) if sums else None


def _percentile(prev: RoleScrape | None, cur: RoleScrape, key: Key, p: Percentile | None) -> float | None:
    if p is None:
        return None
    h = _hist_delta(prev, cur, key)
    return None if h is None else histogram_quantile(_QUANTILES[p], h)


def prefill_metrics(prev: RoleScrape | None, cur: RoleScrape, ttft: Percentile | None = None) -> PrefillMetrics:
    """Prefill's metrics: the queued prompt tokens, what arrives (processed + the queue's growth), the
    per-replica rate while busy, and the TTFT percentile over the interval."""
    dt = cur.at - prev.at if prev is not None else 0.0
    queued_tokens = _total(cur, Key.QUEUED_PROMPT_TOKENS)
    prompts = _delta(prev, cur, Key.PROMPT_TOKENS)
    finished = _delta(prev, cur, Key.REQUESTS_FINISHED)
    mean_prompt = prompts / finished if prompts is not None and finished else None
    if queued_tokens is None and mean_prompt is not None and (queued := _total(cur, Key.QUEUED)) is not None:
        queued_tokens = queued * mean_prompt  # engines that count queued requests only
    tokens_s = requests_s = rate = None
    if prev is not None and dt > 0:
        if prompts is not None:
            before = _total(prev, Key.QUEUED_PROMPT_TOKENS)
            growth = (queued_tokens - before) if queued_tokens is not None and before is not None else 0.0
            tokens_s = max(0.0, prompts + growth) / dt
        routed = _router_delta(prev, cur)
        if routed is not None:
            requests_s = routed / dt
        elif finished is not None:
            q_now, q_then = _total(cur, Key.QUEUED), _total(prev, Key.QUEUED)
            growth = (q_now - q_then) if q_now is not None and q_then is not None else 0.0
            requests_s = max(0.0, finished + growth) / dt
        busy = _delta(prev, cur, Key.PREFILL_BUSY_SECONDS)
        if busy is not None and busy >= MIN_BUSY_S and prompts:
            rate = prompts / busy
    return PrefillMetrics(queued_prompt_tokens=queued_tokens, prompt_tokens_per_second=tokens_s,
                          requests_per_second=requests_s, prefill_tokens_per_second=rate,
                          ttft_seconds=_percentile(prev, cur, Key.TTFT, ttft))


def decode_metrics(prev: RoleScrape | None, cur: RoleScrape, itl: Percentile | None = None) -> DecodeMetrics:
    """Decode's metrics: KV tokens used and per replica, running and waiting requests, completions per
    second and the ITL percentile over the interval."""
    caps = [s.values[Key.KV_CAPACITY_TOKENS] for s in cur.pods.values() if Key.KV_CAPACITY_TOKENS in s.values]
    dt = cur.at - prev.at if prev is not None else 0.0
    finished = _delta(prev, cur, Key.REQUESTS_FINISHED)
    return DecodeMetrics(
        kv_used_tokens=_total(cur, Key.KV_USED_TOKENS),
        kv_tokens_per_replica=statistics.fmean(caps) if caps else None,
        running_requests=_total(cur, Key.RUNNING),
        queued_requests=_total(cur, Key.QUEUED),
        requests_per_second=finished / dt if finished is not None and dt > 0 else None,
        itl_seconds=_percentile(prev, cur, Key.ITL, itl),
    )


def role_fleet(pods: Iterable[ObservedPod], replicas: int, now: float, gpus_per_replica: int,
               default_startup_s: float = DEFAULT_STARTUP_S) -> RoleFleet:
    """One role's fleet from its pods (a multi-node group counts once, through its leader): routable
    ready replicas, the ages of starting ones, draining ones (deleting too: they hold GPUs until gone),
    and the start-up time measured as the median create -> Ready of its ready pods."""
    ready = draining = 0
    ages: list[float] = []
    took: list[float] = []
    for u in units(list(pods)):
        if u.deleting or u.drain_started is not None:
            draining += 1
        elif u.ready:
            ready += 1
            if u.created is not None and u.ready_since is not None and u.ready_since >= u.created:
                took.append(u.ready_since - u.created)
        else:
            ages.append(max(0.0, now - u.created) if u.created is not None else 0.0)
    startup = statistics.median(took) if took else default_startup_s
    return RoleFleet(replicas=replicas, ready=ready, starting=tuple(ages), draining=draining,
                     startup_seconds=startup, gpus_per_replica=gpus_per_replica)
