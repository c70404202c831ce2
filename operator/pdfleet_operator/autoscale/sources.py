"""Which metric names carry each autoscaling signal, per engine, and one pod's scrape parsed (pure).

The built-in runtime exports SGLang's names (``pdfleet_runtime/pod/metrics.py`` and the worker
API), so one table serves both; vLLM's names are the fallback of each entry, read where a fleet runs
vLLM. A value is the first name of its entry the pod exports (summed over label sets), so a pod is
read the same whichever engine it runs:

=====================  ====================================  =========================================
signal                 SGLang (and the built-in runtime)      vLLM
=====================  ====================================  =========================================
running requests       ``sglang:num_running_reqs``            ``vllm:num_requests_running``
queued requests        ``sglang:num_queue_reqs``              ``vllm:num_requests_waiting``
queued prompt tokens   ``pdfleet_queued_prompt_tokens``       (queued requests x mean prompt length)
KV use (fraction)      ``sglang:token_usage``                 ``vllm:kv_cache_usage_perc``
KV tokens used         ``sglang:num_used_tokens``             (use x capacity)
KV tokens (capacity)   ``sglang:max_total_num_tokens``        ``vllm:cache_config_info`` blocks x size
prompt tokens          ``sglang:prompt_tokens_total``         ``vllm:prompt_tokens_total``
requests finished      ``sglang:num_requests_total``          ``vllm:request_success_total``
prefill busy seconds   ``pdfleet_prefill_busy_seconds_total``  (none: declare the prefill rate)
TTFT histogram         ``sglang:time_to_first_token_seconds``  ``vllm:time_to_first_token_seconds``
ITL histogram          ``sglang:inter_token_latency_seconds``  ``vllm:inter_token_latency_seconds``
=====================  ====================================  =========================================

(``sglang:time_per_output_token_seconds`` and ``vllm:time_per_output_token_seconds`` stand in for
ITL where a version lacks the newer name.) The router's ``smg_router_requests_total`` counts
requests arriving, when a router is scraped.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from enum import StrEnum

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["HISTOGRAMS", "NAMES", "Key", "PodSample", "parse_sample"]


class Key(StrEnum):
    RUNNING = "running"
    QUEUED = "queued"
    QUEUED_PROMPT_TOKENS = "queuedPromptTokens"
    KV_USAGE = "kvUsage"
    KV_USED_TOKENS = "kvUsedTokens"
    KV_CAPACITY_TOKENS = "kvCapacityTokens"
    PROMPT_TOKENS = "promptTokens"  # counter
    REQUESTS_FINISHED = "requestsFinished"  # counter
    PREFILL_BUSY_SECONDS = "prefillBusySeconds"  # counter
    ROUTER_REQUESTS = "routerRequests"  # counter
    TTFT = "ttft"  # histogram
    ITL = "itl"  # histogram


NAMES: dict[Key, tuple[str, ...]] = {
    Key.RUNNING: ("sglang:num_running_reqs", "vllm:num_requests_running"),
    Key.QUEUED: ("sglang:num_queue_reqs", "vllm:num_requests_waiting"),
    Key.QUEUED_PROMPT_TOKENS: ("pdfleet_queued_prompt_tokens",),
    Key.KV_USAGE: ("sglang:token_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    Key.KV_USED_TOKENS: ("sglang:num_used_tokens",),
    Key.KV_CAPACITY_TOKENS: ("sglang:max_total_num_tokens",),
    Key.PROMPT_TOKENS: ("sglang:prompt_tokens_total", "vllm:prompt_tokens_total"),
    Key.REQUESTS_FINISHED: ("sglang:num_requests_total", "vllm:request_success_total"),
    Key.PREFILL_BUSY_SECONDS: ("pdfleet_prefill_busy_seconds_total",),
    Key.ROUTER_REQUESTS: ("smg_router_requests_total",),
}
HISTOGRAMS: dict[Key, tuple[str, ...]] = {
    Key.TTFT: ("sglang:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    Key.ITL: ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}
_VLLM_CACHE_INFO = "vllm:cache_config_info"

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last


@dataclass(frozen=True, slots=True)
class PodSample:
    """One pod's signal values at one scrape (a key absent: the pod does not export it)."""

    values: dict[Key, float] = field(default_factory=dict)
    histograms: dict[Key, Buckets] = field(default_factory=dict)


def _finite(v: float) -> bool:
    return math.isfinite(v) and v >= 0


def parse_sample(text: str) -> PodSample:
    """A pod's ``/metrics`` text -> its signal values; unreadable text raises ``ValueError``."""
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    cache_blocks = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not _finite(float(s.value)) and not (s.name.endswith("_bucket") and math.isinf(s.value)):
                continue
            if s.name.endswith("_bucket") and "le" in s.labels:
                per = buckets.setdefault(s.name[: -len("_bucket")], {})
                le = float(s.labels["le"])
                per[le] = per.get(le, 0.0) + float(s.value)
            elif s.name == _VLLM_CACHE_INFO:
                with contextlib.suppress(ValueError):
                    cache_blocks += float(s.labels.get("num_gpu_blocks", 0)) * float(s.labels.get("block_size", 0))
            else:
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    values: dict[Key, float] = {}
    for key, names in NAMES.items():
        found = next((n for n in names if n in sums), None)
        if found is not None:
            values[key] = sums[found]
    if Key.KV_CAPACITY_TOKENS not in values and cache_blocks > 0:
        values[Key.KV_CAPACITY_TOKENS] = cache_blocks
    if Key.KV_USED_TOKENS not in values and Key.KV_USAGE in values and Key.KV_CAPACITY_TOKENS in values:
        values[Key.KV_USED_TOKENS] = values[Key.KV_USAGE] * values[Key.KV_CAPACITY_TOKENS]
    hists: dict[Key, Buckets] = {}
    for key, names in HISTOGRAMS.items():
        found = next((n for n in names if n in buckets), None)
        if found is not None:
            hists[key] = tuple(sorted(buckets[found].items()))
    return PodSample(values, hists)
