"""The seeded mode's declared compute cost, as queues (pure: times are arguments, nothing sleeps here).

The built-in runtime moves real state but computes nothing; with a ``ComputeCost`` (``config``) its
pods take the time an engine would, so load makes the signals an autoscaler reads move as they do on
an engine, on a machine that cannot run one:

* prefill (``PrefillCompute``): one prompt at a time, first come first served, ``tokens x
  prefill_seconds_per_prompt_token`` each: prompts queue behind the ones before them, so TTFT grows
  with the backlog, and the queued prompt tokens and the busy seconds are what the pod reports;
* decode (``DecodeCompute``): every running request advances one token per step, and a step takes
  ``decode_seconds_per_token + decode_seconds_per_running_request x running``: ITL grows with the
  batch; a request holds its KV tokens (prompt and generated) until its last token;
* start-up (``warming``): the pod reports not Ready for ``startup_seconds`` after it starts.

The pod server applies them (its worker API sleeps the times these give); docs/runtime-server.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from pdfleet_runtime.config import ComputeCost

__all__ = ["COMPUTE_COST_ENV", "MAX_CHUNK_S", "DecodeCompute", "PrefillCompute", "cost_from", "decode_compute",
           "prefill_compute", "warming"]

COMPUTE_COST_ENV = "PDFLEET_COMPUTE_COST"
MAX_CHUNK_S = 0.25
"""A decode request re-reads the batch size at least this often (its step time follows it)."""


def cost_from(configured: ComputeCost | None, environ: Mapping[str, str]) -> ComputeCost | None:
    """The cost in effect: the config's, else ``PDFLEET_COMPUTE_COST`` (JSON, camelCase or snake_case);
    None when neither declares one or it costs nothing. A malformed variable raises ``ValueError``."""
    cost = configured
    if cost is None and (raw := environ.get(COMPUTE_COST_ENV, "").strip()):
        try:
            cost = ComputeCost.model_validate(json.loads(raw))
        except (json.JSONDecodeError, ValidationError) as exc:
            raise ValueError(f"{COMPUTE_COST_ENV} is not a compute cost: {exc}") from exc
    if cost is None or not any(cost.model_dump().values()):
        return None
    return cost


def warming(cost: ComputeCost | None, elapsed_s: float) -> str:
    """Why the pod is not Ready yet for its declared start-up ('' once it is over)."""
    if cost is None or elapsed_s >= cost.startup_seconds:
        return ""
    return f"declared start-up: {cost.startup_seconds - elapsed_s:.0f}s of {cost.startup_seconds:g}s left"


@dataclass
class PrefillCompute:
    """One prefill pod's compute: a FIFO single server over prompt tokens."""

    seconds_per_token: float
    free_at: float = 0.0  # when the last admitted prompt finishes
    _slots: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, tokens), admitted order
    _done_busy: float = 0.0  # busy seconds of slots already finished and forgotten

    def admit(self, tokens: int, now: float) -> tuple[float, float]:
        """A prompt arriving at ``now``: (when its compute starts, when it ends)."""
        start = max(now, self.free_at)
        end = start + tokens * self.seconds_per_token
        self.free_at = end
        self._slots.append((start, end, tokens))
        return start, end

    def _prune(self, now: float) -> None:
        while self._slots and self._slots[0][1] <= now:
            s, e, _ = self._slots.pop(0)
            self._done_busy += e - s

    def queued_tokens(self, now: float) -> int:
        """Prompt tokens admitted whose compute has not started."""
        self._prune(now)
        return sum(t for s, _, t in self._slots if s > now)

    def busy_seconds(self, now: float) -> float:
        """Seconds spent computing up to ``now`` (a counter: the measured prefill rate is tokens / this)."""
        self._prune(now)
        return self._done_busy + sum(max(0.0, min(e, now) - s) for s, e, _ in self._slots if s < now)


@dataclass
class DecodeCompute:
    """One decode pod's generation: the step time follows the batch."""

    seconds_per_token: float
    seconds_per_running_request: float

    def step_seconds(self, running: int) -> float:
        return self.seconds_per_token + self.seconds_per_running_request * max(1, running)

    def chunk(self, remaining: int, running: int, max_chunk_s: float = MAX_CHUNK_S) -> tuple[int, float]:
        """(tokens, seconds) of the next stretch of a request with ``remaining`` tokens to generate while
        ``running`` requests run: at least one token, at most ``max_chunk_s`` of steps (then the batch is
        read again)."""
        step = self.step_seconds(running)
        if remaining <= 0:
            return 0, 0.0
        n = max(1, min(remaining, math.floor(max_chunk_s / step) if step > 0 else remaining))
        return n, n * step


def prefill_compute(cost: ComputeCost | None) -> PrefillCompute | None:
    return PrefillCompute(cost.prefill_seconds_per_prompt_token) if cost is not None else None


def decode_compute(cost: ComputeCost | None) -> DecodeCompute | None:
    if cost is None:
        return None
    return DecodeCompute(cost.decode_seconds_per_token, cost.decode_seconds_per_running_request)
