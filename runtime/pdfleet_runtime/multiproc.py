"""Multi-process parity: every rank its own spawned process on loopback, through a real engine and the protocol.

A *group* is one (backend, prefill shape, decode shape); its processes are one bootstrap host
(no torch: it runs one ``BootstrapServer`` per case, each a fresh "prefill pod" on its own port),
one process per prefill rank and one per decode rank. Each rank process builds the pools of every
case of the group at start and registers all of them with one engine, once; then, per case, the
prefill ranks register with that case's bootstrap and the decode ranks handshake, send their
indices, wait for every source's status and verify their own bytes (the receiving side checks:
background plus the logical state sharded for the decode shape, so bytes outside the request's
items must be untouched). So the process start cost (~1-2 s with torch) is paid once per group,
not per case.

Processes use the ``spawn`` context, are daemons, are driven by commands over pipes with
timeouts, and exit on EOF (their parent died). ``RankProcess`` is also the building block of the
fault tests (kill, restart, hold input, stall a write).

Reading order: ``CaseSpec``/``GroupSpec``, ``run_group`` (the parity flow), ``ProcessGroup``
(start/stop), then the process mains ``_bootstrap_main``, ``_prefill_main``, ``_decode_main``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import os
import secrets
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pdfleet_runtime.layouts import resolve_layout
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.transfer import Protocol

__all__ = [
    "CaseSpec",
    "GroupSpec",
    "ProcessGroup",
    "RankProcess",
    "WorkerError",
    "gpu_of",
    "run_group",
]

READY_TIMEOUT_S = 180.0
"""Waiting for a rank process to build pools and start its engine (2 cores, torch import, several cases)."""
CASE_TIMEOUT_S = 240.0


class WorkerError(RuntimeError):
    """A rank or bootstrap process failed, died or did not answer in time."""


@dataclass(frozen=True)
class CaseSpec:
    """One parity case (a layout) of a group; requests share ``tokens`` as in ``parity.run_parity``."""

    layout_name: str
    requests: int = 2
    tokens: int = 96
    seed: int = 7

    @property
    def name(self) -> str:
        return f"{self.layout_name}-s{self.seed}"


@dataclass(frozen=True)
class GroupSpec:
    """Everything a rank process needs (pickled to spawned processes)."""

    backend: str
    prefill: ParallelShape
    decode: ParallelShape
    cases: tuple[CaseSpec, ...]
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    request_timeout_s: float = 60.0
    lease_s: float = 5.0
    write_timeout_s: float = 30.0
    device: str = "cpu"
    """``cpu``, or ``cuda``: each rank's pools on one GPU of the host (``gpu_of``)."""
    protocol: Protocol = Protocol.TCP
    engine_env: dict[str, str | None] = field(default_factory=dict)
    """Overrides of the protocol table's engine environment (``EngineConfig.env``)."""
    placement: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    """Explicit GPU per global rank (prefill, decode); empty means ``gpu_of``'s default spread."""


def gpu_of(spec: GroupSpec, side: int, rank: int, count: int) -> int:
    """The GPU of a rank (``side`` 1 prefill, 2 decode): the explicit placement, else prefill rank r on
    GPU ``r % count`` and decode rank r on GPU ``(r + 1) % count``, so that with two GPUs an equal-TP
    pair always crosses GPUs and a 2 -> 1 aggregation has one leg within a GPU and one across."""
    explicit = spec.placement[side - 1]
    if explicit:
        return explicit[rank] % count
    return (rank + (side - 1)) % count


# --------------------------------------------------------------------------- processes


class RankProcess:
    """One spawned process and its command pipe."""

    def __init__(self, name: str, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()

    def send(self, *msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise WorkerError(f"{self.name} is gone: {e}") from e

    def recv(self, timeout_s: float, *, expect: str | None = None) -> tuple[Any, ...]:
        """The next message (skipping none); ``WorkerError`` on death, error or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.name} did not answer{' ' + expect if expect else ''} in {timeout_s:.0f}s")
            try:
                if not self.conn.poll(min(left, 0.5)):
                    if not self.proc.is_alive():
                        raise WorkerError(f"{self.name} died (exit code {self.proc.exitcode})")
                    continue
                msg = self.conn.recv()
            except (EOFError, OSError) as e:
                raise WorkerError(f"{self.name} closed its pipe (exit code {self.proc.exitcode})") from e
            if msg[0] == "error":
                raise WorkerError(f"{self.name} failed:\n{msg[1]}")
            if expect is not None and msg[0] != expect:
                raise WorkerError(f"{self.name} answered {msg[0]!r}, expected {expect!r}")
            return tuple(msg)

    def kill(self) -> None:
        """SIGKILL, as a crashed pod would die (no cleanup, no goodbye)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def stop(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(WorkerError):
            self.send("exit")
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class ProcessGroup:
    """The bootstrap host plus one process per prefill and decode rank of a group."""

    def __init__(self, spec: GroupSpec, workdir: Path) -> None:
        self.spec, self.workdir = spec, Path(workdir)
        self.resolver_file = self.workdir / "prefill-endpoints.json"
        self.bootstrap: RankProcess | None = None
        self.prefill: list[RankProcess] = []
        self.decode: list[RankProcess] = []
        self.ready_seconds = 0.0
        self.devices: dict[str, str] = {}
        """Each rank process's torch device, by process name (what ``ready`` reported)."""

    def __enter__(self) -> ProcessGroup:
        t0 = time.monotonic()
        try:
            self.start_bootstrap()
            self.start_prefill()
            self.decode = [RankProcess(f"decode-{t}-{p}", _decode_main, self.spec, t, p, str(self.resolver_file))
                           for t, p in self.spec.decode.coords()]
            for w in [*self.prefill, *self.decode]:
                info = w.recv(READY_TIMEOUT_S, expect="ready")[1]
                self.devices[w.name] = info.get("device", "cpu")
        except BaseException:
            self.close()
            raise
        self.ready_seconds = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_bootstrap(self) -> None:
        self.bootstrap = RankProcess("bootstrap", _bootstrap_main, self.spec)
        self.bootstrap.recv(READY_TIMEOUT_S, expect="ready")

    def start_prefill(self, *, wait: bool = False) -> None:
        self.prefill = [RankProcess(f"prefill-{t}-{p}", _prefill_main, self.spec, t, p)
                        for t, p in self.spec.prefill.coords()]
        if wait:
            for w in self.prefill:
                w.recv(READY_TIMEOUT_S, expect="ready")

    def open_pod(self) -> tuple[str, int]:
        """A fresh bootstrap server (a new prefill pod incarnation); the resolver file names it."""
        from pdfleet_runtime.protocol.discovery import Endpoint, FileResolver

        assert self.bootstrap is not None
        self.bootstrap.send("start", self.spec.prefill)
        _, host, port = self.bootstrap.recv(30, expect="started")
        FileResolver.write(self.resolver_file, [Endpoint(host, port)])
        return host, port

    def close_pod(self, port: int) -> None:
        assert self.bootstrap is not None
        self.bootstrap.send("stop", port)
        self.bootstrap.recv(30, expect="stopped")

    def close(self) -> None:
        for w in [*self.decode, *self.prefill, *([self.bootstrap] if self.bootstrap else [])]:
            w.stop()


# --------------------------------------------------------------------------- the parity flow


def run_group(spec: GroupSpec, workdir: Path) -> list[Any]:
    """Run every case of a group; one ``parity.ParityResult`` per case, in order.

    A case the capability matrix rejects is reported with the matrix's rule and reason and never
    reaches a process; if every case is rejected no process starts.
    """
    from pdfleet_runtime.parity import ParityConfig, ParityResult, check_matrix

    results: list[Any] = [None] * len(spec.cases)
    admitted = []
    for i, case in enumerate(spec.cases):
        cfg = ParityConfig(resolve_layout(case.layout_name), spec.prefill, spec.decode, case.requests, case.tokens,
                           case.seed, spec.backend, case.layout_name, spec.device)
        rejection = check_matrix(cfg)
        if rejection is not None:
            results[i] = ParityResult(ok=False, rejection=rejection)
        else:
            admitted.append(i)
    if not admitted:
        return results
    sub = dataclasses.replace(spec, cases=tuple(spec.cases[i] for i in admitted))
    with ProcessGroup(sub, workdir) as group:
        for j, i in enumerate(admitted):
            results[i] = run_case(group, j)
    return results


def run_case(group: ProcessGroup, case: int) -> Any:
    """One case through a fresh pod: serve on every prefill rank, transfer and verify on every decode rank."""
    from pdfleet_runtime.parity import ParityResult

    spec = group.spec
    host, port = group.open_pod()
    try:
        for w in group.prefill:
            w.send("serve", case, host, port, {})
        for w in group.prefill:
            w.recv(60, expect="serving")
        for w in group.decode:
            w.send("transfer", case, None, spec.request_timeout_s, "a")
        decoded = [w.recv(CASE_TIMEOUT_S, expect="transferred")[1] for w in group.decode]
        served = [w.recv(CASE_TIMEOUT_S, expect="served")[1] for w in group.prefill]
    finally:
        group.close_pod(port)
    c = spec.cases[case]
    bytes_by: dict[str, int] = {}
    desc_by: dict[str, int] = {}
    moved = desc = mismatched = 0
    first = None
    all_ok = True
    plan_s = 0.0
    for d in decoded:
        mismatched += d["mismatched_bytes"]
        first = first or d["first_mismatch"]
        all_ok = all_ok and d["all_success"] and d["mismatched_bytes"] == 0 and d["reports_complete"]
        for r in d["reports"]:
            moved += r["bytes"]
            desc += r["descriptors"]
            plan_s += r["plan_seconds"]
            for k, v in r["bytes_by_state"].items():
                bytes_by[k] = bytes_by.get(k, 0) + v
            for k, v in r["descriptors_by_state"].items():
                desc_by[k] = desc_by.get(k, 0) + v
    all_ok = all_ok and all(s["released"] == s["requests"] for s in served)
    from pdfleet_runtime.seeded import request_lengths

    result = ParityResult(ok=all_ok, bytes_moved=moved, descriptors=desc, mismatched_bytes=mismatched,
                          bytes_by_state=bytes_by, descriptors_by_state=desc_by,
                          request_tokens=request_lengths(c.tokens, c.requests, c.seed), plan_seconds=plan_s,
                          copy_seconds=max(d["seconds"] for d in decoded))
    if first is not None:
        from pdfleet_runtime.parity import Mismatch

        result.first_mismatch = Mismatch(**first)
    result.details = {"decode": decoded, "prefill": served, "devices": dict(group.devices)}  # type: ignore[attr-defined]
    return result


# --------------------------------------------------------------------------- process mains


def _guard(conn: Connection, body: Callable[[], None]) -> None:
    try:
        body()
    except (KeyboardInterrupt, EOFError):
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise


async def _commands(conn: Connection, handle: Callable[[tuple[Any, ...]], Any]) -> None:
    """Read commands until ``exit`` or EOF (the parent died): each is handled as a task."""
    tasks: set[asyncio.Task[Any]] = set()

    async def run(cmd: tuple[Any, ...]) -> None:
        try:
            await handle(cmd)
        except Exception:
            conn.send(("error", traceback.format_exc()))

    while True:
        if not await asyncio.to_thread(conn.poll, 0.5):
            continue
        try:
            cmd = conn.recv()
        except EOFError:
            os._exit(0)
        if cmd[0] == "exit":
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return
        task = asyncio.create_task(run(cmd))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def _bootstrap_main(conn: Connection, spec: GroupSpec) -> None:
    from pdfleet_runtime.protocol.auth import Codec
    from pdfleet_runtime.protocol.bootstrap import BootstrapLimits, BootstrapServer, BootstrapState

    async def main() -> None:
        servers: dict[int, BootstrapServer] = {}

        async def handle(cmd: tuple[Any, ...]) -> None:
            if cmd[0] == "start":
                state = BootstrapState(cmd[1], limits=BootstrapLimits(lease_s=spec.lease_s))
                server = BootstrapServer(state, Codec(spec.secret, "prefill-pod"))
                ep = await server.start()
                servers[ep.port] = server
                conn.send(("started", ep.host, ep.port))
            elif cmd[0] == "stop":
                server = servers.pop(cmd[1], None)
                if server is not None:
                    await server.stop()
                conn.send(("stopped",))

        conn.send(("ready",))
        await _commands(conn, handle)
        for s in servers.values():
            await s.stop()

    _guard(conn, lambda: asyncio.run(main()))


def _prefill_main(conn: Connection, spec: GroupSpec, tp: int, pp: int) -> None:
    from pdfleet_runtime.multiproc_ranks import PrefillWorker

    _guard(conn, lambda: asyncio.run(PrefillWorker(conn, spec, tp, pp).main()))


def _decode_main(conn: Connection, spec: GroupSpec, tp: int, pp: int, resolver_file: str) -> None:
    from pdfleet_runtime.multiproc_ranks import DecodeWorker

    _guard(conn, lambda: asyncio.run(DecodeWorker(conn, spec, tp, pp, Path(resolver_file)).main()))
