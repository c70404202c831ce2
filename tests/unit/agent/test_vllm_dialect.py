"""The agent's vLLM dialect (pure parts): the load read from vLLM's gauges (a prefill's blocks still held count
as in flight), the canary's answer check, the dialect each engine kind and backend gets, and the options that
pick vLLM's ports. vLLM's own code reads the bodies in tests/vllm/test_vllm_agent_bodies.py."""

from __future__ import annotations

import pytest

from pdfleet_runtime.agent.dialect import SGLangDialect, VllmDialect, dialect_for
from pdfleet_runtime.agent.options import AgentOptions
from pdfleet_runtime.agent.vllm_engine import canary_request, check_vllm_answers, vllm_load
from pdfleet_runtime.engine_rules import vllm
from pdfleet_runtime.links import Backend
from pdfleet_runtime.pod.options import OptionsError
from tests.server.harness import config

LABELS = 'engine="0",model_name="m"'


def _metrics(running: float, waiting: float, usage: float | None) -> str:
    lines = [f"vllm:num_requests_running{{{LABELS}}} {running}", f"vllm:num_requests_waiting{{{LABELS}}} {waiting}"]
    if usage is not None:
        lines.append(f"vllm:kv_cache_usage_perc{{{LABELS}}} {usage}")
    return "\n".join(["# TYPE vllm:num_requests_running gauge", lines[0], "# TYPE vllm:num_requests_waiting gauge",
                      lines[1], *(["# TYPE vllm:kv_cache_usage_perc gauge", lines[2]] if usage is not None else [])]) + "\n"


def test_the_load_is_read_from_vllms_gauges_and_held_blocks_count_in_flight() -> None:
    assert vllm_load(_metrics(2, 1, 0.0)) == vllm_load(_metrics(2, 1, None))
    load = vllm_load(_metrics(0, 0, 0.25))
    assert (load.running, load.queued, load.inflight, load.idle) == (0, 0, 1, False)
    assert vllm_load(_metrics(0, 0, 0.0)).idle
    with pytest.raises(ValueError, match="no vllm:num_requests_waiting"):
        vllm_load(_metrics(0, 0, 0.0).replace("vllm:num_requests_waiting", "sglang:num_queue_reqs"))


def _answer(text: str = "abc", tokens: int = 3, **pdfleet: object) -> dict:
    out: dict = {"choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 9, "completion_tokens": tokens}}
    return {**out, "pdfleet": pdfleet} if pdfleet else out


def test_the_canary_answer_check_names_what_is_wrong() -> None:
    body = canary_request("m")
    ok = (200, {"kv_transfer_params": {"do_remote_prefill": True}})
    assert check_vllm_answers(body, ok, (200, _answer()), nixl=True) is None  # a real vLLM answer
    assert "no kv_transfer_params" in str(check_vllm_answers(body, (200, {}), (200, _answer()), nixl=True))
    assert check_vllm_answers(body, (200, {"kv_transfer_params": None}), (200, _answer()), nixl=False) is None
    assert "prefill pod answered 503" in str(check_vllm_answers(body, (503, "busy"), (0, ""), nixl=True))
    assert "engine answered 400" in str(check_vllm_answers(body, ok, (400, {"error": {}}), nixl=True))
    assert "outside OpenAI's completion shape" in str(check_vllm_answers(body, ok, (200, {"text": "x"}), nixl=True))
    assert "no completion" in str(check_vllm_answers(body, ok, (200, _answer(tokens=0)), nixl=True))
    recomputed = _answer(transferBytes=0, layoutBytes=100, recomputed=True, room=5)
    assert "moved 0 of 100 bytes" in str(check_vllm_answers(body, ok, (200, recomputed), nixl=True, room=5))
    short = _answer(transferBytes=60, layoutBytes=100, room=5, state="model")
    assert "moved 60 of 100" in str(check_vllm_answers(body, ok, (200, short), nixl=True, room=5))
    other_room = _answer(transferBytes=100, layoutBytes=100, room=6, state="model")
    assert "names room 5" in str(check_vllm_answers(body, ok, (200, other_room), nixl=True, room=5))
    model = _answer(transferBytes=100, layoutBytes=100, room=5, state="model")
    assert check_vllm_answers(body, ok, (200, model), nixl=True, room=5) is None
    seeded = _answer(text="not derived", transferBytes=100, layoutBytes=100, room=5, verified=True)
    assert "not the one the verified state derives" in str(check_vllm_answers(body, ok, (200, seeded), nixl=True,
                                                                               room=5))


def test_each_engine_kind_gets_its_dialect() -> None:
    assert dialect_for("sglang", Backend.MORI, "m") == SGLangDialect()
    assert dialect_for("vllm", Backend.NIXL, "m") == VllmDialect(served_model="m", nixl=True)
    assert dialect_for("vllm", Backend.MOONCAKE, "m") == VllmDialect(served_model="m", nixl=False)
    with pytest.raises(ValueError, match="NIXL and Mooncake connectors, not mori"):
        dialect_for("vllm", Backend.MORI, "m")
    with pytest.raises(ValueError, match="beside sglang or vllm"):
        dialect_for("trtllm", Backend.NIXL, "m")


def test_options_pick_vllms_ports_and_refuse_an_unknown_kind() -> None:
    cfg = config("decode", backend="nixl")
    opts = AgentOptions.build(cfg, {}, engine_version="0.33.0", engine_kind="vllm")
    assert (opts.engine_port, opts.engine_bootstrap_port) == (vllm.ENGINE_PORT, vllm.MOONCAKE_BOOTSTRAP_PORT)
    assert opts.engine_url == f"http://127.0.0.1:{vllm.ENGINE_PORT}" and opts.dialect.router == "vllm-router"
    assert AgentOptions.build(cfg, {}, engine_version="0.33.0", engine_kind="vllm",
                              engine_url="http://127.0.0.1:9").engine_url == "http://127.0.0.1:9"
    with pytest.raises(OptionsError, match="--engine-kind 'trtllm'"):
        AgentOptions.build(cfg, {}, engine_version="1", engine_kind="trtllm")
