"""Token parity for Qwen4-Exp (``qwen4_exp_text``) in transformers' form: KV, raw per-token index keys,
request-wide index positions, GDN conv and recurrent state, PLE conv and n-gram ids per PLE layer, all carried
through pdfleet's pools and planner, PD against transformers' own greedy generate. Removing any one of the new
state kinds from what the decode rebuilds changes the tokens (each kind matters)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pdfleet_runtime.layouts import StateType
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.verify.model_parity import load_runner, run_model_parity
from pdfleet_runtime.verify.model_results import FP32_LOGIT_BOUND, ModelParityConfig
from tests.verify.tiny_models import QWEN4, make_model

PROMPTS = ((5, 17, 99, 3, 44, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 1, 2), (1, 2, 3))
NEW_TOKENS = 8
PAIRS = {"tp1-tp1": (S(1), S(1)), "tp1-tp2": (S(1), S(2)), "tp2-tp1": (S(2), S(1)), "tp2-tp4": (S(2), S(4)),
         "pp2-pp1": (S(1, 2), S(1)), "tp2pp2-tp1": (S(2, 2), S(1))}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, with every all-zero weight redrawn (Qwen4-Exp initialises its PLE short conv to zero,
    which would make that state invisible to a token check; shared/realmodel.md)."""
    import torch
    from transformers import AutoModelForCausalLM

    d = make_model(QWEN4, tmp_path_factory.mktemp("models") / QWEN4)
    m = AutoModelForCausalLM.from_pretrained(d)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1 and not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    m.save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def runner(model: Path) -> object:
    return load_runner(ModelParityConfig(model, (), 1, S(1), S(1)))


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
def test_qwen4_exp_pd_is_token_exact(pair: str, model: Path, runner: object) -> None:
    p, d = PAIRS[pair]
    res = run_model_parity(ModelParityConfig(model, PROMPTS, NEW_TOKENS, p, d), runner)
    assert res.rejection is None and res.ok, res.failures()
    assert res.max_logit_diff <= FP32_LOGIT_BOUND
    states = set().union(*(c.bytes_by_state for c in res.cases))
    assert states == {"kv", "mamba", "index_k", "positions", "ple_short_conv", "ple_ngram"}


@pytest.mark.slow
@pytest.mark.parametrize("dropped", [StateType.INDEX_K, StateType.POSITIONS, StateType.PLE_SHORT_CONV,
                                     StateType.PLE_NGRAM])
def test_each_new_state_kind_matters(dropped: StateType, model: Path, runner: object,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode rebuilds its cache without one kind (zeroed): some case's tokens or logits differ."""
    import torch

    from pdfleet_runtime.rank import cache_pools

    real = cache_pools.cache_from_state

    def without(state, config, layout):  # type: ignore[no-untyped-def]
        state.extra = {k: (torch.zeros_like(v) if k[0] is dropped else v) for k, v in state.extra.items()}
        return real(state, config, layout)

    monkeypatch.setattr(cache_pools, "cache_from_state", without)
    import pdfleet_runtime.rank.model_runner as mr

    monkeypatch.setattr(mr, "cache_from_state", without)
    res = run_model_parity(ModelParityConfig(model, PROMPTS, NEW_TOKENS, S(1), S(1)), runner)
    assert not res.ok, f"zeroing {dropped.value} changed nothing"
