"""Token parity through the serving rank processes and a real engine (``parity --model --backend mooncake|nixl``).

A prefill pod and a decode pod of ``rank.process`` processes, each built from a runtime config that names the
model (``RuntimeConfig.model``: the ranks load it, refusing a layout that disagrees with config.json), as
``group.CasePods`` runs byte parity. Per case:

1. every decode rank gets a ``TransferOp`` carrying the prompt, as a pod's router would send it: its
   ``DecodeRank`` sends a ``TransferRequest`` with a ``PromptFill``; every prefill rank computes the prompt's
   forward, writes its share of the cache into its pools at the request's items, and writes them through the
   engine; its status carries the first generated token;
2. each decode rank answers its share of the request, read from its own pools (``TransferResult.share``);
3. decode rank 0 gets every share (``GenerateOp``), rebuilds the state and continues greedily;
4. the tokens and logits are compared with transformers' own ``generate`` in this process.

Faults (``ModelFault``) reach both pods' ranks as ``FaultOptions.model``. With ``group_nodes`` (``--nodes 1,N``) the
decode replica spans N pods: this process leads it (``pod.group.GroupRanks`` around its own rank processes,
as the leader pod's process holds it) and each other pod is a ``pod.member.MemberServer``, as ``serve`` runs a
member, joined over the signed group channel; shares and ``GenerateOp`` cross it like every other rank call.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np

from pdfleet_runtime.config import (
    GROUP_PORT,
    GroupConfig,
    ModelSourceConfig,
    Role,
    RuntimeConfig,
    StagingConfig,
)
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.model.hf_config import config_dtype, family
from pdfleet_runtime.pod.group import GroupRanks
from pdfleet_runtime.pod.launcher import RankLauncher
from pdfleet_runtime.pod.member import MemberServer
from pdfleet_runtime.pod.options import ServeOptions
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.group import group_codec
from pdfleet_runtime.protocol.keys import load_secret, mounted_keys
from pdfleet_runtime.protocol.messages import RequestKind
from pdfleet_runtime.rank.model_runner import Generation, ModelRunner
from pdfleet_runtime.rank.pipe import (
    FaultOptions,
    Generated,
    GenerateOp,
    RankSpec,
    TransferOp,
    TransferResult,
)
from pdfleet_runtime.seeded import request_seed
from pdfleet_runtime.testing.local import free_offset

from .cases import CaseSpec, GroupSpec
from .group import CALL_MARGIN_S, CasePods, _of
from .model_parity import case_name, compare_case, parity_config
from .model_results import ModelCase, ModelParityConfig, ModelParityResult
from .precheck import check_matrix

__all__ = ["ModelPods", "run_model_parity_engine"]


class ModelPods(CasePods):
    """The two pods of a token-parity run: every rank computes ``model`` (and carries ``fault``)."""

    ready_timeout_s = 600.0
    """Each rank also imports transformers and builds the model (about 4 CPU-seconds more per rank on CPU)."""

    def __init__(self, spec: GroupSpec, case: CaseSpec, cfg: ModelParityConfig, runner: ModelRunner,
                 workdir: Path | None = None) -> None:
        self.model_cfg, self.runner, self.workdir = cfg, runner, workdir
        self.members: list[ServeOptions] = []
        self._member_runs: list[asyncio.Task[int]] = []
        super().__init__(spec, case, open_pod=True)
        nodes = cfg.group_nodes[1]
        if nodes > 1:  # the decode replica over ``nodes`` pods: this process leads, the others are members
            dcfg = self.config(Role.DECODE)
            assert dcfg.group is not None and workdir is not None
            instance = self.decode.specs[0].instance
            port = free_offset() + GROUP_PORT
            local = RankLauncher(self.decode.specs[: dcfg.local_world])
            keys = mounted_keys(dcfg.group.secret_path, load_secret(dcfg.group.secret_path))
            self.decode = GroupRanks(local, dcfg, group_codec(keys, instance), host="127.0.0.1", port=port,
                                     instance=instance)  # type: ignore[assignment]
            self.members = [ServeOptions(
                config=dcfg, bind_host="127.0.0.1", port_offset=free_offset(), pod_name=f"{instance}-m{m}",
                group_member=m, group_leader_address=("127.0.0.1", port), gate=False, log_level="WARNING",
                request_timeout_s=spec.request_timeout_s, write_timeout_s=spec.write_timeout_s,
                fence_timeout_s=spec.write_timeout_s + 1.0, faults=FaultOptions(model=cfg.fault))
                for m in range(1, nodes)]

    def config(self, role: Role) -> RuntimeConfig:
        cfg = self.model_cfg
        layout = LayoutRef(preset=cfg.preset) if cfg.preset else LayoutRef(inline=self.runner.layout)
        model = ModelSourceConfig(path=Path(cfg.model_dir).resolve(), init_seed=cfg.init_seed,
                                  init_range=cfg.init_range)
        update: dict[str, object] = {"layout": layout, "model": model}
        if self.spec.device != "cpu":  # every request takes the staged GPU path (docs/gpu.md), however small
            update["staging"] = StagingConfig(threshold_bytes=0)
        nodes = cfg.group_nodes[0 if role is Role.PREFILL else 1]
        if nodes > 1:
            assert self.workdir is not None
            secret, key = self.workdir / "secret", self.workdir / "group-key"
            secret.write_bytes(self.spec.secret)
            key.write_bytes(b"group-key-of-the-parity-run-" + self.spec.secret[:16])
            update["secret_path"] = secret
            update["group"] = GroupConfig(nodes=nodes, service="parity-group", secret_path=key)
        return super().config(role).model_copy(update=update)

    async def __aenter__(self) -> ModelPods:
        self._member_runs = [asyncio.create_task(MemberServer(o).run()) for o in self.members]
        try:
            await super().__aenter__()
            deadline = time.monotonic() + self.ready_timeout_s
            while self.decode.up < self.spec.decode.world:  # every member joined, its ranks up
                dead = [t for t in self._member_runs if t.done()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"decode group members did not join: {self.decode.up} of "
                                       f"{self.spec.decode.world} ranks up" + (f", a member exited {dead[0].result()}"
                                                                             if dead else ""))
                await asyncio.sleep(0.2)
        except BaseException:
            await self._stop_members()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await super().__aexit__(*exc)  # the leader closes its members' links: they exit
        finally:
            await self._stop_members()

    async def _stop_members(self) -> None:
        if self._member_runs:
            await self.decode.stop(10.0)
            await asyncio.wait(self._member_runs, timeout=30.0)

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
                                           prompt=prompt, kind=RequestKind.REQUEST), timeout_s=timeout_s + CALL_MARGIN_S)
            for i in range(self.spec.decode.world)))]
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
    if cfg.group_nodes[0] > 1:
        raise ValueError("a prefill replica over several pods is not run by the token-parity harness yet: "
                         "spread the decode replica (--nodes 1,N)")
    if cfg.decode.world % cfg.group_nodes[1]:
        raise ValueError(f"--nodes: {cfg.group_nodes[1]} decode pods do not divide the decode's {cfg.decode.world} "
                         "ranks")
    spec = GroupSpec(cfg.backend, cfg.prefill, cfg.decode,
                     (CaseSpec("model", len(cfg.prompts), sum(len(p) for p in cfg.prompts), cfg.seed),),
                     secret=secrets.token_hex(32).encode(),  # printable: members read it from a file
                     device="cpu" if cfg.device == "cpu" else "cuda", protocol=LinkProtocol(cfg.protocol))
    aggregate = [(runner.generate(p, cfg.max_new_tokens), runner.forward_reference(p, cfg.max_new_tokens))
                 for p in cfg.prompts]
    bound = cfg.bound(dtype)

    async def main(workdir: Path) -> list[ModelCase]:
        t0 = time.perf_counter()
        async with ModelPods(spec, spec.cases[0], cfg, runner, workdir) as pods:
            result.seconds["start"] = time.perf_counter() - t0
            return list(await asyncio.gather(*(
                _case(pods, case_name(i, p), p, agg, ref, cfg.max_new_tokens, bound, spec.request_timeout_s)
                for i, (p, (agg, ref)) in enumerate(zip(cfg.prompts, aggregate, strict=True)))))

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdfleet-parity-") as workdir:
        result.cases = asyncio.run(main(Path(workdir)))
    result.seconds["run"] = time.perf_counter() - t0
    result.ok = bool(result.cases) and all(c.ok for c in result.cases)
    return result


async def _case(pods: ModelPods, name: str, prompt: tuple[int, ...], agg: Generation, ref: Generation, steps: int,
                bound: float, timeout_s: float) -> ModelCase:
    try:
        tokens, logits, results, moved = await pods.generate(name, prompt, steps - 1, timeout_s)
    except CaseFailed as e:
        return ModelCase(name, prompt, (), agg.tokens, 0.0, bound, error=str(e))
    by_state: dict[str, int] = {}
    for rep in (x for r in results for x in r.reports):
        for k, v in rep.bytes_by_state.items():
            by_state[k.value] = by_state.get(k.value, 0) + v
    return compare_case(name, prompt, tokens, logits, agg, ref, bound, bytes_moved=sum(by_state.values()),
                        bytes_by_state=by_state, seconds={"transfer": moved})
