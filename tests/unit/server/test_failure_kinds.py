"""Every ``FailureReason`` end to end, in one process: from where it is made to the pod's answer and readiness.

The parts are the real ones: a prefill pod's ``BootstrapServer`` on 127.0.0.1 with one ``PrefillRank``
whose synthetic state comes from the serving rank's ``SyntheticSource``, a decode rank's
``DecodeRequests`` (the work ``rank/process.py`` runs for each ``TransferOp``), the ``local`` engine,
the decode pod's ``RequestRouter`` and ``Readiness``. One stand-in: ``InProcessRanks`` plays the
``RankLauncher`` (it calls the decode rank's work directly instead of over a pipe to another process).
Each case produces one kind where it arises (a prefill rank's report on the wire, the decode rank, the
rank or the pod) and checks the kind and cause the pod answers, its HTTP status and the readiness verdict.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdfleet_runtime.engines import EngineConfig, TransferFailed, create_engine
from pdfleet_runtime.layouts import PRESETS, Layout
from pdfleet_runtime.pod.launcher import RankCallError
from pdfleet_runtime.pod.metrics import ServerMetrics
from pdfleet_runtime.pod.readiness import Problem, Readiness
from pdfleet_runtime.pod.routing import (
    CALLER_FAULT,
    NOT_THE_PATH,
    RequestRouter,
    SyntheticResult,
    canary_result,
)
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapLimits, BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.messages import RequestKind, StatusReport, SyntheticFill
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.protocol.states import FailureReason as F
from pdfleet_runtime.rank.pipe import FaultOptions, RankSpec, TransferOp, TransferResult
from pdfleet_runtime.rank.requests import DecodeRequests, SyntheticSource
from pdfleet_runtime.records import ParallelShape, RequestIndices
from tests.server.harness import config

SECRET = b"failure-kinds-secret-0123456789ab"
RANK_KEY = b"failure-kinds-rank-key-0123456789"
LAYOUT = PRESETS["llama-dense"]
TOKENS = 32


class InProcessRanks:
    """Stand-in for ``RankLauncher``: the decode rank's work runs here, not behind a pipe (``error``: a dead rank)."""

    def __init__(self, work: DecodeRequests, error: str = "", failure: F = F.RANK) -> None:
        self.work, self.error, self.failure = work, error, failure

    async def call_all(self, op: TransferOp, *, timeout_s: float) -> list[TransferResult]:
        if self.error:
            raise RankCallError(self.error, self.failure)
        return [await asyncio.wait_for(self.work.transfer(op), timeout_s)]


class FailingWrites:
    """The local engine, with every write failing as an engine would (a reachable peer, a failed batch)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def write(self, *args: Any, **kwargs: Any) -> Any:
        raise TransferFailed("injected: the engine failed the batch")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


@dataclass
class Setup:
    """What a case changes; the defaults make a transfer that succeeds."""

    faults: FaultOptions = field(default_factory=FaultOptions)
    decode_layout: Layout = LAYOUT
    prefill_tokens: int = 512
    decode_tokens: int = 512
    tokens: int = TOKENS
    timeout_s: float = 5.0
    fill_delay_s: float = 0.0
    failing_writes: bool = False
    poll: bool = True
    lease_s: float = 5.0
    dead_rank: bool = False
    lost_member: bool = False
    unreachable: bool = False


@dataclass
class Pod:
    server: BootstrapServer
    prefill: PrefillRank
    router: RequestRouter
    readiness: Readiness
    endpoint: Endpoint
    reports: list[StatusReport]
    stop: asyncio.Event
    work: DecodeRequests


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(setup: Setup, body: Callable[[Pod], Awaitable[None]]) -> None:
    async def main() -> None:
        shape = ParallelShape(1)
        server = BootstrapServer(BootstrapState(shape, limits=BootstrapLimits(lease_s=setup.lease_s)),
                                 Codec(SECRET, "pod", rank_key=RANK_KEY))
        ep = await server.start()
        src = RankPools(LAYOUT, shape, 0, 0, Capacity(2, setup.prefill_tokens))
        dst_cap = Capacity(2, setup.decode_tokens)
        dst = RankPools(setup.decode_layout, shape, 0, 0, dst_cap)
        engines = []
        for pools in (src, dst):
            eng = create_engine(EngineConfig("local"))
            eng.start()
            engines.append((eng, eng.register_rank(pools.registration())))
        source = SyntheticSource(src, RequestAllocator(LAYOUT, Capacity(2, setup.prefill_tokens)))

        async def fill(request_id: str, f: SyntheticFill) -> RequestIndices:
            await asyncio.sleep(setup.fill_delay_s)
            return await source.fill(request_id, f)

        reports: list[StatusReport] = []
        engine = FailingWrites(engines[0][0]) if setup.failing_writes else engines[0][0]
        prefill = PrefillRank(src.registration(), engine, engines[0][1], BootstrapClient(ep, Codec(SECRET, "p", rank_key=RANK_KEY)),
                              settings=PrefillSettings(poll_wait_s=0.1, write_timeout_s=5.0),
                              release=source.release, synthetic=fill, on_report=lambda _, rep: reports.append(rep))
        spec = RankSpec(config("decode"), 0, 0, SECRET, "dec", "127.0.0.1", ("127.0.0.1", 0),
                        request_timeout_s=setup.timeout_s, write_timeout_s=5.0, fence_timeout_s=6.0,
                        faults=setup.faults)
        work = DecodeRequests(spec, dst, RequestAllocator(setup.decode_layout, dst_cap), engines[1][1])
        readiness = Readiness("decode", floor_gbps=0.0, clock=lambda: 0.0, ranks_total=1, ranks_up=1)
        router = RequestRouter(readiness, ServerMetrics("decode"), asyncio.Event())
        router.launcher = (  # type: ignore[assignment]
            InProcessRanks(work, "rank 1 on group member 1: member lost", F.GROUP_MEMBER_LOST) if setup.lost_member
            else InProcessRanks(work, "decode[0,0] exited (died; exit code -9)" if setup.dead_rank else ""))
        target = Endpoint("127.0.0.1", _closed_port()) if setup.unreachable else ep
        stop = asyncio.Event()
        await prefill.register()
        loop = asyncio.create_task(prefill.run(stop)) if setup.poll else None
        try:
            await asyncio.wait_for(body(Pod(server, prefill, router, readiness, target, reports, stop, work)), 60)
        finally:
            stop.set()
            if loop is not None:
                await loop
            await work.close()
            await prefill.client.close()
            await server.stop()

    asyncio.run(main())


async def canary(pod: Pod, rid: str, setup: Setup) -> tuple[SyntheticResult, Problem | None]:
    """One canary as the canary loop runs it: the pod's answer and the verdict it leaves (None: no verdict)."""
    res = await pod.router.run(RequestKind.CANARY, setup.tokens, rid, 0, setup.timeout_s, endpoint=pod.endpoint)
    verdict = canary_result(res)
    if verdict is None:
        return res, None
    pod.readiness.record_canary(str(pod.endpoint), verdict)
    return res, pod.readiness.verdict().problem


def status(res: SyntheticResult) -> int:
    """The HTTP status ``POST /v1/synthetic`` answers for it (``pod/app.py``)."""
    return 200 if res.ok else 503 if res.failure in NOT_THE_PATH else 409 if res.failure in CALLER_FAULT else 502


# (setup, failure the pod answers, its cause, HTTP status, readiness problem or None for no verdict)
CASES: dict[str, tuple[Setup, F | None, F | None, int, Problem | None]] = {
    "success": (Setup(), None, None, 200, Problem.NONE),
    "timeout": (Setup(fill_delay_s=2.0, timeout_s=0.8), F.TIMEOUT, None, 502, Problem.FAILING),
    "peer_unreachable": (Setup(unreachable=True), F.PEER_UNREACHABLE, None, 502, Problem.UNREACHABLE),
    "refused": (Setup(faults=FaultOptions(wire="2.0")), F.REFUSED, None, 502, Problem.INCOMPATIBLE),
    "plan": (Setup(decode_layout=LAYOUT.model_copy(update={"kv_heads": 4})), F.SOURCE_FAILED, F.PLAN, 502,
             Problem.INCOMPATIBLE),
    "engine": (Setup(failing_writes=True), F.SOURCE_FAILED, F.ENGINE, 502, Problem.FAILING),
    "peer_lost": (Setup(poll=False, lease_s=0.5), F.SOURCE_FAILED, F.PEER_LOST, 502, Problem.FAILING),
    "busy_prefill": (Setup(prefill_tokens=64, tokens=400), F.BUSY, F.BUSY, 503, None),
    "busy_decode": (Setup(decode_tokens=64, tokens=400), F.BUSY, None, 503, None),
    "verify": (Setup(faults=FaultOptions(corrupt_received=True)), F.VERIFY, None, 502, Problem.CORRUPT),
    "rank": (Setup(dead_rank=True), F.RANK, None, 502, Problem.FAILING),
    "group_member_lost": (Setup(lost_member=True), F.GROUP_MEMBER_LOST, None, 502, Problem.GROUP_MEMBER_LOST),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_failure_kind_reaches_the_pods_answer_and_readiness(case: str) -> None:
    setup, failure, cause, http, problem = CASES[case]

    async def body(pod: Pod) -> None:
        res, verdict = await canary(pod, f"canary-{case}", setup)
        assert (res.failure, res.cause) == (failure, cause), res
        assert status(res) == http and verdict is problem, (res, verdict)
        if failure is not None:
            assert res.reason  # every failure carries a sentence for the operator

    run(setup, body)


def test_draining_refusal_is_answered_draining_and_names_the_peer_draining() -> None:
    setup = Setup()

    async def body(pod: Pod) -> None:
        pod.server.state.drain(True)
        res, verdict = await canary(pod, "canary-draining", setup)
        assert res.failure is F.DRAINING and status(res) == 503 and verdict is Problem.PEER_DRAINING, res

    run(setup, body)


def test_a_prefill_rank_registering_again_fails_its_requests_peer_restarted() -> None:
    setup = Setup(fill_delay_s=1.0)

    async def body(pod: Pod) -> None:
        task = asyncio.create_task(canary(pod, "canary-restarted", setup))
        await asyncio.sleep(0.4)  # the request is pending at the bootstrap, the source still filling
        await pod.prefill.register()  # the same rank again: a restarted prefill rank
        res, verdict = await task
        assert (res.failure, res.cause) == (F.SOURCE_FAILED, F.PEER_RESTARTED), res
        assert status(res) == 502 and verdict is Problem.FAILING

    run(setup, body)


def test_a_cancelled_leg_and_a_full_prefill_say_nothing_about_the_prefill_pods_path() -> None:
    """The decode gives up (its timeout): the prefill fails the leg ``CANCELLED``; the prefill pod's
    readiness does not count it, nor a leg it had no room for."""
    setup = Setup(fill_delay_s=1.5, timeout_s=0.6)

    async def body(pod: Pod) -> None:
        res, _ = await canary(pod, "canary-cancelled", setup)
        assert res.failure is F.TIMEOUT
        for _ in range(100):
            if any(r.failure is F.CANCELLED for r in pod.reports):
                break
            await asyncio.sleep(0.05)
        legs = [r for r in pod.reports if r.failure is F.CANCELLED]
        assert legs, pod.reports
        mine = Readiness("prefill", floor_gbps=0.0, clock=lambda: 0.0, failures_not_ready=1, ranks_total=1,
                         ranks_up=1, bootstrap_registered=1)
        for r in legs:
            mine.record_leg(False, r.failure, r.reason, canary=True)
        mine.record_leg(False, F.BUSY, "synthetic request r: prefill pools are full", canary=True)
        assert mine.failed_in_row == 0
        mine.record_leg(False, F.ENGINE, "write failed", canary=True)
        assert mine.failed_in_row == 1 and mine.verdict().problem is Problem.FAILING

    run(setup, body)


def test_no_peer_and_a_conflicting_request_id() -> None:
    setup = Setup(fill_delay_s=0.5)

    async def body(pod: Pod) -> None:
        alone = await pod.router.run(RequestKind.REQUEST, TOKENS, "r-none", 0, 5.0)  # discovery found nobody
        assert alone.failure is F.NO_PEER and status(alone) == 503
        assert pod.readiness.failed_in_row == 0  # not the path: no readiness fact
        pod.router.found([pod.endpoint])
        first, second = await asyncio.gather(pod.router.run(RequestKind.REQUEST, TOKENS, "r-same", 0, 5.0),
                                             pod.router.run(RequestKind.REQUEST, TOKENS, "r-same", 0, 5.0))
        assert sorted([first.ok, second.ok]) == [False, True], (first, second)
        clash = second if first.ok else first
        assert clash.failure is F.CONFLICT and status(clash) == 409
        assert pod.readiness.failed_in_row == 0 and not pod.readiness.last_failure  # the caller's mistake
        assert pod.work.held == {}  # the clash allocated nothing, the success gave its items back

    run(setup, body)


def test_a_request_id_sent_again_after_it_ended_is_refused_and_holds_nothing() -> None:
    """Issue 39's High finding: a repeated room after its request ended failed with IllegalTransition after
    the rank took its items, which nothing gave back (8 of 8 slots held, the pod still Ready)."""
    async def body(pod: Pod) -> None:
        pod.router.found([pod.endpoint])
        free = pod.work.free()
        for i in range(4):
            first = await pod.router.run(RequestKind.REQUEST, TOKENS, f"room-{i}", 0, 5.0)
            assert first.ok, first
            again = await pod.router.run(RequestKind.REQUEST, TOKENS, f"room-{i}", 0, 5.0)
            assert again.failure is F.CONFLICT and status(again) == 409, again
            assert "send a new id" in again.reason
        assert pod.work.held == {} and pod.work.free() == free  # every item back: nothing leaked
        assert pod.work.held_by() == {"running": 0, "fencing": 0, "orphaned": 0}
        assert pod.readiness.failed_in_row == 0
        ok = await pod.router.run(RequestKind.REQUEST, TOKENS, "room-new", 0, 5.0)  # the rank still serves
        assert ok.ok, ok

    run(Setup(), body)


def test_every_failure_kind_has_a_case_here() -> None:
    produced = {c[1] for c in CASES.values()} | {c[2] for c in CASES.values()}
    produced |= {F.DRAINING, F.PEER_RESTARTED, F.CANCELLED, F.NO_PEER, F.CONFLICT}
    assert set(F) <= produced, set(F) - produced
