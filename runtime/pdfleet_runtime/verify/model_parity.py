"""Token parity: does PD generate exactly what the same model generates in one process?

Each case (a prompt) runs twice:

* aggregate: transformers' own greedy ``generate`` on the model, ``max_new_tokens`` exactly (end-of-sequence
  never stops it), in this process;
* PD: a prefill computes the prompt's forward and writes each rank's share of the cache into its pools at the
  request's fragmented pages and slot (``rank.cache_pools``), the planner moves the bytes to the decode's
  pools, and the decode rebuilds the cache from every decode rank's share exactly as its pools hold it and
  continues from the prefill's first token.

Parity: equal token ids, and the decode's logits within the dtype's bound of aggregate's (fp32: 1e-3).

``run_model_parity`` does it all in this process (every rank's pools here, the blocks copied by
``LocalCopyExecutor``); ``run_model_parity_engine`` runs the serving rank processes through a real engine
(``model_group``); ``model_run.run`` picks one for the command. A fault (``ModelFault``) makes the PD side
wrong on purpose; parity must then fail.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from pdfleet_runtime.model.hf_config import config_dtype, family
from pdfleet_runtime.model.state import ModelFault
from pdfleet_runtime.planner import Blocks, compile_destination, source_ranks
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.rank.cache_pools import ShareError, gather_state, read_share, write_share
from pdfleet_runtime.rank.faults import conv_lag, faulted_state, ungrouped
from pdfleet_runtime.rank.model_runner import Generation, ModelRunner

from .arena import LocalCopyExecutor
from .model_results import ModelCase, ModelParityConfig, ModelParityResult
from .precheck import precheck
from .results import ParityConfig

__all__ = ["case_name", "compare_case", "load_runner", "prompts_from_seed", "run_model_parity"]


def load_runner(cfg: ModelParityConfig) -> ModelRunner:
    """The model as every side computes it (one torch thread: 2 threads on 2 cores ran 8x slower)."""
    torch.set_num_threads(1)
    return ModelRunner(cfg.model_dir, declared=cfg.preset, page_size=cfg.page_size, init_seed=cfg.init_seed,
                       init_range=cfg.init_range, device=cfg.device)


def prompts_from_seed(count: int, tokens: int, vocab: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """``count`` prompts of lengths summing to ``tokens`` (as byte parity splits requests), ids from ``seed``."""
    from pdfleet_runtime.seeded import request_lengths

    rng = np.random.default_rng([seed, 17])
    return tuple(tuple(int(t) for t in rng.integers(0, vocab, n)) for n in request_lengths(tokens, count, seed))


def case_name(i: int, prompt: Sequence[int]) -> str:
    return f"case{i}-len{len(prompt)}"


def parity_config(cfg: ModelParityConfig, runner: ModelRunner) -> ParityConfig:
    """The byte harness's view of this run (the matrix precheck reads it)."""
    return ParityConfig(runner.layout, cfg.prefill, cfg.decode, len(cfg.prompts), sum(len(p) for p in cfg.prompts),
                        cfg.seed, cfg.backend, cfg.preset or "inline", cfg.device, cfg.protocol)


def compare_case(name: str, prompt: tuple[int, ...], pd: tuple[int, ...], pd_logits: np.ndarray,
                 agg: Generation, ref: Generation, bound: float, **extra: object) -> ModelCase:
    """PD's tokens against aggregate's (``generate``) and the forward reference's; PD's decode logits against the
    reference's (bounded) and ``generate``'s (reported). The decode's steps are the aggregates' steps 1..N-1."""
    def diff(logits: np.ndarray) -> float:
        steps = min(len(pd_logits), max(0, len(logits) - 1))
        return float(np.abs(pd_logits[:steps] - logits[1 : 1 + steps]).max()) if steps else 0.0

    return ModelCase(name, prompt, pd, agg.tokens, diff(ref.logits), bound, reference=ref.tokens,  # type: ignore[arg-type]
                     generate_logit_diff=diff(agg.logits), **extra)


def run_model_parity(cfg: ModelParityConfig, runner: ModelRunner | None = None) -> ModelParityResult:
    """Every case through PD (all ranks' pools in this process) and through aggregate; one result."""
    t0 = time.perf_counter()
    runner = runner or load_runner(cfg)
    lay, P, D = runner.layout, cfg.prefill, cfg.decode
    dtype = config_dtype(runner.raw_config).value
    result = ModelParityResult(ok=False, model_type=family(runner.raw_config), dtype=dtype)
    rejection = precheck(parity_config(cfg, runner))
    if rejection is not None:
        result.rejection = rejection
        return result
    t_load = time.perf_counter()
    cap = Capacity(len(cfg.prompts), sum(len(p) for p in cfg.prompts))
    prefill = {(t, p): RankPools(lay, P, t, p, cap, cfg.device) for t, p in P.coords()}
    decode = {(t, p): RankPools(lay, D, t, p, cap, cfg.device) for t, p in D.coords()}
    src_alloc = RequestAllocator(lay, cap, seed=cfg.seed * 2 + 1)
    dst_alloc = RequestAllocator(lay, cap, seed=cfg.seed * 2 + 2)
    src = [src_alloc.allocate(len(p)) for p in cfg.prompts]
    dst = [dst_alloc.allocate(len(p)) for p in cfg.prompts]

    firsts: list[int | None] = []
    t_prefill = time.perf_counter()
    for prompt, idx in zip(cfg.prompts, src, strict=True):
        pre = runner.prefill(prompt, conv_lag=conv_lag(cfg.fault))
        state = faulted_state(pre.state, cfg.fault)
        for pools in prefill.values():
            write_share(pools, state, idx)
        firsts.append(None if cfg.fault is ModelFault.FIRST_TOKEN_LOST else pre.first_token)

    t_move = time.perf_counter()
    reg = (lambda pools: ungrouped(pools.registration())) if cfg.fault is ModelFault.CONV_UNGROUPED else \
        (lambda pools: pools.registration())
    registrations = {k: reg(v) for k, v in prefill.items()}
    per_case: list[list[Blocks]] = [[] for _ in cfg.prompts]
    for (t, p), pools in decode.items():
        dest = compile_destination(reg(pools), [registrations[k] for k in source_ranks(P, D, t, p)])
        for c, (s_idx, d_idx) in enumerate(zip(src, dst, strict=True)):
            per_case[c].extend(dest.plan(s_idx, d_idx).values())
    moves = [Blocks.concat(b) for b in per_case]
    LocalCopyExecutor([v.arena for v in (*prefill.values(), *decode.values())]).execute(Blocks.concat(moves))

    t_decode = time.perf_counter()
    cases: list[ModelCase] = []
    for c, (prompt, idx, first) in enumerate(zip(cfg.prompts, dst, firsts, strict=True)):
        agg = runner.generate(prompt, cfg.max_new_tokens)
        ref = runner.forward_reference(prompt, cfg.max_new_tokens)
        extra = {"bytes_moved": moves[c].bytes, "bytes_by_state": moves[c].bytes_by_state()}
        name = case_name(c, prompt)
        if first is None:
            cases.append(ModelCase(name, prompt, (), agg.tokens, 0.0, cfg.bound(dtype),
                                   error="the prefill carried no first token: the decode cannot continue",
                                   **extra))  # type: ignore[arg-type]
            continue
        try:
            state = gather_state(lay, D, [read_share(pools, idx) for pools in decode.values()], len(prompt),
                                 cfg.device)
        except ShareError as e:
            cases.append(ModelCase(name, prompt, (), agg.tokens, 0.0, cfg.bound(dtype), error=f"decode shares: {e}",
                                   **extra))  # type: ignore[arg-type]
            continue
        gen = runner.decode(state, first, cfg.max_new_tokens - 1)
        cases.append(compare_case(name, prompt, (first, *gen.tokens), gen.logits, agg, ref, cfg.bound(dtype), **extra,
                                  seconds={"decode": gen.seconds, "aggregate": agg.seconds}))
    t_end = time.perf_counter()
    result.cases = cases
    result.ok = bool(cases) and all(c.ok for c in cases)
    result.seconds = {"load": t_load - t0, "prefill": t_move - t_prefill, "move": t_decode - t_move,
                      "decode_and_aggregate": t_end - t_decode}
    return result
