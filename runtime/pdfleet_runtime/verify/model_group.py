"""Token parity through the serving rank processes and a real engine (``parity --model --backend mooncake|nixl``).

A prefill pod and a decode pod of ``server.ranks`` processes, each built from a runtime config that names the
model (``RuntimeConfig.model``: the ranks load it, refusing a layout that disagrees with config.json), as
``group.CasePods`` runs byte parity. Per case:

1. every decode rank gets a ``TransferOp`` carrying the prompt, as a pod's router would send it: its
   ``DecodeRank`` sends a ``TransferRequest`` with a ``PromptFill``; every prefill rank computes the prompt's
   forward, writes its share of the cache into its pools at the request's items, and writes them through the
   engine; its status carries the first generated token;
2. each decode rank answers its share of the request, read from its own pools (``TransferResult.share``);
3. decode rank 0 gets every share (``GenerateOp``), rebuilds the state and continues greedily;
4. the tokens and logits are compared with transformers' own ``generate`` in this process.

Faults (``ModelFault``) reach both pods' ranks as ``FaultOptions.model``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from pdfleet_runtime.config import ModelSourceConfig, Role, RuntimeConfig
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.model.hf_config import config_dtype, family
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.rank.model_runner import Generation, ModelRunner
from pdfleet_runtime.seeded import request_seed
from pdfleet_runtime.server.options import FaultOptions
from pdfleet_runtime.server.pipe import Generated, GenerateOp, RankSpec, TransferOp, TransferResult

from .cases import CaseSpec, GroupSpec
from .group import CALL_MARGIN_S, CasePods, _of
from .model_parity import case_name, compare_case, parity_config
from .model_results import ModelCase, ModelParityConfig, ModelParityResult
from .precheck import check_matrix

__all__ = ["ModelPods", "run_model_parity_engine"]


class ModelPods(CasePods):
    """The two pods of a token-parity run: every rank computes ``model`` (and carries ``fault``)."""

    def __init__(self, spec: GroupSpec, case: CaseSpec, cfg: ModelParityConfig, runner: ModelRunner) -> None:
        self.model_cfg, self.runner = cfg, runner
        super().__init__(spec, case, open_pod=True)

    def config(self, role: Role) -> RuntimeConfig:
        cfg = self.model_cfg
        layout = LayoutRef(preset=cfg.preset) if cfg.preset else LayoutRef(inline=self.runner.layout)
        model = ModelSourceConfig(path=Path(cfg.model_dir).resolve(), init_seed=cfg.init_seed,
                                  init_range=cfg.init_range)
        return super().config(role).model_copy(update={"layout": layout, "model": model})

    def _specs(self, role: Role, instance: str, bootstrap: Endpoint | None = None,
               faults: FaultOptions | None = None) -> list[RankSpec]:
        return super()._specs(role, instance, bootstrap, faults or FaultOptions(model=self.model_cfg.fault))

    async def generate(self, name: str, prompt: tuple[int, ...], steps: int, timeout_s: float
                       ) -> tuple[tuple[int, ...], np.ndarray, list[TransferResult], float]:
        """One prompt through PD: (first token + the decode's tokens, decode logits, each rank's result, seconds
        of the transfer). Raises ``CaseFailed`` naming what went wrong before tokens exist."""
        ep = self.endpoint
        t0 = time.perf_counter()
        results = [_of(TransferResult, r) for r in await asyncio.gather(*(
            self.decode.call(i, TransferOp(name, ep.host, ep.port, len(prompt), request_seed(name), timeout_s,
                                           prompt=prompt), timeout_s=timeout_s + CALL_MARGIN_S)
            for i in range(len(self.decode.handles))))]
        moved = time.perf_counter() - t0
        failed = [r for r in results if not r.ok]
        if failed:
            f = failed[0]
            raise CaseFailed(f"transfer failed on {len(failed)} decode rank(s): "
                             f"{f.failure.value if f.failure else '?'}: {f.reason}")
        firsts = {r.first_token for res in results for r in res.reports if r.first_token is not None}
        if not firsts:
            raise CaseFailed("the prefill carried no first token: the decode cannot continue")
        if len(firsts) > 1:
            raise CaseFailed(f"prefill ranks carried different first tokens {sorted(firsts)}")
        first = firsts.pop()
        shares = tuple(r.share for r in results if r.share is not None)
        if len(shares) != len(results):
            raise CaseFailed("a decode rank answered no share of the request")
        gen = _of(Generated, await self.decode.call(0, GenerateOp(name, len(prompt), first, steps, shares),
                                                      timeout_s=timeout_s + CALL_MARGIN_S))
        logits = np.asarray(gen.logits, dtype=np.float32).reshape(len(gen.tokens), -1)
        return (first, *gen.tokens), logits, results, moved


class CaseFailed(RuntimeError):
    """A case that ended before its tokens could be compared; the message names why."""


def run_model_parity_engine(cfg: ModelParityConfig, runner: ModelRunner) -> ModelParityResult:
    """Every case through a prefill and a decode pod of serving rank processes and a real engine."""
    dtype = config_dtype(runner.raw_config).value
    result = ModelParityResult(ok=False, model_type=family(runner.raw_config), dtype=dtype)
    pcfg = parity_config(cfg, runner)
    rejection = check_matrix(pcfg)
    if rejection is not None:
        result.rejection = rejection
        return result
    spec = GroupSpec(cfg.backend, cfg.prefill, cfg.decode,
                     (CaseSpec("model", len(cfg.prompts), sum(len(p) for p in cfg.prompts), cfg.seed),),
                     device="cpu" if cfg.device == "cpu" else "cuda", protocol=LinkProtocol(cfg.protocol))
    aggregate = [runner.generate(p, cfg.max_new_tokens) for p in cfg.prompts]
    bound = cfg.bound(dtype)

    async def main() -> list[ModelCase]:
        t0 = time.perf_counter()
        async with ModelPods(spec, spec.cases[0], cfg, runner) as pods:
            result.seconds["start"] = time.perf_counter() - t0
            return list(await asyncio.gather(*(
                _case(pods, case_name(i, p), p, agg, cfg.max_new_tokens, bound, spec.request_timeout_s)
                for i, (p, agg) in enumerate(zip(cfg.prompts, aggregate, strict=True)))))

    t0 = time.perf_counter()
    result.cases = asyncio.run(main())
    result.seconds["run"] = time.perf_counter() - t0
    result.ok = bool(result.cases) and all(c.ok for c in result.cases)
    return result


async def _case(pods: ModelPods, name: str, prompt: tuple[int, ...], agg: Generation, steps: int, bound: float,
                timeout_s: float) -> ModelCase:
    try:
        tokens, logits, results, moved = await pods.generate(name, prompt, steps - 1, timeout_s)
    except CaseFailed as e:
        return ModelCase(name, prompt, (), agg.tokens, 0.0, bound, error=str(e))
    by_state: dict[str, int] = {}
    for rep in (x for r in results for x in r.reports):
        for k, v in rep.bytes_by_state.items():
            by_state[k.value] = by_state.get(k.value, 0) + v
    return compare_case(name, prompt, tokens, logits, agg, bound, bytes_moved=sum(by_state.values()),
                        bytes_by_state=by_state, seconds={"transfer": moved})
