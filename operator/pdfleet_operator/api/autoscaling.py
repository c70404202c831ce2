"""``spec.autoscaling``: each role's replica bounds and signals, the ratio band and the GPU budget.

Kept apart from ``models.py`` (which only names the field) so the autoscaling API, its admission
checks (``autoscaling_violations``) and its docs move together. The decision itself is
``pdfleet_operator.autoscale.planner``; docs/autoscaling.md describes both.

A role's ``signals`` object sets one or more signals; the planner takes the largest replica count
any of them asks for (as an HPA with several metrics does). The structural schema cannot say "at
least one of", so a CEL rule does (``autoscaling-signal``).

Besides the CEL rules (``rules.py``, which the apiserver enforces itself), two checks need a loop
over replica counts and run where the capability matrix runs (the webhook and ``pdfleet
validate``): ``autoscaling-ratio-feasible`` exactly (its CEL twin is the real-number relaxation)
and ``autoscaling-budget-feasible``.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import NamedTuple

from pydantic import AwareDatetime, Field

from pdfleet_operator.api.kube import ApiModel

__all__ = [
    "AUTOSCALING_RULES",
    "AutoscalingSpec",
    "AutoscalingStatus",
    "BacklogSignal",
    "DecodeAutoscaling",
    "DecodeSignals",
    "KVCacheSignal",
    "LatencySignal",
    "Percentile",
    "PrefillAutoscaling",
    "PrefillSignals",
    "RatioBand",
    "Recommendation",
    "RoleAutoscalingStatus",
    "RunningRequestsSignal",
    "SignalReading",
    "cheapest_in_band",
]

MAX_WINDOW_SECONDS = 3600
"""Stabilization windows are bounded at an hour: the planner keeps its recommendations that long."""


class Percentile(StrEnum):
    """Which percentile of a latency histogram a latency signal reads."""

    P50 = "p50"
    P90 = "p90"
    P95 = "p95"
    P99 = "p99"


class BacklogSignal(ApiModel):
    """Prefill backlog in seconds: queued prompt tokens over the prefill rate of one replica."""

    target_seconds: float = Field(
        gt=0,
        le=600,
        description="Seconds of queued prompt tokens the prefill role may hold: the planner keeps the "
        "queue a newly queued prompt waits behind below this (e.g. 1.5 for a ~2 s TTFT target). Arrivals "
        "are served at their measured rate and a standing backlog is cleared within one start-up time.",
    )
    prefill_tokens_per_second: float | None = Field(
        None,
        gt=0,
        le=1e8,
        description="Prompt tokens one prefill replica computes per second, declared (measure it through "
        "the transfer path you serve on: a slow KV fabric lowers it). Unset: measured from the pods' "
        "prefill throughput while they are busy.",
    )


class LatencySignal(ApiModel):
    """A latency percentile against its target (TTFT for prefill, inter-token latency for decode)."""

    percentile: Percentile = Field(Percentile.P90, description="p50, p90 (default), p95 or p99.")
    target_seconds: float = Field(gt=0, le=600, description="The percentile's target in seconds.")


class KVCacheSignal(ApiModel):
    """Decode KV-cache use: the fraction of the role's KV tokens in use or wanted."""

    target: float = Field(
        gt=0,
        le=1,
        description="KV-cache use per decode replica to aim at, a fraction (e.g. 0.8: act at 80% full). "
        "Requests waiting for decode admission and prompts already in prefill count as wanted.",
    )


class RunningRequestsSignal(ApiModel):
    """Requests a decode replica runs at once (its batch), waiting ones included."""

    target_per_replica: int = Field(
        ge=1, le=65536, description="Running requests per decode replica to aim at (its batch size)."
    )


class PrefillSignals(ApiModel):
    """The prefill role's signals: set one or both; the larger replica count wins."""

    backlog: BacklogSignal | None = Field(None, description="Seconds of queued prompt tokens.")
    ttft: LatencySignal | None = Field(None, description="A time-to-first-token percentile.")


class DecodeSignals(ApiModel):
    """The decode role's signals: set one or more; the largest replica count wins."""

    kv_cache: KVCacheSignal | None = Field(None, description="KV-cache use.")
    running_requests: RunningRequestsSignal | None = Field(None, description="Running requests per replica.")
    itl: LatencySignal | None = Field(None, description="An inter-token latency percentile.")


class _RoleBounds(ApiModel):
    min_replicas: int = Field(ge=1, le=4096, description="Fewest replicas the autoscaler keeps.")
    max_replicas: int = Field(ge=1, le=4096, description="Most replicas the autoscaler asks for.")
    scale_up_stabilization_seconds: int = Field(
        0,
        ge=0,
        le=MAX_WINDOW_SECONDS,
        description="Scale up only to the smallest count recommended over this window, and never within "
        "it after a scale-down (as an HPA's behavior.scaleUp window). Default 0.",
    )
    scale_down_stabilization_seconds: int = Field(
        300,
        ge=0,
        le=MAX_WINDOW_SECONDS,
        description="Scale down only to the largest count recommended over this window, and never within "
        "it after a scale-up. Default 300. A removed replica leaves through a drain.",
    )


class PrefillAutoscaling(_RoleBounds):
    """Bounds, signals and windows of the prefill role."""

    signals: PrefillSignals = Field(description="What the prefill role scales on (at least one).")


class DecodeAutoscaling(_RoleBounds):
    """Bounds, signals and windows of the decode role."""

    signals: DecodeSignals = Field(description="What the decode role scales on (at least one).")


class RatioBand(ApiModel):
    """Bounds on prefill replicas per decode replica."""

    min: float = Field(gt=0, le=4096, description="Fewest prefill replicas per decode replica, e.g. 0.25.")
    max: float = Field(gt=0, le=4096, description="Most prefill replicas per decode replica, e.g. 2.")


class AutoscalingSpec(ApiModel):
    """Autoscaling of both roles on PD signals (docs/autoscaling.md). Absent: replicas are fixed."""

    prefill: PrefillAutoscaling = Field(description="The prefill role's bounds, signals and windows.")
    decode: DecodeAutoscaling = Field(description="The decode role's bounds, signals and windows.")
    prefill_decode_ratio: RatioBand | None = Field(
        None,
        description="Keep prefill replicas / decode replicas inside this band whenever the bounds, the "
        "budget and the windows allow. Unset: no band.",
    )
    gpu_budget: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="Most GPUs the deployment's replicas may hold (each replica holds tensor x pipeline), "
        "draining ones included. Unset: no budget.",
    )


# -- status: what the operator decided and why (written by ``autoscale.runner``) -----------------


class SignalReading(ApiModel):
    """One signal's reading at a decision: its value, its target and the replicas it asked for."""

    signal: str = Field(max_length=64, description="backlogSeconds, ttftSeconds, kvCacheUsage, "
                        "runningRequestsPerReplica or itlSeconds.")
    value: float = Field(description="The signal's value over the role (seconds, a fraction, requests per replica).")
    target: float = Field(description="The spec's target for it.")
    recommendation: int = Field(ge=0, description="Replicas this signal alone asks for.")
    covered_by_starting: bool = Field(False, description="The replicas already starting cover it.")


class Recommendation(ApiModel):
    """One past recommendation, kept for the stabilization windows (an operator restart resumes them)."""

    at: float = Field(ge=0, description="When, in epoch seconds.")
    replicas: int = Field(ge=0, description="What the signals asked for.")


class RoleAutoscalingStatus(ApiModel):
    """One role's latest autoscaling decision."""

    desired: int = Field(ge=0, description="The replicas the autoscaler hands to the reconcile (it drains "
                         "the surplus, never deletes a serving pod).")
    current: int = Field(0, ge=0, description="The count in effect before this decision.")
    recommendation: int | None = Field(None, ge=0, description="What the signals asked for, before the "
                                       "windows, the bounds, the budget and the band (unset: no signal).")
    reason: str = Field(max_length=64, description="Why desired is what it is: SignalAboveTarget, "
                        "SignalBelowTarget, WithinTarget, StartingReplicasCover, ScaleUpStabilizing, "
                        "ScaleDownStabilizing, AtMinReplicas, AtMaxReplicas, GpuBudget, RatioBand, NoSignal, "
                        "RolloutInProgress.")
    message: str = Field("", max_length=4096, description="The same in words.")
    readings: list[SignalReading] | None = Field(None, max_length=8, description="Every configured signal "
                                                 "that was reported, with the replicas it asked for.")
    ready: int = Field(0, ge=0, description="Routable ready replicas at the decision.")
    starting: int = Field(0, ge=0, description="Replicas created and not yet Ready.")
    draining: int = Field(0, ge=0, description="Replicas draining (they hold GPUs until they go).")
    startup_seconds: float | None = Field(None, ge=0, description="The role's measured create -> Ready time "
                                          "(the median of its ready pods), which the planner waits out.")
    scraped: int = Field(0, ge=0, description="Pods whose metrics were read at this decision.")
    last_scale_up: float | None = Field(None, ge=0, description="Epoch seconds of the last growth.")
    last_scale_down: float | None = Field(None, ge=0, description="Epoch seconds of the last shrink.")
    recommendations: list[Recommendation] | None = Field(
        None, max_length=512, description="Recommendations inside the longer stabilization window, oldest first.")


class AutoscalingStatus(ApiModel):
    """``status.autoscaling``: the latest decision of both roles (docs/autoscaling.md)."""

    last_decision_time: AwareDatetime | None = Field(None, description="When the latest decision was made.")
    held_by_rollout: bool = Field(False, description="A rollout is in progress: the autoscaler holds both "
                                  "counts until it completes (the rollout wins).")
    gpus: int = Field(0, ge=0, description="GPUs of the desired replicas of both roles.")
    ratio_in_band: bool | None = Field(None, description="Whether desired prefill / decode is inside the "
                                       "band (unset: no band).")
    prefill: RoleAutoscalingStatus | None = Field(None, description="The prefill role's decision.")
    decode: RoleAutoscalingStatus | None = Field(None, description="The decode role's decision.")


# -- admission checks that need a loop (the webhook and `pdfleet validate`) ------------------------


class _Rule(NamedTuple):
    """Why a rule exists and how to fix a violation (the CEL rules of ``rules.py`` use these too)."""

    reason: str
    fix: str


AUTOSCALING_RULES: dict[str, _Rule] = {
    "autoscaling-min-max": _Rule(
        "the autoscaler keeps each role's replicas between minReplicas and maxReplicas",
        "lower minReplicas or raise maxReplicas",
    ),
    "autoscaling-signal": _Rule(
        "a role with autoscaling needs a signal to scale on",
        "set a signal: prefill backlog or ttft; decode kvCache, runningRequests or itl",
    ),
    "autoscaling-replicas-in-range": _Rule(
        "spec.<role>.replicas is the count the fleet starts from before the first decision",
        "set replicas between the role's minReplicas and maxReplicas",
    ),
    "autoscaling-ratio-order": _Rule(
        "the ratio band is [min, max] of prefill replicas per decode replica",
        "swap prefillDecodeRatio.min and .max, or set min <= max",
    ),
    "autoscaling-ratio-feasible": _Rule(
        "no prefill and decode replica counts inside their min/max have a ratio inside the band, so the "
        "band could never hold",
        "widen prefillDecodeRatio, or move the roles' minReplicas/maxReplicas so a ratio in the band exists",
    ),
    "autoscaling-budget-minimums": _Rule(
        "the minimum replicas of both roles already hold more GPUs than the budget allows",
        "raise gpuBudget to at least the minimums' GPUs, or lower minReplicas",
    ),
    "autoscaling-max-unreachable": _Rule(
        "a maxReplicas the GPU budget can never reach is a bound that does nothing",
        "lower maxReplicas to what the budget holds, or raise gpuBudget",
    ),
    "autoscaling-double-control": _Rule(
        "spec.autoscaling scales both roles; a role with scalingAdapter is scaled from outside (an HPA or KEDA "
        "through its PDRoleScale): two controllers of one count would fight",
        "remove spec.autoscaling, or set scalingAdapter false on both roles",
    ),
    "autoscaling-budget-feasible": _Rule(
        "every replica count inside min/max whose ratio is in the band holds more GPUs than the budget",
        "raise gpuBudget, widen prefillDecodeRatio, or lower minReplicas",
    ),
}


def cheapest_in_band(
    prefill: tuple[int, int], decode: tuple[int, int], band: tuple[float, float] | None, gpus: tuple[int, int]
) -> tuple[int, int] | None:
    """The (prefill, decode) counts inside both bounds and the band that hold the fewest GPUs, or None
    when the band admits no pair. Exact over integers (the CEL twin only checks the real relaxation)."""
    (pa, pb), (da, db) = prefill, decode
    if pa > pb or da > db:
        return None
    if band is None:
        return pa, da
    lo, hi = band
    best: tuple[int, int] | None = None
    for d in range(da, db + 1):
        p = max(pa, math.ceil(lo * d - 1e-9))
        if p <= min(pb, math.floor(hi * d + 1e-9)) and (
            best is None or p * gpus[0] + d * gpus[1] < best[0] * gpus[0] + best[1] * gpus[1]
        ):
            best = (p, d)
    return best
