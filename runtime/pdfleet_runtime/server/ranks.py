"""One rank process of a pod: its pools, its engine, its protocol coordinator, driven over a pipe.

Started by ``launcher`` with the ``spawn`` context (one per local GPU rank, as a daemon). The pod's
process never imports torch or an engine; this one does. The messages on the pipe are the typed
ones of ``pipe``; EOF (the pod process died) ends the rank at once.

Decode ops: ``TransferOp`` (one synthetic request through this rank: ``rank_requests.DecodeRequests``)
and ``StatsOp``. Prefill ops: ``StatsOp``. A prefill rank makes a synthetic request's state when the
decode's ``TransferRequest`` asks for it (``rank_requests.SyntheticSource``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, cast

from pdfleet_runtime.config import Role
from pdfleet_runtime.engines import EngineConfig, TransferEngine, create_engine
from pdfleet_runtime.layouts import resolve_layout
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.keys import mounted_keys
from pdfleet_runtime.protocol.messages import StatusReport
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.protocol.states import StateTimeouts
from pdfleet_runtime.records import ParallelShape

from .pipe import (
    Call,
    CallFailed,
    Exit,
    LegReport,
    RankFailed,
    RankOp,
    RankReady,
    RankResult,
    RankSpec,
    RankStats,
    Reply,
    StatsOp,
    TransferOp,
    Transport,
)
from .rank_requests import DecodeRequests, SyntheticSource
from .staging_setup import staging_of

__all__ = ["rank_main"]

log = logging.getLogger("pdfleet_runtime.server.rank")


def rank_main(conn: Connection, spec: RankSpec) -> None:
    """Process entry point (spawned)."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s {spec.name} %(name)s: %(message)s")
    try:
        asyncio.run(_Rank(conn, spec).main())
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(RankFailed(traceback.format_exc()))
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
    def __init__(self, conn: Connection, spec: RankSpec) -> None:
        self.conn, self.spec = conn, spec
        cfg = spec.config
        self.shape = ParallelShape(cfg.shape.tensor, cfg.shape.pipeline)
        self.stop = asyncio.Event()
        self.work: SyntheticSource | DecodeRequests | None = None

    # ------------------------------------------------------------------ lifecycle

    async def main(self) -> None:
        cfg, spec = self.spec.config, self.spec
        t0 = time.perf_counter()
        device = cfg.device_of(spec.index)
        if device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(device))  # this process's threads default to its GPU
        layout = resolve_layout(cfg.layout)
        cap = Capacity(cfg.max_concurrent_requests, cfg.kv_tokens)
        self.pools = RankPools(layout, self.shape, spec.tp, spec.pp, cap, device)
        self.alloc = RequestAllocator(layout, cap, seed=spec.faults.scatter_pages)
        self.staging = staging_of(cfg, self.pools)
        self.engine = create_engine(EngineConfig(cfg.backend.value, cfg.protocol, host=spec.host,
                                                 rdma_devices=cfg.rdma_devices,
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
        self.conn.send(RankReady(
            (self.spec.tp, self.spec.pp), os.getpid(), self.info.name,
            Transport(t.requested.value if t.requested else None, t.engine_protocol, t.effective, t.pinned),
            self.pools.region.total_bytes))

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if isinstance(msg, Exit):
                    self.stop.set()
                elif isinstance(msg, Call):
                    task = asyncio.get_running_loop().create_task(self._call(msg))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        except (EOFError, OSError):
            os._exit(0)  # the pod process is gone: so is this rank

    async def _call(self, call: Call) -> None:
        result: RankResult
        try:
            result = await self._handle(call.op)
        except Exception as e:  # a bad call must not kill the rank: the pod sees the error
            log.exception("call %s failed", type(call.op).__name__)
            result = CallFailed(f"{type(e).__name__}: {e}")
        with contextlib.suppress(OSError):
            self.conn.send(Reply(call.call_id, result))

    async def _handle(self, op: RankOp) -> RankResult:
        match op:
            case TransferOp() if isinstance(self.work, DecodeRequests):
                return await self.work.transfer(op)
            case StatsOp():
                return self.stats()
        return CallFailed(f"a {self.spec.config.role.value} rank does not take {type(op).__name__}")

    # ------------------------------------------------------------------ prefill

    async def _prefill(self) -> None:
        spec = self.spec
        engine = self.engine
        if spec.faults.write_delay_s > 0:
            engine = cast(TransferEngine, _DelayedWrites(engine, spec.faults.write_delay_s))
        self.work = source = SyntheticSource(self.pools, self.alloc, corrupt=spec.faults.corrupt_sent)
        client = BootstrapClient(Endpoint(*spec.bootstrap), Codec(mounted_keys(spec.config.secret_path, spec.secret),
                                                                  f"{spec.instance}-{spec.tp}-{spec.pp}",
                                                                  rank_key=spec.rank_key))
        timeouts = StateTimeouts(waiting_for_input_s=spec.request_timeout_s, transferring_s=spec.request_timeout_s)
        self.coord = PrefillRank(self.pools.registration(), engine, self.info, client,
                                 settings=PrefillSettings(timeouts=timeouts, write_timeout_s=spec.write_timeout_s),
                                 release=source.release, synthetic=source.fill, on_report=self._on_report,
                                 staging=self.staging)
        source.allocated = self.coord.prepare
        await self.coord.register()
        self._ready()
        try:
            await self.coord.run(self.stop)
        finally:
            await client.close()

    def _on_report(self, r: StatusReport) -> None:
        log.info("request %s -> %s%s: %s%s, %d bytes in %.4fs", r.request_id, r.instance, list(r.dst.pair),
                 r.state.value, f" ({r.failure.value}: {r.reason})" if r.failure else "", r.bytes, r.write_seconds)
        with contextlib.suppress(OSError):
            self.conn.send(LegReport(r.request_id, r.state, r.failure, r.reason, r.bytes, r.write_seconds))

    # ------------------------------------------------------------------ decode

    async def _decode(self) -> None:
        self.work = DecodeRequests(self.spec, self.pools, self.alloc, self.info, staging=self.staging)
        self._ready()
        try:
            await self.stop.wait()
        finally:
            await self.work.close()

    def stats(self) -> RankStats:
        st = self.work.stats(self.coord.in_flight) if isinstance(self.work, SyntheticSource) else self.work.stats()
        return dataclasses.replace(st, staged=self.staging.metrics.to_dict()) if self.staging is not None else st
