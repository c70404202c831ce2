"""The rank processes of a parity group (``group``): pools for every case, one engine, one coordinator per case.

Separate from ``group`` and ``bootstrap_host`` so that the bootstrap host process never imports torch. Commands
(tuples over the pipe) are handled as asyncio tasks, so a test can send ``add`` while ``serve``
runs. Request ids are ``<case>-<attempt>-<q>``: ``q`` indexes the case's request list, whose
logical bytes ``seeded.logical_items`` derives from the seed, so both sides agree without talking.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from pdfleet_runtime.engines import EngineConfig, TransferEngine, create_engine
from pdfleet_runtime.engines import cuda as cuda_facts
from pdfleet_runtime.layouts import resolve_layout
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.decode import DecodeRank, DecodeSettings
from pdfleet_runtime.protocol.discovery import Endpoint, FileResolver
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.protocol.states import RequestState, StateTimeouts
from pdfleet_runtime.records import RequestIndices
from pdfleet_runtime.seeded import request_lengths

from .arena import compare, fill_background, write_requests
from .cases import CaseSpec, GroupSpec, gpu_of
from .procs import guard, serve_commands

__all__ = ["DecodeWorker", "PrefillWorker", "decode_main", "prefill_main"]

_EMPTY = RequestIndices([])


@dataclass
class _Case:
    spec: CaseSpec
    pools: RankPools
    alloc: RequestAllocator
    lengths: list[int]
    reqs: list[RequestIndices | None]
    background: np.ndarray
    done: dict[int, RequestIndices] = field(default_factory=dict)
    dirty: list[RequestIndices] = field(default_factory=list)

    def rid(self, attempt: str, q: int) -> str:
        return f"{self.spec.name}-{attempt}-{q}"

    def free_counts(self) -> dict[str, int]:
        return {k.value: n for k, n in self.alloc.free_counts().items()}

    def ensure(self, q: int, *, write: bool) -> RequestIndices:
        """Request ``q``'s items, allocated anew if an earlier attempt released them (and filled, on prefill)."""
        idx = self.reqs[q]
        if idx is None:
            idx = self.reqs[q] = self.alloc.allocate(self.lengths[q])
            if write:
                write_requests([self.pools], self.spec.seed, [idx if i == q else _EMPTY
                                                                for i in range(len(self.reqs))], None)
                cuda_facts.synchronize(self.pools.region.device)  # engines may read on their own streams
        return idx

    def release(self, request_id: str) -> None:
        q = int(request_id.rsplit("-", 1)[1])
        idx = self.reqs[q]
        if idx is not None:
            self.dirty.append(idx)
            self.alloc.free(idx)
            self.reqs[q] = None
            self.done.pop(q, None)


def _build(case: CaseSpec, spec: GroupSpec, tp: int, pp: int, side: int, device: str = "cpu") -> _Case:
    """Pools, background and allocations of one case on one rank, as ``verify.parity.run_parity`` makes them."""
    layout = resolve_layout(case.layout_name)
    shape = spec.prefill if side == 1 else spec.decode
    cap = Capacity(case.requests, case.tokens)
    pools = RankPools(layout, shape, tp, pp, cap, device)
    background = fill_background(pools, case.seed, side)
    alloc = RequestAllocator(layout, cap, seed=case.seed * 2 + side)
    lengths = request_lengths(case.tokens, case.requests, case.seed)
    reqs: list[RequestIndices | None] = [alloc.allocate(n) for n in lengths]
    if side == 1:
        write_requests([pools], case.seed, [r or _EMPTY for r in reqs], None)
    cuda_facts.synchronize(device)  # engines may read (and UCX writes) on streams of their own
    return _Case(case, pools, alloc, lengths, reqs, background)


def rank_device(spec: GroupSpec, side: int, tp: int, pp: int) -> str:
    """This rank's torch device; on ``cuda`` also binds the process's threads to it.

    Every GPU stays visible (CUDA IPC opens a peer's memory only on a device this process sees);
    the runtime's current device is per thread, so the default executor (``asyncio.to_thread``, where
    engine writes run) binds each new worker thread to the rank's GPU too.
    """
    if spec.device == "cpu":
        return "cpu"
    import torch

    shape = spec.prefill if side == 1 else spec.decode
    gpu = gpu_of(spec, side, shape.rank(tp, pp), torch.cuda.device_count())
    device = f"cuda:{gpu}"
    torch.cuda.set_device(gpu)
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
        initializer=cuda_facts.bind_thread, initargs=(device,)))
    return device


class _Worker:
    side = 0

    def __init__(self, conn: Connection, spec: GroupSpec, tp: int, pp: int) -> None:
        self.conn, self.spec, self.tp, self.pp = conn, spec, tp, pp
        self.cases: list[_Case] = []
        self.engine: TransferEngine | None = None
        self.device = "cpu"

    async def main(self) -> None:
        t0 = time.perf_counter()
        self.device = rank_device(self.spec, self.side, self.tp, self.pp)
        self.cases = [_build(c, self.spec, self.tp, self.pp, self.side, self.device) for c in self.spec.cases]
        role = "prefill" if self.side == 1 else "decode"
        self.engine = create_engine(EngineConfig(self.spec.backend, self.spec.protocol, env=self.spec.engine_env,
                                                 name=f"{role}-{self.tp}-{self.pp}-{time.time_ns()}"))
        self.engine.start()
        self.info = self.engine.register([c.pools.region for c in self.cases],
                                         [r for c in self.cases for r in c.pools.records])
        self.conn.send(("ready", {"seconds": time.perf_counter() - t0, "device": self.device}))
        try:
            await serve_commands(self.conn, self.handle)
        finally:
            await self.aclose()
            self.engine.close()

    async def handle(self, cmd: tuple[Any, ...]) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


class PrefillWorker(_Worker):
    """Commands: ``serve(case, host, port, opts)`` -> ``serving`` (registered), later ``served``; ``add()`` adds
    held requests; ``states(request ids)`` -> ``states``.

    ``opts``: ``attempt`` (request id tag), ``hold`` (do not add requests until ``add``), ``stall_s``
    (sleep before writing, after telling the parent ``stalling``: a transfer kept in flight).
    """

    side = 1

    def __init__(self, conn: Connection, spec: GroupSpec, tp: int, pp: int) -> None:
        super().__init__(conn, spec, tp, pp)
        self._held: list[tuple[str, RequestIndices]] = []
        self._coord: PrefillRank | None = None

    async def handle(self, cmd: tuple[Any, ...]) -> None:
        if cmd[0] == "add":
            assert self._coord is not None
            for rid, idx in self._held:
                self._coord.add_request(rid, idx)
            self._held = []
            self.conn.send(("added",))
        elif cmd[0] == "states":
            coord = self._coord
            states = {} if coord is None else {rid: (coord.outcome(rid) or RequestState.BOOTSTRAPPING).value
                                               for rid in cmd[1]}
            self.conn.send(("states", states))
        elif cmd[0] == "serve":
            await self._serve(*cmd[1:])

    async def _serve(self, case: int, host: str, port: int, opts: dict[str, Any]) -> None:
        c = self.cases[case]
        assert self.engine is not None
        attempt = opts.get("attempt", "a")
        released: list[str] = []

        def release(rid: str) -> None:
            c.release(rid)
            released.append(rid)

        async def stall(rid: str) -> None:
            if opts.get("stall_s"):
                self.conn.send(("stalling", rid))
                await asyncio.sleep(opts["stall_s"])

        client = BootstrapClient(Endpoint(host, port), Codec(self.spec.secret, f"prefill-{self.tp}-{self.pp}",
                                                                 rank_key=self.spec.rank_key))
        timeouts = StateTimeouts(waiting_for_input_s=self.spec.request_timeout_s,
                                 transferring_s=self.spec.request_timeout_s)
        coord = PrefillRank(c.pools.registration(), self.engine, self.info, client,
                            settings=PrefillSettings(timeouts=timeouts, poll_wait_s=min(1.0, self.spec.lease_s / 4),
                                                     write_timeout_s=self.spec.write_timeout_s),
                            release=release, before_write=stall)
        self._coord = coord
        await coord.register()
        self.conn.send(("serving",))
        reqs = [(c.rid(attempt, q), c.ensure(q, write=True)) for q in range(len(c.reqs))]
        free_before = c.free_counts()
        if opts.get("hold"):
            self._held = list(reqs)
        else:
            for rid, idx in reqs:
                coord.add_request(rid, idx)
        stop = asyncio.Event()
        runner = asyncio.create_task(coord.run(stop))
        deadline = time.monotonic() + self.spec.request_timeout_s + 30
        while len(released) < len(reqs) and time.monotonic() < deadline and not runner.done():
            await asyncio.sleep(0.02)
        stop.set()
        await runner
        await client.close()
        self.conn.send(("served", {
            "requests": len(reqs), "released": len(released),
            "states": {rid: (coord.outcome(rid) or RequestState.BOOTSTRAPPING).value for rid, _ in reqs},
            "failures": {r.request_id: r.reason for r in (coord.tracker.get(rid) for rid, _ in reqs
                                                          if rid in coord.tracker) if r.reason},
            "free_before": free_before, "free_after": c.free_counts(), "polls_failed": coord.polls_failed,
        }))


class DecodeWorker(_Worker):
    """Commands: ``transfer(case, qs|None, timeout_s, attempt)`` -> ``transferred`` with outcomes and the byte check."""

    side = 2

    def __init__(self, conn: Connection, spec: GroupSpec, tp: int, pp: int, resolver_file: Path) -> None:
        super().__init__(conn, spec, tp, pp)
        self.resolver = FileResolver(resolver_file)
        self.coords: dict[int, DecodeRank] = {}

    async def handle(self, cmd: tuple[Any, ...]) -> None:
        if cmd[0] == "transfer":
            await self._transfer(*cmd[1:])

    async def aclose(self) -> None:
        for coord in self.coords.values():
            await coord.close()

    def _coord(self, case: int) -> DecodeRank:
        if case not in self.coords:
            c = self.cases[case]
            timeouts = StateTimeouts(bootstrapping_s=30.0, transferring_s=self.spec.request_timeout_s)
            self.coords[case] = DecodeRank(
                c.pools.registration(), self.info, self.resolver, Codec(self.spec.secret, f"decode-{self.tp}-{self.pp}"),
                instance=f"decode-{c.spec.name}", release=c.release,
                # Held items of a failed request wait for the sources' fence, at most one write timeout.
                settings=DecodeSettings(timeouts=timeouts, fence_timeout_s=self.spec.write_timeout_s + 1.0,
                                        fence_margin_s=1.0))
        return self.coords[case]

    async def _transfer(self, case: int, qs: list[int] | None, timeout_s: float, attempt: str) -> None:
        c = self.cases[case]
        coord = self._coord(case)
        qs = list(range(len(c.reqs))) if qs is None else qs
        for q in qs:
            c.ensure(q, write=False)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(coord.transfer(c.rid(attempt, q), c.reqs[q], timeout_s=timeout_s)
                                          for q in qs))  # type: ignore[arg-type]
        seconds = time.perf_counter() - t0
        await coord.wait_fenced(self.spec.write_timeout_s + 5.0)  # failed requests' items come back after the fence
        for q, o in zip(qs, outcomes, strict=True):
            if o.state is RequestState.SUCCESS:
                c.done[q] = c.reqs[q]  # type: ignore[assignment]
        mismatched, first = self._verify(c)
        sources = len(coord.sources) if coord.sources is not None else None
        ok = [o for o in outcomes if o.state is RequestState.SUCCESS]
        self.conn.send(("transferred", {
            "outcomes": [{"request_id": o.request_id, "state": o.state.value,
                          "failure": o.failure.value if o.failure else None, "reason": o.reason,
                          "seconds": o.seconds, "reports": len(o.reports),
                          "endpoint": str(o.endpoint) if o.endpoint else None} for o in outcomes],
            "all_success": len(ok) == len(outcomes),
            "reports_complete": sources is not None and all(len(o.reports) == sources for o in ok),
            "reports": [r.model_dump(mode="json") for o in ok for r in o.reports],
            "mismatched_bytes": mismatched, "first_mismatch": first, "seconds": seconds,
            "free": c.free_counts(), "handshakes": coord.handshakes,
        }))

    def _verify(self, c: _Case) -> tuple[int, dict[str, Any] | None]:
        """Compare the whole arena with the background plus every succeeded request's logical bytes.

        Items of failed requests may hold a partial write; they are freed and compared as "don't care"
        (the expected bytes there are the actual ones) unless a later request succeeded into them.
        """
        expected = c.background.copy()
        actual = c.pools.arena.cpu().numpy()
        base = c.pools.region.address
        for idx in c.dirty:
            for rec in c.pools.records:
                items = idx.of(rec.spec.index)
                off = rec.address - base
                view = slice(off, off + rec.total_bytes)
                exp = expected[view].reshape(rec.count, rec.spec.item_bytes)
                exp[items] = actual[view].reshape(rec.count, rec.spec.item_bytes)[items]
        reqs = [c.done.get(q, _EMPTY) for q in range(len(c.reqs))]
        write_requests([c.pools], c.spec.seed, reqs, [expected])
        n, m = compare(c.pools, expected)
        return n, (dataclasses.asdict(m) if m is not None else None)


def prefill_main(conn: Connection, spec: GroupSpec, tp: int, pp: int) -> None:
    """Process entry point of a prefill rank (spawned)."""
    guard(conn, lambda: asyncio.run(PrefillWorker(conn, spec, tp, pp).main()))


def decode_main(conn: Connection, spec: GroupSpec, tp: int, pp: int, resolver_file: str) -> None:
    """Process entry point of a decode rank (spawned)."""
    guard(conn, lambda: asyncio.run(DecodeWorker(conn, spec, tp, pp, Path(resolver_file)).main()))
