"""The seeded mode's load, as the worker API applies and reports it: the declared compute cost paced
in real time (``compute_cost`` gives the times; this sleeps them) and the load metrics an autoscaler
reads, under SGLang's names (``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``,
``sglang:num_requests_total``, ``sglang:time_to_first_token_seconds``,
``sglang:inter_token_latency_seconds``, ``sglang:max_total_num_tokens``) plus two of pdfleet's own
that SGLang lacks (``pdfleet_queued_prompt_tokens``, ``pdfleet_prefill_busy_seconds_total``: the
backlog and the measured prefill rate). They are registered on the pod's registry, beside the gauges
of ``server.metrics`` (running, queued, token usage), with or without a declared cost. The tokens and the
latency histograms are kept under vLLM's names too (``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
labels ``model_name`` and ``engine``), from the same calls (``metrics.Twin``), and so are the requests
(``vllm:request_success_total``, by ``finished_reason``).

What a pod counts: a prefill pod a request once its prompt is computed (TTFT: arrival to then); a
decode pod once its last token is out (TTFT: arrival to its first token, ITL per token).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from .compute_cost import DecodeCompute, PrefillCompute
from .metrics import VLLM_ENGINE, VLLM_LABELS, Twin

__all__ = ["ITL_BUCKETS", "TTFT_BUCKETS", "Finished", "LoadMetrics"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class _Busy:
    """``pdfleet_prefill_busy_seconds_total``, read from the prefill compute at scrape time."""

    def __init__(self, compute: PrefillCompute, clock: Callable[[], float]) -> None:
        self.compute, self.clock = compute, clock

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("pdfleet_prefill_busy_seconds", "Seconds this prefill pod spent computing "
                                  "prompts (declared compute cost): prompt tokens over it is the measured rate",
                                  value=self.compute.busy_seconds(self.clock()))


class Finished:
    """Requests finished (prefill: prompt computed; decode: last token out), under SGLang's name and under
    vLLM's, which counts them by finish reason (``vllm:request_success_total``: the doctor's count of a vLLM
    decode's answers)."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        self.sglang = Counter("sglang:num_requests", "Requests finished (prefill: prompt computed; decode: last "
                              "token out).", ["model_name"], registry=registry).labels(model)
        self.vllm = Counter("vllm:request_success", "Count of successfully processed requests.",
                            [*VLLM_LABELS, "finished_reason"], registry=registry)

    def inc(self, finish_reason: str = "length") -> None:
        self.sglang.inc()
        self.vllm.labels(self.model, VLLM_ENGINE, finish_reason).inc()


class LoadMetrics:
    """One pod's load counters and histograms, and the pacing of its declared compute."""

    def __init__(self, registry: CollectorRegistry, model: str, role: str, kv_tokens: int,
                 prefill: PrefillCompute | None = None, decode: DecodeCompute | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        lab, r = ["model_name"], registry
        self.role, self.prefill, self.decode, self.clock = role, prefill, decode, clock
        vl, v = list(VLLM_LABELS), (model, VLLM_ENGINE)
        self.prompt_tokens = Twin(
            Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", lab, registry=r).labels(model),
            Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", vl, registry=r).labels(*v))
        self.generation_tokens = Twin(
            Counter("sglang:generation_tokens", "Number of generation tokens processed.", lab,
                    registry=r).labels(model),
            Counter("vllm:generation_tokens", "Number of generation tokens processed.", vl, registry=r).labels(*v))
        self.requests = Finished(r, model)
        self.ttft = Twin(
            Histogram("sglang:time_to_first_token_seconds", "Time to first token (prefill pods: to the prompt "
                      "computed).", lab, buckets=TTFT_BUCKETS, registry=r).labels(model),
            Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds (prefill "
                      "pods: to the prompt computed).", vl, buckets=TTFT_BUCKETS, registry=r).labels(*v))
        self.itl = Twin(
            Histogram("sglang:inter_token_latency_seconds", "Inter-token latency.", lab, buckets=ITL_BUCKETS,
                      registry=r).labels(model),
            Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", vl,
                      buckets=ITL_BUCKETS, registry=r).labels(*v))
        Gauge("sglang:max_total_num_tokens", "Maximum total number of tokens (the KV pool).", lab,
              registry=r).labels(model).set(kv_tokens)
        if role == "prefill":
            Gauge("pdfleet_queued_prompt_tokens", "Prompt tokens admitted whose compute has not started (0 "
                  "without a declared compute cost).", registry=r).set_function(
                lambda: prefill.queued_tokens(clock()) if prefill is not None else 0)
            if prefill is not None:
                r.register(_Busy(prefill, clock))

    async def prefill_prompt(self, tokens: int, arrived: float) -> None:
        """Wait for this prompt's turn and its compute (nothing without a declared cost); count it."""
        await self.recompute_prompt(tokens, arrived)
        self.requests.inc()
        self.ttft.observe(max(0.0, self.clock() - arrived))

    async def recompute_prompt(self, tokens: int, arrived: float) -> None:
        """The prompt's compute and its tokens counted, not the request (a decode without its KV connector
        computes the prompt itself, then generates: ``generate`` counts the request)."""
        if self.prefill is not None:
            _, end = self.prefill.admit(tokens, arrived)
            await asyncio.sleep(max(0.0, end - self.clock()))
        self.prompt_tokens.inc(tokens)

    async def generate(self, tokens: int, arrived: float, running: Callable[[], int],
                       hold: Callable[[int], None], finish_reason: str = "length") -> None:
        """Generate ``tokens`` at the batch's pace (``running()`` read at each stretch), holding their KV
        through ``hold(+n)`` until the last one (then ``hold(-tokens)``); count them and the request."""
        first, left, held = True, tokens, 0
        try:
            while left > 0:
                if self.decode is None:
                    n, seconds = left, 0.0
                else:
                    n, seconds = self.decode.chunk(left, running())
                hold(n)
                held += n
                await asyncio.sleep(seconds)
                per = seconds / n if n else 0.0
                if first:
                    self.ttft.observe(max(0.0, self.clock() - arrived - seconds + per))
                    first = False
                for _ in range(n if self.decode is not None else 0):
                    self.itl.observe(per)
                self.generation_tokens.inc(n)
                left -= n
            self.requests.inc(finish_reason)
        finally:
            hold(-held)
