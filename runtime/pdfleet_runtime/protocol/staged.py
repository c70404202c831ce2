"""The staged path inside the protocol: staging regions, lanes, chunk flow control over the engine.

Why: a request is thousands of scattered pages; the engines move a scattered batch at 8-20 GB/s and
one contiguous block near the link's limit. The staged path (``staging.py``) gathers a request into a
staging ring on the source GPU, writes each chunk as one block into the decode's ring and scatters it
there. This module makes it part of a rank:

- **Regions.** Every GPU rank allocates one staging region at start (``StagingRegion``, sized from
  the runtime config's ``staging``) and registers it with its engine beside its pools. A decode rank's
  region holds ``lanes`` rings (one staged source at a time each) plus a table area and three signal
  words per lane; it announces the region (``StagingModel``) in its ``DecodeRegister``. A prefill
  rank's region holds one ring, a table buffer and a row of constant words (``0, 1, 2, ...``) that
  its signal writes copy from (no per-signal GPU write).
- **Grant.** Per request the decode picks the path (``choose_path``: staged at or above the config's
  threshold, on GPU pools, when a lane per source is free) and names the lanes in its
  ``TransferRequest`` (``lanes``, in the order of its sources); their words are zeroed first.
- **Flow control** (every signal an engine operation, so it works between nodes): the sender writes
  the dst block table and then ``ready`` (1: staged, 2: this source writes directly or has nothing for
  this rank); the decode cuts its scatter plan from that table on its own GPU. Per chunk the sender
  writes ``landed = k`` after chunk ``k``'s write reported done; the decode scatters only chunks it
  saw landed, whole, and sets its local ``freed`` after each scatter ended; the sender reads
  ``freed`` (one 8-byte engine read) only when its ring is full: at most ``slots`` chunks in flight.
- **Failure mid-way.** Either side stops between chunks (``staging.Aborted``); the decode never
  scatters a chunk that did not land, and the request's items and lanes stay held until the sources
  fence, as for a direct write (``protocol/decode.py``).

The costs of each signal (the landed write, the freed read) are kept in ``StagedMetrics``'
histograms; each leg's per-chunk timeline (``staged_timeline``) is kept (the last few per side, in
``timelines``) and logged once when the leg ends; ``bench/gpu_serve.py`` reports both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from pdfleet_runtime import staging
from pdfleet_runtime.engines.chunks import ChunkLink
from pdfleet_runtime.protocol.staged_timeline import Timeline

__all__ = ["HEADER_WORDS", "READY_DIRECT", "READY_STAGED", "DecodeStaging", "Histogram", "Lane", "Layout",
           "Path", "PrefillStaging", "Prepared", "StagedMetrics", "StagingError", "StagingRegion", "choose_path"]

READY_STAGED, READY_DIRECT = 1, 2
HEADER_WORDS = 4
"""Table header: blocks, total bytes, the receiver's unit, chunk bytes."""
_WORD = 8
_SIGNAL_STRIDE = 64
_LANDED, _FREED, _READY = 0, 1, 2
COUNT_WORDS = 8192
"""Constant words a prefill region holds (signal values 0..8191: the most chunks one request may have)."""
KEPT_TIMELINES = 8
"""Timelines of the last legs kept per side (``timelines``), besides the one log line per leg."""
log = logging.getLogger(__name__)


class StagingError(RuntimeError):
    """The staging region cannot be made (does not fit beside the pools) or a peer's is unusable."""


class Path(StrEnum):
    DIRECT = "direct"
    STAGED = "staged"


def choose_path(nbytes: int, device: str, threshold_bytes: int, *, enabled: bool = True, cpu: bool = False) -> Path:
    """Staged for requests of at least ``threshold_bytes`` on GPU pools (``cpu``: on host pools too, for
    tests); the direct write otherwise (small requests: per-chunk fixed costs would dominate)."""
    if not enabled or nbytes <= 0 or nbytes < threshold_bytes:
        return Path.DIRECT
    return Path.STAGED if device != "cpu" or cpu else Path.DIRECT


@dataclass(frozen=True)
class Layout:
    """Byte layout of a staging region (offsets from its start); pure."""

    slots: int
    slot_bytes: int
    lanes: int
    table_bytes: int

    def __post_init__(self) -> None:
        if self.slots < 1 or self.lanes < 1 or self.slot_bytes < 256 or self.slot_bytes % 256:
            raise ValueError(f"bad staging layout {self}: slots, lanes >= 1, slot bytes a positive multiple of 256")
        if self.table_bytes < 256 or self.table_bytes % 256:
            raise ValueError("table bytes must be a positive multiple of 256")

    @property
    def ring_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def lane_bytes(self) -> int:
        return self.ring_bytes + self.table_bytes

    @property
    def signals(self) -> int:
        return self.lanes * self.lane_bytes

    @property
    def total(self) -> int:
        return self.signals + self.lanes * _SIGNAL_STRIDE

    @property
    def max_blocks(self) -> int:
        return (self.table_bytes - HEADER_WORDS * _WORD) // (2 * _WORD)

    def ring(self, lane: int) -> int:
        return lane * self.lane_bytes

    def table(self, lane: int) -> int:
        return lane * self.lane_bytes + self.ring_bytes

    def word(self, lane: int, which: int) -> int:
        return self.signals + lane * _SIGNAL_STRIDE + which * _WORD


@dataclass(frozen=True)
class Lane:
    """A decode lane as the sender sees it: absolute addresses in the decode's staging region."""

    ring: int
    table: int
    landed: int
    freed: int
    ready: int


class Histogram:
    """Counts of seconds by upper bound (Prometheus-style buckets, cumulative when exported)."""

    BOUNDS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BOUNDS) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, seconds: float) -> None:
        i = next((j for j, b in enumerate(self.BOUNDS) if seconds <= b), len(self.BOUNDS))
        self.counts[i] += 1
        self.sum += seconds
        self.n += 1

    @property
    def mean(self) -> float:
        return self.sum / self.n if self.n else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.BOUNDS), "counts": list(self.counts), "sum": self.sum, "count": self.n}


@dataclass
class StagedMetrics:
    """Bytes and requests per path, and the time per chunk (post to landed), per landed write, per freed read."""

    bytes: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in Path})
    requests: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in Path})
    chunk_s: Histogram = field(default_factory=Histogram)
    landed_write_s: Histogram = field(default_factory=Histogram)
    freed_read_s: Histogram = field(default_factory=Histogram)

    def count(self, path: Path | str, nbytes: int) -> None:
        key = Path(path).value
        self.bytes[key] += nbytes
        self.requests[key] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": dict(self.bytes), "requests": dict(self.requests), "chunk_seconds": self.chunk_s.to_dict(),
                "landed_write_seconds": self.landed_write_s.to_dict(),
                "freed_read_seconds": self.freed_read_s.to_dict()}


class StagingRegion:
    """One staging allocation on the rank's device (registered with the engine beside the pools)."""

    def __init__(self, layout: Layout, device: str, *, extra: int = 0, what: str = "staging") -> None:
        self.layout = layout
        nbytes = layout.total + extra
        if device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            if nbytes > free:
                raise StagingError(
                    f"the {what} region ({nbytes / 2**20:.0f} MiB: staging.slots {layout.slots} x staging.slotMib "
                    f"{layout.slot_bytes >> 20}, x {layout.lanes} lanes, plus tables) does not fit beside the pools "
                    f"on {device} ({free / 2**20:.0f} MiB free): lower staging.slotMib, staging.slots or "
                    "staging.lanes in the runtime config, or set staging.enabled false")
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.address = self.buffer.data_ptr()
        self.device = device

    def record(self) -> Any:
        from pdfleet_runtime.records import RegionRecord

        return RegionRecord(self.address, self.buffer.numel(), str(self.buffer.device))

    def words(self, offset: int, n: int = 1) -> torch.Tensor:
        return self.buffer[offset : offset + n * _WORD].view(torch.int64)

    def ring(self, offset: int) -> staging.StagingRing:
        lay = self.layout
        return staging.StagingRing(lay.slots, lay.slot_bytes, self.buffer.device,
                                   self.buffer[offset : offset + lay.ring_bytes])


class _Poller:
    """Reads and writes of this side's own words, on a stream of their own (never the model's)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def read(self, word: torch.Tensor) -> int:
        if self.stream is None:
            return int(word.item())
        with torch.cuda.stream(self.stream):
            return int(word.item())

    def on(self) -> Any:
        """This stream as the current one (a no-op on the host)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else _null()

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def write(self, word: torch.Tensor, value: int) -> None:
        if self.stream is None:
            word.fill_(value)
            return
        with torch.cuda.stream(self.stream):
            word.fill_(value)
        self.stream.synchronize()


# --------------------------------------------------------------------------- decode side


class DecodeStaging:
    """A decode rank's staging region: lanes granted per request, each request's chunks received."""

    def __init__(self, region: StagingRegion, arena: torch.Tensor, *, threshold_bytes: int,
                 min_chunks: int = 4, cpu: bool = False, metrics: StagedMetrics | None = None) -> None:
        self.region, self.arena = region, arena
        self.layout = region.layout
        self.threshold_bytes, self.min_chunks, self.cpu = threshold_bytes, min_chunks, cpu
        self.metrics = metrics or StagedMetrics()
        self._free = list(range(self.layout.lanes))
        self._held: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self._poll = _Poller(arena.device)
        self.timelines: deque[Timeline] = deque(maxlen=KEPT_TIMELINES)

    def announce(self) -> dict[str, int]:
        """What the decode's registration says of its region (``StagingModel`` fields)."""
        lay = self.layout
        return {"address": self.region.address, "slots": lay.slots, "slot_bytes": lay.slot_bytes,
                "lanes": lay.lanes, "table_bytes": lay.table_bytes, "min_chunks": self.min_chunks}

    def grant(self, request_id: str, nbytes: int, sources: int) -> tuple[int, ...] | None:
        """Lanes for a request of ``nbytes`` into this rank from ``sources`` ranks, or None (direct write)."""
        if sources < 1 or choose_path(nbytes, str(self.arena.device), self.threshold_bytes, cpu=self.cpu) is Path.DIRECT:
            return None
        with self._lock:
            if len(self._free) < sources or request_id in self._held:
                return None
            lanes = tuple(self._free[:sources])
            del self._free[:sources]
            self._held[request_id] = lanes
        for lane in lanes:
            self.region.words(self.layout.word(lane, 0), 3).zero_()
        if self.arena.is_cuda:
            torch.cuda.synchronize(self.arena.device)
        return lanes

    def release(self, request_id: str) -> None:
        """The request's lanes back (after its sources fenced, as its items)."""
        with self._lock:
            self._free.extend(self._held.pop(request_id, ()))

    @property
    def lanes_free(self) -> int:
        return len(self._free)

    def receive(self, lane: int, *, abort: Callable[[], bool], timeout_s: float = 30.0) -> int:
        """Wait for the source's table, cut the scatter plan and scatter every chunk; the bytes scattered
        (0 when the source wrote directly). Raises ``staging.Aborted``, ``TimeoutError`` or ``StagingError``."""
        lay, region = self.layout, self.region
        ready_w = region.words(lay.word(lane, _READY))
        with self._lock:
            request = next((r for r, ls in self._held.items() if lane in ls), "-")
        timeline = Timeline.begin("receive", request, f"lane {lane}")
        deadline = time.monotonic() + timeout_s
        while (ready := self._poll.read(ready_w)) == 0:
            if abort():
                raise staging.Aborted("staged receive: aborted before the source's table arrived")
            if time.monotonic() > deadline:
                raise TimeoutError(f"staged receive: no table from the source after {timeout_s}s")
            time.sleep(0)
        if ready == READY_DIRECT:
            return 0
        if ready != READY_STAGED:
            raise StagingError(f"lane {lane}: ready word {ready} is neither staged nor direct")
        timeline.mark("table")
        plan = self._plan(lane)
        timeline.mark("plan")
        trace: list[tuple[int, str, float]] = []
        staging.receive(plan, self.arena, region.ring(lay.ring(lane)), _ReceiverSignals(self, lane),
                        timeout_s=max(0.001, deadline - time.monotonic()), abort=abort, trace=trace)
        timeline.mark("end")
        timeline.add_trace(trace)
        _keep(self.timelines, timeline)
        self.metrics.count(Path.STAGED, plan.bytes)
        return plan.bytes

    def _plan(self, lane: int) -> staging.StagePlan:
        lay, region = self.layout, self.region
        t = lay.table(lane)
        n, total, unit, chunk = (int(x) for x in region.words(t, HEADER_WORDS).tolist())
        if not (0 < n <= lay.max_blocks) or chunk > lay.slot_bytes or chunk % 256 or unit not in (1, 2, 4, 8, 16):
            raise StagingError(f"lane {lane}: the source's table header (blocks {n}, chunk {chunk}, unit {unit}) "
                               f"does not fit this region (at most {lay.max_blocks} blocks, slots of {lay.slot_bytes})")
        with self._poll.on():
            blocks = region.words(t + HEADER_WORDS * _WORD, 2 * n).view(2, n)
            lo, hi, s = blocks[0].min(), (blocks[0] + blocks[1]).max(), blocks[1].sum()
            bad = torch.stack([lo < 0, hi > self.arena.numel(), s != total, blocks[1].min() <= 0]).tolist()
            if any(bad):
                raise StagingError(f"lane {lane}: the source's block table leaves this rank's arena or does not "
                                   f"add up to {total} bytes")
            plan = staging.StagePlan.on_device(blocks.clone(), total, unit, chunk)
        self._poll.sync()
        return plan


class _ReceiverSignals:
    def __init__(self, owner: DecodeStaging, lane: int) -> None:
        lay = owner.layout
        self._poll = owner._poll
        self._landed = owner.region.words(lay.word(lane, _LANDED))
        self._freed = owner.region.words(lay.word(lane, _FREED))

    def landed(self) -> int:
        return self._poll.read(self._landed)

    def set_landed(self, n: int) -> None:
        raise AssertionError("the sender sets landed")

    def freed(self) -> int:
        return self._poll.read(self._freed)

    def set_freed(self, n: int) -> None:
        self._poll.write(self._freed, n)


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


# --------------------------------------------------------------------------- prefill side


class PrefillStaging:
    """A prefill rank's staging region: one ring, a table buffer, constant words, one read-back word."""

    def __init__(self, region: StagingRegion, arena: torch.Tensor, *, enabled: bool = True,
                 metrics: StagedMetrics | None = None) -> None:
        self.region, self.arena, self.enabled = region, arena, enabled
        self.layout = region.layout
        self.metrics = metrics or StagedMetrics()
        base = self.layout.total
        self.counts_offset, self.readback_offset = base, base + COUNT_WORDS * _WORD
        region.words(self.counts_offset, COUNT_WORDS).copy_(torch.arange(COUNT_WORDS, dtype=torch.int64))
        self._poll = _Poller(arena.device)
        self.timelines: deque[Timeline] = deque(maxlen=KEPT_TIMELINES)
        if arena.is_cuda:
            torch.cuda.synchronize(arena.device)

    @staticmethod
    def extra_bytes() -> int:
        """Bytes past the layout: the constant words and the read-back word (256-aligned)."""
        return COUNT_WORDS * _WORD + 256

    def lane(self, announced: Any, lane: int) -> Lane:
        """Addresses of the decode's ``lane`` from its announcement (``StagingModel``)."""
        lay = Layout(announced.slots, announced.slot_bytes, announced.lanes, announced.table_bytes)
        if not 0 <= lane < lay.lanes:
            raise StagingError(f"lane {lane} is not one of the decode's {lay.lanes}")
        a = announced.address
        return Lane(a + lay.ring(lane), a + lay.table(lane), a + lay.word(lane, _LANDED),
                    a + lay.word(lane, _FREED), a + lay.word(lane, _READY))

    def _count(self, n: int) -> int:
        if not 0 <= n < COUNT_WORDS:
            raise StagingError(f"signal value {n} is past the {COUNT_WORDS} constant words")
        return self.region.address + self.counts_offset + n * _WORD

    def direct(self, link: ChunkLink, lane: Lane) -> None:
        """Tell the decode this source writes directly (or has nothing for it) on this lane."""
        link.write_word(self._count(READY_DIRECT), lane.ready)

    def prepare(self, link: ChunkLink, lane: Lane, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
                slot_bytes: int, min_chunks: int) -> Prepared:
        """Cut this side's plan (on a side stream, never the model's) and write the decode's block table
        and ``ready`` into ``lane``, so the decode cuts its plan too: done when the decode's indices arrive,
        while the request's state is still being computed. Blocks in order: arena offsets ``src`` here,
        ``dst`` in the decode's arena, ``length`` bytes each."""
        lay, region = self.layout, self.region
        n = int(length.size)
        if n > lay.max_blocks:
            raise StagingError(f"{n} blocks do not fit the table area ({lay.max_blocks}): raise staging.tableMib")
        total = int(length.sum())
        chunk = staging.chunk_size(total, min(slot_bytes, lay.slot_bytes), min_chunks)
        with self._poll.on():
            plan = staging.StagePlan.build(src, length, chunk, device=self.arena.device)
        if len(plan.chunks) >= COUNT_WORDS:
            raise StagingError(f"{len(plan.chunks)} chunks: more than the {COUNT_WORDS - 1} signal values")
        unit = staging._unit(np.asarray(dst, dtype=np.int64), np.asarray(length, dtype=np.int64))
        table = np.concatenate([np.array([n, total, unit, chunk], dtype=np.int64),
                                np.asarray(dst, dtype=np.int64), np.asarray(length, dtype=np.int64)])
        t = lay.table(0)
        with self._poll.on():
            region.words(t, table.size).copy_(torch.from_numpy(table))
        self._poll.sync()
        _wait(link.post(region.address + t, lane.table, table.size * _WORD))
        link.write_word(self._count(READY_STAGED), lane.ready)
        return Prepared(plan, lane, total)

    def send_prepared(self, link: ChunkLink, prepared: Prepared, *, abort: Callable[[], bool],
                      timeout_s: float = 30.0, trace: list[tuple[int, str, float]] | None = None,
                      request: str = "-", where: str = "") -> int:
        """The chunks of a prepared request, each with its landed count. Returns the chunks. Its timeline
        (``request``, ``where``: what the log line names) is kept and logged once, when every chunk landed."""
        lane, plan = prepared.lane, prepared.plan
        timeline = Timeline.begin("send", request, where)
        trace = [] if trace is None else trace
        ring = self.region.ring(self.layout.ring(0))
        if hasattr(link, "ring"):
            link.ring(ring.address(0), lane.ring, ring.slots, ring.slot_bytes)  # NIXL: prepared slot lists
        posted: dict[int, float] = {}
        writes: list[tuple[int, dict[str, float]]] = []

        def post(k: int, address: int, nbytes: int) -> Callable[[], bool]:
            posted[k] = time.perf_counter()
            done = link.post(address, lane.ring + (k % ring.slots) * ring.slot_bytes, nbytes)
            if (stamps := getattr(done, "stamps", None)) is not None:  # Mooncake: the poster's blocking write
                writes.append((k, stamps))
            return done

        signals = _SenderSignals(self, link, lane, posted)
        chunks = staging.send(plan, self.arena, ring, post, signals, timeout_s=timeout_s, abort=abort, trace=trace)
        timeline.mark("end")
        trace.extend((k, step, t) for k, stamps in writes for step, t in stamps.items())
        timeline.add_trace(trace)
        _keep(self.timelines, timeline)
        self.metrics.count(Path.STAGED, prepared.total)
        return chunks

    def send(self, link: ChunkLink, lane: Lane, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
             slot_bytes: int, min_chunks: int, abort: Callable[[], bool], timeout_s: float = 30.0,
             trace: list[tuple[int, str, float]] | None = None) -> int:
        """``prepare`` then ``send_prepared``."""
        prepared = self.prepare(link, lane, src, dst, length, slot_bytes=slot_bytes, min_chunks=min_chunks)
        return self.send_prepared(link, prepared, abort=abort, timeout_s=timeout_s, trace=trace)


@dataclass(frozen=True)
class Prepared:
    """A request's staged leg once its plan is cut and the decode has its table."""

    plan: staging.StagePlan
    lane: Lane
    total: int


class _SenderSignals:
    def __init__(self, owner: PrefillStaging, link: ChunkLink, lane: Lane, posted: dict[int, float]) -> None:
        self._owner, self._link, self._lane, self._posted = owner, link, lane, posted
        self._readback = owner.region.words(owner.readback_offset)
        self._readback_addr = owner.region.address + owner.readback_offset

    def landed(self) -> int:
        raise AssertionError("the receiver reads landed")

    def set_landed(self, n: int) -> None:
        t0 = time.perf_counter()
        self._link.write_word(self._owner._count(n), self._lane.landed)
        t1 = time.perf_counter()
        m = self._owner.metrics
        m.landed_write_s.observe(t1 - t0)
        if (p := self._posted.pop(n - 1, None)) is not None:
            m.chunk_s.observe(t1 - p)

    def freed(self) -> int:
        t0 = time.perf_counter()
        self._link.read_word(self._readback_addr, self._lane.freed)
        value = self._owner._poll.read(self._readback)
        self._owner.metrics.freed_read_s.observe(time.perf_counter() - t0)
        return value

    def set_freed(self, n: int) -> None:
        raise AssertionError("the receiver sets freed")


def _keep(timelines: deque[Timeline], timeline: Timeline) -> None:
    """Keep a finished leg's timeline and log it: one line per leg and side, never one per chunk."""
    timelines.append(timeline)
    if log.isEnabledFor(logging.INFO):
        log.info("%s", timeline.line())


def _wait(done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"staged table write not done after {timeout_s}s")
        time.sleep(0)
