"""The prefill rank's transfer coordinator: register, take work from the pod's bootstrap, plan, write, report.

One asyncio task polls the bootstrap (heartbeat and events), one sends status reports, one
expires deadlines; writes run on worker threads (engines are blocking), one at a time per decode rank
(its lock), never behind another decode's: the engine lock covers only connect, forget and closing a
link (they change the engine's peer table), and the engines are thread-safe for the rest (a NIXL agent
is made with strict thread sync, Mooncake's engine is). Every write has a deadline, the write timeout
plus ``WRITE_GRACE_S``: a write whose engine call has not returned by then (a hung status call) fails
its request with ``TIMEOUT``, reported unfenced, its source items held until the call returns.
A request becomes known either from the local scheduler (``add_request``: its state is ready in
this rank's pools) or from a decode rank's ``TransferRequest``; it moves
Bootstrapping -> WaitingForInput (every decode rank it serves sent indices) -> Transferring ->
Success | Failed. Every decode rank this source pairs with gets a status, also when this rank's
plan holds no block for it (not elected, or a PP stage without that layer). When the request is
terminal its source items are released (``release`` callback), whatever the outcome.

Fencing: a status sent while a write to that destination may still run (the request was cancelled
or timed out mid-write) says ``fenced=False``; when the write has returned (finished, failed or
timed out in the engine) the same status is sent again with ``fenced=True``. Only then may the
decode reuse the destination items, so a late write can never land in pages given to another
request. Every other status is fenced when sent.

A synthetic request (``TransferRequest.fill``) has no local scheduler: the ``synthetic`` callback
allocates and fills this rank's items, then the request proceeds as if ``add_request`` was called. A prompt
request (``PromptFill``, the reference engine) is filled the same way by computing the model; its first
generated token (the ``first_token`` callback) rides on each successful status, as SGLang's prefill sends it.

Staged path (``staged.py``): when the decode granted a lane to this source (``TransferRequest.lanes``)
the leg goes through this rank's ``PrefillStaging`` (gather, one write per chunk, per-chunk signals),
or, without staging here or with no block for that rank, the direct write with the lane marked direct.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pdfleet_runtime.engines.base import PeerId, PeerInfo, TransferEngine
from pdfleet_runtime.engines.errors import EngineError, FailureKind, TransferFailed
from pdfleet_runtime.layouts import StateType
from pdfleet_runtime.planner import (
    STATE_ORDER,
    Blocks,
    PairPlan,
    PlanError,
    compile_destination,
    source_ranks,
)
from pdfleet_runtime.records import ParallelShape, RankRegistration, RequestIndices

from .auth import ProtocolError
from .client import BootstrapClient, BootstrapUnreachable
from .messages import (
    Cancel,
    DecodeRegister,
    PrefillPoll,
    PrefillRegister,
    PrefillWork,
    PromptFill,
    RankKey,
    RankModel,
    StatusReport,
    StatusReports,
    SyntheticFill,
    TransferRequest,
)
from .states import FailureReason, RequestState, RequestTracker, StateTimeouts

if TYPE_CHECKING:
    from .staged import PrefillStaging

__all__ = ["PrefillRank", "PrefillSettings", "SyntheticError"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
Pair = tuple[int, int]
_DIRECT = "direct"  # staged.Path.DIRECT (a StrEnum) without importing torch into this module
LegKey = tuple[str, Pair]  # (decode instance, decode rank)
WRITE_GRACE_S = 1.0
"""Past the write timeout, how long a write's engine call may take to return before its request fails:
the engine's own deadline (``Transfer.wait``) fires first unless its status call itself hangs."""
WRITERS = 64
"""Writer threads of one prefill rank: one per decode rank being written to (a hung call keeps its own)."""


class SyntheticError(RuntimeError):
    """The ``synthetic`` callback could not make a request's state; the request fails with ``failure``
    (``BUSY`` when the pools are full)."""

    def __init__(self, failure: FailureReason, reason: str) -> None:
        super().__init__(reason)
        self.failure = failure


@dataclass(frozen=True)
class PrefillSettings:
    """Timing of one prefill rank. ``poll_wait_s`` must stay well under the bootstrap's lease (5 s)."""

    timeouts: StateTimeouts = field(default_factory=StateTimeouts)
    poll_wait_s: float = 1.0
    rpc_timeout_s: float = 5.0
    register_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    tick_s: float = 0.1


@dataclass
class _Decode:
    msg: DecodeRegister
    registration: RankRegistration
    peer: PeerId | None = None
    plan: PairPlan | None = None
    error: str = ""
    link: Any = None
    """The staged path's chunk link to this decode rank (made on its first staged leg)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by the write (or staged prepare) to this decode rank in flight: one at a time per peer. An
    asyncio lock: a write waiting for it holds no worker thread (hung calls must not use them all up)."""


@dataclass
class _Leg:
    request: TransferRequest
    state: RequestState = RequestState.WAITING_FOR_INPUT
    report: StatusReport | None = None
    writing: bool = False
    """The engine may still be writing to this destination (its status cannot be fenced yet)."""
    prepare: asyncio.Task[Any] | None = None
    """Staged: the task cutting this leg's plan and writing the decode's table (``PrefillRank.prepare``)."""
    blocks: Blocks | None = None


@dataclass
class _Request:
    request_id: str
    src: RequestIndices | None = None
    legs: dict[LegKey, _Leg] = field(default_factory=dict)
    expected: frozenset[LegKey] | None = None
    released: bool = False
    filling: bool = False
    """A synthetic request's state is being made (``synthetic`` callback)."""
    writing: bool = False
    """A write task runs: source items are freed only after it returns (the engine may still read them)."""


class PrefillRank:
    """Coordinator of one prefill rank (one process, one engine)."""

    def __init__(self, registration: RankRegistration, engine: TransferEngine, engine_info: PeerInfo,
                 client: BootstrapClient, *, settings: PrefillSettings | None = None,
                 release: Callable[[str], None] | None = None,
                 before_write: Callable[[str], Awaitable[None]] | None = None,
                 synthetic: Callable[[str, SyntheticFill | PromptFill], Awaitable[RequestIndices]] | None = None,
                 on_report: Callable[[TransferRequest, StatusReport], None] | None = None,
                 first_token: Callable[[str], int | None] | None = None,
                 expected_tokens: Callable[[str], tuple[int, ...]] | None = None,
                 staging: PrefillStaging | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registration, self.engine, self.client = registration, engine, client
        self.settings = settings or PrefillSettings()
        self.me: Pair = (registration.tp_rank, registration.pp_rank)
        self._engine_info = engine_info
        self._release, self._before_write = release, before_write
        self._synthetic, self._on_report = synthetic, on_report
        self._first_token = first_token
        self._expected_tokens = expected_tokens
        self.staging = staging
        self.tracker = RequestTracker(self.settings.timeouts, clock)
        self._clock = clock
        self._siblings: dict[Pair, RankRegistration] = {}
        self._decodes: dict[LegKey, _Decode] = {}
        self._targets: dict[ParallelShape, frozenset[Pair]] = {}  # decode shape -> the ranks this rank feeds
        self._requests: dict[str, _Request] = {}
        self._outbox: list[StatusReport] = []
        self._outbox_event = asyncio.Event()
        self._ack = 0
        self._siblings_tag = ""
        self._more = False
        self._engine_lock = threading.Lock()
        self._writers = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="prefill-write")
        self._tasks: set[asyncio.Task[None]] = set()
        self.polls_failed = 0

    # ------------------------------------------------------------------ public

    async def register(self) -> None:
        """Register with the pod's bootstrap, retrying while it is not up (bounded)."""
        msg = PrefillRegister(rank=RankModel.of(self.registration), engine=self._engine_info.to_wire(),
                              write_timeout_s=self.settings.write_timeout_s)  # decodes fence at least this long
        deadline = self._clock() + self.settings.register_timeout_s
        delay = 0.05
        while True:
            try:
                await self.client.call(msg, timeout_s=self.settings.rpc_timeout_s)
                return
            except BootstrapUnreachable:
                if self._clock() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def add_request(self, request_id: str, indices: RequestIndices) -> RequestState:
        """The local scheduler says: this request's state is in the pools at ``indices``; they are ours now.

        A request the decode side already gave up on (cancelled, timed out) is released at once and
        reported Failed, so its items never leak.
        """
        req = self._request(request_id)
        if req is None:
            if self._release is not None:
                self._release(request_id)
            return RequestState.FAILED
        if req.src is not None:
            raise ValueError(f"request {request_id} was added twice")
        req.src = indices
        self._progress(req)
        return self.tracker.get(request_id).state

    def prepare(self, request_id: str, indices: RequestIndices) -> None:
        """The request's source items are known (its state is still being computed): cut the plans of its
        staged legs and hand each decode its block table now, on worker threads, so that the transfer
        starts with its first gather once the state is ready."""
        req = self._requests.get(request_id)
        if req is None or self.staging is None or not self.staging.enabled:
            return
        for key, leg in req.legs.items():
            if leg.request.lanes and leg.prepare is None:
                leg.prepare = asyncio.get_running_loop().create_task(self._prepare_leg(key, leg, indices))

    async def _prepare_leg(self, key: LegKey, leg: _Leg, src: RequestIndices) -> Any:
        """A leg's ``Prepared``, or None (the write path then plans, and reports any problem, itself)."""
        dec = self._decodes.get(key)
        if dec is None or dec.peer is None or self.staging is None:
            return None
        try:
            if dec.plan is None:
                dec.plan = self._compile(key, dec)
            blocks = dec.plan.plan(src, leg.request.indices.indices())
            lane = self._lane(key, dec, leg)
        except (PlanError, ValueError):
            return None
        if not blocks.descriptors or lane is None:
            return None
        try:
            async with dec.lock:
                leg.writing = True  # the table and ready word go to the decode's lane
                prepared = await asyncio.get_running_loop().run_in_executor(
                    self._writers, self._prepare_staged, dec, blocks, lane)
        except Exception as e:  # the write retries it and reports what fails
            log.info("prefill rank %s: staged prepare for %s failed: %s", self.me, key[1], e)
            return None
        finally:
            leg.writing = False
            self._fence(leg)
        leg.blocks = blocks
        return prepared

    def _prepare_staged(self, dec: _Decode, blocks: Blocks, lane: Any) -> Any:
        st, a = self.staging, dec.msg.staging
        assert st is not None and a is not None
        return st.prepare(self._link(dec), lane, blocks.src - self.registration.region.address,
                          blocks.dst - dec.registration.region.address, blocks.length, slot_bytes=a.slot_bytes,
                          min_chunks=a.min_chunks)

    def _link(self, dec: _Decode) -> Any:
        if dec.link is None:
            from pdfleet_runtime.engines.chunks import chunk_link

            assert dec.peer is not None and dec.msg.staging is not None
            link = chunk_link(self.engine, dec.peer)
            a = dec.msg.staging
            link.check_remote(a.address, a.lanes * (a.slots * a.slot_bytes + a.table_bytes) + a.lanes * 64)
            dec.link = link
        return dec.link

    def outcome(self, request_id: str) -> RequestState | None:
        return self.tracker.get(request_id).state if request_id in self.tracker else None

    @property
    def in_flight(self) -> int:
        return sum(1 for r in self._requests.values() if not r.released)

    def holding(self) -> set[str]:
        """Requests whose source items this coordinator still holds (it releases each once)."""
        return {rid for rid, r in self._requests.items() if not r.released}

    async def run(self, stop: asyncio.Event) -> None:
        """Poll, report and expire until ``stop`` is set (then flush reports for a moment)."""
        tasks = [asyncio.create_task(self._poll_loop(stop)), asyncio.create_task(self._report_loop(stop)),
                 asyncio.create_task(self._tick_loop(stop))]
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flush(), timeout=self.settings.rpc_timeout_s)
            for t in [*tasks, *self._tasks]:
                t.cancel()
            await asyncio.gather(*tasks, *self._tasks, return_exceptions=True)
            self._writers.shutdown(wait=False)  # a thread still in a hung engine call is left to it

    # ------------------------------------------------------------------ loops

    async def _poll_loop(self, stop: asyncio.Event) -> None:
        delay = 0.05
        while not stop.is_set():
            try:
                reply = await self.client.call(
                    PrefillPoll(rank=RankKey(tp=self.me[0], pp=self.me[1]), ack=self._ack,
                                wait_s=0.0 if self._more else self.settings.poll_wait_s,  # more: next page now
                                siblings_tag=self._siblings_tag),
                    timeout_s=self.settings.poll_wait_s + self.settings.rpc_timeout_s)
            except (BootstrapUnreachable, ProtocolError) as e:
                self.polls_failed += 1
                log.warning("prefill rank %s: poll failed: %s", self.me, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            delay = 0.05
            assert isinstance(reply.body, PrefillWork)
            await self._apply(reply.body)

    async def _report_loop(self, stop: asyncio.Event) -> None:
        delay = 0.05
        while not stop.is_set():
            await self._outbox_event.wait()
            self._outbox_event.clear()
            try:
                await self._flush()
                delay = 0.05
            except (BootstrapUnreachable, ProtocolError) as e:  # kept: sent again when the pod answers
                log.warning("prefill rank %s: status report failed: %s", self.me, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                self._outbox_event.set()

    async def _flush(self) -> None:
        """Send queued statuses in batches; a batch the pod refuses for good is retried one by one and
        the refused reports dropped (for example a request the pod already forgot), never retried forever."""
        while self._outbox:
            batch = self._outbox[:512]
            try:
                await self.client.call(StatusReports(reports=tuple(batch)), timeout_s=self.settings.rpc_timeout_s)
            except ProtocolError as e:
                if e.code.retryable:
                    raise
                for r in batch:
                    try:
                        await self.client.call(StatusReports(reports=(r,)), timeout_s=self.settings.rpc_timeout_s)
                    except ProtocolError as one:
                        if one.code.retryable:
                            raise
                        log.warning("prefill rank %s: pod refused status of %s: %s", self.me, r.request_id, one)
                    self._outbox.remove(r)
                continue
            del self._outbox[: len(batch)]

    async def _tick_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for rec in self.tracker.expire():
                req = self._requests.get(rec.request_id)
                if req is not None:
                    self._fail_request(req, FailureReason.TIMEOUT, rec.reason)
            self.tracker.purge()
            await asyncio.sleep(self.settings.tick_s)

    # ------------------------------------------------------------------ events

    async def _apply(self, work: PrefillWork) -> None:
        for sib in work.siblings:
            self._siblings[sib.rank.rank.pair] = sib.rank.registration()
        self._siblings_tag, self._more = work.siblings_tag, work.more
        for ev in work.events:
            if ev.seq <= self._ack:
                continue  # re-sent after a lost reply: already applied
            if ev.decode is not None:
                await self._on_decode(ev.decode)
            elif ev.request is not None:
                self._on_request(ev.request)
            elif ev.cancel is not None:
                self._on_cancel(ev.cancel)
            self._ack = ev.seq

    async def _on_decode(self, msg: DecodeRegister) -> None:
        key = (msg.instance, msg.rank.rank.pair)
        old = self._decodes.get(key)
        if old is not None and old.msg == msg:
            return
        dec = _Decode(msg, msg.rank.registration())
        self._decodes[key] = dec
        if old is not None and old.link is not None:
            await asyncio.to_thread(self._locked, old.link.close)
        if old is not None and old.peer is not None:
            await asyncio.to_thread(self._locked, self.engine.forget, old.peer)
        try:
            dec.peer = await asyncio.to_thread(self._locked, self.engine.connect, PeerInfo.from_wire(msg.engine))
        except EngineError as e:
            dec.error = f"cannot connect to decode rank {key[1]} of {key[0]}: {e}"
            log.warning("prefill rank %s: %s", self.me, dec.error)

    def _on_request(self, msg: TransferRequest) -> None:
        leg_key = (msg.instance, msg.dst.pair)
        req = self._request(msg.request_id, deadline=self._clock() + msg.timeout_s)
        if req is None or leg_key in req.legs:
            return
        req.legs[leg_key] = _Leg(msg)
        if msg.fill is not None and req.src is None and not req.filling and self._synthetic is not None:
            req.filling = True
            self._spawn(self._fill(req, msg.fill))
        if req.expected is None:
            dec = self._decodes.get(leg_key)
            if dec is None:
                self._report(req, _Leg(msg), RequestState.FAILED, FailureReason.PLAN,
                             f"decode rank {leg_key[1]} of {msg.instance} sent a request before registering")
                return
            req.expected = frozenset((msg.instance, d) for d in self._targets_of(dec.registration.shape))
        self._progress(req)

    async def _fill(self, req: _Request, fill: SyntheticFill | PromptFill) -> None:
        assert self._synthetic is not None
        try:
            idx = await self._synthetic(req.request_id, fill)
        except SyntheticError as e:
            if not self.tracker.get(req.request_id).state.terminal:
                self._fail_request(req, e.failure, f"synthetic request {req.request_id}: {e}")
            return
        req.src = idx
        if req.released:  # cancelled or timed out while filling: give the items straight back
            if self._release is not None:
                self._release(req.request_id)
            return
        self._progress(req)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_cancel(self, msg: Cancel) -> None:
        req = self._requests.get(msg.request_id)
        if req is not None:
            self._fail_request(req, FailureReason.CANCELLED, f"decode cancelled: {msg.reason or 'no reason given'}")

    # ------------------------------------------------------------------ request progress

    def _request(self, request_id: str, *, deadline: float | None = None) -> _Request | None:
        req = self._requests.get(request_id)
        if req is None:
            if request_id in self.tracker:
                return None  # finished and released earlier
            self.tracker.start(request_id, deadline=deadline)
            req = self._requests[request_id] = _Request(request_id)
        return req

    def _progress(self, req: _Request) -> None:
        rec = self.tracker.get(req.request_id)
        if rec.state is RequestState.BOOTSTRAPPING and req.expected is not None and req.expected <= set(req.legs):
            self.tracker.advance(req.request_id, RequestState.WAITING_FOR_INPUT)
            rec = self.tracker.get(req.request_id)
        if rec.state is RequestState.WAITING_FOR_INPUT and req.src is not None:
            self.tracker.advance(req.request_id, RequestState.TRANSFERRING)
            self._spawn(self._transfer(req))

    async def _transfer(self, req: _Request) -> None:
        req.writing = True
        try:
            if self._before_write is not None:
                await self._before_write(req.request_id)
            for key, leg in sorted(req.legs.items()):
                if self.tracker.get(req.request_id).state.terminal:
                    break  # failed meanwhile (timeout or cancel): every leg was reported
                leg.state = RequestState.TRANSFERRING
                await self._write_leg(req, key, leg)
            else:
                self._finish(req)
        finally:
            req.writing = False
            for leg in req.legs.values():
                self._fence(leg)
            if self.tracker.get(req.request_id).state.terminal:
                self._free(req)

    async def _write_leg(self, req: _Request, key: LegKey, leg: _Leg) -> None:
        dec = self._decodes.get(key)
        if dec is None or dec.peer is None:
            why = dec.error if dec is not None else f"decode rank {key[1]} of {key[0]} is not registered"
            self._report(req, leg, RequestState.FAILED, FailureReason.PEER_UNREACHABLE, why)
            return
        t0 = time.perf_counter()
        prepared = await leg.prepare if leg.prepare is not None else None
        try:
            if dec.plan is None:
                dec.plan = self._compile(key, dec)
            assert req.src is not None
            blocks = leg.blocks if prepared is not None and leg.blocks is not None else \
                dec.plan.plan(req.src, leg.request.indices.indices())
        except PlanError as e:
            self._report(req, leg, RequestState.FAILED, FailureReason.PLAN, f"planning for {key[1]}: {e}")
            return
        t1 = time.perf_counter()
        try:
            lane = self._lane(key, dec, leg)
        except ValueError as e:
            self._report(req, leg, RequestState.FAILED, FailureReason.PLAN, f"staging lane for {key[1]}: {e}")
            return
        if blocks.descriptors or lane is not None:
            try:
                async with dec.lock:  # one write per decode rank at a time
                    if self._ended(req.request_id):
                        return  # failed while an earlier write to this rank ran: every leg was reported
                    leg.writing = True
                    await self._deadlined(req, key, self._write, dec, req.request_id, blocks, lane, prepared)
            except EngineError as e:
                leg.writing = False
                failure = (FailureReason.PEER_UNREACHABLE if e.kind is FailureKind.PEER_UNREACHABLE
                           else FailureReason.ENGINE)
                self._report(req, leg, RequestState.FAILED, failure, f"write to decode rank {key[1]}: {e}")
                return
            finally:
                leg.writing = False
                self._fence(leg)
        self._report(req, leg, RequestState.SUCCESS, None, "", blocks=blocks, plan_s=t1 - t0,
                     write_s=time.perf_counter() - t1)

    async def _deadlined(self, req: _Request, key: LegKey, fn: Callable[..., object], *args: object) -> None:
        """Run a write on a writer thread; past the write timeout plus ``WRITE_GRACE_S`` fail the request
        (``TIMEOUT``, its statuses unfenced: the engine may still write) and wait on for the thread,
        so that the leg is fenced and the source items freed only once the engine call has returned."""
        task = asyncio.get_running_loop().run_in_executor(self._writers, fn, *args)
        budget = self.settings.write_timeout_s + WRITE_GRACE_S
        try:
            await asyncio.wait_for(asyncio.shield(task), budget)
            return
        except TimeoutError:
            if not self.tracker.get(req.request_id).state.terminal:
                why = (f"write to decode rank {key[1]} of {key[0]}: the engine call has not returned after "
                       f"{budget:.1f}s (write timeout {self.settings.write_timeout_s:.1f}s)")
                log.warning("prefill rank %s: %s", self.me, why)
                self._fail_request(req, FailureReason.TIMEOUT, why)
        with contextlib.suppress(EngineError):
            await task

    def _lane(self, key: LegKey, dec: _Decode, leg: _Leg) -> Any:
        """The decode's staging lane granted to this source (addresses), or None (direct write)."""
        lanes, announced = leg.request.lanes, dec.msg.staging
        if not lanes:
            return None
        if announced is None or self.staging is None:
            raise ValueError("lanes granted, but " + ("the decode announced no staging region" if announced is None
                                                      else "this prefill rank has no staging region"))
        order = sorted(source_ranks(self.registration.shape, dec.registration.shape, key[1][0], key[1][1]))
        if len(lanes) != len(order):
            raise ValueError(f"{len(lanes)} lanes granted for {len(order)} sources")
        return self.staging.lane(announced, lanes[order.index(self.me)])

    def _write(self, dec: _Decode, request_id: str, blocks: Blocks, lane: Any, prepared: Any = None) -> None:
        """One leg's bytes (worker thread, this decode's lock held): staged through ``lane``, else the direct write."""
        assert dec.peer is not None
        st = self.staging
        if lane is None or st is None:
            t0 = time.monotonic()
            self.engine.write(dec.peer, blocks, timeout_s=self.settings.write_timeout_s)
            log.info("direct leg %s -> %s: %d bytes in %d blocks, written %.6f-%.6f", request_id, dec.peer,
                     blocks.bytes, blocks.descriptors, t0, time.monotonic())
            if st is not None:
                st.metrics.count(_DIRECT, blocks.bytes)
            return
        link = self._link(dec)
        if not st.enabled or not blocks.descriptors:
            st.direct(link, lane)
            if blocks.descriptors:
                self.engine.write(dec.peer, blocks, timeout_s=self.settings.write_timeout_s)
                st.metrics.count(_DIRECT, blocks.bytes)
            return
        try:
            if prepared is None:
                prepared = self._prepare_staged(dec, blocks, lane)
            t0 = time.monotonic()
            chunks = st.send_prepared(link, prepared, abort=lambda: self._ended(request_id),
                                      timeout_s=self.settings.write_timeout_s, request=request_id,
                                      where=f"rank {self.me} -> {dec.peer}")
        except EngineError:
            raise
        except (RuntimeError, TimeoutError, ValueError) as e:  # staging.Aborted, StagingError, a stalled ring
            raise TransferFailed(f"staged write: {e}") from e
        m = st.metrics
        log.info("staged leg %s -> %s: %d bytes in %d chunks, sent %.6f-%.6f; means so far: chunk %.1f us, landed "
                 "write %.1f us, freed read %.1f us (%d reads)", request_id, dec.peer, prepared.total, chunks, t0,
                 time.monotonic(), m.chunk_s.mean * 1e6, m.landed_write_s.mean * 1e6, m.freed_read_s.mean * 1e6,
                 m.freed_read_s.n)

    def _ended(self, request_id: str) -> bool:
        return request_id not in self.tracker or self.tracker.get(request_id).state.terminal

    def _targets_of(self, shape: ParallelShape) -> frozenset[Pair]:
        """The decode ranks of a shape that this rank is a source of (paired once per decode shape)."""
        targets = self._targets.get(shape)
        if targets is None:
            P = self.registration.shape
            targets = self._targets[shape] = frozenset(
                d for d in shape.coords() if self.me in source_ranks(P, shape, d[0], d[1]))
        return targets

    def _compile(self, key: LegKey, dec: _Decode) -> PairPlan:
        P, D = self.registration.shape, dec.registration.shape
        wanted = source_ranks(P, D, key[1][0], key[1][1])
        missing = [s for s in wanted if s not in self._siblings]
        if missing:
            raise PlanError(f"prefill ranks {missing} have not registered with the pod")
        dest = compile_destination(dec.registration, [self._siblings[s] for s in wanted])
        mine = [p for p in dest.pairs if p.src_rank == self.registration.rank]
        if len(mine) != 1:
            raise PlanError(f"rank {self.me} is not a source of decode rank {key[1]}")
        return mine[0]

    def _report(self, req: _Request, leg: _Leg, state: RequestState, failure: FailureReason | None, reason: str,
                *, blocks: Blocks | None = None, plan_s: float = 0.0, write_s: float = 0.0) -> None:
        if leg.report is not None:
            return  # one status per leg
        leg.state = state
        m = leg.request
        by_state, desc_by_state = {}, {}
        if blocks is not None and blocks.descriptors:
            by_state = {StateType(k): v for k, v in blocks.bytes_by_state().items()}
            if blocks.state is not None:
                codes, counts = np.unique(blocks.state, return_counts=True)
                desc_by_state = {STATE_ORDER[int(c)]: int(n) for c, n in zip(codes, counts, strict=True)}
        leg.report = StatusReport(
            request_id=m.request_id, instance=m.instance, src=RankKey(tp=self.me[0], pp=self.me[1]), dst=m.dst,
            state=state, failure=failure, reason=reason, bytes=blocks.bytes if blocks is not None else 0,
            descriptors=blocks.descriptors if blocks is not None else 0, bytes_by_state=by_state,
            descriptors_by_state=desc_by_state, plan_seconds=plan_s, write_seconds=write_s, fenced=not leg.writing,
            first_token=self._first_token(m.request_id) if self._first_token and state is RequestState.SUCCESS
            else None,
            expected_tokens=self._expected_tokens(m.request_id) if self._expected_tokens
            and state is RequestState.SUCCESS else ())
        self._outbox.append(leg.report)
        self._outbox_event.set()
        if self._on_report is not None:
            self._on_report(m, leg.report)

    def _fence(self, leg: _Leg) -> None:
        """The write to this leg's destination has returned: confirm a status that was sent unfenced."""
        if leg.report is not None and not leg.report.fenced and not leg.writing:
            leg.report = leg.report.model_copy(update={"fenced": True})
            self._outbox.append(leg.report)
            self._outbox_event.set()

    def _finish(self, req: _Request) -> None:
        reports = [leg.report for leg in req.legs.values()]
        failed = [r for r in reports if r is None or r.state is RequestState.FAILED]
        if failed:
            first = failed[0]
            self.tracker.fail(req.request_id, first.failure if first and first.failure else FailureReason.ENGINE,
                              first.reason if first else "a leg ended without a status")
        else:
            self.tracker.advance(req.request_id, RequestState.SUCCESS)
        self._free(req)

    def _fail_request(self, req: _Request, failure: FailureReason, reason: str) -> None:
        self.tracker.fail(req.request_id, failure, reason)
        for leg in req.legs.values():
            if leg.report is None:
                self._report(req, leg, RequestState.FAILED, failure, reason)
        self._free(req)

    def _free(self, req: _Request) -> None:
        if not req.released and not req.writing:
            req.released = True
            self._requests.pop(req.request_id, None)
            if req.src is not None and self._release is not None:
                self._release(req.request_id)

    def _locked(self, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """Connect, forget, close a link: calls that change the engine's peer table, one at a time."""
        with self._engine_lock:
            return fn(*args, **kwargs)
