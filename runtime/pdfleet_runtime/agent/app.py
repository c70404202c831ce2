"""The agent beside an SGLang or vLLM engine: checks, the canary, the readiness gate, the drain, its own metrics.

Reading order: ``Agent.run``; the loops ``_check_loop`` (engine /health, what the engine says of itself,
config.json), ``_canary_loop`` (decode: the dialect's canary through each prefill pod), ``_gate_loop`` (the verdict
to /readyz, the ``pdfleet_ready`` gauge and the pod's readiness-gate condition) and ``_pod_loop`` (the
operator's drain requests, the ``pdfleet.io/drained`` report); then the drain. HTTP (``httpPort``):
``/healthz``, ``/readyz``, ``/metrics``; admin (``adminPort``, 127.0.0.1 only, ``pod.admin``): the
preStop hook's ``POST /drain?wait=true`` and ``DELETE /drain``. docs/agent.md describes each step.

The drain (``pod.drain.Drain``, its phases and budget ``drainTimeoutSeconds``): go not-ready, wait
``router_drop_s`` (routers stop sending the pod work), then wait until the engine's metrics report no
running and no queued request and, prefill, no transfer in flight. SGLang's routers keep a worker
until its pod is deleted (docs/router.md), so the preStop hook (the deletion) runs the wait again.
What differs by engine (its self-description, its metric names, its router's requests) is the dialect's
(``dialect.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdfleet_runtime.agent.canary import PrefillTarget
from pdfleet_runtime.agent.engine_info import EngineLoad
from pdfleet_runtime.agent.model_config import model_config_problems
from pdfleet_runtime.agent.options import AgentOptions
from pdfleet_runtime.agent.readiness import AgentReadiness
from pdfleet_runtime.config import DRAIN_ANNOTATION, DRAINED_CONDITION, drained_message
from pdfleet_runtime.layouts import LayoutError, resolve_layout
from pdfleet_runtime.pod.admin import start_admin
from pdfleet_runtime.pod.drain import Drain, DrainPhase
from pdfleet_runtime.pod.gate import GateWriter, NoGate
from pdfleet_runtime.pod.metrics import CONTENT_TYPE, LATENCY_BUCKETS
from pdfleet_runtime.protocol.discovery import DnsResolver, ResolveError

__all__ = ["Agent"]

log = logging.getLogger("pdfleet_runtime.agent")
GATE_REASSERT_S = 30.0  # as the built-in runtime: a condition someone else wrote does not stick


class Agent:
    def __init__(self, opts: AgentOptions, *, gate: GateWriter | None = None) -> None:
        self.opts = opts
        self.role = opts.config.role.value
        self.dialect = opts.dialect
        self.readiness = AgentReadiness(self.role, opts.failures_not_ready, group_member=opts.group_member,
                                        router=self.dialect.router)
        self.gate: GateWriter = gate or NoGate()
        self.drain = Drain(opts.config.drain_timeout_seconds, self._in_flight, on_change=self._set_draining,
                           on_done=lambda forced: self.drains.labels("forced" if forced else "drained").inc(),
                           poll_s=0.2)
        self.load: EngineLoad | None = None
        self._final = False  # the preStop hook's drain started (it is not started again)
        self._by_operator = False
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.ready = Gauge("pdfleet_ready", "1 when /readyz answers ready (the transfer-path gate)", registry=r)
        self.draining = Gauge("pdfleet_draining", "1 while the pod drains", registry=r)
        self.drains = Counter("pdfleet_drains", "Drains finished, by result (drained | forced: budget ran out)",
                              ["result"], registry=r)
        self.engine_up = Gauge("pdfleet_agent_engine_up", "1 while the engine answers /health", registry=r)
        self.canaries = Counter("pdfleet_agent_canaries", "Canaries sent as the engine's router sends a "
                                "request, by outcome", ["outcome"], registry=r)
        self.canary_seconds = Histogram("pdfleet_agent_canary_seconds", "Canary latency (both answers)",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.check_failures = Counter("pdfleet_agent_check_failures", "Checks of the engine that failed, by check "
                                      "(health, server_info: what the engine says of itself, model_config, metrics)", ["check"], registry=r)
        self.engine_load = Gauge("pdfleet_agent_engine_requests", "The engine's load as the drain last read it "
                                 "(running, queued, inflight)", ["kind"], registry=r)

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event | None = None) -> int:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, stop)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.opts.canary_timeout_s))
        try:
            await self._start_http()
        except OSError as e:
            log.error("cannot start: %s", e)
            await self._close()
            return 1
        log.info("%s agent on :%d beside the engine at %s (%s %s)", self.role, self.opts.config.http_port,
                 self.opts.engine_url, self.dialect.name, self.opts.engine_version)
        loops = [self._check_loop, self._gate_loop]
        if not isinstance(self.gate, NoGate):
            loops.append(self._pod_loop)
        if self.role == "decode" and not self.opts.group_member:  # a member's ranks serve through its leader
            loops.append(self._canary_loop)
        self._tasks = [loop.create_task(_kept(f)) for f in loops]
        await stop.wait()
        await self.drain.wait()
        await self._close()
        log.info("stopped (drain %s)", "forced" if self.drain.forced else self.drain.phase.value)
        return 0

    def _on_signal(self, stop: asyncio.Event) -> None:
        log.info("SIGTERM: exiting after the drain (%s)", self.drain.phase.value)
        if not self._final:  # SIGTERM without the preStop hook (local runs): drain first
            self._final_drain()
        stop.set()

    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, self.opts.bind_host, self.opts.config.http_port, reuse_address=True).start()
        self._runners.append(await start_admin(self._drain_handler, self._undrain_handler, self.opts.config.admin_port))

    async def _close(self) -> None:
        self.drain.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in self._runners:
            await r.cleanup()
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ HTTP

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"alive": True, "role": self.role, "phase": self.drain.phase.value})

    async def _readyz(self, _: web.Request) -> web.Response:
        body = self.readiness.as_json()
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        self.ready.set(int(self.readiness.verdict().ready))
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE})

    async def _drain_handler(self, request: web.Request) -> web.Response:
        """The preStop hook (both containers' hooks call it): the pod is being deleted, so routers drop it
        now; the wait for them and for the engine runs from here, once, whatever drained before."""
        if not self._final:
            self._final_drain()
        if request.query.get("wait", "").lower() in ("1", "true", "yes"):
            await self.drain.wait()
        return web.json_response(self._drain_body())

    async def _undrain_handler(self, _: web.Request) -> web.Response:
        self._final = False
        self.drain.cancel()
        return web.json_response(self._drain_body())

    def _drain_body(self) -> dict[str, Any]:
        load = self.load
        return {"phase": self.drain.phase.value, "drained": self.drain.phase is DrainPhase.DRAINED,
                "forced": self.drain.forced, "engine": None if load is None else
                {"running": load.running, "queued": load.queued, "inflight": load.inflight}}

    # ------------------------------------------------------------------ checks

    async def _get(self, path: str) -> tuple[int, str]:
        assert self._session is not None
        async with self._session.get(f"{self.opts.engine_url}{path}",
                                     timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            return resp.status, await resp.text()

    async def check_engine(self) -> None:
        """One round of the engine checks: /health, then what the engine says of itself (SGLang's
        /server_info, vLLM's /version and /v1/models) and config.json."""
        r = self.readiness
        try:
            code, _ = await self._get("/health")
            r.engine_health(code == 200, "" if code == 200 else f"the engine's /health answered {code}")
        except (aiohttp.ClientError, TimeoutError) as e:
            r.engine_health(False, f"the engine's /health does not answer: {e!r}")
        self.engine_up.set(int(r.engine_up))
        if not r.engine_up:
            self.check_failures.labels("health").inc()
            return
        if self.opts.group_member:  # SGLang's node ranks >= 1 serve /health only (no /server_info)
            r.config_problems = await asyncio.to_thread(self._config_problems)
            return
        try:
            r.engine_problems = await self.dialect.problems(self._get, version=self.opts.engine_version,
                                                            served_model=self.opts.served_model, role=self.role)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            r.engine_problems = [f"cannot read what the engine says of itself: {e}"]
        if r.engine_problems:
            self.check_failures.labels("server_info").inc()
        r.config_problems = await asyncio.to_thread(self._config_problems)
        if r.config_problems:
            self.check_failures.labels("model_config").inc()

    def _config_problems(self) -> list[str]:
        if self.opts.model_path is None:
            return []
        path = self.opts.model_path / "config.json"
        try:
            cfg = json.loads(path.read_text())
            return model_config_problems(cfg, resolve_layout(self.opts.config.layout))
        except OSError as e:
            return [f"cannot read {path}: {e.strerror}"]
        except (ValueError, LayoutError) as e:
            return [f"{path} is not a model config: {e}"]

    async def _check_loop(self) -> None:
        while True:
            await self.check_engine()
            await asyncio.sleep(self.opts.check_period_s if self.readiness.checked else 1.0)

    # ------------------------------------------------------------------ canary

    def _targets(self) -> list[PrefillTarget]:
        if self.opts.prefill_targets:
            return list(self.opts.prefill_targets)
        eps = DnsResolver(self.opts.config.prefill_service, self.opts.engine_bootstrap_port).resolve()
        return [PrefillTarget(e.host, self.opts.engine_port, self.opts.engine_bootstrap_port) for e in eps]

    async def canary_round(self) -> None:
        """A canary through each prefill pod found (the pod is ready once one passes)."""
        r = self.readiness
        try:
            targets = await asyncio.to_thread(self._targets)
        except ResolveError as e:
            r.discovery_error, targets = f"cannot find prefill pods: {e}", []
        if not targets and not r.discovery_error:
            r.discovery_error = f"no prefill pod behind {self.opts.config.prefill_service}"
        assert self._session is not None
        for t in targets:
            if not self.drain.serving or not r.checked:
                return
            out = await self.dialect.canary(self._session, t, self.opts.engine_url, self.opts.canary_timeout_s)
            self.canaries.labels("success" if out.ok else "failed").inc()
            self.canary_seconds.observe(out.seconds)
            r.canary(out.ok, out.reason, out.unreachable)
            if not out.ok:
                log.warning("canary failed: %s", out.reason)

    async def _canary_loop(self) -> None:
        while True:
            if self.drain.serving and self.readiness.checked:
                await self.canary_round()
            ready = self.readiness.verdict().ready
            await asyncio.sleep(self.opts.canary_period_s if ready else self.opts.retry_period_s)

    # ------------------------------------------------------------------ gate and the operator's drain

    async def _gate_loop(self) -> None:
        written: tuple[bool, str] | None = None
        at = 0.0
        while True:
            v = self.readiness.verdict()
            self.ready.set(int(v.ready))
            key = (v.ready, v.problem.value)
            if key != written or time.monotonic() - at >= GATE_REASSERT_S:
                if key != written:
                    log.info("readiness: %s (%s): %s", "ready" if v.ready else "not ready", v.problem.value, v.reason)
                try:
                    await self.gate.set(v.ready, v.problem.value, v.reason)
                    written, at = key, time.monotonic()
                except Exception as e:  # the API may be briefly unavailable: retried next tick
                    log.warning("cannot write the readiness gate: %s", e)
            await asyncio.sleep(0.25)

    async def _pod_loop(self) -> None:
        """The operator's drain request (annotation ``pdfleet.io/drain-started``): drain, cancel when it
        goes, and report ``pdfleet.io/drained`` once the engine is idle (the operator then deletes the pod)."""
        reported: tuple[str, bool] | None = None
        stamp: str | None = None
        while True:
            try:
                wanted = (await self.gate.annotations() or {}).get(DRAIN_ANNOTATION)
            except Exception as e:
                log.warning("cannot read this pod: %s", e)
                await asyncio.sleep(0.5)
                continue
            if wanted is not None and self.drain.serving:
                log.info("the operator asked for a drain (annotation %s=%s)", DRAIN_ANNOTATION, wanted)
                self.drain.start()
            elif wanted is None and self._by_operator and not self._final:
                self.drain.cancel()
            self._by_operator = wanted is not None
            stamp = wanted or stamp
            if stamp is not None and not self._final:  # deleted: the operator has read its report
                done = self.drain.phase is DrainPhase.DRAINED
                ok, reason, text = ((done, "Forced" if self.drain.forced else "Drained" if done else "Draining",
                                     "the engine had requests when the budget ran out" if self.drain.forced else
                                     "the engine reports no running, queued or in-flight request" if done else
                                     "drain started: waiting for routers, then for the engine")
                                    if wanted is not None else (False, "Cancelled", "drain cancelled: serving again"))
                if (stamp, ok) != reported:
                    try:
                        await self.gate.set_condition(DRAINED_CONDITION, ok, reason, drained_message(stamp, text))
                        reported = (stamp, ok)
                    except Exception as e:
                        log.warning("cannot report drained: %s", e)
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ drain

    def _final_drain(self) -> None:
        """The deletion's drain: (re)started so its wait for routers counts from now."""
        self._final = True
        self.drain.cancel()
        self.drain.start()
        log.info("drain started (pod deleted): %s", self._drain_body()["engine"])

    def _set_draining(self, draining: bool) -> None:
        self.readiness.draining = draining
        self.draining.set(int(draining))

    async def _in_flight(self) -> int:
        """What the drain waits for: routers first (``router_drop_s`` from the drain's start), then the
        engine's running, queued and (prefill) in-flight requests; unreadable metrics count as busy."""
        if self.opts.group_member:
            return 0  # no router sends it work and its engine reports no load: the leader's drain covers it
        started = self.drain.started
        if started is not None and time.monotonic() - started < self.opts.router_drop_s:
            return 1
        try:
            code, text = await self._get("/metrics")
            if code != 200:
                raise ValueError(f"the engine's /metrics answered {code}")
            self.load = load = self.dialect.load(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self.check_failures.labels("metrics").inc()
            log.warning("drain: cannot read the engine's load: %s", e)
            return 1
        for kind, n in (("running", load.running), ("queued", load.queued), ("inflight", load.inflight)):
            self.engine_load.labels(kind).set(n)
        return load.running + load.queued + (load.inflight if self.role == "prefill" else 0)


async def _kept(loop_fn: Any) -> None:
    while True:
        try:
            await loop_fn()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; restarting it", getattr(loop_fn, "__name__", "loop"))
            await asyncio.sleep(1.0)
