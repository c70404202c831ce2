"""The parity command's entry for token parity: prompts, then in this process or through rank processes.

Apart from ``model_parity`` (the in-process harness and the pieces both harnesses share) so that neither
harness imports the other: ``model_group`` uses those pieces, and this module chooses between the two.
"""

from __future__ import annotations

import dataclasses

from .model_group import run_model_parity_engine
from .model_parity import load_runner, prompts_from_seed, run_model_parity
from .model_results import ModelParityConfig, ModelParityResult

__all__ = ["run"]


def run(cfg: ModelParityConfig, *, requests: int = 2, tokens: int = 64) -> ModelParityResult:
    """The parity command's entry: prompts drawn from the seed when none are given (``requests`` prompts of
    ``tokens`` in all), then in this process (``local``, ``mori``) or through rank processes and a real engine."""
    runner = load_runner(cfg)
    if not cfg.prompts:
        if requests < 1 or tokens < requests:
            raise ValueError(f"need --tokens >= --requests >= 1, got {tokens} and {requests}")
        cfg = dataclasses.replace(cfg, prompts=prompts_from_seed(requests, tokens, runner.vocab_size, cfg.seed))
    if cfg.backend in ("mooncake", "nixl"):
        return run_model_parity_engine(cfg, runner)
    return run_model_parity(cfg, runner)
