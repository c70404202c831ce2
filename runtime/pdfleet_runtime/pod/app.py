"""The pod server: ``pdfleet-runtime serve``'s pod process (HTTP, readiness, drain), over the rank processes.

Reading order: ``PodServer.run`` (start, serve, shut down), the HTTP handlers, then the loops:
``_canary_loop`` (decode: find prefill pods, canary each, record verdicts), ``_gate_loop`` (the
verdict to /readyz, the ``pdfleet_ready`` gauge and the pod's readiness-gate condition), ``_pod_loop``
(the operator's drain requests) and drain (``start_drain``, ``cancel_drain``; the phases are ``drain.Drain``).
Where a synthetic request goes is ``routing.RequestRouter``.

HTTP (``httpPort``, 8080): ``GET /healthz`` (the pod process and every rank process are alive),
``GET /readyz`` (the transfer-path verdict with its reason; 200 or 503), ``GET /metrics``
(Prometheus), ``POST /v1/synthetic`` (decode pods: one synthetic request end to end), and the worker
API (``openai_api``: the OpenAI endpoints, SGLang's ``/generate`` and registration endpoints). Metrics
(``metricsPort``, 8090, ``pod.metrics_port``): ``GET /metrics`` alone, for a scraper kept off the worker API. Admin
(``adminPort``, 8081, on 127.0.0.1 only, ``pod.admin``): ``POST /drain[?wait=true]`` (stop
admitting, finish in-flight; the exec preStop hook) and ``DELETE /drain`` (cancel a drain: routable
again). docs/runtime-server.md describes each answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pdfleet_runtime import __version__
from pdfleet_runtime.config import (
    DRAIN_ANNOTATION,
    DRAINED_CONDITION,
    SILENT_FALLBACK_CONDITION,
    Role,
    drained_message,
)
from pdfleet_runtime.layouts import layout_digest, resolve_layout
from pdfleet_runtime.model.hf_config import read_config
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.discovery import (
    DnsResolver,
    Endpoint,
    FileResolver,
    ResolveError,
    Resolver,
    StaticResolver,
)
from pdfleet_runtime.protocol.group import group_codec
from pdfleet_runtime.protocol.http_guard import GuardedServer
from pdfleet_runtime.protocol.keys import Keyring, load_secret, mounted_keys, new_rank_key
from pdfleet_runtime.protocol.messages import WIRE, RequestKind, parse_wire
from pdfleet_runtime.rank.pipe import Generated, GenerateOp, LegReport, RankStats, StatsOp, Transport

from .admin import start_admin
from .compute_cost import warming
from .drain import Drain, DrainPhase
from .fallbacks import FallbackReason
from .gate import GateWriter, NoGate
from .group import GroupRanks
from .launcher import LaunchError, RankCallError, RankLauncher, rank_specs
from .metrics import CONTENT_TYPE, ServerMetrics
from .metrics_port import start_metrics
from .model_text import ChatMessage, ModelTextError
from .openai_api import WorkerApi, request_items, request_state_bytes_by_state
from .options import ServeOptions
from .readiness import Readiness, pools_held
from .router_checks import RouterChecks
from .routing import CALLER_FAULT, NOT_THE_PATH, RequestRouter, SyntheticResult, canary_result
from .worker_api import ApiError, load_json
from .worker_auth import WorkerAuth

__all__ = ["GATE_REASSERT_S", "PodServer"]

# The gate condition is written again this often with an unchanged verdict, so a value someone else
# wrote (the pod's status is patchable by more than this runtime) does not stick.
GATE_REASSERT_S = 30.0
CANARY_CHAT = "Recite the Zen of Python."
"""A model pod's canary question (any model answers something; the check is that PD's answer is aggregate's). The
project's Zen model was not trained on it, and zeroing its first GDN layer's recurrent state changes the answer's
second token."""
CANARY_EXPECT = 16
"""Tokens of the canary's continuation checked."""
POOLS_S = 2.0
"""How often the pod reads its ranks' pool accounting (metrics and the ``PoolsHeld`` readiness fact)."""

log = logging.getLogger("pdfleet_runtime.server")
_ID_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/@+=-")


class PodServer:
    """One pod: its rank processes, its HTTP endpoint, (prefill) its bootstrap endpoint."""

    def __init__(self, opts: ServeOptions, *, gate: GateWriter | None = None, resolver: Resolver | None = None) -> None:
        self.opts = opts
        cfg = opts.config
        self.role = cfg.role
        self.metrics = ServerMetrics(self.role.value)
        self.metrics.floor_gbps.set(opts.floor)
        if self.role is Role.DECODE:  # what a pulled request moved, by state type
            # a request's split depends on its token count only: computed once per count, not per transfer
            self.metrics.split_states_with(functools.lru_cache(maxsize=1024)(
                functools.partial(request_state_bytes_by_state, cfg)))
        self.metrics.info.labels(__version__, cfg.runtime_version, opts.stand_in_for or "").set(1)
        self.readiness = Readiness(self.role.value, opts.floor, opts.failures_not_ready, ranks_total=cfg.shape.world)
        self.gate: GateWriter = gate or NoGate()
        if resolver is None:
            if opts.prefill_addresses:
                resolver = StaticResolver([Endpoint(h, p) for h, p in opts.prefill_addresses])
            elif opts.prefill_addresses_file is not None:
                resolver = FileResolver(opts.prefill_addresses_file)
            else:
                resolver = DnsResolver(cfg.prefill_service, cfg.bootstrap_port)
        self.resolver = resolver
        self.router_checks = RouterChecks(cfg.router_health_failures, recent_s=cfg.router_drop_seconds)
        """The routers' health checks of ``/health``, counted per caller: when every router has dropped the pod."""
        self._pod_wake = asyncio.Event()
        self.drain = Drain(cfg.drain_timeout_seconds, self._in_flight_now, on_change=self._set_draining,
                           on_admit=self._set_admitting, leave_s=cfg.router_drop_seconds,
                           routers=self.router_checks, on_done=self._drain_done)
        self._recheck = asyncio.Event()
        self.router = RequestRouter(self.readiness, self.metrics, self._recheck)
        self._tasks: list[asyncio.Task[None]] = []
        self._gate_written: tuple[bool, str] | None = None
        self._gate_written_at = 0.0
        self._fallback_written: tuple[bool, str] | None = None
        self._drain_by_operator = False
        self.bootstrap: BootstrapServer | None = None
        self._rank_key = new_rank_key()
        """This incarnation's rank key: its bootstrap and its own rank processes (over the pipe) hold it."""
        self.launcher: RankLauncher | GroupRanks | None = None
        self._canary: tuple[tuple[int, ...], int] | None = None
        self.http_port = opts.http_port
        self._runner: web.AppRunner | None = None
        self._http_server: asyncio.Server | None = None
        self.auth = WorkerAuth(Keyring.from_file(cfg.worker_key_path) if cfg.worker_key_path else None)
        """The worker key required on the routes that start or hold work, and the port's bounds."""
        self._admin: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.metrics.in_flight_from(lambda: float(self._in_flight_estimate()))
        self.worker = WorkerApi(self, self.metrics.registry)
        """The OpenAI endpoints and SGLang's PD worker contract (``openai_api``), over this server as its
        ``WorkerPod``."""
        born, cost = time.monotonic(), self.worker.cost
        self.readiness.warming = lambda: warming(cost, time.monotonic() - born)  # a declared start-up delay

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Serve until ``stop`` is set or SIGTERM/SIGINT (then drain within the budget); the exit code."""
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, sig, stop)
        cfg, opts = self.opts.config, self.opts
        secret = load_secret(cfg.secret_path)
        try:
            if self.role is Role.PREFILL:
                wire = parse_wire(opts.faults.wire) if opts.faults.wire else WIRE
                state = BootstrapState(cfg.shape, wire=wire, model=cfg.model_identity or "",
                                       layout=layout_digest(resolve_layout(cfg.layout)))
                state.admit = self.worker.rooms.admit  # claims of rooms go through the worker API's rooms,
                state.settled = self.worker.rooms.settle  # and so do the ends of their legs
                codec = Codec(mounted_keys(cfg.secret_path, secret), opts.instance, rank_key=self._rank_key)
                self.bootstrap = BootstrapServer(state, codec, host=opts.bind_host, port=opts.bootstrap_port)
                self.bootstrap.answers = {"/query": self.worker.vllm_query,  # vLLM's Mooncake bootstrap: the engine id
                                          "/handshake": self.worker.vllm_handshake}  # what a decode checks
                await self.bootstrap.start()
            await self._start_http()
            log.info("%s pod %s serving HTTP on %s:%d%s", self.role.value, opts.instance, opts.bind_host,
                     self.http_port, f", bootstrap on :{self.bootstrap.port}" if self.bootstrap else "")
            self.launcher = self.router.launcher = self._ranks(secret)
            await self.launcher.start()
        except (LaunchError, OSError) as e:
            log.error("cannot start: %s", e)
            await self._close()
            return 1
        for h in self.launcher.handles:
            t = h.info.transport if h.info else Transport(None, None, None, None)
            self.metrics.transport.labels(h.spec.name, cfg.backend.value, str(t.requested), str(t.engine_protocol),
                                          str(t.effective), str(t.pinned).lower()).set(1)
        self._tasks.append(loop.create_task(_kept(self._gate_loop)))
        self._tasks.append(loop.create_task(_kept(self._pools_loop)))
        if not isinstance(self.gate, NoGate):  # in a cluster: follow the operator's drain requests
            self._tasks.append(loop.create_task(_kept(self._pod_loop)))
        if self.role is Role.DECODE:
            self._tasks.append(loop.create_task(_kept(self._canary_loop)))
        await stop.wait()
        await self._shutdown()
        return 0

    def _ranks(self, secret: bytes) -> RankLauncher | GroupRanks:
        """This pod's rank processes; a group leader's also drive its members' ranks (``pod.group``)."""
        cfg, o = self.opts.config, self.opts
        boot = ("127.0.0.1", self.bootstrap.port if self.bootstrap else o.bootstrap_port)
        rank_key = self._rank_key if cfg.role is Role.PREFILL else None
        local = RankLauncher(rank_specs(o, secret, bootstrap=boot, rank_key=rank_key), on_report=self._on_report)
        if cfg.group is None:
            return local
        keys = mounted_keys(cfg.group.secret_path, load_secret(cfg.group.secret_path))
        ranks = GroupRanks(local, cfg, group_codec(keys, o.instance), host=o.bind_host, port=o.group_port,
                           instance=o.instance, rank_key=rank_key,
                           bootstrap_port=self.bootstrap.port if self.bootstrap else None,
                           on_report=self._on_report, on_lost=self._on_member_lost)
        if self.bootstrap is not None:
            self.bootstrap.rank_peers = ranks.member_addresses
        return ranks

    def _on_member_lost(self, ranks: list[tuple[int, int]], why: str) -> None:
        """A lost member's prefill ranks: what they had not finished fails now (their decodes stop waiting)."""
        if self.bootstrap is not None:
            task = asyncio.get_running_loop().create_task(self.bootstrap.fail_sources(ranks, why))
            self._tasks.append(task)

    def _on_signal(self, sig: signal.Signals, stop: asyncio.Event) -> None:
        log.info("%s: draining (budget %ds), then exiting", sig.name, self.opts.config.drain_timeout_seconds)
        self.start_drain()
        stop.set()

    async def _shutdown(self) -> None:
        await self.drain.wait()
        await self._close()
        log.info("stopped (drain %s)", "forced" if self.drain.forced else self.drain.phase.value)

    async def _close(self) -> None:
        self.drain.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for aux in (self._admin, self._metrics_runner):
            if aux is not None:
                await aux.cleanup()
        if self._http_server is not None:
            self._http_server.close()
        if self._runner is not None:  # first: no request may reach a rank that is stopping
            await self._runner.cleanup()
        if self.launcher is not None:
            await self.launcher.stop(10.0)
        if self.bootstrap is not None:
            await self.bootstrap.stop()

    async def _start_http(self) -> None:
        auth = self.auth
        app = web.Application(middlewares=[auth.middleware])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/synthetic", self._synthetic)
        self.worker.add_routes(app)
        # Handlers still running at exit are cut after 2 s (the drain has already waited for transfers); a
        # refused body is read and dropped for ``linger_s`` after the answer, then its connection closed.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0,
                                     keepalive_timeout=auth.limits.idle_s, lingering_time=auth.limits.linger_s)
        await self._runner.setup()
        assert self._runner.server is not None
        auth.guard = GuardedServer(self._runner.server, auth.limits)
        family = socket.AF_INET6 if ":" in self.opts.bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.opts.bind_host, self.opts.http_port))
        self.http_port = sock.getsockname()[1]  # port 0 (tests): the one chosen
        self._http_server = await asyncio.get_running_loop().create_server(auth.guard, sock=sock, backlog=1024)
        self._admin = await start_admin(self._drain, self._undrain, self.opts.admin_port)
        self._metrics_runner = await start_metrics(self._metrics, self.opts.bind_host, self.opts.metrics_port)

    async def read_body(self, request: web.Request) -> bytes:
        """A request's body within the port's read deadline (``ApiError`` 408 when it trickles in)."""
        try:
            async with asyncio.timeout(self.auth.limits.read_s):
                return await request.read()
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within {self.auth.limits.read_s:g}s",
                           code="request_timeout") from None

    # ------------------------------------------------------------------ the worker API's interface (WorkerPod)

    @property
    def bootstrap_state(self) -> BootstrapState | None:
        return self.bootstrap.state if self.bootstrap is not None else None

    def ranks_up(self) -> int:
        return self.launcher.up if self.launcher is not None else 0

    def ranks_died(self) -> bool:
        return self.launcher is not None and bool(self.launcher.died)

    async def rank_stats(self, timeout_s: float) -> list[RankStats]:
        if self.launcher is None:
            return []
        return [s for s in await self.launcher.call_all(StatsOp(), timeout_s=timeout_s) if isinstance(s, RankStats)]

    def health_checked(self, request: web.Request | None, ok: bool) -> None:
        # Only callers holding the worker key are routers whose checks end a drain's window (anyone may ask).
        caller = (request.remote if request is not None and self.auth.allows(request.headers.get("Authorization"))
                  else None)
        self.router_checks.answered(caller, ok, time.monotonic())

    async def known_prefill(self, ep: Endpoint) -> bool:
        return await self.router.known(ep, self.resolver)

    async def pull(self, ep: Endpoint, room: int, tokens: int, request_id: str, seed: int, timeout_s: float, *,
                   retry_refused_s: float, prompt: tuple[int, ...] = ()) -> SyntheticResult:
        return await self.router.pull(ep, room, tokens, request_id, seed, timeout_s, retry_refused_s=retry_refused_s,
                                      prompt=prompt)

    async def generate(self, op: GenerateOp, timeout_s: float,
                       on_token: Callable[[int, int], None] | None = None) -> Generated:
        if self.launcher is None:
            raise RankCallError("rank processes are not up")
        res = await self.launcher.call(0, op, timeout_s=timeout_s, on_progress=on_token)
        if not isinstance(res, Generated):
            raise RankCallError(f"decode rank 0 answered {type(res).__name__} to GenerateOp")
        return res

    # ------------------------------------------------------------------ HTTP

    async def _healthz(self, _: web.Request) -> web.Response:
        died = self.launcher.died if self.launcher else []
        body = {"alive": not died, "role": self.role.value, "phase": self.drain.phase.value,
                "ranksUp": self.launcher.up if self.launcher else 0, "ranks": self.opts.config.shape.world,
                "died": died}
        return web.json_response(body, status=503 if died else 200)

    async def _readyz(self, _: web.Request) -> web.Response:
        self._refresh_facts()
        body = self.readiness.as_json()
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        self._refresh_facts()
        await self._scrape_staged()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _scrape_staged(self) -> None:
        """The ranks' staged-path counters (``RankStats.staged``) into the pod's metrics; kept as last seen
        when a rank does not answer in time."""
        if self.launcher is None or not self.launcher.up:
            return
        with contextlib.suppress(RankCallError):
            stats = await self.launcher.call_all(StatsOp(), timeout_s=2.0)
            if all(isinstance(s, RankStats) for s in stats):  # a partial sum would make the counters fall
                self.metrics.staged.update(s.staged for s in stats if isinstance(s, RankStats))

    async def _drain(self, request: web.Request) -> web.Response:
        self.start_drain()
        if request.query.get("wait", "").lower() in ("1", "true", "yes"):
            await self.drain.wait()
        return web.json_response(await self._drain_body())

    async def _undrain(self, _: web.Request) -> web.Response:
        self.cancel_drain()
        return web.json_response(await self._drain_body())

    async def _drain_body(self) -> dict[str, Any]:
        return {"phase": self.drain.phase.value, "drained": self.drain.phase is DrainPhase.DRAINED,
                "forced": self.drain.forced,
                "inFlight": await self._in_flight_now()}

    async def _synthetic(self, request: web.Request) -> web.Response:
        if self.role is not Role.DECODE:
            return web.json_response({"error": "synthetic requests start at a decode pod"}, status=409)
        if not self.drain.admitting:
            return web.json_response({"error": f"the pod is draining ({self.drain.phase.value}): no new requests"},
                                     status=503)
        if self.launcher is None or self.launcher.up < self.opts.config.shape.world:
            lost = self.launcher.lost if isinstance(self.launcher, GroupRanks) else []
            return web.json_response({"error": "; ".join(lost) or "rank processes are not up"}, status=503)
        try:
            body = load_json(await self.read_body(request)) if request.can_read_body else {}
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            tokens = int(body.get("tokens", self.opts.canary_tokens))
            rid = str(body.get("requestId") or f"syn-{uuid.uuid4().hex[:16]}")
            seed = int(body.get("seed", 0))
            timeout_s = float(body.get("timeoutS", self.opts.request_timeout_s))
            verify = bool(body.get("verify", True))
            if not 1 <= tokens <= self.opts.config.kv_tokens or not 0 < timeout_s <= 3600:
                raise ValueError(f"tokens must be in 1..{self.opts.config.kv_tokens}, timeoutS in (0, 3600]")
            if not 0 < len(rid) <= 200 or not set(rid) <= _ID_OK:
                raise ValueError(f"requestId {rid[:50]!r} is not a valid request id")
        except ApiError as e:
            return web.json_response({"error": f"bad synthetic request: {e.message}"}, status=e.status)
        except (ValueError, TypeError, AttributeError, OverflowError) as e:
            return web.json_response({"error": f"bad synthetic request: {e}"}, status=400)
        res = await self.router.run(RequestKind.REQUEST, tokens, rid, seed, timeout_s, verify=verify,
                                    own_budget=timeout_s >= self.opts.request_timeout_s)
        status = 200 if res.ok else 503 if res.failure in NOT_THE_PATH else 409 if res.failure in CALLER_FAULT else 502
        return web.json_response(res.as_json(), status=status)

    # ------------------------------------------------------------------ loops

    async def _canary_loop(self) -> None:
        n = itertools.count()
        tag = uuid.uuid4().hex[:8]  # ids are opaque and a client's may be any: its own cannot be guessed
        o = self.opts
        while True:
            self._recheck.clear()  # first: a recheck asked for during this round starts the next one at once
            if self.drain.serving and not self._group_incomplete():
                try:
                    endpoints = await asyncio.to_thread(self.resolver.resolve)
                except ResolveError as e:
                    endpoints = []
                    self.readiness.discovery_error = f"cannot find prefill pods: {e}"
                self.router.found(endpoints)
                self.readiness.forget_peers({str(e) for e in endpoints})
                self.metrics.forget_peers({str(e) for e in endpoints})
                tokens = min(o.canary_tokens, o.config.kv_tokens)
                prompt, expect = self._canary_prompt()
                for ep in list(endpoints):
                    if not self.drain.serving:
                        break
                    res = await self.router.run(RequestKind.CANARY, tokens, f"canary-{o.instance}-{tag}-{next(n)}",
                                                0, o.canary_timeout_s, endpoint=ep, prompt=prompt, expect=expect)
                    canary = canary_result(res)
                    if canary is None:
                        continue  # pools full of real traffic: no verdict either way
                    check = self.readiness.record_canary(str(ep), canary)
                    if canary.ok and canary.gbps is not None and canary.gbps < o.floor:
                        self.worker.fallbacks.count(FallbackReason.BELOW_FLOOR)
                    if check.ok:
                        self.router.shunned.discard(str(ep))
                    self.metrics.canary(str(ep), check.gbps or 0.0, check.ok)
            period = o.canary_period_s if self.readiness.verdict().ready else o.retry_period_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), period)

    def _canary_prompt(self) -> tuple[tuple[int, ...], int]:
        """A model pod's canary: a fixed prompt (``CANARY_CHAT``, through the chat template when the model has one;
        ids drawn over the vocabulary without a tokenizer) and the tokens of its continuation the prefill computes
        itself and the decode's must equal. A seeded pod's canary moves seeded bytes: ``((), 0)``."""
        if self._canary is None:
            self._canary = (), 0
            text, model = self.worker.text, self.opts.config.model
            if text is not None and model is not None:
                try:
                    msg = [ChatMessage(role="user", content=CANARY_CHAT)]
                    ids = text.encode(text.render_chat(msg) if text.template_source else CANARY_CHAT)
                except ModelTextError:
                    vocab = int(read_config(model.path).get("vocab_size") or 2)
                    ids = tuple((7919 * i + 3) % vocab for i in range(16))
                self._canary = ids[: self.opts.config.kv_tokens - CANARY_EXPECT], CANARY_EXPECT
        return self._canary

    def _group_incomplete(self) -> bool:
        """A group leader whose members are not all joined (or one is lost): a canary would say nothing about
        the transfer path (readiness says WaitingForGroup or GroupMemberLost instead)."""
        ranks = self.launcher
        return isinstance(ranks, GroupRanks) and bool(ranks.waiting or ranks.lost)

    async def _gate_loop(self) -> None:
        last: tuple[bool, str] | None = None
        while True:
            self._refresh_facts()
            v = self.readiness.verdict()
            key = (v.ready, v.problem.value)
            if key != last:
                log.info("readiness: %s (%s): %s", "ready" if v.ready else "not ready", v.problem.value, v.reason)
                last = key
            if key != self._gate_written or time.monotonic() - self._gate_written_at >= GATE_REASSERT_S:
                try:
                    await self.gate.set(v.ready, v.problem.value, v.reason)
                    self._gate_written, self._gate_written_at = key, time.monotonic()
                except Exception as e:  # the API may be briefly unavailable: retried next tick
                    log.warning("cannot write the readiness gate: %s", e)
            await self._report_fallbacks()
            await asyncio.sleep(0.25)

    async def _report_fallbacks(self) -> None:
        """The ``pdfleet.io/silent-fallback`` condition, written when its verdict changes (``pod.fallbacks``)."""
        fb = self.worker.fallbacks.verdict()
        if (fb.active, fb.reason) == self._fallback_written:
            return
        (log.warning if fb.active else log.info)("silent fallback: %s (%s): %s", fb.active, fb.reason, fb.message)
        try:
            await self.gate.set_condition(SILENT_FALLBACK_CONDITION, fb.active, fb.reason, fb.message)
            self._fallback_written = (fb.active, fb.reason)
        except Exception as e:  # retried next tick
            log.warning("cannot write the silent-fallback condition: %s", e)

    async def _pools_loop(self) -> None:
        """The ranks' held items by reason into the metrics and the ``PoolsHeld`` fact, every ``POOLS_S``."""
        cfg = self.opts.config
        tokens = min(self.opts.canary_tokens, cfg.kv_tokens)
        need = request_items(cfg, tokens)
        while True:
            await asyncio.sleep(POOLS_S)
            launcher = self.launcher
            if launcher is None or launcher.up < cfg.shape.world:
                continue
            try:
                stats = [s for s in await launcher.call_all(StatsOp(), timeout_s=5.0) if isinstance(s, RankStats)]
            except RankCallError:
                continue
            held: dict[str, int] = {}
            for st in stats:
                for k, v in st.held_by.items():
                    held[k] = held.get(k, 0) + v
            lowest = {k: min(st.free.get(k, 0) for st in stats) for k in {k for st in stats for k in st.free}}
            self.metrics.pools(held, lowest, {i: st.reclaimed for i, st in enumerate(stats)})
            active = self.router.active if self.role is Role.DECODE else self.worker.running
            self.readiness.pools_held = pools_held([st.held_by for st in stats], [st.free for st in stats], need,
                                                   active)

    async def _pod_loop(self) -> None:
        """Follow the operator's drain request on this pod (the ``pdfleet.io/drain-started``
        annotation): start the drain, cancel it when the annotation goes, and report
        ``pdfleet.io/drained`` once no transfer is in flight, so the operator may delete the pod."""
        reported: tuple[str, bool] | None = None  # the (drain, drained) last written, or None
        drain: str | None = None  # the drain followed: the annotation's value
        while True:
            try:
                annotations = await self.gate.annotations()
            except Exception as e:  # the API may be briefly unavailable: asked again next tick
                log.warning("cannot read this pod: %s", e)
                annotations = None
            if annotations is not None:
                wanted = annotations.get(DRAIN_ANNOTATION)
                if wanted is not None and self.drain.serving:
                    log.info("the operator asked for a drain (annotation %s=%s)", DRAIN_ANNOTATION, wanted)
                    self.start_drain()
                elif wanted is None and not self.drain.serving and self._drain_by_operator:
                    self.cancel_drain()
                self._drain_by_operator = wanted is not None
                if wanted is not None:
                    drain = wanted
                want = self._drained_report(drain, wanted is not None)
                if want is not None and want[:2] != reported:
                    stamp, ok, reason, text = want
                    try:
                        await self.gate.set_condition(DRAINED_CONDITION, ok, reason, drained_message(stamp, text))
                        reported = (stamp, ok)
                    except Exception as e:
                        log.warning("cannot report drained: %s", e)
            self._pod_wake.clear()
            with contextlib.suppress(TimeoutError):  # a finished drain is reported at once, not on the next tick
                await asyncio.wait_for(self._pod_wake.wait(), 0.5)

    def _drained_report(self, drain: str | None, wanted: bool) -> tuple[str, bool, str, str] | None:
        """(drain, drained, reason, text) to write: False when a drain starts or is cancelled (so a report
        of an earlier drain cannot stand), True once it is drained; None before any drain."""
        if drain is None:
            return None
        if not wanted:
            return drain, False, "Cancelled", "drain cancelled: serving again"
        if self.drain.phase is not DrainPhase.DRAINED:
            return drain, False, "Draining", "drain started: finishing in-flight transfers"
        if self.drain.forced:
            return drain, True, "Forced", "drain deadline passed with transfers in flight"
        return drain, True, "Drained", "no transfer in flight"

    def _refresh_facts(self) -> None:
        r = self.readiness
        if self.launcher is not None:
            r.ranks_up = self.launcher.up
            r.died = list(self.launcher.died)
            if isinstance(self.launcher, GroupRanks):
                r.group_lost, r.group_waiting = self.launcher.lost, self.launcher.waiting
            self.metrics.ranks_up.set(r.ranks_up)
        if self.bootstrap is not None:
            r.bootstrap_registered = len(self.bootstrap.state.ranks)
        self.metrics.ready.set(1 if r.verdict().ready else 0)

    def _on_report(self, rank: int, rep: LegReport) -> None:
        """A prefill rank's status of one leg: metrics, and the canary / failure facts of readiness."""
        self.metrics.transfer(rep.kind, rep.ok, rep.bytes, rep.write_s, rep.failure)
        self.readiness.record_leg(rep.ok, rep.failure, rep.reason, canary=rep.kind is RequestKind.CANARY)

    # ------------------------------------------------------------------ drain

    def start_drain(self) -> None:
        """Leave the routers (``/health`` 503), then stop admitting (synthetic and worker requests refused;
        prefill: the bootstrap refuses new requests); idempotent."""
        if self.drain.start():
            leave, routers = self.drain.leave_s, self.router_checks.pending()
            wait = (f"until the routers checking it ({', '.join(sorted(routers))}) have each failed "
                    f"{self.router_checks.failures} checks, at most {leave:g}s" if routers and self.router_checks.counting
                    else f"for {leave:g}s more")
            log.info("drain started: %d transfers in flight%s", self._in_flight_estimate(),
                     f"; /health 503, admitting {wait} (routers drop the pod)" if leave else "")

    def cancel_drain(self) -> None:
        """A drain no longer wanted: take requests again (the pod becomes routable after its next check)."""
        if self.drain.cancel():
            self._recheck.set()
            log.info("drain cancelled")

    def _set_draining(self, draining: bool) -> None:
        """Readiness and the metric follow the drain at once (``/health`` reads the drain's phase)."""
        self.readiness.draining = draining
        self.metrics.draining.set(int(draining))

    def _drain_done(self, forced: bool) -> None:
        self.metrics.drains.labels("forced" if forced else "drained").inc()
        self._pod_wake.set()

    def _set_admitting(self, admitting: bool) -> None:
        """The end of the routers' window: (prefill) the bootstrap refuses new requests, or takes them again."""
        if not admitting:
            window = self.drain.window
            ended = f" ({window[0]:.2f}s into the drain, window ended by {window[1].value})" if window else ""
            if window is not None:
                self.metrics.drain_window.labels(window[1].value).observe(window[0])
            log.info("admission stopped: %d transfers in flight%s", self._in_flight_estimate(), ended)
        if self.bootstrap is not None:
            self.bootstrap.state.drain(not admitting)

    def _in_flight_estimate(self) -> int:
        computing = self.worker.computing if hasattr(self, "worker") else 0  # the declared compute (seeded_load)
        if self.bootstrap is not None:
            return self.bootstrap.state.unfinished + computing
        return self.router.active + computing

    async def _in_flight_now(self) -> int:
        """Decode: requests admitted and not answered. Prefill: requests some source has not finished, and
        source items still held by a rank (a write not yet returned)."""
        n = self._in_flight_estimate()
        if self.bootstrap is not None and self.launcher is not None and self.launcher.up:
            with contextlib.suppress(RankCallError):
                n += sum(s.in_flight for s in await self.launcher.call_all(StatsOp(), timeout_s=5.0)
                         if isinstance(s, RankStats))
        return n


async def _kept(loop_fn: Callable[[], Awaitable[None]]) -> None:
    """Run a server loop for good: a bug in one pass is logged and the loop restarts a second later."""
    while True:
        try:
            await loop_fn()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; restarting it", getattr(loop_fn, "__name__", "loop"))
            await asyncio.sleep(1.0)
