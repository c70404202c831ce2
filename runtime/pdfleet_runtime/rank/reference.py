"""A rank process as a reference engine (``RuntimeConfig.model``): load the model, compute prompts, continue them.

A rank process only (torch, transformers). ``load_rank_model`` builds the ``rank.model_runner.ModelRunner``
once at start, refusing a layout that disagrees with the model's config.json. A prefill rank's
``ModelSource`` serves ``PromptFill`` requests (seeded ``SyntheticFill`` ones still go to ``SyntheticSource``,
so canaries and byte checks keep working): it computes the prompt's forward, writes this rank's share of the
cache into its pools at the request's items (``rank.cache_pools.write_share``) and keeps the first token for
the status reports. A decode rank answers ``GenerateOp``: gather every rank's share, continue greedily.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.layouts import Layout
from pdfleet_runtime.model.digest import check_digest
from pdfleet_runtime.model.state import ModelFault
from pdfleet_runtime.pools import PoolExhausted, RankPools, RequestAllocator
from pdfleet_runtime.protocol.messages import PromptFill, SyntheticFill
from pdfleet_runtime.protocol.prefill import SyntheticError
from pdfleet_runtime.protocol.states import FailureReason
from pdfleet_runtime.rank.cache_pools import ShareError, gather_state, write_share
from pdfleet_runtime.rank.faults import conv_lag, faulted_state
from pdfleet_runtime.rank.model_runner import ModelRunner
from pdfleet_runtime.records import RequestIndices

from .pipe import Generated, GenerateOp
from .requests import SyntheticSource

__all__ = ["ModelSource", "generate", "load_rank_model"]

log = logging.getLogger("pdfleet_runtime.server.rank")


def load_rank_model(cfg: RuntimeConfig, layout: Layout, device: str) -> ModelRunner | None:
    """The model this rank computes (one torch thread), or None for seeded state (no ``model`` in the config)."""
    if cfg.model is None:
        return None
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    m = cfg.model
    check_digest(m.path, m.digest)  # before loading: another directory's weights never serve
    declared = cfg.layout.preset if cfg.layout.preset is not None else layout
    runner = ModelRunner(m.path, declared=declared, init_seed=m.init_seed, init_range=m.init_range,
                         max_weight_bytes=m.max_weight_gib << 30, device=device)
    log.info("model %s (%s) loaded in %.1fs", m.path, runner.raw_config.get("model_type"), time.perf_counter() - t0)
    return runner


class ModelSource(SyntheticSource):
    """A prefill rank's request state: computed from the prompt (``PromptFill``) or seeded (``SyntheticFill``)."""

    def __init__(self, pools: RankPools, alloc: RequestAllocator, runner: ModelRunner, *,
                 fault: ModelFault | None = None, **kwargs: object) -> None:
        super().__init__(pools, alloc, **kwargs)  # type: ignore[arg-type]
        self.runner, self.fault = runner, fault
        self._first: dict[str, int] = {}
        self._expected: dict[str, tuple[int, ...]] = {}

    async def fill(self, request_id: str, fill: SyntheticFill | PromptFill) -> RequestIndices:
        if not isinstance(fill, PromptFill):
            return await super().fill(request_id, fill)
        try:
            idx = self.take(request_id, len(fill.prompt))
        except PoolExhausted as e:
            raise SyntheticError(FailureReason.BUSY, f"prefill pools are full: {e}") from None
        if self.allocated is not None:
            self.allocated(request_id, idx)
        try:
            first, seconds, expected = await asyncio.to_thread(self._compute, fill.prompt, idx, fill.expect)
        except (ValueError, ShareError) as e:
            raise SyntheticError(FailureReason.RANK, f"prompt of {len(fill.prompt)} tokens: {e}") from None
        if self.fault is not ModelFault.FIRST_TOKEN_LOST:
            self._first[request_id] = first
        if expected:
            self._expected[request_id] = expected
        log.info("request %s: prefilled %d tokens in %.3fs, first token %d", request_id, len(fill.prompt), seconds,
                 first)
        return idx

    def _compute(self, prompt: tuple[int, ...], idx: RequestIndices, expect: int
                 ) -> tuple[int, float, tuple[int, ...]]:
        """The forward and this rank's share written; with ``expect`` (a canary) also the prompt's aggregate
        continuation, by the model's own cache (``ModelRunner.forward_reference``), never by the pools."""
        with self.runner.lock:
            pre = self.runner.prefill(prompt, conv_lag=conv_lag(self.fault))
            write_share(self.pools, faulted_state(pre.state, self.fault), idx)
            expected = self.runner.forward_reference(prompt, expect).tokens if expect else ()
        return pre.first_token, pre.seconds, expected

    def first_token(self, request_id: str) -> int | None:
        """The first generated token of a prompt request (None for seeded state): ``PrefillRank(first_token=)``."""
        return self._first.get(request_id)

    def expected_tokens(self, request_id: str) -> tuple[int, ...]:
        """A canary's aggregate continuation (``PromptFill.expect``), empty otherwise."""
        return self._expected.get(request_id, ())

    def release(self, request_id: str) -> None:
        self._first.pop(request_id, None)
        self._expected.pop(request_id, None)
        super().release(request_id)


def generate(runner: ModelRunner, op: GenerateOp, shape: object, fault: ModelFault | None = None,
             on_token: Callable[[int, int], None] | None = None) -> Generated:
    """Rebuild the request's state from every decode rank's share and continue it (a worker thread). ``fault``
    (tests: a decode pod's ``--fault-model``): the gathered state as that fault would leave it, as if the decode
    mangled what it received (``gdn-slot-zeroed``: one GDN layer's recurrent slot zeroed)."""
    with runner.lock:
        state = gather_state(runner.layout, shape, op.shares, op.length, runner.device)  # type: ignore[arg-type]
        gen = runner.decode(faulted_state(state, fault), op.first_token, op.steps, op.stop_ids, on_token)
    return Generated(gen.tokens, tuple(tuple(row) for row in gen.logits.tolist()), gen.seconds)
