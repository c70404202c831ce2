"""The pod server: ``pdfleet-runtime serve``'s pod process (HTTP, readiness, drain), over the rank processes.

Reading order: ``PodServer.run`` (start, serve, shut down), the HTTP handlers, then the loops:
``_canary_loop`` (decode: find prefill pods, canary each, record verdicts), ``_gate_loop`` (the
verdict to /readyz, the ``pdfleet_ready`` gauge and the pod's readiness-gate condition), and drain
(``start_drain``, ``_drain_watch``).

HTTP (``httpPort``, 8080): ``GET /healthz`` (the pod process and every rank process are alive),
``GET /readyz`` (the transfer-path verdict with its reason; 200 or 503), ``GET /metrics``
(Prometheus), ``GET|POST /drain[?wait=true]`` (stop admitting, finish in-flight; the preStop hook),
``DELETE /drain`` (cancel a drain: routable again), ``POST /v1/synthetic`` (decode pods: one
synthetic request end to end). docs/runtime-server.md describes each answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from aiohttp import web

from pdfleet_runtime.config import DRAIN_ANNOTATION, DRAINED_CONDITION, Role, drained_message
from pdfleet_runtime.protocol.auth import Codec, load_secret
from pdfleet_runtime.protocol.bootstrap import BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.discovery import (
    DnsResolver,
    Endpoint,
    FileResolver,
    ResolveError,
    Resolver,
    StaticResolver,
)
from pdfleet_runtime.protocol.messages import WIRE, parse_wire
from pdfleet_runtime.records import ParallelShape

from .gate import GateWriter, NoGate
from .launcher import LaunchError, RankCallError, RankLauncher, RankSpec
from .metrics import CONTENT_TYPE, ServerMetrics
from .options import ServeOptions
from .readiness import CanaryResult, Problem, Readiness, busy, classify

__all__ = ["GATE_REASSERT_S", "DrainPhase", "PodServer", "SyntheticResult"]

# The gate condition is written again this often with an unchanged verdict, so a value someone else
# wrote (the pod's status is patchable by more than this runtime) does not stick.
GATE_REASSERT_S = 30.0

log = logging.getLogger("pdfleet_runtime.server")
_ID_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/@+=-")


class DrainPhase(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"


@dataclass(frozen=True)
class SyntheticResult:
    """One synthetic request through every rank of this decode pod."""

    request_id: str
    ok: bool
    failure: str | None
    reason: str
    bytes: int
    write_s: float
    seconds: float
    mismatched: int
    prefill: str | None
    released: bool = False
    """Failed with every rank's items given back at once (nothing accepted it): another pod may take it."""

    def as_json(self) -> dict[str, Any]:
        return {"requestId": self.request_id, "ok": self.ok, "failure": self.failure, "reason": self.reason,
                "bytes": self.bytes, "writeSeconds": self.write_s, "seconds": self.seconds,
                "mismatchedBytes": self.mismatched, "prefill": self.prefill}


class PodServer:
    """One pod: its rank processes, its HTTP endpoint, (prefill) its bootstrap endpoint."""

    def __init__(self, opts: ServeOptions, *, gate: GateWriter | None = None, resolver: Resolver | None = None) -> None:
        self.opts = opts
        cfg = opts.config
        self.role = cfg.role
        self.metrics = ServerMetrics(self.role.value)
        self.metrics.floor_gbps.set(opts.floor)
        self.readiness = Readiness(self.role.value, opts.floor, opts.failures_not_ready, ranks_total=cfg.shape.ranks)
        self.gate: GateWriter = gate or NoGate()
        if resolver is None:
            if opts.prefill_addresses:
                resolver = StaticResolver([Endpoint(h, p) for h, p in opts.prefill_addresses])
            elif opts.prefill_addresses_file is not None:
                resolver = FileResolver(opts.prefill_addresses_file)
            else:
                resolver = DnsResolver(cfg.prefill_service, cfg.bootstrap_port)
        self.resolver = resolver
        self.phase = DrainPhase.SERVING
        self.drain_started: float | None = None
        self.drain_forced = False
        self._drained = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        self._recheck = asyncio.Event()
        self._active = 0
        self._endpoints: list[Endpoint] = []
        self._shunned: set[str] = set()  # prefill pods that refused a request as draining or did not answer
        self._rr = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._gate_written: tuple[bool, str] | None = None
        self._gate_written_at = 0.0
        self._drain_by_operator = False
        self.bootstrap: BootstrapServer | None = None
        self.launcher: RankLauncher | None = None
        self.http_port = opts.http_port
        self._runner: web.AppRunner | None = None
        self.metrics.in_flight_from(lambda: float(self._in_flight_estimate()))

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
                state = BootstrapState(ParallelShape(cfg.shape.tensor, cfg.shape.pipeline), wire=wire)
                self.bootstrap = BootstrapServer(state, Codec(secret, opts.instance), host=opts.bind_host,
                                                 port=opts.bootstrap_port)
                await self.bootstrap.start()
            await self._start_http()
            log.info("%s pod %s serving HTTP on %s:%d%s", self.role.value, opts.instance, opts.bind_host,
                     self.http_port, f", bootstrap on :{self.bootstrap.port}" if self.bootstrap else "")
            self.launcher = RankLauncher(self._specs(secret), on_report=self._on_report)
            await self.launcher.start()
        except (LaunchError, OSError) as e:
            log.error("cannot start: %s", e)
            await self._close()
            return 1
        for h in self.launcher.handles:
            t = h.info["transport"] if h.info else {}
            self.metrics.transport.labels(h.spec.name, cfg.backend.value, str(t.get("requested")),
                                          str(t.get("engine_protocol")), str(t.get("effective")),
                                          str(t.get("pinned")).lower()).set(1)
        self._tasks.append(loop.create_task(_kept(self._gate_loop)))
        if not isinstance(self.gate, NoGate):  # in a cluster: follow the operator's drain requests
            self._tasks.append(loop.create_task(_kept(self._pod_loop)))
        if self.role is Role.DECODE:
            self._tasks.append(loop.create_task(_kept(self._canary_loop)))
        await stop.wait()
        await self._shutdown()
        return 0

    def _specs(self, secret: bytes) -> list[RankSpec]:
        cfg, o = self.opts.config, self.opts
        boot = ("127.0.0.1", self.bootstrap.port if self.bootstrap else o.bootstrap_port)
        return [RankSpec(cfg, t, p, secret, o.instance, o.advertise_host, boot, o.request_timeout_s,
                         o.write_timeout_s, o.fence_timeout_s, o.log_level, o.faults)
                for p in range(cfg.shape.pipeline) for t in range(cfg.shape.tensor)]

    def _on_signal(self, sig: signal.Signals, stop: asyncio.Event) -> None:
        log.info("%s: draining (budget %ds), then exiting", sig.name, self.opts.config.drain_timeout_seconds)
        self.start_drain()
        stop.set()

    async def _shutdown(self) -> None:
        if self.phase is not DrainPhase.SERVING and self.drain_started is not None:
            left = self.drain_started + self.opts.config.drain_timeout_seconds - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), max(0.0, left) + 0.5)
        await self._close()
        log.info("stopped (drain %s)", "forced" if self.drain_forced else self.phase.value)

    async def _close(self) -> None:
        for t in [*self._tasks, *([self._drain_task] if self._drain_task else [])]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:  # first: no request may reach a rank that is stopping
            await self._runner.cleanup()
        if self.launcher is not None:
            await self.launcher.stop(10.0)
        if self.bootstrap is not None:
            await self.bootstrap.stop()

    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("GET", "/drain", self._drain)
        app.router.add_route("POST", "/drain", self._drain)
        app.router.add_route("DELETE", "/drain", self._undrain)
        app.router.add_post("/v1/synthetic", self._synthetic)
        # Handlers still running at exit are cut after 2 s (the drain has already waited for transfers).
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.opts.bind_host, self.opts.http_port, reuse_address=True)
        await site.start()

    # ------------------------------------------------------------------ HTTP

    async def _healthz(self, _: web.Request) -> web.Response:
        died = self.launcher.died if self.launcher else []
        body = {"alive": not died, "role": self.role.value, "phase": self.phase.value,
                "ranksUp": self.launcher.up if self.launcher else 0, "ranks": self.opts.config.shape.ranks,
                "died": died}
        return web.json_response(body, status=503 if died else 200)

    async def _readyz(self, _: web.Request) -> web.Response:
        self._refresh_facts()
        body = self.readiness.as_json()
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        self._refresh_facts()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _drain(self, request: web.Request) -> web.Response:
        self.start_drain()
        if request.query.get("wait", "").lower() in ("1", "true", "yes"):
            assert self.drain_started is not None
            left = self.drain_started + self.opts.config.drain_timeout_seconds - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), max(0.0, left) + 0.5)
        return web.json_response(await self._drain_body())

    async def _undrain(self, _: web.Request) -> web.Response:
        self.cancel_drain()
        return web.json_response(await self._drain_body())

    async def _drain_body(self) -> dict[str, Any]:
        return {"phase": self.phase.value, "drained": self.phase is DrainPhase.DRAINED, "forced": self.drain_forced,
                "inFlight": await self._in_flight_now()}

    async def _synthetic(self, request: web.Request) -> web.Response:
        if self.role is not Role.DECODE:
            return web.json_response({"error": "synthetic requests start at a decode pod"}, status=409)
        if self.phase is not DrainPhase.SERVING:
            return web.json_response({"error": f"the pod is draining ({self.phase.value}): no new requests"},
                                     status=503)
        if self.launcher is None or self.launcher.up < self.opts.config.shape.ranks:
            return web.json_response({"error": "rank processes are not up"}, status=503)
        try:
            body = await request.json() if request.can_read_body else {}
            tokens = int(body.get("tokens", self.opts.canary_tokens))
            rid = str(body.get("requestId") or f"syn-{uuid.uuid4().hex[:16]}")
            seed = int(body.get("seed", 0))
            timeout_s = float(body.get("timeoutS", self.opts.request_timeout_s))
            verify = bool(body.get("verify", True))
            if not 1 <= tokens <= self.opts.config.kv_tokens or not 0 < timeout_s <= 3600:
                raise ValueError(f"tokens must be in 1..{self.opts.config.kv_tokens}, timeoutS in (0, 3600]")
            if not 0 < len(rid) <= 200 or not set(rid) <= _ID_OK or rid.startswith("canary-"):
                raise ValueError(f"requestId {rid[:50]!r} is not a valid request id")
        except (ValueError, TypeError, AttributeError) as e:
            return web.json_response({"error": f"bad synthetic request: {e}"}, status=400)
        res = await self.run_synthetic("request", tokens, rid, seed, timeout_s, verify=verify)
        status = 200 if res.ok else 503 if res.failure in ("busy", "no_peer", "draining") else 502
        return web.json_response(res.as_json(), status=status)

    # ------------------------------------------------------------------ synthetic requests

    async def run_synthetic(self, kind: str, tokens: int, request_id: str, seed: int, timeout_s: float, *,
                            verify: bool = True, endpoint: Endpoint | None = None) -> SyntheticResult:
        """One request through every rank of this decode pod; tries the next prefill pod (up to 3) when one
        refused it as draining or was unreachable before anything accepted it."""
        from .synthetic import request_seed

        self._active += 1
        t0 = time.perf_counter()
        try:
            candidates = [endpoint] if endpoint is not None else self._endpoints_for_requests()
            res = SyntheticResult(request_id, False, "no_peer", "no prefill pod known", 0, 0.0, 0.0, -1, None)
            for ep in candidates[:3]:
                res = await self._through(ep, tokens, request_id, request_seed(request_id, seed), timeout_s, verify)
                problem = None if res.ok else classify(res.failure, res.reason)
                # Another prefill pod may take it when this one refused it (draining) or never answered
                # (gone: DNS still names a deleted pod for a while) and nothing accepted it.
                if problem is not Problem.PEER_DRAINING and not (problem is Problem.UNREACHABLE and res.released):
                    break
                if kind == "request":  # requests try it last from now on, until a canary passes there again
                    self._shunned.add(str(ep))
                    self._recheck.set()
                if problem is Problem.PEER_DRAINING:
                    res = SyntheticResult(request_id, False, "draining", res.reason, 0, 0.0, res.seconds, -1, str(ep))
        finally:
            self._active -= 1
        seconds = time.perf_counter() - t0
        res = SyntheticResult(res.request_id, res.ok, res.failure, res.reason, res.bytes, res.write_s, seconds,
                              res.mismatched, res.prefill)
        if res.failure not in ("no_peer", "draining", "busy") or res.ok:
            self.metrics.transfer(kind, res.ok, res.bytes, seconds, res.failure)
        if res.mismatched > 0:
            self.metrics.mismatched.inc(res.mismatched)
        if kind == "request" and res.failure not in ("no_peer", "draining", "busy"):
            self.readiness.record_transfer(res.ok, res.reason)
            if not res.ok:
                self._recheck.set()
        log.info("request %s (%s, %d tokens) via prefill %s: %s%s, %d bytes in %.4fs", request_id, kind, tokens,
                 res.prefill, "success" if res.ok else "failed", "" if res.ok else f" ({res.failure}: {res.reason})",
                 res.bytes, seconds)
        return res

    async def _through(self, ep: Endpoint, tokens: int, rid: str, seed: int, timeout_s: float,
                       verify: bool) -> SyntheticResult:
        assert self.launcher is not None
        try:
            outs = await self.launcher.call_all("transfer", {
                "request_id": rid, "host": ep.host, "port": ep.port, "tokens": tokens, "seed": seed,
                "timeout_s": timeout_s, "verify": verify}, timeout_s=timeout_s + 30.0)
        except RankCallError as e:
            return SyntheticResult(rid, False, "rank", str(e), 0, 0.0, 0.0, -1, str(ep))
        failed = [o for o in outs if o["state"] != "success"]
        mismatched = sum(max(0, o["mismatched"]) for o in outs)
        moved = sum(o["bytes"] for o in outs)
        write_s = max(o["write_s"] for o in outs)
        if failed:
            f = failed[0]
            # The prefill pod had no room for it: load, not the path (no canary verdict, not a failing pod).
            failure = "busy" if busy(f["failure"], f["reason"]) else f["failure"]
            return SyntheticResult(rid, False, failure, f["reason"], moved, write_s, 0.0, -1, str(ep),
                                   released=all(o.get("released", False) for o in outs))
        if mismatched:
            return SyntheticResult(rid, False, "verify", f"{mismatched} bytes arrived different from the seeded state",
                                   moved, write_s, 0.0, mismatched, str(ep))
        return SyntheticResult(rid, True, None, "", moved, write_s, 0.0, 0, str(ep))

    def _endpoints_for_requests(self) -> list[Endpoint]:
        """Prefill pods whose canary passed first (round robin), then the others known, then those that
        refused a request as draining or did not answer since their last canary."""
        good = [e for e in self._endpoints if (c := self.readiness.peers.get(str(e))) is not None and c.ok
                and str(e) not in self._shunned]
        shunned = [e for e in self._endpoints if str(e) in self._shunned]
        rest = [e for e in self._endpoints if e not in good and e not in shunned] + shunned
        if good:
            k = next(self._rr) % len(good)
            good = good[k:] + good[:k]
        return good + rest

    # ------------------------------------------------------------------ loops

    async def _canary_loop(self) -> None:
        n = itertools.count()
        o = self.opts
        while True:
            self._recheck.clear()  # first: a recheck asked for during this round starts the next one at once
            if self.phase is DrainPhase.SERVING:
                try:
                    self._endpoints = await asyncio.to_thread(self.resolver.resolve)
                except ResolveError as e:
                    self._endpoints = []
                    self.readiness.discovery_error = f"cannot find prefill pods: {e}"
                self.readiness.forget_peers({str(e) for e in self._endpoints})
                self._shunned &= {str(e) for e in self._endpoints}
                tokens = min(o.canary_tokens, o.config.kv_tokens)
                for ep in list(self._endpoints):
                    if self.phase is not DrainPhase.SERVING:
                        break
                    res = await self.run_synthetic("canary", tokens, f"canary-{o.instance}-{next(n)}", 0,
                                                   o.canary_timeout_s, endpoint=ep)
                    if res.failure == "busy":
                        continue  # pools full of real traffic: no verdict either way
                    check = self.readiness.record_canary(str(ep), CanaryResult(
                        res.ok, res.failure, res.reason, res.bytes, res.write_s, max(0, res.mismatched)))
                    if check.ok:
                        self._shunned.discard(str(ep))
                    self.metrics.canary_gbps.labels(str(ep)).set(check.gbps or 0.0)
            period = o.canary_period_s if self.readiness.verdict().ready else o.retry_period_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), period)

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
            await asyncio.sleep(0.25)

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
                if wanted is not None and self.phase is DrainPhase.SERVING:
                    log.info("the operator asked for a drain (annotation %s=%s)", DRAIN_ANNOTATION, wanted)
                    self.start_drain()
                elif wanted is None and self.phase is not DrainPhase.SERVING and self._drain_by_operator:
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
            await asyncio.sleep(0.5)

    def _drained_report(self, drain: str | None, wanted: bool) -> tuple[str, bool, str, str] | None:
        """(drain, drained, reason, text) to write: False when a drain starts or is cancelled (so a report
        of an earlier drain cannot stand), True once it is drained; None before any drain."""
        if drain is None:
            return None
        if not wanted:
            return drain, False, "Cancelled", "drain cancelled: serving again"
        if self.phase is not DrainPhase.DRAINED:
            return drain, False, "Draining", "drain started: finishing in-flight transfers"
        if self.drain_forced:
            return drain, True, "Forced", "drain deadline passed with transfers in flight"
        return drain, True, "Drained", "no transfer in flight"

    def _refresh_facts(self) -> None:
        r = self.readiness
        if self.launcher is not None:
            r.ranks_up = self.launcher.up
            r.died = list(self.launcher.died)
            self.metrics.ranks_up.set(r.ranks_up)
        if self.bootstrap is not None:
            r.bootstrap_registered = len(self.bootstrap.state.ranks)
        self.metrics.ready.set(1 if r.verdict().ready else 0)

    def _on_report(self, rank: int, rep: dict[str, Any]) -> None:
        """A prefill rank's status of one leg: metrics, and the canary / failure facts of readiness."""
        kind = "canary" if rep["request_id"].startswith("canary-") else "request"
        ok = rep["state"] == "success"
        self.metrics.transfer(kind, ok, rep["bytes"], rep["write_s"], rep["failure"])
        if rep["failure"] == "cancelled" or busy(rep["failure"], rep["reason"]):
            return  # the decode gave up, or this pod had no room for it: says nothing about this pod's path
        self.readiness.record_transfer(ok, rep["reason"])
        if ok and kind == "canary":
            self.readiness.canaries_served += 1

    # ------------------------------------------------------------------ drain

    def start_drain(self) -> None:
        """Stop admitting (synthetic requests refused; prefill: the bootstrap refuses new requests); idempotent."""
        if self.phase is not DrainPhase.SERVING:
            return
        self.phase = DrainPhase.DRAINING
        self.drain_started = time.monotonic()
        self.drain_forced = False
        self._drained.clear()
        self._set_draining(True)
        log.info("drain started: %d transfers in flight", self._in_flight_estimate())
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_watch())

    def cancel_drain(self) -> None:
        """A drain no longer wanted: take requests again (the pod becomes routable after its next check)."""
        if self.phase is DrainPhase.SERVING:
            return
        if self._drain_task is not None:
            self._drain_task.cancel()
        self.phase = DrainPhase.SERVING
        self.drain_started = None
        self._drained.clear()
        self._set_draining(False)
        self._recheck.set()
        log.info("drain cancelled")

    def _set_draining(self, draining: bool) -> None:
        """Readiness, the metric and (prefill) the bootstrap's admission follow the drain together."""
        self.readiness.draining = draining
        self.metrics.draining.set(int(draining))
        if self.bootstrap is not None:
            self.bootstrap.state.drain(draining)

    async def _drain_watch(self) -> None:
        assert self.drain_started is not None
        deadline = self.drain_started + self.opts.config.drain_timeout_seconds
        while True:
            n = await self._in_flight_now()
            if n == 0 or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        self.drain_forced = n > 0
        self.phase = DrainPhase.DRAINED
        self.metrics.drains.labels("forced" if self.drain_forced else "drained").inc()
        log.info("drain %s after %.2fs%s", "forced" if self.drain_forced else "finished",
                 time.monotonic() - self.drain_started, f": {n} transfers still in flight" if n else "")
        self._drained.set()

    def _in_flight_estimate(self) -> int:
        if self.bootstrap is not None:
            return self.bootstrap.state.unfinished
        return self._active

    async def _in_flight_now(self) -> int:
        """Decode: requests admitted and not answered. Prefill: requests some source has not finished, and
        source items still held by a rank (a write not yet returned)."""
        n = self._in_flight_estimate()
        if self.bootstrap is not None and self.launcher is not None and self.launcher.up:
            with contextlib.suppress(RankCallError):
                n += sum(s["in_flight"] for s in await self.launcher.call_all("stats", {}, timeout_s=5.0))
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
