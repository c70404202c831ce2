"""One rank process of a pod: its pools, its engine, its protocol coordinator, driven over a pipe.

Started by ``launcher`` with the ``spawn`` context (one per local GPU rank, as a daemon). The pod's
process never imports torch or an engine; this one does. The messages on the pipe are the typed
ones of ``pipe``; EOF (the pod process died) ends the rank at once.

Decode ops: ``TransferOp`` (one synthetic or prompt request through this rank: ``requests.DecodeRequests``),
``GenerateOp`` (reference engine: continue a request from every rank's share, ``reference``) and ``StatsOp``. Prefill ops: ``StatsOp``. A prefill rank makes a synthetic request's state when the
decode's ``TransferRequest`` asks for it (``requests.SyntheticSource``). The parity harness
drives these same processes, with ``SeededArenaOp`` (both roles), ``ArenaCheckOp`` (decode) and
``RequestStatesOp`` (prefill) besides.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, cast

from pdfleet_runtime.config import Role
from pdfleet_runtime.engines import EngineConfig, TransferEngine, create_engine
from pdfleet_runtime.engines import cuda as cuda_facts
from pdfleet_runtime.layouts import resolve_layout
from pdfleet_runtime.model.state import ModelFault
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.keys import mounted_keys
from pdfleet_runtime.protocol.messages import StatusReport, TransferRequest
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.protocol.states import RequestState, StateTimeouts
from pdfleet_runtime.rank.faults import UngroupedConvPools

from . import pipe
from .arena import SeededArena
from .reference import ModelSource, generate, load_rank_model
from .requests import DecodeRequests, SyntheticSource
from .staging_setup import staging_of

__all__ = ["rank_main"]

log = logging.getLogger("pdfleet_runtime.server.rank")
RECONCILE_S = 5.0
"""How often a rank compares the items it holds with the requests running (``requests._Items``)."""


def rank_main(conn: Connection, spec: pipe.RankSpec) -> None:
    """Process entry point (spawned)."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s {spec.name} %(name)s: %(message)s")
    try:
        asyncio.run(_Rank(conn, spec).main())
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(pipe.RankFailed(traceback.format_exc()))
        raise


class _DelayedWrites:
    """Fault injection (tests): every write sleeps first, inside the time the coordinator measures."""

    def __init__(self, engine: TransferEngine, delay_s: float) -> None:
        self._engine, self._delay = engine, delay_s

    def write(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._delay)
        return self._engine.write(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _Rank:
    def __init__(self, conn: Connection, spec: pipe.RankSpec) -> None:
        self.conn, self.spec = conn, spec
        cfg = spec.config
        self.shape = cfg.shape
        self.stop = asyncio.Event()
        self.work: SyntheticSource | DecodeRequests | None = None

    # ------------------------------------------------------------------ lifecycle

    async def main(self) -> None:
        cfg, spec = self.spec.config, self.spec
        t0 = time.perf_counter()
        self.device = cfg.device_of(spec.local_index) if spec.gpu is None or cfg.device == "cpu" else f"cuda:{spec.gpu}"
        if self.device != "cpu":
            # The current device is per thread: bind this one and every worker thread (engine writes, fills).
            cuda_facts.bind_thread(self.device)
            asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
                initializer=cuda_facts.bind_thread, initargs=(self.device,)))
        self.layout = resolve_layout(cfg.layout)
        self.capacity = Capacity(cfg.max_concurrent_requests, cfg.kv_tokens)
        self.runner = await asyncio.to_thread(load_rank_model, cfg, self.layout, self.device)  # None: seeded state
        pools = UngroupedConvPools if spec.faults.model is ModelFault.CONV_UNGROUPED else RankPools
        self.pools = pools(self.layout, self.shape, spec.tp, spec.pp, self.capacity, self.device)
        self.alloc = RequestAllocator(self.layout, self.capacity, seed=spec.faults.scatter_pages)
        self.staging = staging_of(cfg, self.pools)
        self.engine = create_engine(EngineConfig(cfg.backend, cfg.protocol, host=spec.host,
                                                 rdma_devices=cfg.rdma_devices, env=spec.engine_env,
                                                 name=f"{spec.instance}-{cfg.role.value}-{spec.tp}-{spec.pp}"))
        self.engine.start()
        reg = self.pools.registration()
        extra = (self.staging.region.record(),) if self.staging is not None else ()
        self.info = self.engine.register((reg.region, *extra), reg.buffers)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._readable)
        self.tasks: set[asyncio.Task[None]] = set()
        try:
            if cfg.role is Role.PREFILL:
                await self._prefill()
            else:
                await self._decode()
        finally:
            loop.remove_reader(self.conn.fileno())
            for t in list(self.tasks):
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            self.engine.close()
        log.info("rank stopped after %.1fs", time.perf_counter() - t0)

    def _ready(self) -> None:
        t = self.engine.transport()
        self.conn.send(pipe.RankReady(
            (self.spec.tp, self.spec.pp), os.getpid(), self.info.name,
            pipe.Transport(t.requested.value if t.requested else None, t.engine_protocol, t.effective, t.pinned),
            self.pools.region.total_bytes, self.device))

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if isinstance(msg, pipe.Exit):
                    self.stop.set()
                elif isinstance(msg, pipe.Call):
                    task = asyncio.get_running_loop().create_task(self._call(msg))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        except (EOFError, OSError):
            os._exit(0)  # the pod process is gone: so is this rank

    async def _call(self, call: pipe.Call) -> None:
        result: pipe.RankResult
        try:
            result = await self._handle(call.op, call.call_id)
        except Exception as e:  # a bad call must not kill the rank: the pod sees the error
            log.exception("call %s failed", type(call.op).__name__)
            result = pipe.CallFailed(f"{type(e).__name__}: {e}")
        with contextlib.suppress(OSError):
            self.conn.send(pipe.Reply(call.call_id, result))

    async def _handle(self, op: pipe.RankOp, call_id: int = 0) -> pipe.RankResult:
        work = self.work
        match op:
            case pipe.TransferOp() if isinstance(work, DecodeRequests):
                return await work.transfer(op)
            case pipe.StatsOp():
                return self.stats()
            case pipe.SeededArenaOp():
                return await self._seed_arena(op)
            case pipe.ArenaCheckOp() if isinstance(work, DecodeRequests) and work.arena is not None:
                return await asyncio.to_thread(work.arena.check)
            case pipe.GenerateOp() if self.runner is not None and self.spec.config.role is Role.DECODE:
                return await asyncio.to_thread(generate, self.runner, op, self.shape, self.spec.faults.model,
                                               self._progress(call_id) if op.stream else None)
            case pipe.RequestStatesOp() if isinstance(work, SyntheticSource):
                return pipe.RequestStates({rid: self.coord.outcome(rid) or RequestState.BOOTSTRAPPING
                                           for rid in op.request_ids})
        return pipe.CallFailed(f"a {self.spec.config.role.value} rank does not take {type(op).__name__} now")

    def _progress(self, call_id: int) -> Callable[[int, int], None]:
        """A streaming continuation's tokens, sent from the loop's thread (the pipe is not thread-safe)."""
        loop = asyncio.get_running_loop()

        def send(msg: pipe.GeneratedToken) -> None:
            with contextlib.suppress(OSError):
                self.conn.send(msg)

        return lambda i, tok: loop.call_soon_threadsafe(send, pipe.GeneratedToken(call_id, i, tok))

    async def _seed_arena(self, op: pipe.SeededArenaOp) -> pipe.RankStats:
        """Parity: seeded background, a seeded allocator and the reserved requests' items (no request held)."""
        assert self.work is not None
        self.alloc = RequestAllocator(self.layout, self.capacity, seed=op.allocator_seed)
        self.work.reset(self.alloc, op.reserve)
        side = 1 if self.spec.config.role is Role.PREFILL else 2
        arena = await asyncio.to_thread(SeededArena, self.pools, op.background_seed, side)
        if isinstance(self.work, DecodeRequests):
            self.work.arena = arena
        return self.stats()

    # ------------------------------------------------------------------ prefill

    async def _prefill(self) -> None:
        spec = self.spec
        engine = self.engine
        if spec.faults.write_delay_s > 0:
            engine = cast(TransferEngine, _DelayedWrites(engine, spec.faults.write_delay_s))
        kw = {"corrupt": spec.faults.corrupt_sent, "fill_delay_s": spec.faults.fill_delay_s,
              "orphan_grace_s": 2 * spec.write_timeout_s + 10.0}
        source = (ModelSource(self.pools, self.alloc, self.runner, fault=spec.faults.model, **kw)
                  if self.runner is not None else SyntheticSource(self.pools, self.alloc, **kw))  # type: ignore[arg-type]
        self.work = source
        client = BootstrapClient(Endpoint(*spec.bootstrap), Codec(mounted_keys(spec.config.secret_path, spec.secret),
                                                                  f"{spec.instance}-{spec.tp}-{spec.pp}",
                                                                  rank_key=spec.rank_key))
        timeouts = StateTimeouts(waiting_for_input_s=spec.request_timeout_s, transferring_s=spec.request_timeout_s)
        self.coord = PrefillRank(self.pools.registration(), engine, self.info, client,
                                 settings=PrefillSettings(timeouts=timeouts, write_timeout_s=spec.write_timeout_s),
                                 release=source.release, synthetic=source.fill, on_report=self._on_report,
                                 staging=self.staging,
                                 first_token=source.first_token if isinstance(source, ModelSource) else None,
                                 expected_tokens=source.expected_tokens if isinstance(source, ModelSource) else None)
        source.allocated = self.coord.prepare
        source.holding = self.coord.holding
        await self.coord.register()
        self._ready()
        self._spawn_reconcile()
        try:
            await self.coord.run(self.stop)
        finally:
            await client.close()

    def _on_report(self, req: TransferRequest, r: StatusReport) -> None:
        log.info("request %s -> %s%s: %s%s, %d bytes in %.4fs", r.request_id, r.instance, list(r.dst.pair),
                 r.state.value, f" ({r.failure.value}: {r.reason})" if r.failure else "", r.bytes, r.write_seconds)
        with contextlib.suppress(OSError):
            self.conn.send(pipe.LegReport(r.request_id, r.state, r.failure, r.reason, r.bytes, r.write_seconds,
                                          kind=req.kind))

    # ------------------------------------------------------------------ decode

    async def _decode(self) -> None:
        self.work = DecodeRequests(self.spec, self.pools, self.alloc, self.info, staging=self.staging)
        self._ready()
        self._spawn_reconcile()
        try:
            await self.stop.wait()
        finally:
            await self.work.close()

    def _spawn_reconcile(self) -> None:
        task = asyncio.get_running_loop().create_task(self._reconcile_loop())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reconcile_loop(self) -> None:
        """Held items against running requests, every ``RECONCILE_S`` (``_Items.reconcile``)."""
        while not self.stop.is_set():
            await asyncio.sleep(RECONCILE_S)
            if self.work is not None:
                self.work.reconcile()

    def stats(self) -> pipe.RankStats:
        st = self.work.stats(self.coord.in_flight) if isinstance(self.work, SyntheticSource) else self.work.stats()
        return dataclasses.replace(st, staged=self.staging.metrics.to_dict()) if self.staging is not None else st
