"""The launcher: one process per local rank (tp x pp per pod), supervised from the pod's event loop.

Rank processes come from a fork server (``multiprocessing``'s ``forkserver``), which imports the rank
module and torch once, before any thread, engine or CUDA context exists, and forks each rank from that
clean state: a pod's ranks no longer each import torch (2.8-6.8 s per rank to import on a loaded 2-core host;
a TP4 pod paid it four times). Never ``fork`` from the pod process itself: it runs an event loop, threads
and, on a prefill, the bootstrap server. Ranks are daemons (they die with the pod process) and exit on EOF
of their pipe (the pod process was killed; the fork server exits then too). The pod
process reads every pipe from its event loop (``add_reader``), so calls (``call``/``call_all``, typed
operations of ``pipe`` answered by typed results) are plain awaits with a timeout, and reports reach ``on_report`` without a thread. A rank that dies
is noticed within ``watch_s`` and fails its pending calls; the pod then reports itself unhealthy
(its container is restarted: a pod with a dead rank cannot serve).

This module imports neither torch nor an engine: the fork server and the ranks import ``rank.process``, never the
pod process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Literal

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.protocol.states import FailureReason
from pdfleet_runtime.rank.entry import rank_entry
from pdfleet_runtime.rank.pipe import (
    Call,
    CallFailed,
    Exit,
    GeneratedToken,
    LegReport,
    RankFailed,
    RankOp,
    RankReady,
    RankResult,
    RankSpec,
    Reply,
)

from .options import ServeOptions

__all__ = ["LaunchError", "RankCallError", "RankLauncher", "rank_specs"]

log = logging.getLogger("pdfleet_runtime.server.launcher")  # the name log readers know

_PRELOAD = ("pdfleet_runtime.rank.process",)
"""What the fork server imports before forking ranks: torch and the pools, no engine (Mooncake and NIXL are
imported in each rank)."""
_PRELOAD_MODEL = ("pdfleet_runtime.rank.model_runner", "transformers.modeling_utils", "transformers.generation",
                  "transformers.cache_utils")
"""Added when the first ranks this process starts compute a model (the reference engine): transformers' core
(about 5 s per rank to import on a loaded host); each rank still imports its model's family."""


StartMethod = Literal["forkserver", "spawn"]
"""``forkserver`` (what pods use); ``spawn``, a fresh interpreter per rank, only as bench/rank_start.py's baseline."""


def _rank_context(specs: list[RankSpec], method: StartMethod) -> mp.context.ForkServerContext | mp.context.SpawnContext:
    """The fork server's context. Its preload takes effect when the server first starts, so the first ranks a
    process starts decide it (a pod starts one config; a test process may start both kinds: a later rank
    imports what the server lacks itself, only slower)."""
    if method == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    model = any(spec.config.model is not None for spec in specs)
    ctx.set_forkserver_preload(list(_PRELOAD + (_PRELOAD_MODEL if model else ())))
    return ctx


def _start_ranks(specs: list[RankSpec], method: StartMethod) -> list[tuple[RankSpec, BaseProcess, Connection]]:
    """Start one rank process per spec; each gets its end of a fresh pipe (the pod process keeps the other)."""
    ctx = _rank_context(specs, method)
    started: list[tuple[RankSpec, BaseProcess, Connection]] = []
    for spec in specs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=rank_entry, args=(child, spec), name=f"pdfleet-{spec.name}", daemon=True)
        proc.start()
        child.close()
        started.append((spec, proc, parent))
    return started


class LaunchError(RuntimeError):
    """A rank process failed to start (its traceback or exit code is in the message)."""


class RankCallError(RuntimeError):
    """A call to a rank failed: it died, timed out, or the operation raised there. ``failure``: the kind a
    request through it fails with (``GROUP_MEMBER_LOST`` when the rank's group member went away)."""

    def __init__(self, message: str, failure: FailureReason = FailureReason.RANK) -> None:
        super().__init__(message)
        self.failure = failure


def rank_specs(opts: ServeOptions, secret: bytes, *, member: int = 0, instance: str | None = None,
               bootstrap: tuple[str, int], rank_key: bytes | None = None) -> list[RankSpec]:
    """The specs of the ranks pod ``member`` of the replica runs: global ranks ``[m * local, (m + 1) * local)``
    in tensor x pipeline order (one pod per replica: all of them). ``instance``: the replica's protocol name
    (a member's is its leader's); ``bootstrap``: prefill, where the ranks register (the leader's)."""
    cfg: RuntimeConfig = opts.config
    local = cfg.local_world
    return [RankSpec(cfg, i % cfg.shape.tp, i // cfg.shape.tp, secret, instance or opts.instance, opts.advertise_host,
                     bootstrap, opts.request_timeout_s, opts.write_timeout_s, opts.fence_timeout_s, opts.log_level,
                     opts.faults, rank_key=rank_key)
            for i in range(member * local, (member + 1) * local)]


@dataclass
class _Handle:
    spec: RankSpec
    proc: BaseProcess
    conn: Connection
    info: RankReady | None = None
    error: str = ""
    ready: asyncio.Future[None] | None = None


class RankLauncher:
    """Starts, talks to and stops the rank processes of one pod."""

    def __init__(self, specs: list[RankSpec], *, on_report: Callable[[int, LegReport], None] | None = None,
                 watch_s: float = 0.5, start_method: StartMethod = "forkserver") -> None:
        self.specs, self.start_method = specs, start_method
        self._on_report, self._watch_s = on_report, watch_s
        self.handles: list[_Handle] = []
        self._calls: dict[int, asyncio.Future[RankResult]] = {}
        self._owner: dict[int, int] = {}
        self._progress: dict[int, Callable[[int, int], None]] = {}
        self._ids = itertools.count(1)
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False
        self.died: list[str] = []
        """One line per rank process that exited while the pod was serving."""

    @property
    def up(self) -> int:
        return sum(1 for h in self.handles if h.info is not None and h.proc.is_alive())

    @property
    def healthy(self) -> bool:
        return not self.died

    async def start(self, timeout_s: float = 180.0) -> None:
        """Spawn every rank and wait until each said ready; ``LaunchError`` (all stopped) otherwise."""
        loop = asyncio.get_running_loop()
        # On a thread: a start waits for the fork server to answer with the rank's pid, the first one for its
        # preload (seconds), and the pod's event loop serves its probes meanwhile.
        for spec, proc, parent in await asyncio.to_thread(_start_ranks, self.specs, self.start_method):
            h = _Handle(spec, proc, parent, ready=loop.create_future())
            self.handles.append(h)
            loop.add_reader(parent.fileno(), self._readable, len(self.handles) - 1)
        self._watch = loop.create_task(self._watcher())
        try:
            async with asyncio.timeout(timeout_s):
                for h in self.handles:
                    assert h.ready is not None
                    await h.ready
        except (TimeoutError, LaunchError) as e:
            await self.stop(5.0)
            raise LaunchError(f"rank processes did not start: {e or f'not ready after {timeout_s:.0f}s'}") from None

    async def call(self, rank: int, op: RankOp, *, timeout_s: float,
                   on_progress: Callable[[int, int], None] | None = None) -> RankResult:
        """The rank's answer to ``op`` (never ``CallFailed``: that raises ``RankCallError``); ``on_progress(index,
        token)`` hears a streaming ``GenerateOp``'s tokens before it."""
        h = self.handles[rank]
        name = type(op).__name__
        if not h.proc.is_alive():
            raise RankCallError(f"{h.spec.name} is not running ({h.error or f'exit code {h.proc.exitcode}'})")
        call_id = next(self._ids)
        fut: asyncio.Future[RankResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id], self._owner[call_id] = fut, rank
        if on_progress is not None:
            self._progress[call_id] = on_progress
        try:
            h.conn.send(Call(call_id, op))
            async with asyncio.timeout(timeout_s):
                reply = await fut
        except TimeoutError:
            raise RankCallError(f"{h.spec.name} did not answer {name} within {timeout_s:.1f}s") from None
        except OSError as e:
            raise RankCallError(f"{h.spec.name} is gone: {e}") from None
        finally:
            self._calls.pop(call_id, None)
            self._owner.pop(call_id, None)
            self._progress.pop(call_id, None)
        if isinstance(reply, CallFailed):
            raise RankCallError(f"{h.spec.name}: {name} failed: {reply.error}")
        return reply

    async def call_all(self, op: RankOp, *, timeout_s: float) -> list[RankResult]:
        return list(await asyncio.gather(*(self.call(i, op, timeout_s=timeout_s) for i in range(len(self.handles)))))

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to exit, wait up to ``timeout_s`` in all, then kill what is left."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        loop = asyncio.get_running_loop()
        self._stopping = True
        for h in self.handles:
            with contextlib.suppress(OSError, ValueError):
                h.conn.send(Exit())
        deadline = time.monotonic() + timeout_s
        for h in self.handles:
            await asyncio.to_thread(h.proc.join, max(0.1, deadline - time.monotonic()))
            if h.proc.is_alive():
                log.warning("%s did not exit in time: killed", h.spec.name)
                h.proc.kill()
                await asyncio.to_thread(h.proc.join, 5)
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(h.conn.fileno())
            h.conn.close()

    # ------------------------------------------------------------------ internals

    def _readable(self, rank: int) -> None:
        h = self.handles[rank]
        try:
            while h.conn.poll():
                self._dispatch(rank, h, h.conn.recv())
        except (EOFError, OSError):
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(h.conn.fileno())
            self._gone(rank, h, h.error or "closed its pipe")

    def _dispatch(self, rank: int, h: _Handle, msg: object) -> None:
        match msg:
            case RankReady():
                h.info = msg
                if h.ready is not None and not h.ready.done():
                    h.ready.set_result(None)
                log.info("%s ready (pid %s, engine %s, transport %s)", h.spec.name, msg.pid, msg.engine,
                         msg.transport.effective)
            case Reply():
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg.result)
            case GeneratedToken():
                cb = self._progress.get(msg.call_id)
                if cb is not None:
                    cb(msg.index, msg.token)
            case LegReport():
                if self._on_report is not None:
                    self._on_report(rank, msg)
            case RankFailed():
                h.error = msg.traceback.strip().splitlines()[-1] if msg.traceback.strip() else "failed"
                log.error("%s failed:\n%s", h.spec.name, msg.traceback)
            case _:
                log.error("%s sent an unknown message %s", h.spec.name, type(msg).__name__)

    def _gone(self, rank: int, h: _Handle, why: str) -> None:
        line = f"{h.spec.name} exited ({why}; exit code {h.proc.exitcode})"
        if h.ready is not None and not h.ready.done():
            h.ready.set_exception(LaunchError(line))
        elif line not in self.died and not self._stopping:
            self.died.append(line)
            log.error("%s", line)
        for call_id, owner in list(self._owner.items()):
            fut = self._calls.get(call_id)
            if owner == rank and fut is not None and not fut.done():
                fut.set_result(CallFailed(line))

    async def _watcher(self) -> None:
        while True:
            await asyncio.sleep(self._watch_s)
            for i, h in enumerate(self.handles):
                if not h.proc.is_alive() and not any(line.startswith(h.spec.name) for line in self.died):
                    self._gone(i, h, h.error or "died")
