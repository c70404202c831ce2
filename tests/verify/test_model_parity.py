"""Token parity in one process: tiny real models of every family, PD (pools, planner, copies) against
transformers' own greedy generate, over every TP pairing the heads allow and PP; the negative controls fail.

The multi-process runs through Mooncake and NIXL are in test_model_engines.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pdfleet_runtime.model.state import ModelFault
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.verify.model_parity import load_runner, run_model_parity
from pdfleet_runtime.verify.model_results import FP32_LOGIT_BOUND, ModelParityConfig
from tests.verify.tiny_models import FAMILIES, make_model

PROMPTS = ((5, 17, 99, 3, 44, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 1, 2), (1, 2, 3))
NEW_TOKENS = 8
PAIRS = {  # prefill -> decode
    "tp1-tp1": (S(1), S(1)), "tp1-tp2": (S(1), S(2)), "tp2-tp1": (S(2), S(1)), "tp2-tp4": (S(2), S(4)),
    "tp4-tp2": (S(4), S(2)), "tp4-tp4": (S(4), S(4)), "pp2-pp1": (S(1, 2), S(1)), "pp2-pp2": (S(1, 2), S(1, 2)),
    "tp2pp2-tp1": (S(2, 2), S(1)), "pp2-tp2": (S(1, 2), S(2)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def runners(models: dict[str, Path]) -> dict[str, object]:
    return {f: load_runner(ModelParityConfig(d, (), 1, S(1), S(1))) for f, d in models.items()}


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("family", FAMILIES)
def test_pd_is_token_exact_in_process(family: str, pair: str, models: dict[str, Path], runners: dict) -> None:
    p, d = PAIRS[pair]
    res = run_model_parity(ModelParityConfig(models[family], PROMPTS, NEW_TOKENS, p, d), runners[family])
    assert res.rejection is None and res.ok, res.failures()
    assert [len(c.tokens) for c in res.cases] == [NEW_TOKENS] * len(PROMPTS)
    assert res.max_logit_diff <= FP32_LOGIT_BOUND
    assert all(c.bytes_moved > 0 for c in res.cases)
    states = set().union(*(c.bytes_by_state for c in res.cases))
    assert states == ({"kv", "mamba"} if family.startswith("qwen3") else {"kv"})


GDN_FAULTS = [(ModelFault.KV_ONLY, "tp1-tp1"), (ModelFault.GDN_SLOT_ZEROED, "tp1-tp1"),
              (ModelFault.CONV_SHIFTED, "tp2-tp1"), (ModelFault.CONV_UNGROUPED, "tp1-tp2"),
              (ModelFault.CONV_UNGROUPED, "tp4-tp2"), (ModelFault.FIRST_TOKEN_LOST, "tp1-tp1")]


@pytest.mark.parametrize(("fault", "pair"), GDN_FAULTS)
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_every_negative_control_fails_naming_the_case(family: str, fault: ModelFault, pair: str,
                                                      models: dict[str, Path], runners: dict) -> None:
    p, d = PAIRS[pair]
    res = run_model_parity(ModelParityConfig(models[family], PROMPTS, NEW_TOKENS, p, d, fault=fault),
                           runners[family])
    assert res.rejection is None and not res.ok
    failures = res.failures()
    assert failures and all(f.startswith("case case") for f in failures), failures
    if fault is ModelFault.FIRST_TOKEN_LOST:
        assert all("no first token" in f for f in failures)
    else:
        assert all("differs" in f or "logit diff" in f for f in failures), failures
        assert any("differs" in f for f in failures), failures  # the token check itself sees it


def test_ungrouped_conv_is_invisible_at_equal_tp(models: dict[str, Path], runners: dict) -> None:
    """Why the ungrouped-conv control runs across TP sizes: at equal TP whole items move, groups or not."""
    res = run_model_parity(ModelParityConfig(models["qwen3_next"], PROMPTS, NEW_TOKENS, S(2), S(2),
                                             fault=ModelFault.CONV_UNGROUPED), runners["qwen3_next"])
    assert res.ok, res.failures()


def test_without_weights_the_model_is_drawn_from_the_seed(tmp_path: Path) -> None:
    d = make_model("llama", tmp_path / "bare", weights=False)
    cfg = ModelParityConfig(d, PROMPTS, 4, S(2), S(1), init_seed=3, init_range=0.3)
    a, b = load_runner(cfg), load_runner(cfg)
    assert run_model_parity(cfg, a).ok
    assert a.generate(PROMPTS[0], 4).tokens == b.generate(PROMPTS[0], 4).tokens  # the same seed, the same model


def test_cli_json_has_one_list_under_tokens(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from pdfleet_runtime.cli import main

    args = ["parity", "--model", str(models["deepseek_v3"]), "--prefill", "tp=2", "--decode", "tp=4",
            "--prompt-ids", "5,17,99", "--max-new-tokens", "5", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["model_type"] == "deepseek_v3" and out["max_logit_diff"] <= FP32_LOGIT_BOUND
    (case,) = out["cases"]
    assert len(case["tokens"]) == 5 and case["tokens"] == case["aggregate_ids"]

    def token_lists(obj: object, key: str = "") -> list[str]:
        if isinstance(obj, dict):
            return [p for k, v in obj.items() for p in token_lists(v, k)]
        if isinstance(obj, list):
            return ([key] if key == "tokens" else []) + [p for v in obj for p in token_lists(v)]
        return []

    assert token_lists(out) == ["tokens"]
    assert main([*args[:-1], "--fault", "kv-only"]) == 2  # a state control needs GDN state: refused, named
    assert "needs linear-attention state" in capsys.readouterr().err
    assert main(["parity", "--model", str(models["qwen3_next"]), "--prefill", "tp=1", "--decode", "tp=1",
                 "--fault", "first-token-lost", "--max-new-tokens", "3"]) == 1
    assert "no first token" in capsys.readouterr().out
