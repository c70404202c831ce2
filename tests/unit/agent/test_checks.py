"""The agent's pure checks: config.json against the layout, /server_info and /metrics in SGLang 0.5.23's
shapes (``sglang_bodies``), the canary's answer check, and the readiness verdict's order."""

from __future__ import annotations

import copy

import pytest

from pdfleet_runtime.agent.canary import PrefillTarget, canary_body, check_answers
from pdfleet_runtime.agent.engine_info import engine_load, server_info_problems
from pdfleet_runtime.agent.model_config import config_for_layout, model_config_problems
from pdfleet_runtime.agent.readiness import AgentProblem, AgentReadiness
from pdfleet_runtime.engine_rules.sglang import MODEL_FAMILIES
from pdfleet_runtime.layouts import PRESETS, resolve_layout
from tests.unit.agent.sglang_bodies import IDLE_METRICS, METRICS, MODEL_INFO, SERVER_INFO


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_generated_config_agrees_with_its_layout(preset: str) -> None:
    fam = MODEL_FAMILIES.get(preset)
    cfg = config_for_layout(resolve_layout(preset), "A", "a", nested_text_config=bool(fam and fam.nested_text_config))
    assert model_config_problems(cfg, resolve_layout(preset)) == []


def test_each_contradicting_field_is_named() -> None:
    lay = resolve_layout("qwen3-next-hybrid")
    cfg = config_for_layout(lay, "Qwen3NextForCausalLM", "qwen3_next")
    cfg.update(num_key_value_heads=7, linear_num_value_heads=3)
    problems = model_config_problems(cfg, lay)
    assert len(problems) == 2
    assert "num_key_value_heads = 7, the layout declares 2 (kvHeads)" in problems[0]
    assert "linear_num_value_heads = 3" in problems[1] and "linearAttention.numValueHeads" in problems[1]


def test_another_model_is_refused_for_layers_types_and_states() -> None:
    hybrid = resolve_layout("qwen3-next-hybrid")
    dense = config_for_layout(resolve_layout("llama-dense"), "LlamaForCausalLM", "llama")
    text = "\n".join(model_config_problems(dense, hybrid))
    assert "num_hidden_layers" in text and "layer_types differ" in text
    assert "implies state types ['kv'], the layout declares ['kv', 'mamba']" in text


def test_qwen3_next_interval_form_is_read_without_layer_types() -> None:
    lay = resolve_layout("qwen3-next-hybrid")
    cfg = config_for_layout(lay, "Qwen3NextForCausalLM", "qwen3_next")
    del cfg["layer_types"]
    assert model_config_problems(cfg, lay) == []
    cfg["full_attention_interval"] = 2
    assert any("layer_types differ" in p for p in model_config_problems(cfg, lay))


def test_server_info_of_sglang_passes_and_each_mismatch_is_named() -> None:
    assert server_info_problems(SERVER_INFO, version="0.5.23", served_model="llama-test", role="decode") == []
    other = copy.deepcopy(SERVER_INFO) | {"version": "0.5.22", "served_model_name": "other"}
    problems = server_info_problems(other, version="0.5.23", served_model="llama-test", role="prefill")
    assert [p.split(" ")[3] for p in problems] == ["version", "model", "disaggregation_mode"]
    assert "'0.5.22'" in problems[0] and "spec.engine.version" in problems[0]
    # /model_info carries the same identity (the router registers workers with it)
    assert MODEL_INFO["served_model_name"] == SERVER_INFO["served_model_name"]


def test_load_sums_schedulers_and_leaves_priority_breakdowns_out() -> None:
    load = engine_load(METRICS)
    assert (load.running, load.queued, load.inflight) == (3, 3, 4)
    assert not load.idle and engine_load(IDLE_METRICS).idle
    with pytest.raises(ValueError, match="--enable-metrics"):
        engine_load("# TYPE sglang:token_usage gauge\nsglang:token_usage 0.1\n")


def _generate_answer(n: int = 4) -> dict:
    # python/sglang/srt/managers/tokenizer_manager.py: a /generate answer (text, output_ids, meta_info)
    return {"text": " a b c d", "output_ids": list(range(n)),
            "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 12,
                          "completion_tokens": n, "cached_tokens": 0, "e2e_latency": 0.1}}


def test_canary_answers_are_checked_in_sglangs_shape() -> None:
    body = canary_body(PrefillTarget("10.0.0.5", 30000, 8998), 42)
    assert body["bootstrap_host"] == "10.0.0.5" and body["bootstrap_port"] == 8998 and body["bootstrap_room"] == 42
    prefill_ok = (200, {"text": "", "meta_info": {}})
    assert check_answers(body, prefill_ok, (200, _generate_answer())) is None
    assert "prefill pod answered 500" in str(check_answers(body, (500, "boom"), (200, _generate_answer())))
    assert "no completion" in str(check_answers(body, prefill_ok, (200, _generate_answer(0))))
    assert "outside SGLang's /generate shape" in str(check_answers(body, prefill_ok, (200, {"ok": True})))
    # the built-in runtime standing in: its completion is derived again from the verified state
    stand_in = _generate_answer() | {"pdfleet": {"verified": True, "room": 42, "transferBytes": 1024}}
    assert "is not the one the verified state" in str(check_answers(body, prefill_ok, (200, stand_in)))


def test_the_verdict_order() -> None:
    r = AgentReadiness("decode")
    assert r.verdict().problem is AgentProblem.STARTING
    r.engine_health(True)
    r.engine_problems = ["the engine reports version '0.5.22'"]
    assert r.verdict().problem is AgentProblem.ENGINE_MISMATCH and "0.5.22" in r.verdict().reason
    r.engine_problems = []
    assert r.verdict().problem is AgentProblem.WAITING
    r.canary(True, "room 1 via prefill pod p")
    assert r.verdict().ready and r.verdict().problem is AgentProblem.NONE
    for _ in range(2):
        r.canary(False, "answered 502")
    assert r.verdict().ready  # re-checked: failures_not_ready (3) in a row take it out
    r.canary(False, "answered 502")
    assert r.verdict().problem is AgentProblem.CANARY_FAILED
    r.engine_health(False, "the engine's /health answered 503")
    assert r.verdict().problem is AgentProblem.ENGINE_DOWN
    r.draining = True
    assert r.verdict().problem is AgentProblem.DRAINING
    prefill = AgentReadiness("prefill")
    prefill.engine_health(True)
    assert prefill.verdict().ready and prefill.verdict().problem is AgentProblem.ENGINE_VERIFIED


def test_a_group_members_agent_is_ready_on_its_engines_health_alone() -> None:
    """SGLang's node ranks >= 1 serve /health only; the leader's checks and canary prove the replica."""
    r = AgentReadiness("decode", group_member=1)
    assert r.verdict().problem is AgentProblem.STARTING
    r.engine_health(True)
    v = r.verdict()
    assert v.ready and v.problem is AgentProblem.GROUP_MEMBER and "node rank 1" in v.reason
    r.draining = True
    assert not r.verdict().ready
    leader = AgentReadiness("decode")
    leader.engine_health(True)
    assert leader.verdict().problem is AgentProblem.WAITING  # the leader still needs its canary


def test_the_member_env_must_fit_the_roles_groups() -> None:
    from pdfleet_runtime.agent.options import AgentOptions
    from pdfleet_runtime.config import GroupConfig
    from pdfleet_runtime.pod.options import OptionsError
    from tests.server.harness import config

    cfg = config("decode", tp=2)
    with pytest.raises(OptionsError, match="PDFLEET_GROUP_MEMBER='1'"):
        AgentOptions.build(cfg, {"PDFLEET_GROUP_MEMBER": "1"}, engine_version="0.5.23")
    grouped = cfg.model_copy(update={"group": GroupConfig(nodes=2, service="d-decode-group",
                                                          secret_path="/var/run/pdfleet/group-auth/key")})
    assert AgentOptions.build(grouped, {"PDFLEET_GROUP_MEMBER": "1"}, engine_version="0.5.23").group_member == 1
    with pytest.raises(OptionsError):
        AgentOptions.build(grouped, {"PDFLEET_GROUP_MEMBER": "2"}, engine_version="0.5.23")
