"""The prefill pod's bootstrap endpoint: where its ranks register and decode ranks find them.

Two layers, as kopf splits admission: ``BootstrapState`` is a pure, synchronous function of the
authenticated messages (registry, per-rank event logs, status fan-in; clock injected), and
``BootstrapServer`` is the aiohttp shell (one POST endpoint, signatures, size limit, long polls).
A message that is refused raises ``ProtocolError`` before anything is changed.

Who may say what (the shell checks it): ``PrefillRegister``, ``PrefillPoll`` and ``StatusReports``
only from this replica's own ranks, i.e. signed with the pod's rank key (``keys``) and from a loopback
address or, in a replica group, from the address a joined member's group connection came from
(``rank_peers``: that member proved the group key, and holds the rank key only through it); everything else from any holder of the deployment secret. Every message but ``Hello``
must name this pod and its incarnation (``Envelope.to``). The headers are checked (declared length,
header MAC) before a byte of the body is read, the body must arrive within ``HttpLimits.read_s``,
and connections are capped per peer and cut when idle (``http_guard``).

Flow: prefill ranks ``PrefillRegister`` then ``PrefillPoll`` (heartbeat + events, acknowledged by
sequence number, so a lost reply is re-sent). A decode rank says ``Hello`` (version check),
``DecodeRegister`` (refused as ``not_ready`` until every prefill rank registered), then per request
``TransferRequest`` (its ``kind`` and ``room`` say what it is for; its id is a name); it is queued to
every source rank the decode rank pairs with, after the pod's ``admit`` hook. Source ranks answer with
``StatusReports``, including ranks that send nothing; the decode rank's ``StatusQuery`` collects them,
and the pod's ``settled`` hook hears of each request once every source reported it terminal. A source rank that stops polling for ``lease_s`` is reported
``Failed (peer_lost)`` for every request it has not finished.

Draining (``drain()``): new request ids are refused with ``draining`` (a decode then tries another
pod); requests already accepted go on until every source reported, which ``unfinished`` counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdfleet_runtime.planner import PlanError, check_shapes, source_ranks
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.versions import CURRENT_RUNTIME_VERSION, WireProtocol

from .auth import AUTH_HEADER, RANK_ONLY, SIGNATURE_HEADER, Codec, KeyScope, ProtocolError
from .discovery import Endpoint
from .http_guard import GuardedServer, HttpLimits, is_loopback
from .messages import (
    WIRE,
    Ack,
    Body,
    Cancel,
    DecodeRegister,
    DecodeRegistered,
    Hello,
    PrefillPoll,
    PrefillRegister,
    PrefillWork,
    RankKey,
    RefusalCode,
    StatusQuery,
    StatusReply,
    StatusReport,
    StatusReports,
    TransferRequest,
    Welcome,
    WorkEvent,
    parse_wire,
)
from .states import FailureReason, RequestState

__all__ = ["MESSAGES_PATH", "BootstrapLimits", "BootstrapServer", "BootstrapState"]

MESSAGES_PATH = "/v1/messages"
_STATUS = {
    RefusalCode.MALFORMED: 400, RefusalCode.TOO_LARGE: 413, RefusalCode.UNSIGNED: 401,
    RefusalCode.BAD_SIGNATURE: 401, RefusalCode.REPLAYED: 409, RefusalCode.STALE: 401, RefusalCode.VERSION: 409,
    RefusalCode.NOT_READY: 503, RefusalCode.UNKNOWN_PEER: 404, RefusalCode.CONFLICT: 409, RefusalCode.BUSY: 503,
    RefusalCode.UNEXPECTED: 422, RefusalCode.DRAINING: 503, RefusalCode.WRONG_RECIPIENT: 421,
    RefusalCode.FORBIDDEN: 403,
}

Pair = tuple[int, int]


@dataclass(frozen=True)
class BootstrapLimits:
    """Bounds on what one pod holds; the defaults fit thousands of requests in flight.

    ``lease_s``: a prefill rank silent that long is lost (ranks poll at least every second).
    ``retain_s``: finished requests stay queryable that long.
    """

    lease_s: float = 5.0
    retain_s: float = 60.0
    max_requests: int = 50_000
    max_decode_ranks: int = 4096
    max_events: int = 100_000
    page_events: int = 1024
    """At most this many events in one ``PrefillWork`` (``more`` says another page waits)."""
    page_bytes: int = 1 << 20
    """... and about this many bytes of events and siblings (a rank refuses a reply over 4 MiB)."""


@dataclass
class _Pending:
    request: TransferRequest
    sources: tuple[Pair, ...]
    created: float
    reports: dict[Pair, StatusReport] = field(default_factory=dict)
    finished: float | None = None


class BootstrapState:
    """The registry and mailboxes of one prefill pod (pure; one instance per pod incarnation)."""

    def __init__(self, prefill: ParallelShape, *, limits: BootstrapLimits | None = None,
                 clock: Callable[[], float] = time.monotonic, wire: WireProtocol = WIRE, model: str = "",
                 layout: str = "") -> None:
        self.prefill, self.limits, self._clock, self.wire = prefill, limits or BootstrapLimits(), clock, wire
        self.model = model
        """The model this pod serves (``RuntimeConfig.model_identity``); a decode of another one is refused."""
        self.layout = layout
        """This pod's layout digest (``layouts.layout_digest``); a decode of another one is refused ('': not
        checked)."""
        self.draining = False
        self.broken = ""
        """Why this replica lost ranks for good (``fail_sources``); '' while whole."""
        self.ranks: dict[Pair, PrefillRegister] = {}
        self.last_seen: dict[Pair, float] = {}
        self.decodes: dict[tuple[str, Pair], DecodeRegister] = {}
        self.sources: dict[tuple[str, Pair], tuple[Pair, ...]] = {}
        """The source ranks of each registered decode rank, paired once at its registration."""
        self._events: dict[Pair, list[WorkEvent]] = {}
        self._sizes: dict[int, int] = {}
        """Serialized size of each queued event, by ``id(event)`` (measured once, at queueing)."""
        self._queued = 0
        self._siblings_tag = ""
        self._seq: dict[Pair, int] = {}
        self.pending: dict[tuple[str, str, Pair], _Pending] = {}
        self._expiry: list[tuple[float, tuple[str, str, Pair]]] = []
        """When each pending entry may go (a heap; stale entries are skipped), so a message costs what
        expires, not a walk of every entry (10.7 ms per heartbeat at 50k entries before)."""
        self._unfinished = 0
        self.version = 0
        """Bumped on every change (long polls wait for it)."""
        self.admit: Callable[[TransferRequest], TransferRequest] | None = None
        """The pod's say on a request before it is accepted: the request to accept (a held room's state
        replaces the claim's fill), or ``ProtocolError`` to refuse it (``pod/rooms.py``)."""
        self.settled: Callable[[TransferRequest, tuple[StatusReport, ...]], None] | None = None
        """Told once per accepted request, when every source reported it terminal: the request (its kind, its
        room) and the sources' reports, in their order (``pod/rooms.py``: a room's outcome, awaited per room)."""

    # ------------------------------------------------------------------ dispatch

    def handle(self, body: Body) -> Body:
        """Apply one authenticated message; the reply, or ``ProtocolError`` with nothing changed."""
        self._purge()
        match body:
            case Hello():
                return self.hello(body)
            case PrefillRegister():
                return self.prefill_register(body)
            case PrefillPoll():
                return self.prefill_poll(body)
            case DecodeRegister():
                return self.decode_register(body)
            case TransferRequest():
                return self.transfer_request(body)
            case StatusReports():
                return self.status_reports(body)
            case StatusQuery():
                return self.status_query(body)
            case Cancel():
                return self.cancel(body)
        raise ProtocolError(RefusalCode.UNEXPECTED, f"a bootstrap endpoint does not take {body.type!r} messages")

    @property
    def ready(self) -> bool:
        return len(self.ranks) == self.prefill.world

    @property
    def unfinished(self) -> int:
        """Accepted requests (per decode rank) that some source rank has not reported terminal yet."""
        self._purge()
        return self._unfinished

    def drain(self, on: bool = True) -> None:
        """Refuse new requests (``draining``) from now on; ``drain(False)`` takes them again."""
        if self.draining != on:
            self.draining = on
            self._changed()

    # ------------------------------------------------------------------ handlers

    def hello(self, msg: Hello) -> Welcome:
        try:
            theirs = parse_wire(msg.wire)
        except ValueError as e:
            raise ProtocolError(RefusalCode.MALFORMED, str(e)) from None
        if not self.wire.talks_to(theirs):
            raise ProtocolError(RefusalCode.VERSION, f"{msg.role.value} {msg.instance} (runtime {msg.runtime_version}) "
                                f"speaks wire protocol {theirs}; this prefill pod (runtime "
                                f"{CURRENT_RUNTIME_VERSION}) speaks {self.wire}")
        if msg.model != self.model:
            raise ProtocolError(RefusalCode.CONFLICT, f"{msg.role.value} {msg.instance} serves model "
                                f"{msg.model or '(not pinned)'}; this prefill pod serves {self.model or '(not pinned)'}: "
                                "pods of two model generations never pair")
        if msg.layout and self.layout and msg.layout != self.layout:  # '': a pod from before wire 1.3
            raise ProtocolError(RefusalCode.CONFLICT, f"{msg.role.value} {msg.instance} keeps state in layout "
                                f"{msg.layout}; this prefill pod's is {self.layout}: pods of two layout generations "
                                "(a dtype, a page size, a state) never pair")
        return Welcome(runtime_version=CURRENT_RUNTIME_VERSION, wire=str(self.wire), prefill_tp=self.prefill.tp,
                       prefill_pp=self.prefill.pp, ready=self.ready, model=self.model, layout=self.layout)

    def prefill_register(self, msg: PrefillRegister) -> Ack:
        key = msg.rank.rank.pair
        if msg.rank.shape != self.prefill:
            raise ProtocolError(RefusalCode.CONFLICT, f"rank registers shape {msg.rank.shape}, this pod is "
                                f"{self.prefill}")
        if key in self.ranks:
            # A rank registers once per coordinator: again means it restarted (or lost its state), so
            # what was queued for the old one is void and it must learn every decode rank anew.
            self._fail_source(key, FailureReason.PEER_RESTARTED, f"prefill rank {key} registered again "
                              "(restarted): its unfinished requests are lost")
        self.ranks[key] = msg
        self._siblings_tag = hashlib.sha256(b"".join(self.ranks[k].model_dump_json().encode()
                                                     for k in sorted(self.ranks))).hexdigest()[:32]
        self.last_seen[key] = self._clock()
        self._forget(self._events.get(key, []))
        self._events[key] = []
        self._seq.setdefault(key, 0)
        for dkey, dec in self.decodes.items():
            if key in self.sources[dkey]:
                self._push(key, decode=dec)
        self._changed()
        return Ack()

    def prefill_poll(self, msg: PrefillPoll) -> PrefillWork:
        key = msg.rank.pair
        if key not in self.ranks:
            raise ProtocolError(RefusalCode.UNKNOWN_PEER, f"prefill rank {key} has not registered")
        self.last_seen[key] = self._clock()
        log = self._events[key]
        if log and msg.ack >= log[0].seq:
            self._forget([e for e in log if e.seq <= msg.ack])
            self._events[key] = log = [e for e in log if e.seq > msg.ack]
        siblings = () if msg.siblings_tag == self._siblings_tag else tuple(self.ranks[k] for k in sorted(self.ranks))
        budget = self.limits.page_bytes - sum(len(s.model_dump_json()) for s in siblings)
        n = 0
        while n < len(log) and n < self.limits.page_events and (n == 0 or budget >= self._sizes[id(log[n])]):
            budget -= self._sizes[id(log[n])]
            n += 1
        return PrefillWork(siblings=siblings, siblings_tag=self._siblings_tag, events=tuple(log[:n]),
                           more=n < len(log))

    def decode_register(self, msg: DecodeRegister) -> DecodeRegistered:
        if not self.ready:
            raise ProtocolError(RefusalCode.NOT_READY, f"{len(self.ranks)} of {self.prefill.world} prefill ranks "
                                "registered")
        shape, dst = msg.rank.shape, msg.rank.rank.pair
        try:
            sources = self._sources(shape, dst)
        except PlanError as e:
            raise ProtocolError(RefusalCode.CONFLICT, f"decode shape {shape} cannot pair with prefill "
                                f"{self.prefill}: {e}") from None
        for (inst, _), other in self.decodes.items():
            if inst == msg.instance and other.rank.shape != shape:
                raise ProtocolError(RefusalCode.CONFLICT, f"decode instance {inst} registered shape "
                                    f"{other.rank.shape} before, now {shape}")
        key = (msg.instance, dst)
        if key not in self.decodes and len(self.decodes) >= self.limits.max_decode_ranks:
            raise ProtocolError(RefusalCode.BUSY, f"{len(self.decodes)} decode ranks registered")
        if self.decodes.get(key) != msg:
            self.decodes[key] = msg
            self.sources[key] = sources
            for src in sources:
                self._push(src, decode=msg)
            self._changed()
        return DecodeRegistered(sources=tuple(RankKey(tp=t, pp=p) for t, p in sources),
                                write_timeout_s=max(self.ranks[s].write_timeout_s for s in sources))

    def transfer_request(self, msg: TransferRequest) -> Ack:
        dst = msg.dst.pair
        dec = self.decodes.get((msg.instance, dst))
        if dec is None:
            raise ProtocolError(RefusalCode.UNKNOWN_PEER, f"decode rank {dst} of {msg.instance} has not registered")
        if self.admit is not None:
            msg = self.admit(msg)
        key = (msg.instance, msg.request_id, dst)
        have = self.pending.get(key)
        if have is not None:
            # A resend (its reply was lost, or the decode re-resolved to this pod) carries the time it has
            # left, so only what the request asks for must match; the first deadline stands.
            if have.request.model_copy(update={"timeout_s": msg.timeout_s}) != msg:
                raise ProtocolError(RefusalCode.CONFLICT, f"request {msg.request_id} was sent before with other "
                                    "indices")
            return Ack()
        if self.draining:
            raise ProtocolError(RefusalCode.DRAINING, f"prefill pod is draining: request {msg.request_id} refused, "
                                "send it to another prefill pod")
        if self.broken:
            raise ProtocolError(RefusalCode.DRAINING, f"this prefill replica lost ranks ({self.broken}): request "
                                f"{msg.request_id} refused, send it to another prefill pod")
        if len(self.pending) >= self.limits.max_requests:
            raise ProtocolError(RefusalCode.BUSY, f"{len(self.pending)} requests pending (maxRequests "
                                f"{self.limits.max_requests}): request {msg.request_id} refused, retry later or "
                                "send it to another prefill pod")
        sources = self.sources[(msg.instance, dst)]
        self._room(len(sources), f"request {msg.request_id}")
        now = self._clock()
        self.pending[key] = _Pending(msg, sources, now)
        self._unfinished += 1
        heapq.heappush(self._expiry, (now + msg.timeout_s + self.limits.retain_s, key))
        for src in sources:
            self._push(src, request=msg)
        self._changed()
        return Ack()

    def status_reports(self, msg: StatusReports) -> Ack:
        for r in msg.reports:  # check all first: a refused batch changes nothing
            p = self.pending.get((r.instance, r.request_id, r.dst.pair))
            if p is None or r.src.pair not in p.sources:
                raise ProtocolError(RefusalCode.UNEXPECTED, f"no pending request {r.request_id} from "
                                    f"{r.src.pair} to {r.dst.pair} of {r.instance}")
        for r in msg.reports:
            p = self.pending[(r.instance, r.request_id, r.dst.pair)]
            prev = p.reports.get(r.src.pair)
            if prev is None or not prev.state.terminal:  # the first outcome stands
                p.reports[r.src.pair] = r
            elif r.fenced and not prev.fenced:  # ... but a later fence (the write ended) is recorded
                p.reports[r.src.pair] = prev.model_copy(update={"fenced": True})
            self._mark_finished(p)
        self._changed()
        return Ack()

    def status_query(self, msg: StatusQuery) -> StatusReply:
        now, out = self._clock(), []
        for rid in msg.request_ids:
            p = self.pending.get((msg.instance, rid, msg.dst.pair))
            if p is None:
                continue
            for src in p.sources:
                r = p.reports.get(src)
                if (r is None or not r.state.terminal) and now - self.last_seen.get(src, 0.0) > self.limits.lease_s:
                    r = StatusReport(request_id=rid, instance=msg.instance, src=RankKey(tp=src[0], pp=src[1]),
                                     dst=msg.dst, state=RequestState.FAILED, failure=FailureReason.PEER_LOST,
                                     reason=f"prefill rank {src} stopped polling the bootstrap for more than "
                                     f"{self.limits.lease_s:.1f}s (process gone?)")
                if r is not None:
                    out.append(r)
        return StatusReply(reports=tuple(out))

    def cancel(self, msg: Cancel) -> Ack:
        hits = [p for (inst, rid, _), p in self.pending.items() if inst == msg.instance and rid == msg.request_id]
        if not hits:
            raise ProtocolError(RefusalCode.UNEXPECTED, f"no pending request {msg.request_id} of {msg.instance}")
        srcs = sorted({s for p in hits for s in p.sources})
        self._room(len(srcs), f"cancel of {msg.request_id}")
        for src in srcs:
            self._push(src, cancel=msg)
        self._changed()
        return Ack()

    # ------------------------------------------------------------------ internals

    def _sources(self, decode: ParallelShape, dst: Pair) -> tuple[Pair, ...]:
        check_shapes(self.prefill, decode)
        if not (0 <= dst[0] < decode.tp and 0 <= dst[1] < decode.pp):
            raise PlanError(f"decode rank {dst} is outside {decode}")
        return tuple(sorted(source_ranks(self.prefill, decode, dst[0], dst[1])))

    def _room(self, n: int, what: str) -> None:
        """Refuse (``busy``) what would queue ``n`` more events past ``max_events`` (every kind counts)."""
        if self._queued + n > self.limits.max_events:
            raise ProtocolError(RefusalCode.BUSY, f"{self._queued} events queued for this pod's prefill ranks "
                                f"(maxEvents {self.limits.max_events}): {what} refused, retry later")

    def _push(self, src: Pair, **kind: object) -> None:
        if src not in self._events:
            return  # not registered yet: it gets the decodes on registration, requests need it registered
        self._seq[src] += 1
        ev = WorkEvent(seq=self._seq[src], **kind)
        self._events[src].append(ev)
        self._sizes[id(ev)] = len(ev.model_dump_json()) + 1
        self._queued += 1

    def _forget(self, events: list[WorkEvent]) -> None:
        for ev in events:
            self._sizes.pop(id(ev), None)
        self._queued -= len(events)

    def fail_sources(self, sources: list[Pair], reason: str) -> None:
        """Ranks of this replica that went away for good (a lost group member's): their unfinished requests
        fail ``peer_lost`` now, not once their lease runs out, and from now on new requests are refused
        ``draining`` (the replica cannot serve them: the decode sends them to another prefill pod)."""
        for src in sources:
            self._fail_source(src, FailureReason.PEER_LOST, reason)
        self.broken = self.broken or reason
        self._changed()

    def _fail_source(self, src: Pair, failure: FailureReason, reason: str) -> None:
        for (inst, rid, dst), p in self.pending.items():
            r = p.reports.get(src)
            if src in p.sources and (r is None or not r.state.terminal):
                p.reports[src] = StatusReport(request_id=rid, instance=inst, src=RankKey(tp=src[0], pp=src[1]),
                                              dst=RankKey(tp=dst[0], pp=dst[1]), state=RequestState.FAILED,
                                              failure=failure, reason=reason)
                self._mark_finished(p)

    def _mark_finished(self, p: _Pending) -> None:
        if p.finished is None and all(s in p.reports and p.reports[s].state.terminal for s in p.sources):
            p.finished = self._clock()
            self._unfinished -= 1
            r = p.request
            heapq.heappush(self._expiry, (p.finished + self.limits.retain_s, (r.instance, r.request_id, r.dst.pair)))
            if self.settled is not None:
                self.settled(r, tuple(p.reports[s] for s in p.sources))

    def _purge(self) -> None:
        """Drop entries finished ``retain_s`` ago or past their timeout plus ``retain_s``: only those due."""
        now, keep, heap = self._clock(), self.limits.retain_s, self._expiry
        while heap and heap[0][0] < now:
            _, k = heapq.heappop(heap)
            p = self.pending.get(k)
            if p is not None and ((p.finished is not None and now - p.finished > keep)
                                  or now - p.created > p.request.timeout_s + keep):
                del self.pending[k]
                self._unfinished -= p.finished is None

    def _changed(self) -> None:
        self.version += 1


class BootstrapServer:
    """aiohttp shell around ``BootstrapState``: authenticates, applies, signs the reply, serves long polls."""

    def __init__(self, state: BootstrapState, codec: Codec, *, host: str = "127.0.0.1", port: int = 0,
                 http: HttpLimits | None = None) -> None:
        self.state, self.codec, self.host, self.port = state, codec, host, port
        self.http = http or HttpLimits()
        self._cond: asyncio.Condition | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self.guard: GuardedServer | None = None
        self.refused: dict[RefusalCode, int] = {}
        self.rank_peers: Callable[[], set[str]] = set
        """Addresses besides loopback this replica's ranks speak from (a group leader's joined members)."""
        self.answers: dict[str, Callable[[], dict[str, Any]]] = {}
        """Unauthenticated GET routes and their answers, read by vLLM-contract peers (``GET /query``: vLLM's
        Mooncake bootstrap, the engine id vllm-router reads; ``GET /handshake``: what a decode checks before
        it pulls); none by default. Set before ``start``."""

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.codec.max_bytes)
        app.router.add_post(MESSAGES_PATH, self._messages)
        app.router.add_get("/v1/healthz", self._healthz)
        for path, answer in self.answers.items():
            app.router.add_get(path, _answering(answer))
        return app

    async def start(self) -> Endpoint:
        self._cond = asyncio.Condition()
        # Handlers still running at stop (long polls) are cut after 2 s; a body left unread (a refusal
        # before reading) is read and dropped for ``linger_s`` after the answer, then the connection closed.
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                                     keepalive_timeout=self.http.idle_s, shutdown_timeout=2.0, lingering_time=self.http.linger_s)
        await self._runner.setup()
        # Bind here so that port 0 (tests) yields the chosen port; the fixed port in pods.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        assert self._runner.server is not None
        self.guard = GuardedServer(self._runner.server, self.http)
        self._server = await asyncio.get_running_loop().create_server(self.guard, sock=sock, backlog=1024)
        return self.endpoint

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ready": self.state.ready, "boot": self.codec.boot,
                                  "draining": self.state.draining})

    def _reply(self, body: Body, status: int, reply_to: str | None, *, close: bool = False) -> web.Response:
        raw, sig, _ = self.codec.seal(body, reply_to=reply_to)
        resp = web.Response(body=raw, status=status, content_type="application/json",
                            headers={SIGNATURE_HEADER: sig})
        if close:
            resp.force_close()  # the body was not read: closed after the answer (and ``linger_s`` of dropping it)
        return resp

    async def _messages(self, request: web.Request) -> web.Response:
        assert self.guard is not None
        with self.guard.busy(request.transport):
            return await self._message(request)

    async def _message(self, request: web.Request) -> web.Response:
        reply_to = None
        read = False
        try:
            headers = request.headers
            self.codec.check_headers(headers.get(SIGNATURE_HEADER), headers.get(AUTH_HEADER), request.content_length)
            raw = await self._read(request)
            read = True
            opened = self.codec.open(raw, headers.get(SIGNATURE_HEADER))
            reply_to = opened.envelope.nonce
            body = opened.body
            if opened.envelope.to is None and not isinstance(body, Hello):
                raise ProtocolError(RefusalCode.WRONG_RECIPIENT, f"a {body.type} message must name its recipient "
                                    f"(this pod: {self.codec.sender}, boot {self.codec.boot})")
            if isinstance(body, RANK_ONLY) and (opened.scope is not KeyScope.RANK
                                                or not self.rank_peer(request.remote or "")):
                raise ProtocolError(RefusalCode.FORBIDDEN, f"{body.type} is taken only from this replica's own ranks "
                                    "(signed with the pod's rank key, over loopback or from a joined group member)")
            before = self.state.version
            reply = self.state.handle(body)
            if self.state.version != before:
                await self._notify()
            if isinstance(body, PrefillPoll | StatusQuery) and body.wait_s > 0 and _empty(reply):
                await self._wait(body.wait_s)
                reply = self.state.handle(body)
            return self._reply(reply, 200, reply_to)
        except ProtocolError as e:
            self.refused[e.code] = self.refused.get(e.code, 0) + 1
            return self._reply(e.refusal(), _STATUS[e.code], reply_to, close=not read)

    async def fail_sources(self, sources: list[Pair], reason: str) -> None:
        """``BootstrapState.fail_sources``, and the long polls waiting on it answered now."""
        self.state.fail_sources(sources, reason)
        if self._cond is not None:
            await self._notify()

    def rank_peer(self, remote: str) -> bool:
        """May a rank-only message come from ``remote``: loopback, or a joined group member's address."""
        return is_loopback(remote) or remote in self.rank_peers()

    async def _read(self, request: web.Request) -> bytes:
        """The body, exactly its declared length, within ``read_s`` (a half-sent body is cut, not waited on)."""
        length = request.content_length or 0
        try:
            async with asyncio.timeout(self.http.read_s):
                return await request.content.readexactly(length)
        except TimeoutError:
            raise ProtocolError(RefusalCode.MALFORMED, f"body of {length} bytes not received within "
                                f"{self.http.read_s:g}s") from None
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise ProtocolError(RefusalCode.MALFORMED, f"body cut short: {type(e).__name__}") from None

    async def _wait(self, seconds: float) -> None:
        assert self._cond is not None
        start = self.state.version
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds), self._cond:
                await self._cond.wait_for(lambda: self.state.version != start)

    async def _notify(self) -> None:
        assert self._cond is not None
        async with self._cond:
            self._cond.notify_all()


def _empty(reply: Body) -> bool:
    if isinstance(reply, PrefillWork):
        return not reply.events
    if isinstance(reply, StatusReply):
        return not reply.reports or not all(r.state.terminal for r in reply.reports)
    return False


def _answering(answer: Callable[[], dict[str, Any]]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(_: web.Request) -> web.Response:
        return web.json_response(answer())
    return handle
