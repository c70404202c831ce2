"""The seeded mode's declared compute cost: prefill as a FIFO server over prompt tokens (queue, busy
time), decode steps that grow with the batch, the start-up delay, where the cost comes from, and the
load metrics it makes, read back through the operator's metric table (SGLang's names)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdfleet_operator.autoscale.sources import Key, parse_sample
from pdfleet_runtime.config import ComputeCost
from pdfleet_runtime.pod.compute_cost import (
    COMPUTE_COST_ENV,
    DecodeCompute,
    PrefillCompute,
    cost_from,
    decode_compute,
    prefill_compute,
    warming,
)
from pdfleet_runtime.pod.seeded_load import LoadMetrics


def test_prefill_is_one_fifo_server_over_prompt_tokens() -> None:
    p = PrefillCompute(0.001)  # 1 ms per token
    assert p.admit(1000, now=0.0) == (0.0, 1.0)
    assert p.admit(500, now=0.2) == (1.0, 1.5)  # waits behind the first
    assert p.admit(2000, now=0.3) == (1.5, 3.5)
    assert p.queued_tokens(0.5) == 2500  # the two not started
    assert p.queued_tokens(1.2) == 2000
    assert p.busy_seconds(1.2) == pytest.approx(1.2)
    assert p.admit(100, now=10.0) == (10.0, 10.1)  # an idle server starts at once
    assert p.busy_seconds(10.05) == pytest.approx(3.5 + 0.05)
    assert p.queued_tokens(20.0) == 0


def test_decode_steps_grow_with_the_batch_and_stretches_reread_it() -> None:
    d = DecodeCompute(0.01, 0.001)
    assert d.step_seconds(1) == pytest.approx(0.011) and d.step_seconds(40) == pytest.approx(0.05)
    n, s = d.chunk(100, running=40, max_chunk_s=0.25)
    assert n == 5 and s == pytest.approx(0.25)  # at most a quarter second before the batch is read again
    assert d.chunk(3, running=1) == (3, pytest.approx(0.033))
    assert d.chunk(0, running=1) == (0, 0.0)


def test_the_cost_comes_from_the_config_or_the_environment() -> None:
    declared = ComputeCost(prefill_seconds_per_prompt_token=0.001)
    assert cost_from(declared, {COMPUTE_COST_ENV: '{"startupSeconds": 9}'}) == declared  # the config wins
    env = cost_from(None, {COMPUTE_COST_ENV: '{"prefillSecondsPerPromptToken": 0.0002, "decodeSecondsPerToken": '
                                             '0.02, "decodeSecondsPerRunningRequest": 0.001, "startupSeconds": 20}'})
    assert env is not None and env.startup_seconds == 20 and env.decode_seconds_per_token == 0.02
    assert cost_from(None, {}) is None and cost_from(ComputeCost(), {}) is None  # zero costs nothing
    with pytest.raises(ValueError, match=COMPUTE_COST_ENV):
        cost_from(None, {COMPUTE_COST_ENV: '{"prefillSecondsPerPromptToken": -1}'})
    assert prefill_compute(None) is None and decode_compute(None) is None


def test_the_declared_start_up_keeps_the_pod_not_ready() -> None:
    from pdfleet_runtime.pod.readiness import Problem, Readiness

    cost = ComputeCost(startup_seconds=30)
    assert "30s" in warming(cost, 0.0) and warming(cost, 30.0) == "" and warming(None, 0.0) == ""
    r = Readiness("prefill", 0.0, ranks_total=1, ranks_up=1, bootstrap_registered=1, canaries_served=1)
    assert r.verdict().ready
    r.warming = lambda: warming(cost, 10.0)
    v = r.verdict()
    assert not v.ready and v.problem is Problem.STARTING and "20s of 30s left" in v.reason


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_load_metrics_are_read_by_the_operators_table(monkeypatch) -> None:
    clock = Clock()
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)
        clock.t += s

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    reg = CollectorRegistry()
    prefill = PrefillCompute(0.001)
    m = LoadMetrics(reg, "m", "prefill", 1000, prefill, clock=clock)
    asyncio.run(m.prefill_prompt(1000, arrived=0.0))
    assert slept == [1.0]
    prefill.admit(700, now=clock.t + 5)  # queued behind nothing yet, but not started at the scrape
    s = parse_sample(generate_latest(reg).decode())
    assert s.values[Key.PROMPT_TOKENS] == 1000 and s.values[Key.REQUESTS_FINISHED] == 1
    assert s.values[Key.PREFILL_BUSY_SECONDS] == pytest.approx(1.0)
    assert s.values[Key.QUEUED_PROMPT_TOKENS] == 700
    assert s.values[Key.KV_CAPACITY_TOKENS] == 1000
    assert s.histograms[Key.TTFT]  # the prompt's wait and compute

    dreg, held = CollectorRegistry(), []
    d = LoadMetrics(dreg, "m", "decode", 5000, decode=DecodeCompute(0.01, 0.0), clock=clock)
    asyncio.run(d.generate(30, arrived=clock.t, running=lambda: 1, hold=held.append))
    assert sum(held) == 0 and max(held) > 0  # generated tokens held KV until the last one
    s = parse_sample(generate_latest(dreg).decode())
    assert s.values[Key.REQUESTS_FINISHED] == 1
    itl = s.histograms[Key.ITL]
    assert itl[-1][1] == 30  # one observation per token
    assert Key.QUEUED_PROMPT_TOKENS not in s.values  # a prefill pod's gauge only
