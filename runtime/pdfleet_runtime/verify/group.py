"""Multi-process parity through the serving rank processes: ``rank.process``, started by ``pod.launcher``.

A *group* is one (backend, prefill shape, decode shape) and its cases (layouts). Each case runs as
``serve`` runs it: a prefill pod (its bootstrap server in this process, as the pod process holds
it, and one rank process per prefill rank) and a decode pod (one rank process per decode rank),
every rank built from the case's ``RuntimeConfig`` and driven over the typed rank pipe. The flow:

1. ``SeededArenaOp`` on every rank: seeded background, and the requests allocated in order from
   seeded allocators, exactly as ``parity.run_parity`` allocates them (so bytes and descriptors agree);
2. ``TransferOp`` per request to every decode rank: serving's synthetic request (the prefill fills
   the request's seeded state, the engine moves it, the decode checks the request's items);
3. ``ArenaCheckOp`` on every decode rank: its whole arena against the background plus every
   succeeded request's state, so bytes outside the request's items must be untouched;
4. the prefill ranks give every request's items back (their free counts before and after).

Reading order: ``cases`` (``CaseSpec``/``GroupSpec``), ``run_group``, ``run_case`` (the flow above),
then ``CasePods`` (the two pods: start, seed, transfer, kill, stop).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from pdfleet_runtime.config import Role, RuntimeConfig
from pdfleet_runtime.layouts import LayoutRef, resolve_layout
from pdfleet_runtime.planner import source_ranks
from pdfleet_runtime.pod.launcher import RankLauncher
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapLimits, BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.messages import RequestKind
from pdfleet_runtime.protocol.states import RequestState
from pdfleet_runtime.rank.pipe import (
    ArenaCheck,
    ArenaCheckOp,
    FaultOptions,
    LegReport,
    RankSpec,
    RankStats,
    RequestStates,
    RequestStatesOp,
    SeededArenaOp,
    StatsOp,
    TransferOp,
    TransferResult,
)
from pdfleet_runtime.seeded import request_lengths, request_seed
from pdfleet_runtime.versions import CURRENT_RUNTIME_VERSION

from .cases import CaseSpec, GroupSpec, gpu_of
from .precheck import check_matrix
from .results import DecodeRun, ParityConfig, ParityResult, PrefillRun, RunDetails

__all__ = ["READY_TIMEOUT_S", "CasePods", "run_case", "run_group"]

READY_TIMEOUT_S = 180.0
"""Waiting for the rank processes to build pools and start their engines (2 cores, torch import)."""
CALL_MARGIN_S = 60.0
"""A rank's answer may come this long after the request's own timeout (start-up, fences)."""
_pods = itertools.count()
_T = TypeVar("_T")


class CasePods:
    """The prefill and decode pods of one case: ``async with`` starts the decode pod (and, with ``open_pod``, a
    prefill pod beside it, both starting at once), ``open_pod`` a fresh prefill pod."""

    ready_timeout_s = READY_TIMEOUT_S
    """How long each pod's rank processes may take to start."""

    def __init__(self, spec: GroupSpec, case: CaseSpec, *, open_pod: bool = False) -> None:
        self.spec, self.case, self._open_at_start = spec, case, open_pod
        self.decode = RankLauncher(self._specs(Role.DECODE, f"parity-{os.getpid()}-{next(_pods)}-decode"))
        self.prefill: RankLauncher | None = None
        self.bootstrap: BootstrapServer | None = None
        self.endpoint = Endpoint("127.0.0.1", 0)
        self.legs: list[list[LegReport]] = []
        """Every status the current prefill pod's ranks sent, per rank."""
        self.ready_seconds = 0.0

    async def __aenter__(self) -> CasePods:
        t0 = time.monotonic()
        try:
            async with asyncio.TaskGroup() as starting:  # one failing cancels the other
                starting.create_task(self.decode.start(self.ready_timeout_s))
                if self._open_at_start:
                    starting.create_task(self.open_pod())
        except BaseException as e:
            await self.close_pod()
            await self.decode.stop(5.0)
            if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
                raise e.exceptions[0] from None  # the LaunchError itself, not its task group
            raise
        self.ready_seconds = time.monotonic() - t0
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close_pod()
        await self.decode.stop(10.0)

    @property
    def devices(self) -> dict[str, str]:
        """Each rank process's torch device, by rank name."""
        return {h.spec.name: h.info.device for launcher in (self.prefill, self.decode) if launcher is not None
                for h in launcher.handles if h.info is not None}

    # ------------------------------------------------------------------ pods

    def config(self, role: Role) -> RuntimeConfig:
        s, c = self.spec, self.case
        mine, peer = (s.prefill, s.decode) if role is Role.PREFILL else (s.decode, s.prefill)
        return RuntimeConfig(
            deployment="parity", namespace="verify", role=role, runtime_version=CURRENT_RUNTIME_VERSION,
            layout=LayoutRef(preset=c.layout_name), shape=mine, peer_shape=peer,
            backend=s.backend, protocol=s.protocol, max_concurrent_requests=c.requests, kv_tokens=c.tokens,
            prefill_service="parity-prefill", secret_path=Path("/nonexistent"),
            device="cpu" if s.device == "cpu" else "cuda")

    def _specs(self, role: Role, instance: str, bootstrap: Endpoint | None = None,
               faults: FaultOptions | None = None) -> list[RankSpec]:
        s, cfg = self.spec, self.config(role)
        shape = s.prefill if role is Role.PREFILL else s.decode
        side = 1 if role is Role.PREFILL else 2
        gpus = _gpu_count() if s.device != "cpu" else 0
        boot = (bootstrap.host, bootstrap.port) if bootstrap is not None else ("127.0.0.1", 0)
        return [RankSpec(cfg, t, p, s.secret, instance, "127.0.0.1", boot, s.request_timeout_s, s.write_timeout_s,
                         s.write_timeout_s + 1.0, "WARNING", faults or FaultOptions(), dict(s.engine_env),
                         gpu_of(s, side, shape.rank(t, p), gpus) if gpus else None,
                         rank_key=s.rank_key if role is Role.PREFILL else None)
                for t, p in shape.coords()]

    async def open_pod(self, faults: FaultOptions | None = None) -> Endpoint:
        """A fresh prefill pod (a new bootstrap server on a new port, new rank processes), as a pod restarted
        elsewhere; ``faults`` as ``serve``'s hidden fault flags."""
        await self.close_pod()
        instance = f"parity-{os.getpid()}-{next(_pods)}-prefill"
        state = BootstrapState(self.spec.prefill, limits=BootstrapLimits(lease_s=self.spec.lease_s))
        self.bootstrap = BootstrapServer(state, Codec(self.spec.secret, instance, rank_key=self.spec.rank_key))
        self.endpoint = await self.bootstrap.start()
        self.legs = [[] for _ in self.spec.prefill.coords()]
        self.prefill = RankLauncher(self._specs(Role.PREFILL, instance, self.endpoint, faults),
                                    on_report=lambda rank, leg: self.legs[rank].append(leg))
        await self.prefill.start(self.ready_timeout_s)
        return self.endpoint

    async def close_pod(self) -> None:
        if self.prefill is not None:
            await self.prefill.stop(10.0)
            self.prefill = None
        if self.bootstrap is not None:
            await self.bootstrap.stop()
            self.bootstrap = None

    @staticmethod
    def kill(launcher: RankLauncher, rank: int = 0) -> None:
        """SIGKILL one rank process, as a crashed pod dies (no cleanup, no goodbye)."""
        proc = launcher.handles[rank].proc
        proc.kill()
        proc.join(5)

    # ------------------------------------------------------------------ requests

    async def seed(self, reserve: Sequence[tuple[str, int]]) -> list[RankStats]:
        """``SeededArenaOp`` on every rank (as ``parity.run_parity`` seeds each side); the prefill ranks' stats."""
        assert self.prefill is not None
        seed, reserve = self.case.seed, tuple(reserve)
        pre, _ = await asyncio.gather(
            self.prefill.call_all(SeededArenaOp(seed, seed * 2 + 1, reserve), timeout_s=CALL_MARGIN_S),
            self.decode.call_all(SeededArenaOp(seed, seed * 2 + 2, reserve), timeout_s=CALL_MARGIN_S))
        return [_of(RankStats, s) for s in pre]

    async def transfer(self, requests: Sequence[tuple[str, int]], timeout_s: float | None = None
                       ) -> list[list[TransferResult]]:
        """Every request into every decode rank at once (as the pod's router sends it); per rank, in order."""
        t = self.spec.request_timeout_s if timeout_s is None else timeout_s
        ep, seed = self.endpoint, self.case.seed
        ranks = range(len(self.decode.handles))
        out = await asyncio.gather(*(
            self.decode.call(i, TransferOp(rid, ep.host, ep.port, n, request_seed(rid, seed), t,
                                              kind=RequestKind.REQUEST),
                             timeout_s=t + CALL_MARGIN_S) for i in ranks for rid, n in requests))
        per = len(requests)
        return [[_of(TransferResult, r) for r in out[i * per : (i + 1) * per]] for i in ranks]

    async def prefill_states(self, request_ids: Sequence[str]) -> dict[str, RequestState]:
        """Each request's state on prefill rank 0."""
        assert self.prefill is not None
        reply = await self.prefill.call(0, RequestStatesOp(tuple(request_ids)), timeout_s=10.0)
        return _of(RequestStates, reply).states

    async def wait_states(self, request_ids: Sequence[str], want: RequestState, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        states: dict[str, RequestState] = {}
        while time.monotonic() < deadline:
            states = await self.prefill_states(request_ids)
            if all(states.get(r) is want for r in request_ids):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"requests never reached {want.value} on the prefill: {states}")

    async def wait_idle(self, launcher: RankLauncher, timeout_s: float) -> list[RankStats]:
        """Poll until no rank holds a request or waits on a fence (bounded); the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = [_of(RankStats, s) for s in await launcher.call_all(StatsOp(), timeout_s=10.0)]
            if all(s.held == 0 and s.fences_pending == 0 for s in stats) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.05)

    def leg_outcomes(self, request_ids: Sequence[str]) -> tuple[dict[str, RequestState], dict[str, str]]:
        """Per request, its state over the prefill's legs (failed if one leg failed) and a failed leg's reason."""
        wanted = set(request_ids)
        states: dict[str, RequestState] = {}
        failures: dict[str, str] = {}
        for leg in (x for rank in self.legs for x in rank if x.request_id in wanted):
            if leg.state is RequestState.FAILED:
                states[leg.request_id] = RequestState.FAILED
                failures.setdefault(leg.request_id, leg.reason)
            else:
                states.setdefault(leg.request_id, leg.state)
        return states, failures


def _gpu_count() -> int:
    import torch  # the cuda placement only: the harness itself runs no kernel

    return int(torch.cuda.device_count())


def _of(kind: type[_T], reply: object) -> _T:
    if not isinstance(reply, kind):
        raise TypeError(f"expected {kind.__name__}, the rank answered {type(reply).__name__}: {reply}")
    return reply


# --------------------------------------------------------------------------- the flow


def run_group(spec: GroupSpec) -> list[ParityResult]:
    """Run every case of a group; one ``ParityResult`` per case, in order.

    A case the capability matrix rejects is reported with the matrix's rule and reason and never
    reaches a process.
    """

    async def main() -> list[ParityResult]:
        results = []
        for case in spec.cases:
            cfg = ParityConfig(resolve_layout(case.layout_name), spec.prefill, spec.decode, case.requests,
                               case.tokens, case.seed, spec.backend, case.layout_name, spec.device)
            rejection = check_matrix(cfg)
            if rejection is not None:
                results.append(ParityResult(ok=False, rejection=rejection))
                continue
            async with CasePods(spec, case, open_pod=True) as pods:
                results.append(await run_case(pods))
        return results

    return asyncio.run(main())


async def run_case(pods: CasePods, attempt: str = "a") -> ParityResult:
    """One case through the current prefill pod: seed, transfer every request, check every decode arena."""
    spec, c = pods.spec, pods.case
    assert pods.prefill is not None
    rids = [f"{c.name}-{attempt}-{q}" for q in range(c.requests)]
    lengths = request_lengths(c.tokens, c.requests, c.seed)
    requests = list(zip(rids, lengths, strict=True))
    before = await pods.seed(requests)
    t0 = time.perf_counter()
    results = await pods.transfer(requests)
    seconds = time.perf_counter() - t0
    checks = [_of(ArenaCheck, r) for r in await pods.decode.call_all(ArenaCheckOp(), timeout_s=CALL_MARGIN_S)]
    decode_stats = [_of(RankStats, s) for s in await pods.decode.call_all(StatsOp(), timeout_s=10.0)]
    after = await pods.wait_idle(pods.prefill, spec.request_timeout_s + 30)
    states, failures = pods.leg_outcomes(rids)
    prefill = [PrefillRun(len(rids), len(rids) - a.held, b.free, a.free, states, failures)
               for b, a in zip(before, after, strict=True)]
    decode = [DecodeRun(tuple(r), k, s) for r, k, s in zip(results, checks, decode_stats, strict=True)]

    ok = all(p.released == p.requests for p in prefill)
    bytes_by: dict[str, int] = {}
    desc_by: dict[str, int] = {}
    moved = desc = 0
    plan_s = 0.0
    for (t, p), run in zip(spec.decode.coords(), decode, strict=True):
        sources = len(source_ranks(spec.prefill, spec.decode, t, p))
        ok = ok and run.check.mismatched == 0 and all(
            r.ok and r.mismatched == 0 and len(r.reports) == sources for r in run.results)
        for rep in (x for r in run.results for x in r.reports):
            moved += rep.bytes
            desc += rep.descriptors
            plan_s += rep.plan_seconds
            for k, v in rep.bytes_by_state.items():
                bytes_by[k.value] = bytes_by.get(k.value, 0) + v
            for k, v in rep.descriptors_by_state.items():
                desc_by[k.value] = desc_by.get(k.value, 0) + v
    first = next((r.check.first for r in decode if r.check.first is not None), None)
    return ParityResult(ok=ok, bytes_moved=moved, descriptors=desc,
                        mismatched_bytes=sum(r.check.mismatched for r in decode), bytes_by_state=bytes_by,
                        descriptors_by_state=desc_by, request_tokens=lengths, plan_seconds=plan_s,
                        copy_seconds=seconds, first_mismatch=first,
                        details=RunDetails(decode, prefill, pods.devices))
