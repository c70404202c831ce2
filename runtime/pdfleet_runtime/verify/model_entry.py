"""The ``parity --model`` command's entry: prompts drawn from the seed when none are given, then token parity in
this process (``model_parity``) or through rank processes and a real engine (``model_group``).

Its own module so that neither of those two imports the other back.
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
