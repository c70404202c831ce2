"""``pdfleet-runtime agent --engine-kind vllm`` against real ``serve`` processes STANDING IN for vLLM 0.33 (which
needs GPUs): a prefill and a decode started with ``--stand-in-for vllm==0.33.0`` speak vLLM's PD worker contract
(``kv_transfer_params``), ``/version``, ``/v1/models`` and vLLM's metric names, and the agent beside them reads
those and sends its canary as vllm-router sends a request (issue 44: the agent beside a vLLM engine).

Covers: ready only through a canary over NIXL's two steps and over Mooncake's one (the prefill's bytes counted);
the version and the served model refused with the field named; a decode whose engine recomputes instead of
pulling fails its canary (the agent does not pass a vLLM decode started without its KV connector); a prefill's
drain waits on vLLM's own gauges while a finished request's state waits for its decode.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfleet_runtime.agent.vllm_engine import NIXL_STEP_ONE, vllm_load
from tests.server.harness import LAYOUT, http
from tests.server.test_agent import Agent, _model_dir, _text
from tests.server.test_worker_api import MODEL, Pair

pytestmark = pytest.mark.slow

STAND_IN = ("--stand-in-for", "vllm==0.33.0")
VLLM = ("--engine-kind", "vllm", "--engine-version", "0.33.0")


def _pair(tmp: Path, backend: str, *decode_args: str) -> Pair:
    return Pair(tmp, backend, prefill_args=STAND_IN, decode_args=(*STAND_IN, "--canary-period", "3600",
                                                                   *decode_args))


@pytest.fixture(scope="module")
def nixl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One NIXL pair for the tests that need no other (each pair costs two serve processes' start)."""
    pair = _pair(tmp_path_factory.mktemp("nixl"), "nixl").ready()
    try:
        yield pair
    finally:
        pair.stop()


def _moved(pair: Pair) -> float:
    return sum(v for k, v in pair.prefill.metrics().items() if k.startswith("pdfleet_room_transfer_bytes_total"))


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_vllm_decode_is_ready_only_through_a_canary_as_vllm_router_sends_it(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    pair = request.getfixturevalue("nixl") if backend == "nixl" else _pair(tmp_path, backend).ready()
    model = _model_dir(tmp_path, "model", LAYOUT)
    try:
        code, version = http("GET", pair.decode.url + "/version", None, 5)
        assert code == 200 and version == {"version": "0.33.0"}
        lonely = Agent(tmp_path, "agent-alone", pair.decode.cfg, pair.decode, None, model, *VLLM)
        try:
            body = lonely.wait_for("NoPeerFound")
            assert body["engineUp"] is True and not body["engineProblems"], body
        finally:
            lonely.stop()
        before = _moved(pair)
        agent = Agent(tmp_path, "agent", pair.decode.cfg, pair.decode, pair.prefill, model, *VLLM)
        try:
            body = agent.wait_for("TransferPathVerified")
            tag = "NIXL" if backend == "nixl" else "Mooncake"
            assert body["ready"] is True and f"canary as vllm-router sends it: {tag} request" in body["reason"], body
            assert 'pdfleet_agent_canaries_total{outcome="success"}' in _text(agent.url + "/metrics")
            deadline = time.monotonic() + 10
            while _moved(pair) <= before:  # the canary's state crossed the prefill's path
                assert time.monotonic() < deadline, "the prefill moved no bytes for the canary"
                time.sleep(0.2)
        finally:
            agent.stop()
    finally:
        if backend != "nixl":
            pair.stop()


def test_the_declared_version_and_served_model_are_checked_against_vllms_answers(tmp_path: Path, nixl: Pair) -> None:
    pair = nixl
    model = _model_dir(tmp_path, "model", LAYOUT)
    other = pair.decode.cfg.model_copy(update={"served_model_name": "another-model"})
    agents = [Agent(tmp_path, "agent-version", pair.decode.cfg, pair.decode, pair.prefill, model,
                    "--engine-kind", "vllm", "--engine-version", "0.33.1"),
              Agent(tmp_path, "agent-model", other, pair.decode, pair.prefill, model, *VLLM)]
    try:
        assert "version '0.33.0', the deployment declares '0.33.1'" in agents[0].wait_for("EngineMismatch")["reason"]
        said = agents[1].wait_for("EngineMismatch")["reason"]
        assert f"serves models ['{MODEL}'], the deployment declares 'another-model'" in said
        assert all(not a.readyz().get("ready") for a in agents)
    finally:
        for a in agents:
            a.stop()


def test_a_decode_that_recomputes_fails_its_canary(tmp_path: Path) -> None:
    pair = _pair(tmp_path, "nixl", "--kv-connector", "none").ready()
    agent = Agent(tmp_path, "agent", pair.decode.cfg, pair.decode, pair.prefill, _model_dir(tmp_path, "m", LAYOUT),
                  *VLLM)
    try:
        body = agent.wait_for("CanaryFailed")
        assert "the stand-in moved 0 of" in body["reason"] and "(recomputed: True)" in body["reason"], body
        assert body["ready"] is False
    finally:
        agent.stop()
        pair.stop()


def test_a_prefill_drain_waits_on_vllms_gauges_for_state_no_decode_read_yet(tmp_path: Path, nixl: Pair) -> None:
    pair = nixl  # its prefill holds an unclaimed request 2 s (--room-ttl)
    agent = Agent(tmp_path, "agent-prefill", pair.prefill.cfg, pair.prefill, None, _model_dir(tmp_path, "m", LAYOUT),
                  *VLLM, "--router-drop-seconds", "0.2")
    try:
        agent.wait_for("EngineVerified")
        code, first = http("POST", pair.prefill.url + "/v1/completions",
                           {"model": MODEL, "prompt": "state no decode claims", "max_tokens": 1, "stream": False,
                            "kv_transfer_params": NIXL_STEP_ONE}, 30)
        assert code == 200 and first["kv_transfer_params"]["do_remote_prefill"] is True, first
        held = vllm_load(_text(pair.prefill.url + "/metrics"))
        assert held.queued + held.inflight >= 1, held  # vLLM's names report the held request
        t0 = time.monotonic()
        code, body = http("POST", f"http://127.0.0.1:{agent.cfg.admin_port}/drain?wait=true", None, 60)
        waited = time.monotonic() - t0
        assert code == 200 and body["drained"] is True and body["forced"] is False, body
        assert body["engine"] == {"running": 0, "queued": 0, "inflight": 0}, body
        assert waited >= 1.0, f"the drain ended after {waited:.2f}s, before the held request expired"
    finally:
        agent.stop()
