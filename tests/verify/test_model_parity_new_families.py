"""Token parity for the families whose transformers forms came with issue 43: DeepSeek-V3.2 (MLA plus raw
per-token DSA index keys, replicated on every rank), NemotronH (Mamba2: conv channels x|B|C with B and C
replicated when TP exceeds n_groups, SSM state, MLP-only layers holding nothing) and Mistral (a sliding window
of window-1 tokens in SWA pages that follow token positions). PD against transformers'
greedy generate over TP and PP pairings; the index keys matter, and a wrong x|B|C split fails the case."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pdfleet_runtime.layouts import StateType
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.verify.model_parity import load_runner, run_model_parity
from pdfleet_runtime.verify.model_results import FP32_LOGIT_BOUND, ModelParityConfig
from tests.verify.tiny_models import make_model

PROMPTS = ((5, 17, 99, 3, 44, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 1, 2), (1, 2, 3))
NEW_TOKENS = 8
PAIRS = {"tp1-tp1": (S(1), S(1)), "tp1-tp2": (S(1), S(2)), "tp2-tp1": (S(2), S(1)), "tp2-tp4": (S(2), S(4)),
         "tp4-tp1": (S(4), S(1)), "pp2-pp1": (S(1, 2), S(1))}
FAMILIES = ("deepseek_v32", "nemotron_h", "mistral")
STATES = {"deepseek_v32": {"kv", "index_k"}, "nemotron_h": {"kv", "mamba"}, "mistral": {"swa"}}
LONG = (*PROMPTS, tuple(range(3, 40)))  # 37 tokens: Mistral's 8-token window slides over several pages


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def runners(models: dict[str, Path]) -> dict[str, object]:
    return {f: load_runner(ModelParityConfig(d, (), 1, S(1), S(1))) for f, d in models.items()}


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("family", FAMILIES)
def test_pd_is_token_exact(family: str, pair: str, models: dict[str, Path], runners: dict) -> None:
    p, d = PAIRS[pair]
    res = run_model_parity(ModelParityConfig(models[family], LONG, NEW_TOKENS, p, d), runners[family])
    assert res.rejection is None and res.ok, res.failures()
    assert res.max_logit_diff <= FP32_LOGIT_BOUND
    assert set().union(*(c.bytes_by_state for c in res.cases)) == STATES[family]


@pytest.mark.slow
def test_dsa_index_keys_matter(models: dict[str, Path], runners: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import pdfleet_runtime.rank.model_runner as mr

    real = mr.cache_from_state

    def zeroed(state, config, layout):  # type: ignore[no-untyped-def]
        state.extra = {k: torch.zeros_like(v) if k[0] is StateType.INDEX_K else v for k, v in state.extra.items()}
        return real(state, config, layout)

    monkeypatch.setattr(mr, "cache_from_state", zeroed)
    res = run_model_parity(ModelParityConfig(models["deepseek_v32"], PROMPTS, NEW_TOKENS, S(1), S(1)),
                           runners["deepseek_v32"])
    assert not res.ok


@pytest.mark.slow
def test_mutation_xbc_split_as_if_sharded(models: dict[str, Path], runners: dict,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's gather cuts the conv state as if B and C (1 group) were sharded at TP 2: a token differs
    (measured: token 1 of the long prompt, the short one's logits by 2.9)."""
    import dataclasses

    from pdfleet_runtime.rank import cache_pools

    real = cache_pools._group_slices

    def as_sharded(spec, tp, rank):  # type: ignore[no-untyped-def]
        return real(dataclasses.replace(spec, group_heads=None), tp, rank)

    monkeypatch.setattr(cache_pools, "_group_slices", as_sharded)
    res = run_model_parity(ModelParityConfig(models["nemotron_h"], PROMPTS, NEW_TOKENS, S(1), S(2)),
                           runners["nemotron_h"])
    assert not res.ok, "a wrong x|B|C split went unnoticed"


@pytest.mark.slow
def test_mutation_window_one_token_late(models: dict[str, Path], runners: dict,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill writes its sliding window one token late in the SWA pages: a token differs."""
    import torch

    from pdfleet_runtime.layouts import StateType
    from pdfleet_runtime.rank import cache_pools

    real = cache_pools._shard

    def late(full, spec, layout, tp, rank, pages, length=0):  # type: ignore[no-untyped-def]
        out = real(full, spec, layout, tp, rank, pages, length)
        if spec.state_type is not StateType.SWA:
            return out
        n, hpr, ps, d = out.shape
        rows = torch.roll(out.transpose(0, 1).reshape(hpr, n * ps, d), 1, dims=1)
        return rows.view(hpr, n, ps, d).transpose(0, 1)

    monkeypatch.setattr(cache_pools, "_shard", late)
    res = run_model_parity(ModelParityConfig(models["mistral"], LONG, NEW_TOKENS, S(1), S(1)), runners["mistral"])
    assert not res.ok
