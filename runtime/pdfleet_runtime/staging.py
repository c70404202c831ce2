"""Staged transfer of scattered blocks: gather on the source GPU, one bulk write per chunk, scatter on arrival.

Why: a real request is thousands of scattered pages. The engines move one contiguous GiB near the
NVLink limit (~390 GB/s) but a batch of scattered 64 KiB blocks at 8-18 GB/s (design.md section 7):
per-block cost dominates. A GPU index kernel gathers the same blocks at HBM speed, so

    gather chunk k (source stream) -> engine writes the chunk's bytes as ONE block -> receiver scatters chunk k

pipelined over a ring of staging slots: chunk k+1 is gathered while chunk k is on the link and
chunk k-1 is scattered. The receiver scatters a chunk only after the sender published that the
chunk landed (the engine said done and, for Mooncake, the copy's stream reached an event), and the
sender reuses a slot only after the receiver published that its scatter from it ended (credits).

Rows: every block is cut into rows of ``g`` bytes, the largest power of two <= 256 dividing its
source offset, destination offset and length (256 for pages; 16 for a 16-byte ring), so a gather is
``index_select`` over the arena viewed as ``[rows, g/8]`` int64 and a scatter is ``index_copy_``.
Row indices are expanded on the device (``repeat_interleave``) from per-block starts and counts,
so the host only handles one entry per block. Both sides derive the same plan from the same
blocks (``StagePlan.build``); the sender needs source rows, the receiver destination rows.

Works on ``cpu`` tensors too (synchronous, for tests); streams and events only exist on ``cuda``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["MAX_ROW", "Chunk", "Marker", "Segment", "Signals", "StagePlan", "StagingRing", "gather_chunk", "receive",
           "scatter_chunk", "send"]

MAX_ROW = 256
"""Largest row (bytes): pages are 256-aligned in every arena (``pools.ALIGN``)."""
_SEG_ALIGN = 256


@dataclass(frozen=True)
class Segment:
    """Rows ``[r0, r1)`` of row group ``group``, at byte ``offset`` of a staging slot."""

    group: int
    r0: int
    r1: int
    offset: int


@dataclass(frozen=True)
class Chunk:
    segments: tuple[Segment, ...]
    nbytes: int
    """Bytes of the slot the engine writes (last segment's end)."""


@dataclass
class _Group:
    row: int
    """Row size in bytes."""
    starts: np.ndarray
    counts: np.ndarray
    rows: int
    index: torch.Tensor | None = None


def _row_size(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Largest power of two <= MAX_ROW dividing each block's offsets and length (vectorized)."""
    x = (src | dst | length | MAX_ROW).astype(np.int64)
    return x & -x


class StagePlan:
    """The row groups of one side of a batch and its cut into chunks of at most ``chunk_bytes``.

    ``offsets`` are byte offsets of the blocks inside this side's arena; ``peer_offsets`` those on
    the other side (they only choose the row size, which both sides must agree on).
    """

    def __init__(self, groups: list[_Group], chunks: list[Chunk], total: int) -> None:
        self.groups, self.chunks, self.bytes = groups, chunks, total

    @classmethod
    def build(cls, offsets: np.ndarray, peer_offsets: np.ndarray, length: np.ndarray, chunk_bytes: int) -> StagePlan:
        offsets, peer_offsets, length = (np.asarray(a, dtype=np.int64) for a in (offsets, peer_offsets, length))
        if chunk_bytes % _SEG_ALIGN or chunk_bytes < MAX_ROW:
            raise ValueError(f"chunk_bytes must be a multiple of {_SEG_ALIGN}, got {chunk_bytes}")
        row = _row_size(offsets, peer_offsets, length)
        groups: list[_Group] = []
        for g in np.unique(row)[::-1]:  # big rows first: the bulk of the bytes
            sel = row == g
            counts = length[sel] // g
            groups.append(_Group(int(g), offsets[sel] // g, counts, int(counts.sum())))
        chunks: list[Chunk] = []
        segs: list[Segment] = []
        used = 0
        for gi, grp in enumerate(groups):
            r = 0
            while r < grp.rows:
                off = -(-used // _SEG_ALIGN) * _SEG_ALIGN
                room = (chunk_bytes - off) // grp.row
                if room <= 0:
                    chunks.append(Chunk(tuple(segs), used))
                    segs, used = [], 0
                    continue
                n = min(room, grp.rows - r)
                segs.append(Segment(gi, r, r + n, off))
                used = off + n * grp.row
                r += n
        if segs:
            chunks.append(Chunk(tuple(segs), used))
        return cls(groups, chunks, int(length.sum()))

    def materialize(self, device: torch.device | str) -> StagePlan:
        """Expand every group's row indices on ``device`` (per-block arrays cross; rows do not)."""
        for grp in self.groups:
            starts = torch.from_numpy(grp.starts).to(device)
            counts = torch.from_numpy(grp.counts).to(device)
            first = torch.cumsum(counts, 0) - counts  # exclusive prefix sum
            base = torch.repeat_interleave(starts - first, counts, output_size=grp.rows)
            grp.index = base + torch.arange(grp.rows, device=device, dtype=torch.int64)
        return self

    @property
    def max_chunk(self) -> int:
        return max((c.nbytes for c in self.chunks), default=0)


def _rows(flat: torch.Tensor, row: int) -> torch.Tensor:
    """A uint8 buffer viewed as ``[n, row/8]`` int64 (or ``[n, row]`` bytes below 8)."""
    return flat.view(torch.int64).view(-1, row // 8) if row >= 8 else flat.view(-1, row)


def gather_chunk(plan: StagePlan, k: int, arena: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy chunk ``k``'s rows of ``arena`` into ``slot`` (on the current stream)."""
    for s in plan.chunks[k].segments:
        grp = plan.groups[s.group]
        assert grp.index is not None, "materialize() the plan first"
        out = _rows(slot[s.offset : s.offset + (s.r1 - s.r0) * grp.row], grp.row)
        # aten::index (the TensorIterator kernel index_copy_ also uses), not index_select: on an H200
        # index_select gathered 256-byte rows at ~400 GB/s while index_copy_ scattered them at ~1.4 TB/s.
        torch.ops.aten.index.Tensor_out(_rows(arena, grp.row), [grp.index[s.r0 : s.r1]], out=out)


def scatter_chunk(plan: StagePlan, k: int, slot: torch.Tensor, arena: torch.Tensor) -> None:
    """Copy chunk ``k``'s rows from ``slot`` to their places in ``arena`` (on the current stream)."""
    for s in plan.chunks[k].segments:
        grp = plan.groups[s.group]
        assert grp.index is not None, "materialize() the plan first"
        src = _rows(slot[s.offset : s.offset + (s.r1 - s.r0) * grp.row], grp.row)
        _rows(arena, grp.row).index_copy_(0, grp.index[s.r0 : s.r1], src)


class StagingRing:
    """``slots`` staging buffers of ``slot_bytes`` in one allocation (one engine registration)."""

    def __init__(self, slots: int, slot_bytes: int, device: torch.device | str, buffer: torch.Tensor | None = None) -> None:
        if slot_bytes % _SEG_ALIGN:
            raise ValueError(f"slot_bytes must be a multiple of {_SEG_ALIGN}")
        self.slots, self.slot_bytes = slots, slot_bytes
        if buffer is not None and buffer.numel() < slots * slot_bytes:
            raise ValueError(f"a ring of {slots} x {slot_bytes} bytes does not fit {buffer.numel()} bytes")
        self.buffer = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device) if buffer is None else buffer

    def reshaped(self, slots: int, slot_bytes: int) -> StagingRing:
        """Another cut of the same (registered) buffer."""
        return StagingRing(slots, slot_bytes, self.buffer.device, self.buffer)

    def slot(self, k: int) -> torch.Tensor:
        i = k % self.slots
        return self.buffer[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def address(self, k: int) -> int:
        return self.buffer.data_ptr() + (k % self.slots) * self.slot_bytes


class Signals(Protocol):
    """Counters both sides see (shared memory in one host; absolute counts over the connection's life)."""

    def landed(self) -> int: ...
    def set_landed(self, n: int) -> None: ...
    def freed(self) -> int: ...
    def set_freed(self, n: int) -> None: ...


class Marker:
    """An event on ``cuda`` (done when the stream reaches it); always done on ``cpu``."""

    def __init__(self, stream: Any) -> None:
        self._event = None
        if stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def order(self, stream: Any) -> None:
        """Make ``stream`` wait (on the device) for the work this marker follows."""
        if self._event is not None and stream is not None:
            stream.wait_event(self._event)

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())


def _stream(device: torch.device) -> Any:
    """A side stream that first waits for the current one (the arena and the plan's indices were made there)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _on(stream: Any) -> Any:
    import contextlib

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


Writer = Callable[[int, int, int], Callable[[], bool]]
"""``post(k, local_address, nbytes)`` -> ``done()``: write a slot's first bytes to the peer's slot ``k``."""


def send(plan: StagePlan, arena: torch.Tensor, ring: StagingRing, post: Writer, signals: Signals,
         base: int = 0, *, timeout_s: float = 30.0, engine_stream: Any = None,
         trace: list[tuple[int, str, float]] | None = None) -> int:
    """Sender side: gather, write and publish every chunk of ``plan`` (chunks ``base + k`` on the counters).

    A slot is refilled only when the receiver freed it (``freed() > base + k - slots``); ``landed`` is
    published in order, each after its write reported done. ``engine_stream``: the stream the engine
    queues its copies on (Mooncake ``nvlink_intra``: the legacy default stream); it is then made to
    wait for each gather on the device and the chunk is posted at once, instead of after the host saw
    the gather end. ``trace`` collects ``(chunk, step, perf_counter)``. Returns the number of chunks.
    """
    device = arena.device
    stream = _stream(device)
    n, slots = len(plan.chunks), ring.slots
    gathered: deque[tuple[int, Marker]] = deque()
    inflight: deque[tuple[int, Callable[[], bool]]] = deque()
    k_gather = k_landed = 0
    deadline = time.monotonic() + timeout_s
    while k_landed < n:
        progressed = False
        while k_gather < n and k_gather - (signals.freed() - base) < slots and len(gathered) + len(inflight) < slots:
            if trace is not None:
                trace.append((k_gather, "gather", time.perf_counter()))
            with _on(stream):
                gather_chunk(plan, k_gather, arena, ring.slot(k_gather))
                gathered.append((k_gather, Marker(stream)))
            k_gather += 1
            progressed = True
        while gathered and (engine_stream is not None or gathered[0][1].done()):
            k, marker = gathered.popleft()
            marker.order(engine_stream)
            if trace is not None:
                trace.append((k, "post", time.perf_counter()))
            inflight.append((k, post(k, ring.address(k), plan.chunks[k].nbytes)))
            if trace is not None:
                trace.append((k, "posted", time.perf_counter()))
            progressed = True
        while inflight and inflight[0][1]():
            k, _ = inflight.popleft()
            k_landed += 1
            signals.set_landed(base + k_landed)
            if trace is not None:
                trace.append((k, "landed", time.perf_counter()))
            progressed = True
        if not progressed:
            if time.monotonic() > deadline:
                raise TimeoutError(f"staged send: {k_landed} of {n} chunks landed after {timeout_s}s")
            time.sleep(0)
    return n


def receive(plan: StagePlan, arena: torch.Tensor, ring: StagingRing, signals: Signals, base: int = 0, *,
            timeout_s: float = 30.0, trace: list[tuple[int, str, float]] | None = None) -> None:
    """Receiver side: scatter each chunk once it landed; free its slot when the scatter ended; return when all did."""
    device = arena.device
    stream = _stream(device)
    n = len(plan.chunks)
    pending: deque[tuple[int, Marker]] = deque()
    k_next = freed = 0
    deadline = time.monotonic() + timeout_s
    while freed < n:
        progressed = False
        landed = signals.landed() - base
        while k_next < n and k_next < landed:
            if trace is not None:
                trace.append((k_next, "scatter", time.perf_counter()))
            with _on(stream):
                scatter_chunk(plan, k_next, ring.slot(k_next), arena)
                pending.append((k_next, Marker(stream)))
            k_next += 1
            progressed = True
        while pending and pending[0][1].done():
            k, _ = pending.popleft()
            if trace is not None:
                trace.append((k, "freed", time.perf_counter()))
            freed += 1
            signals.set_freed(base + freed)
            progressed = True
        if not progressed:
            if time.monotonic() > deadline:
                raise TimeoutError(f"staged receive: {freed} of {n} chunks scattered after {timeout_s}s")
            time.sleep(0)
    if stream is not None:
        stream.synchronize()
