"""The decode rank's side: find the prefill pod, handshake, register once, then per request send indices
and wait until every source rank it pairs with reported.

Per request (``DecodeRank.transfer``): Bootstrapping (resolve, ``Hello``, ``DecodeRegister``; the
link is kept for later requests) -> WaitingForInput (sending the destination indices) ->
Transferring (long-polling statuses) -> Success once *every* source rank reported Success (ranks
that send nothing report too) | Failed with a kind and a reason: a source failed, the pod is
unreachable for ``unreachable_grace_s``, the pod restarted (its ``boot`` id changed), or the
request's deadline passed. On failure the pod is told to drop the request (``Cancel``, best effort);
the link is dropped so the next request re-resolves the Service and handshakes with whatever pod
answers now.

Fencing (the late-write hazard): a source may still be writing into the request's destination items
when the decode gives up. The items are released only when it is safe: at once when no
``TransferRequest`` was ever sent or every source already sent a *fenced* terminal status; else
after every source fenced its status in answer to the ``Cancel`` (its write returned), polled in
the background; else after the fence timeout (a source or pod that cannot answer: longer than any
write may run): the longer of ``fence_timeout_s`` and the write timeout the prefill ranks announced
at registration (``DecodeRegistered.write_timeout_s``) plus ``fence_margin_s``, so a decode whose
flag is shorter than the prefill's writes still never reuses items a write may reach. ``transfer`` returns the failure without waiting; ``wait_fenced`` waits for the
releases.

Staged path (``staged.py``): with a ``DecodeStaging`` the registration announces its region, and a
request of ``staged_bytes`` at or above its threshold gets one lane per source (``TransferRequest.lanes``);
a receiver per lane (worker threads) scatters each landed chunk whole. Success needs every source's
status and every receiver's end; a failed request stops its receivers between chunks, and its lanes
are released with its items (the ``release`` callback), after the fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdfleet_runtime.engines.base import PeerInfo
from pdfleet_runtime.records import RankRegistration, RequestIndices
from pdfleet_runtime.versions import CURRENT_RUNTIME_VERSION

from .auth import Codec, ProtocolError
from .client import BootstrapClient, BootstrapUnreachable, Reply
from .discovery import Endpoint, ResolveError, Resolver
from .messages import (
    WIRE,
    Cancel,
    DecodeRegister,
    DecodeRegistered,
    Hello,
    IndicesModel,
    RankKey,
    RankModel,
    RefusalCode,
    RequestKind,
    Role,
    StagingModel,
    StatusQuery,
    StatusReply,
    StatusReport,
    SyntheticFill,
    TransferRequest,
    Welcome,
    parse_wire,
)
from .states import FailureReason, IllegalTransition, RequestState, RequestTracker, StateTimeouts

if TYPE_CHECKING:
    from .staged import DecodeStaging

__all__ = ["DecodeRank", "DecodeSettings", "HandshakeRefused", "TransferOutcome"]

log = logging.getLogger(__name__)
Pair = tuple[int, int]
_SEND_ATTEMPTS = 3
_REFUSED_PAUSE_S = 0.05
_RELINK = frozenset({FailureReason.PEER_UNREACHABLE, FailureReason.PEER_RESTARTED})


class HandshakeRefused(ProtocolError):
    """The prefill pod and this rank cannot talk (versions, shapes); the reason names both sides."""


@dataclass(frozen=True)
class DecodeSettings:
    """Timing of one decode rank. ``timeouts.transferring_s`` is the default request budget."""

    timeouts: StateTimeouts = field(default_factory=StateTimeouts)
    rpc_timeout_s: float = 5.0
    status_wait_s: float = 1.0
    unreachable_grace_s: float = 2.0
    cancel_timeout_s: float = 1.0
    fence_timeout_s: float = 35.0
    """Longest a failed request's items stay held waiting for the sources' fence (the prefill's write
    timeout, 30 s by default, plus a margin): after it no write can still be running. The prefill's
    announced write timeout plus ``fence_margin_s`` is used instead when it is longer."""
    fence_margin_s: float = 5.0
    """Added to the prefill's announced write timeout: its engine's own cancellation and a status's trip."""
    fence_poll_s: float = 0.1


@dataclass(frozen=True)
class TransferOutcome:
    request_id: str
    state: RequestState
    failure: FailureReason | None
    reason: str
    reports: tuple[StatusReport, ...]
    seconds: float
    endpoint: Endpoint | None = None
    cause: FailureReason | None = None
    """What lies under ``failure``: the failed source's own kind (``SOURCE_FAILED``), or ``DRAINING`` when
    the prefill pod refused the request as draining (``REFUSED``); readiness decides on the pair."""
    landed_at: float = 0.0
    """``time.monotonic()`` when this rank knew every byte was in place (the last staged chunk scattered,
    or the last source's status for direct writes); 0 for a failed request."""
    staged: bool = False
    accepted: bool = True
    """False when the coordinator never took the request (its id is in use or was used recently): nothing
    was sent, no release will come, the caller still owns the items it allocated."""


def _refusal_cause(code: RefusalCode) -> FailureReason | None:
    return FailureReason.DRAINING if code is RefusalCode.DRAINING else None


class _Failed(Exception):
    def __init__(self, failure: FailureReason, reason: str, *, undelivered: bool = False,
                 cause: FailureReason | None = None) -> None:
        super().__init__(reason)
        self.failure, self.reason, self.cause = failure, reason, cause
        self.undelivered = undelivered  # the message never reached the pod (no connection was made)


@dataclass
class _Link:
    """A handshaken prefill pod: its address, its incarnation and the source ranks of this decode rank."""

    endpoint: Endpoint
    client: BootstrapClient
    boot: str
    sources: tuple[Pair, ...]
    welcome: Welcome
    write_timeout_s: float = 0.0
    """The longest write of this rank's sources (announced at registration)."""


class DecodeRank:
    """Coordinator of one decode rank. ``release(request_id)`` frees the request's pages, slots and rows."""

    def __init__(self, registration: RankRegistration, engine_info: PeerInfo, resolver: Resolver, codec: Codec, *,
                 instance: str, settings: DecodeSettings | None = None,
                 release: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 runtime_version: str = CURRENT_RUNTIME_VERSION, wire: str = str(WIRE),
                 staging: DecodeStaging | None = None, model: str = "", layout: str = "") -> None:
        self.registration, self.resolver, self.codec, self.instance = registration, resolver, codec, instance
        self.settings = settings or DecodeSettings()
        self.me: Pair = (registration.tp_rank, registration.pp_rank)
        self.staging = staging
        self._register_msg = DecodeRegister(instance=instance, rank=RankModel.of(registration),
                                            engine=engine_info.to_wire(),
                                            staging=StagingModel(**staging.announce()) if staging else None)
        self._release, self._clock = release, clock
        self._runtime_version, self._wire = runtime_version, wire
        self.model = model
        """The model this rank serves (``RuntimeConfig.model_identity``): a prefill pod of another one is refused."""
        self.layout = layout
        """This rank's layout digest (``layouts.layout_digest``): a prefill pod of another one is refused."""
        self.tracker = RequestTracker(self.settings.timeouts, clock)
        self._link: _Link | None = None
        self._link_lock = asyncio.Lock()
        self.handshakes = 0
        self._fences: set[asyncio.Task[None]] = set()
        self._fencing: set[str] = set()
        self.fenced = {"at_once": 0, "ack": 0, "deadline": 0}
        """How failed requests' items were released (counts): nothing in flight, sources' fence, deadline."""

    def tracks(self, request_id: str) -> bool:
        """Whether ``request_id`` is in flight or ended recently here (``transfer`` would refuse it)."""
        return request_id in self.tracker

    @property
    def fencing(self) -> set[str]:
        """Failed requests whose items wait for their sources' fence (or the deadline)."""
        return set(self._fencing)

    @property
    def fences_pending(self) -> int:
        """Failed requests whose items are still held until their sources fence (or the deadline)."""
        return len(self._fences)

    async def wait_fenced(self, timeout_s: float | None = None) -> bool:
        """Wait until every held item is released; False if ``timeout_s`` passed first."""
        if not self._fences:
            return True
        _, pending = await asyncio.wait(set(self._fences), timeout=timeout_s)
        return not pending

    async def close(self) -> None:
        for task in list(self._fences):  # the process is leaving: its memory goes with it
            task.cancel()
        if self._link is not None:
            await self._link.client.close()
            self._link = None

    # ------------------------------------------------------------------ handshake

    async def connect(self, *, timeout_s: float | None = None) -> None:
        """Handshake now (also done lazily by ``transfer``); raises ``HandshakeRefused`` or ``_Failed``."""
        deadline = self._clock() + (timeout_s or self.settings.timeouts.bootstrapping_s)
        await self._ensure_link(deadline)

    async def _ensure_link(self, deadline: float) -> _Link:
        async with self._link_lock:
            if self._link is not None:
                return self._link
            delay, last = 0.05, "no attempt"
            down_since: float | None = None
            while self._clock() < deadline:
                try:
                    endpoints = await asyncio.to_thread(self.resolver.resolve)
                    self._link = await self._handshake(endpoints[0], deadline)
                    return self._link
                except ResolveError as e:
                    last = str(e)
                except BootstrapUnreachable as e:
                    # As on a kept link: a pod that does not answer for the grace period is unreachable
                    # (gone, or not listening yet), so the caller may try another pod instead of waiting
                    # out the whole request budget on this one.
                    now = self._clock()
                    down_since = now if down_since is None else down_since
                    if now - down_since >= self.settings.unreachable_grace_s:
                        raise _Failed(FailureReason.PEER_UNREACHABLE, f"no prefill pod handshake: unreachable for "
                                      f"{now - down_since:.1f}s: {e}") from None
                    last = str(e)
                except ProtocolError as e:
                    if e.code is RefusalCode.VERSION:
                        raise HandshakeRefused(e.code, e.reason) from None
                    if not e.code.retryable:
                        raise _Failed(FailureReason.REFUSED, f"prefill pod refused the handshake: {e}",
                                      cause=_refusal_cause(e.code)) from None
                    last = str(e)
                await asyncio.sleep(min(delay, max(0.0, deadline - self._clock())))
                delay = min(delay * 2, 0.5)
            raise _Failed(FailureReason.PEER_UNREACHABLE, f"no prefill pod handshake before the deadline: {last}")

    async def _handshake(self, endpoint: Endpoint, deadline: float) -> _Link:
        client = BootstrapClient(endpoint, self.codec)
        try:
            hello = Hello(role=Role.DECODE, runtime_version=self._runtime_version, wire=self._wire,
                          instance=self.instance, model=self.model, layout=self.layout)
            reply = await client.call(hello, timeout_s=self._rpc(deadline))
            welcome = reply.body
            assert isinstance(welcome, Welcome)
            theirs = parse_wire(welcome.wire)
            if not parse_wire(self._wire).talks_to(theirs):
                raise HandshakeRefused(RefusalCode.VERSION, f"prefill pod {endpoint} (runtime "
                                       f"{welcome.runtime_version}) speaks wire protocol {theirs}; this decode "
                                       f"rank (runtime {self._runtime_version}) speaks {self._wire}")
            if welcome.model != self.model:  # an older prefill pod does not check: this side does
                raise HandshakeRefused(RefusalCode.CONFLICT, f"prefill pod {endpoint} serves model "
                                       f"{welcome.model or '(not pinned)'}; this decode rank serves "
                                       f"{self.model or '(not pinned)'}: pods of two model generations never pair")
            if welcome.layout and self.layout and welcome.layout != self.layout:
                raise HandshakeRefused(RefusalCode.CONFLICT, f"prefill pod {endpoint} keeps state in layout "
                                       f"{welcome.layout}; this decode rank's is {self.layout}: pods of two layout "
                                       "generations (a dtype, a page size, a state) never pair")
            reg = await client.call(self._register_msg, timeout_s=self._rpc(deadline))
            assert isinstance(reg.body, DecodeRegistered)
            if reg.boot != reply.boot:
                raise BootstrapUnreachable(f"prefill pod {endpoint} restarted during the handshake")
        except BaseException:
            await client.close()
            raise
        self.handshakes += 1
        derived = reg.body.write_timeout_s + self.settings.fence_margin_s
        if derived > self.settings.fence_timeout_s:
            log.warning("decode rank %s: fence timeout %.1fs is shorter than prefill pod %s's write timeout %.1fs "
                        "plus %.1fs: fencing waits %.1fs", self.me, self.settings.fence_timeout_s, endpoint,
                        reg.body.write_timeout_s, self.settings.fence_margin_s, derived)
        return _Link(endpoint, client, reply.boot, tuple(s.pair for s in reg.body.sources), welcome,
                     reg.body.write_timeout_s)

    def fence_timeout_s(self, link: _Link | None) -> float:
        """How long a failed request's items may stay held: derived from both sides (module docstring)."""
        theirs = link.write_timeout_s + self.settings.fence_margin_s if link is not None else 0.0
        return max(self.settings.fence_timeout_s, theirs)

    async def _drop_link(self, link: _Link) -> None:
        async with self._link_lock:
            if self._link is link:
                self._link = None
        await link.client.close()

    def _rpc(self, deadline: float) -> float:
        return max(0.05, min(self.settings.rpc_timeout_s, deadline - self._clock()))

    @property
    def sources(self) -> tuple[Pair, ...] | None:
        """The source ranks of this decode rank on the kept link (None before a handshake)."""
        return self._link.sources if self._link is not None else None

    # ------------------------------------------------------------------ requests

    async def transfer(self, request_id: str, indices: RequestIndices, *,
                       timeout_s: float | None = None, fill: SyntheticFill | None = None,
                       staged_bytes: int = 0, wait_refused_s: float = 0.0,
                       kind: RequestKind = RequestKind.REQUEST, room: int | None = None) -> TransferOutcome:
        """Move one request's state into this rank's items ``indices``; never raises for a failed transfer.

        ``fill`` makes it a synthetic request: the prefill makes seeded state instead of a scheduler's.
        ``kind`` and ``room`` say what it is for (``RequestKind``; ``room`` claims a room the pod holds).
        ``staged_bytes``: the bytes the request brings to this rank (the staged path's size test).
        ``wait_refused_s``: a plain refusal of the request itself (not draining; the pod changed nothing,
        e.g. it holds no room for it yet) is sent again, with the same id, for that long. Each rank
        waits for itself, so the ranks of one decode (one pod or a group) all claim under one id.
        """
        t0 = self._clock()
        budget = timeout_s or self.settings.timeouts.transferring_s
        deadline = t0 + budget
        try:
            self.tracker.start(request_id, deadline=deadline)
        except (IllegalTransition, OverflowError) as e:
            # Never taken: nothing was sent and the caller still owns its items (``accepted`` False).
            return TransferOutcome(request_id, RequestState.FAILED, FailureReason.CONFLICT,
                                   f"request id {request_id} was already used on this decode rank (it is kept "
                                   f"{self.tracker.timeouts.retain_s:g}s after it ended): send a new id ({e})",
                                   (), 0.0, accepted=False)
        reports: dict[Pair, StatusReport] = {}
        link: _Link | None = None
        sent = False
        cause: FailureReason | None = None
        lanes: tuple[int, ...] = ()
        landed_at = 0.0
        abort = threading.Event()
        receivers: list[asyncio.Future[float]] = []
        try:
            link = await self._ensure_link(deadline)
            self.tracker.advance(request_id, RequestState.WAITING_FOR_INPUT, deadline=deadline)
            idx = IndicesModel.of(indices)
            if self.staging is not None and staged_bytes:
                lanes = self.staging.grant(request_id, staged_bytes, len(link.sources)) or ()
            refused_until = t0 + min(wait_refused_s, budget)
            attempt = 0
            while True:
                req = TransferRequest(request_id=request_id, kind=kind, room=room, instance=self.instance,
                                      dst=RankKey(tp=self.me[0], pp=self.me[1]), indices=idx,
                                      timeout_s=max(0.001, deadline - self._clock()), fill=fill, lanes=lanes)
                earlier, sent = sent, True  # from here a source may write, even if the reply is lost
                try:
                    await self._call(link, req, deadline, grace_s=0.0)
                    break
                except ProtocolError as e:
                    # Refused (draining, busy limits, no room yet, ...): the pod changed nothing, so no
                    # source will write these items for this send; only an earlier one may have been
                    # accepted. Otherwise they come back at once (the caller may try another pod).
                    sent = earlier
                    if not await self._wait_refused(e, refused_until):
                        raise
                except _Failed as e:
                    if e.undelivered:
                        sent = earlier  # no connection was made: the pod never saw this send
                    # Nobody accepted the request yet, so another pod may take it: a kept link to a pod that
                    # restarted or moved is dropped, the Service re-resolved and the handshake redone.
                    attempt += 1
                    if e.failure not in _RELINK or attempt == _SEND_ATTEMPTS:
                        raise
                    log.info("decode rank %s: %s; re-resolving", self.me, e.reason)
                    link = await self._ensure_link(deadline)
            self.tracker.advance(request_id, RequestState.TRANSFERRING, deadline=deadline)
            if lanes:
                assert self.staging is not None
                receivers = [asyncio.ensure_future(asyncio.to_thread(
                    _receive, self.staging, lane, abort.is_set, max(0.001, deadline - self._clock())))
                    for lane in lanes]
                await self._collect_staged(link, request_id, reports, deadline, receivers)
                landed_at = max(r.result() for r in receivers)
            else:
                await self._collect(link, request_id, reports, deadline)
                landed_at = time.monotonic()
                if self.staging is not None and staged_bytes:
                    self.staging.metrics.count("direct", staged_bytes)  # staged.Path.DIRECT (no torch import here)
            self.tracker.advance(request_id, RequestState.SUCCESS)
        except _Failed as e:
            self.tracker.fail(request_id, e.failure, e.reason)
            cause = e.cause
        except HandshakeRefused as e:
            self.tracker.fail(request_id, FailureReason.REFUSED, e.reason)
        except ProtocolError as e:
            self.tracker.fail(request_id, FailureReason.REFUSED, f"prefill pod refused: {e}")
            cause = _refusal_cause(e.code)
        except Exception as e:  # a bug must not strand the items: failed, then released as any failure is
            log.exception("decode rank %s: request %s failed unexpectedly", self.me, request_id)
            self.tracker.fail(request_id, FailureReason.RANK, f"decode rank error: {type(e).__name__}: {e}")
        rec = self.tracker.get(request_id)
        if receivers:
            abort.set()  # a failed request's receivers stop between chunks (a finished one's have ended)
            await asyncio.gather(*receivers, return_exceptions=True)
        if rec.state is RequestState.FAILED:
            await self._after_failure(link, request_id, rec.reason, sent, reports)
        return TransferOutcome(request_id, rec.state, rec.failure, rec.reason, tuple(reports.values()),
                               self._clock() - t0, link.endpoint if link else None, cause,
                               landed_at if rec.state is RequestState.SUCCESS else 0.0, bool(lanes))

    async def _wait_refused(self, e: ProtocolError, until: float) -> bool:
        """Whether to send a refused request again (after a pause): the pod refused the request itself
        (``unexpected``: e.g. a room it does not hold yet), not as draining, and ``until`` has not passed."""
        if e.code is not RefusalCode.UNEXPECTED or self._clock() + _REFUSED_PAUSE_S >= until:
            return False
        await asyncio.sleep(_REFUSED_PAUSE_S)
        return True

    async def _call(self, link: _Link, body: TransferRequest | StatusQuery, deadline: float,
                    grace_s: float | None = None) -> Reply:
        """One call with retries on ``busy``; unreachable past the grace period or a new boot id fails it."""
        grace = self.settings.unreachable_grace_s if grace_s is None else grace_s
        down_since: float | None = None
        while True:
            if self._clock() >= deadline:
                raise _Failed(FailureReason.TIMEOUT, f"deadline passed waiting for prefill pod {link.endpoint}")
            try:
                reply = await link.client.call(body, timeout_s=self._rpc(deadline) + getattr(body, "wait_s", 0.0))
            except BootstrapUnreachable as e:
                now = self._clock()
                down_since = down_since if down_since is not None else now
                if now - down_since >= grace:
                    await self._drop_link(link)
                    raise _Failed(FailureReason.PEER_UNREACHABLE, f"prefill pod {link.endpoint} unreachable for "
                                  f"{now - down_since:.1f}s: {e}", undelivered=e.connect_failed) from None
                await asyncio.sleep(0.1)
                continue
            except ProtocolError as e:
                if e.code.retryable:
                    await asyncio.sleep(0.05)
                    continue
                if e.code in (RefusalCode.UNKNOWN_PEER, RefusalCode.WRONG_RECIPIENT):  # the pod restarted
                    await self._drop_link(link)
                    raise _Failed(FailureReason.PEER_RESTARTED, f"prefill pod {link.endpoint} forgot this rank: "
                                  f"{e.reason}") from None
                raise
            if reply.boot != link.boot:
                await self._drop_link(link)
                raise _Failed(FailureReason.PEER_RESTARTED, f"prefill pod {link.endpoint} restarted (boot "
                              f"{link.boot} -> {reply.boot}); its state for this request is gone")
            return reply

    async def _collect(self, link: _Link, request_id: str, reports: dict[Pair, StatusReport],
                       deadline: float) -> None:
        query_dst = RankKey(tp=self.me[0], pp=self.me[1])
        while True:
            wait = max(0.0, min(self.settings.status_wait_s, deadline - self._clock() - 0.05))
            reply = await self._call(link, StatusQuery(instance=self.instance, dst=query_dst,
                                                       request_ids=(request_id,), wait_s=wait), deadline)
            assert isinstance(reply.body, StatusReply)
            for r in reply.body.reports:
                if r.request_id == request_id and r.src.pair in link.sources:
                    reports[r.src.pair] = r
            failed = [r for r in reports.values() if r.state is RequestState.FAILED]
            if failed:
                f = failed[0]
                raise _Failed(FailureReason.SOURCE_FAILED, f"prefill rank {f.src.pair} reported "
                              f"{f.failure.value if f.failure else 'failure'}: {f.reason}", cause=f.failure)
            if all(s in reports and reports[s].state is RequestState.SUCCESS for s in link.sources):
                return

    async def _collect_staged(self, link: _Link, request_id: str, reports: dict[Pair, StatusReport],
                              deadline: float, receivers: list[asyncio.Future[float]]) -> None:
        """``_collect`` while the lanes' receivers run: a receiver's failure fails the request at once."""
        collect = asyncio.ensure_future(self._collect(link, request_id, reports, deadline))
        pending: set[asyncio.Future[Any]] = {collect, *receivers}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for f in done:
                    if f is not collect and f.exception() is not None:
                        e = f.exception()
                        raise _Failed(FailureReason.ENGINE, f"staged receive: {type(e).__name__}: {e}")
                if collect in done:
                    collect.result()
        finally:
            if not collect.done():
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)

    async def _after_failure(self, link: _Link | None, request_id: str, reason: str, sent: bool,
                             reports: dict[Pair, StatusReport]) -> None:
        cancelled = False
        if link is not None and self._link is link:
            with contextlib.suppress(BootstrapUnreachable, ProtocolError):
                await link.client.call(Cancel(request_id=request_id, instance=self.instance, reason=reason[:3000]),
                                       timeout_s=self.settings.cancel_timeout_s)
                cancelled = True
        sources = link.sources if link is not None else ()
        if not sent or (sources and all(_fenced(reports.get(s)) for s in sources)):
            self.fenced["at_once"] += 1
            self._do_release(request_id)
            if not sent:  # the id never left this rank: the pod may send it to another prefill pod (failover)
                self.tracker.forget(request_id)
            return
        task = asyncio.get_running_loop().create_task(
            self._fence(link if cancelled else None, request_id, sources, self._clock() + self.fence_timeout_s(link)))
        self._fences.add(task)
        self._fencing.add(request_id)
        task.add_done_callback(self._fences.discard)
        task.add_done_callback(lambda _: self._fencing.discard(request_id))

    async def _fence(self, link: _Link | None, request_id: str, sources: tuple[Pair, ...], deadline: float) -> None:
        """Release the items once every source fenced its status, or at ``deadline`` (never before)."""
        query = StatusQuery(instance=self.instance, dst=RankKey(tp=self.me[0], pp=self.me[1]),
                            request_ids=(request_id,))
        while self._clock() < deadline:
            if link is not None and self._link is link:
                try:
                    reply = await link.client.call(query, timeout_s=self._rpc(deadline))
                except (BootstrapUnreachable, ProtocolError):
                    reply = None
                if reply is not None and reply.boot == link.boot and isinstance(reply.body, StatusReply):
                    got = {r.src.pair: r for r in reply.body.reports if r.request_id == request_id}
                    if all(_fenced(got.get(s)) for s in sources):
                        self.fenced["ack"] += 1
                        self._do_release(request_id)
                        return
            await asyncio.sleep(min(self.settings.fence_poll_s, max(0.0, deadline - self._clock())))
        log.info("decode rank %s: request %s: no fence from its sources; items reused at the fence deadline",
                 self.me, request_id)
        self.fenced["deadline"] += 1
        self._do_release(request_id)

    def _do_release(self, request_id: str) -> None:
        if self._release is not None:
            self._release(request_id)


def _receive(staging: DecodeStaging, lane: int, abort: Callable[[], bool], timeout_s: float) -> float:
    """One lane's chunks (worker thread); the monotonic time its last scatter ended."""
    staging.receive(lane, abort=abort, timeout_s=timeout_s)
    return time.monotonic()


def _fenced(report: StatusReport | None) -> bool:
    return report is not None and report.state.terminal and report.fenced
