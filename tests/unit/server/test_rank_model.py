"""A prefill rank as a reference engine, in one process: ``ModelSource`` computes a prompt, writes this rank's
share into its pools and keeps the first token; a seeded rank refuses a prompt; decode's ``generate`` gathers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.model.state import ModelFault
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.messages import PromptFill
from pdfleet_runtime.protocol.prefill import SyntheticError
from pdfleet_runtime.protocol.states import FailureReason
from pdfleet_runtime.rank.cache_pools import gather_state, read_share
from pdfleet_runtime.rank.model_runner import ModelRunner
from pdfleet_runtime.rank.pipe import GenerateOp
from pdfleet_runtime.rank.reference import ModelSource, generate
from pdfleet_runtime.rank.requests import SyntheticSource
from pdfleet_runtime.records import ParallelShape as S
from tests.verify.tiny_models import make_model

PROMPT = (5, 17, 99, 3, 44, 7)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    return ModelRunner(make_model("qwen3_5_text", tmp_path_factory.mktemp("m") / "qwen"))


def pools_of(runner: ModelRunner, shape: S) -> tuple[list[RankPools], RequestAllocator]:
    cap = Capacity(2, 32)
    return [RankPools(runner.layout, shape, t, p, cap) for t, p in shape.coords()], RequestAllocator(runner.layout, cap)


def test_a_prompt_is_computed_written_per_rank_and_continued(runner: ModelRunner) -> None:
    pools, alloc = pools_of(runner, S(2))
    sources = [ModelSource(p, alloc if i == 0 else RequestAllocator(runner.layout, Capacity(2, 32)), runner)
               for i, p in enumerate(pools)]
    idx = [asyncio.run(s.fill("r1", PromptFill(prompt=PROMPT))) for s in sources]
    pre = runner.prefill(PROMPT)
    assert [s.first_token("r1") for s in sources] == [pre.first_token] * 2
    state = gather_state(runner.layout, S(2), [read_share(p, i) for p, i in zip(pools, idx, strict=True)], len(PROMPT))
    assert state.equal(pre.state)  # each rank wrote exactly its share of the model's cache
    shares = tuple(read_share(p, i) for p, i in zip(pools, idx, strict=True))
    gen = generate(runner, GenerateOp("r1", len(PROMPT), pre.first_token, 4, shares), S(2))
    assert (pre.first_token, *gen.tokens) == runner.generate(PROMPT, 5).tokens
    sources[0].release("r1")
    assert sources[0].first_token("r1") is None


def test_a_lost_first_token_is_not_reported(runner: ModelRunner) -> None:
    pools, alloc = pools_of(runner, S(1))
    src = ModelSource(pools[0], alloc, runner, fault=ModelFault.FIRST_TOKEN_LOST)
    asyncio.run(src.fill("r2", PromptFill(prompt=PROMPT)))
    assert src.first_token("r2") is None


def test_a_seeded_rank_refuses_a_prompt_and_bad_ids_fail_the_request(runner: ModelRunner) -> None:
    pools, alloc = pools_of(runner, S(1))
    with pytest.raises(SyntheticError) as e:
        asyncio.run(SyntheticSource(pools[0], alloc).fill("r3", PromptFill(prompt=PROMPT)))
    assert e.value.failure is FailureReason.REFUSED
    with pytest.raises(SyntheticError) as e:
        asyncio.run(ModelSource(pools[0], alloc, runner).fill("r4", PromptFill(prompt=(1, 10**6))))
    assert e.value.failure is FailureReason.RANK and "prompt ids" in str(e.value)


def test_a_rank_refuses_a_layout_that_disagrees_with_the_model(tmp_path: Path) -> None:
    from pdfleet_runtime.config import ModelSourceConfig, RuntimeConfig
    from pdfleet_runtime.model.hf_config import ModelConfigError
    from pdfleet_runtime.rank.reference import load_rank_model

    d = make_model("llama", tmp_path / "llama", weights=False)
    cfg = RuntimeConfig(deployment="d", namespace="ns", role="prefill", runtime_version="0.1.0",
                        layout=LayoutRef(preset="llama-dense"), shape=S(1), peer_shape=S(1), backend="mooncake",
                        protocol="tcp", max_concurrent_requests=1, kv_tokens=16, prefill_service="p",
                        secret_path=tmp_path / "k", model=ModelSourceConfig(path=d))
    with pytest.raises(ModelConfigError, match="numLayers"):
        load_rank_model(cfg, None, "cpu")  # type: ignore[arg-type]


def test_a_rank_refuses_a_model_directory_of_another_digest(tmp_path: Path) -> None:
    """spec.model.source.digest: checked before anything is loaded; the right digest loads."""
    from pdfleet_runtime.config import ModelSourceConfig, RuntimeConfig
    from pdfleet_runtime.layouts import resolve_layout
    from pdfleet_runtime.model.digest import directory_digest
    from pdfleet_runtime.model.hf_config import ModelConfigError
    from pdfleet_runtime.rank.reference import load_rank_model

    d = make_model("llama", tmp_path / "llama", weights=False)

    def cfg(digest: str) -> RuntimeConfig:
        return RuntimeConfig(deployment="d", namespace="ns", role="prefill", runtime_version="0.1.0",
                             layout=LayoutRef(inline=ModelRunner(d).layout), shape=S(1), peer_shape=S(1),
                             backend="mooncake", protocol="tcp", max_concurrent_requests=1, kv_tokens=16,
                             prefill_service="p", secret_path=tmp_path / "k",
                             model=ModelSourceConfig(path=d, digest=digest))

    with pytest.raises(ModelConfigError, match="has digest sha256:") as e:
        load_rank_model(cfg("sha256:" + "0" * 64), None, "cpu")  # type: ignore[arg-type]
    assert e.value.field == "digest"
    good = cfg(directory_digest(d))
    assert load_rank_model(good, resolve_layout(good.layout), "cpu") is not None
