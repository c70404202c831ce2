"""Staged transfer of scattered blocks: gather on the source GPU, one bulk write per chunk, scatter on arrival.

Why: a real request is thousands of scattered pages. The engines move one contiguous GiB near the
NVLink limit (~390 GB/s) but a batch of scattered 64 KiB blocks at 8-18 GB/s (design.md section 7):
per-block cost dominates. A GPU copy kernel gathers the same blocks at HBM speed, so

    gather chunk k (own stream) -> engine writes the chunk's bytes as ONE block -> receiver scatters chunk k

pipelined over a ring of staging slots: chunk k+1 is gathered while chunk k is on the link and
chunk k-1 is scattered. The receiver scatters a chunk only after the sender published that the
chunk landed (the engine said done and, for Mooncake, the copy's stream reached an event), and the
sender reuses a slot only after the receiver published that its scatter from it ended (credits).

Plan: the blocks, in their given order, form one byte stream; chunk ``k`` is the stream's bytes
``[k * chunk_bytes, (k + 1) * chunk_bytes)`` and lands at the start of a slot. Each side cuts its own
blocks into *pieces* that never cross a chunk boundary and hold at most ``piece_bytes``, and keeps one
table row per piece: (arena offset, slot offset, length). Both sides cut the same stream at the same
chunk boundaries, so they agree on every byte's slot position without sharing tables; the offsets
each side uses are only its own (``StagePlan.build`` takes one side's offsets and the lengths).
The table is cut on the arena's device by a few tensor operations (no per-block Python), when the
request's blocks are known, before its transfer starts.

Kernel (CUDA): one Triton program per piece copies it in sub-blocks of ``SUB_BYTES``, 16-byte
accesses where every offset and length is a multiple of 16 (``unit``; pages are 256-aligned), with
a mask only on a piece's last, partial sub-block. The same kernel gathers (arena -> slot) and
scatters (slot -> arena). The previous row-index kernels (``aten::index`` over 256-byte rows)
gathered at ~400 GB/s on an H200 and did not keep up with the link.

On ``cpu`` tensors (tests, the CPU benchmark) a per-piece copy loop does the same work synchronously;
streams and events only exist on ``cuda``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["MAX_UNIT", "PIECE_BYTES", "SUB_BYTES", "Aborted", "Chunk", "Marker", "Signals", "StagePlan", "StagingRing",
           "chunk_size", "gather_chunk", "receive", "scatter_chunk", "send"]

MAX_UNIT = 16
"""Widest access (bytes) the kernel uses: offsets and lengths that are multiples of 16 get 16-byte loads."""
PIECE_BYTES = 64 << 10
"""Most bytes one kernel program copies (a KV page is 16-64 KiB; a 2 MiB state block becomes 32 pieces)."""
SUB_BYTES = 16 << 10
"""Bytes one program moves per step (loads of the whole step are in flight together)."""
WARPS = 4
_ALIGN = 256
_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class Aborted(RuntimeError):
    """A staged send or receive stopped by its ``abort`` hook (the request failed elsewhere)."""


@dataclass(frozen=True)
class Chunk:
    """``nbytes``: bytes of the slot the engine writes; pieces ``[p0, p1)`` of the plan's table."""

    nbytes: int
    p0: int = 0
    p1: int = 0


def _unit(offsets: np.ndarray, length: np.ndarray) -> int:
    """Largest power of two <= MAX_UNIT dividing every offset and length."""
    x = MAX_UNIT
    if offsets.size:
        x |= int(np.bitwise_or.reduce(offsets)) | int(np.bitwise_or.reduce(length))
    return x & -x


def chunk_size(total: int, slot_bytes: int, min_chunks: int = 4, floor: int = 8 << 20) -> int:
    """A chunk size for a request of ``total`` bytes: the slot, or smaller so that a small request
    still splits into about ``min_chunks`` chunks (pipeline fill and drain are one chunk each), never
    under ``floor``; a multiple of 256."""
    want = max(floor, -(-total // min_chunks))
    return max(_ALIGN, min(slot_bytes, -(-want // _ALIGN) * _ALIGN))


class StagePlan:
    """One side's pieces of a batch and its cut into chunks of at most ``chunk_bytes``.

    ``table``: int64 ``[pieces, 3]`` = (arena offset, slot offset, length) in elements of ``elem``
    bytes (``elem`` = min(unit, 8); the arena and slots are viewed with that element type), on the
    plan's device. The cut runs there too, as a dozen tensor operations: on the H200 hosts the same
    cut in numpy took 1.5 ms for a 32k-token request (18,566 blocks) and 8 ms at 128k, the upload
    of the finished table 0.1-0.3 ms more; on the GPU only the blocks' offsets and lengths cross
    (one copy) and three small reads come back (piece counts and the chunks' piece bounds).
    Build it when the request's blocks are known (the decode's indices arrive while the prefill
    computes), not when the transfer starts.
    """

    def __init__(self, offsets: np.ndarray, length: np.ndarray, chunk_bytes: int, piece_bytes: int = PIECE_BYTES,
                 device: torch.device | str = "cpu") -> None:
        off = np.asarray(offsets, dtype=np.int64)
        ln = np.asarray(length, dtype=np.int64)
        if off.shape != ln.shape:
            raise ValueError("offsets and length differ in shape")
        if chunk_bytes % _ALIGN or chunk_bytes < _ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {_ALIGN}, got {chunk_bytes}")
        if piece_bytes % _ALIGN or piece_bytes < _ALIGN:
            raise ValueError(f"piece_bytes must be a positive multiple of {_ALIGN}, got {piece_bytes}")
        if ln.size and ln.min() <= 0:
            if ln.min() < 0:
                raise ValueError("negative block length")
            keep = ln > 0
            off, ln = off[keep], ln[keep]
        self.device = torch.device(device)
        self.bytes = int(ln.sum())
        self.unit = _unit(off, ln)
        self.elem = min(self.unit, 8)
        self.chunk_bytes, self.piece_bytes = chunk_bytes, piece_bytes
        n = -(-self.bytes // chunk_bytes)
        if not n:
            self.table = torch.empty((0, 3), dtype=torch.int64, device=self.device)
            self.chunks: list[Chunk] = []
            return
        self.table, bounds = _cut(torch.from_numpy(np.stack([off, ln])).to(self.device), chunk_bytes, piece_bytes, n)
        if self.elem > 1:
            self.table //= self.elem
        self.chunks = [Chunk(min(chunk_bytes, self.bytes - k * chunk_bytes), bounds[k], bounds[k + 1])
                       for k in range(n)]

    @classmethod
    def build(cls, offsets: np.ndarray, length: np.ndarray, chunk_bytes: int, piece_bytes: int = PIECE_BYTES,
              device: torch.device | str = "cpu") -> StagePlan:
        """``offsets``: byte offsets of the blocks in this side's arena; ``length``: their sizes, in the
        order both sides use (the receiver passes its own offsets with the same lengths); ``device``:
        where the table lives (the arena's device)."""
        return cls(offsets, length, chunk_bytes, piece_bytes, device)

    @classmethod
    def on_device(cls, blocks: torch.Tensor, total: int, unit: int, chunk_bytes: int,
                  piece_bytes: int = PIECE_BYTES) -> StagePlan:
        """The same cut from blocks already on the arena's device (``[2, n]`` int64 offsets and lengths,
        every length > 0), with their byte total and ``unit`` given (the sender computed both): the
        receiver cuts its plan from the table the sender wrote into its staging region, without a copy
        to the host."""
        if chunk_bytes % _ALIGN or chunk_bytes < _ALIGN or piece_bytes % _ALIGN or piece_bytes < _ALIGN:
            raise ValueError(f"chunk and piece bytes must be positive multiples of {_ALIGN}")
        if unit not in (1, 2, 4, 8, 16):
            raise ValueError(f"unit must be a power of two up to {MAX_UNIT}, got {unit}")
        self = cls.__new__(cls)
        self.device, self.bytes, self.unit = blocks.device, total, unit
        self.elem = min(unit, 8)
        self.chunk_bytes, self.piece_bytes = chunk_bytes, piece_bytes
        n = -(-total // chunk_bytes)
        if not n:
            self.table, self.chunks = torch.empty((0, 3), dtype=torch.int64, device=self.device), []
            return self
        self.table, bounds = _cut(blocks, chunk_bytes, piece_bytes, n)
        if self.elem > 1:
            self.table //= self.elem
        self.chunks = [Chunk(min(chunk_bytes, total - k * chunk_bytes), bounds[k], bounds[k + 1]) for k in range(n)]
        return self


def _cut(blocks: torch.Tensor, cb: int, pb: int, chunks: int) -> tuple[torch.Tensor, list[int]]:
    """Blocks ``[2, n]`` (offset, length; bytes) -> table rows (bytes) and each chunk's first row.

    The blocks in order form one byte stream; each is cut where the stream crosses a chunk boundary,
    then every part longer than ``pb`` into ``pb``-sized pieces from its start."""
    off, ln = blocks[0], blocks[1]
    end = torch.cumsum(ln, 0)
    pos = end - ln
    c0 = torch.div(pos, cb, rounding_mode="floor")
    cc, blk, ps, pe = c0, None, pos, end
    counts = torch.div(end - 1, cb, rounding_mode="floor") - c0 + 1
    total = int(counts.sum())
    if total != off.numel():  # 1. blocks crossing a chunk boundary: one part per chunk
        blk, j = _expand(counts, total)
        cc = c0[blk] + j
        ps = torch.maximum(pos[blk], cc * cb)
        pe = torch.minimum(end[blk], (cc + 1) * cb)
    counts = torch.div(pe - ps + pb - 1, pb, rounding_mode="floor")
    total2 = int(counts.sum())
    if total2 != ps.numel():  # 2. parts longer than a piece
        sub, j = _expand(counts, total2)
        blk = sub if blk is None else blk[sub]
        cc = cc[sub]
        start = ps[sub] + j * pb
        pe = torch.minimum(start + pb, pe[sub])
        ps = start
    if blk is None:
        table = torch.stack([off, ps - cc * cb, pe - ps], 1)
    else:
        table = torch.stack([off[blk] + (ps - pos[blk]), ps - cc * cb, pe - ps], 1)
    bounds = torch.searchsorted(cc, torch.arange(chunks + 1, device=cc.device)).tolist()
    return table, bounds


def _expand(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For counts ``[2, 3]``: owners ``[0, 0, 1, 1, 1]`` and ranks ``[0, 1, 0, 1, 2]``."""
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    return owner, torch.arange(total, device=counts.device) - first[owner]


@functools.cache
def _kernel() -> Any:
    """The Triton copy kernel, compiled on first use (imports triton only then)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["p0"])
    def copy_pieces(src, dst, table, p0, GATHER: tl.constexpr, STEPS: tl.constexpr, SUB: tl.constexpr,
                    VEC: tl.constexpr):
        row = table + (p0 + tl.program_id(0)).to(tl.int64) * 3
        arena_off = tl.load(row)
        slot_off = tl.load(row + 1)
        n = tl.multiple_of(tl.load(row + 2), VEC)
        if GATHER:
            so = tl.multiple_of(arena_off, VEC)
            do = tl.multiple_of(slot_off, VEC)
        else:
            so = tl.multiple_of(slot_off, VEC)
            do = tl.multiple_of(arena_off, VEC)
        offs = tl.arange(0, SUB)
        for i in tl.static_range(STEPS):
            if (i + 1) * SUB <= n:
                x = tl.load(src + so + i * SUB + offs)
                tl.store(dst + do + i * SUB + offs, x)
            elif i * SUB < n:
                m = offs < n - i * SUB
                x = tl.load(src + so + i * SUB + offs, mask=m)
                tl.store(dst + do + i * SUB + offs, x, mask=m)

    return copy_pieces


def _launch(plan: StagePlan, k: int, arena: torch.Tensor, slot: torch.Tensor, gather: bool, table: Any) -> None:
    c = plan.chunks[k]
    if c.p1 == c.p0:
        return
    dt = _DTYPES[plan.elem]
    sub = min(SUB_BYTES, plan.piece_bytes) // plan.elem
    steps = -(-plan.piece_bytes // plan.elem // sub)
    a, s = arena.view(dt), slot[: c.nbytes].view(dt)
    src, dst = (a, s) if gather else (s, a)
    _kernel()[(c.p1 - c.p0,)](src, dst, table, c.p0, GATHER=gather, STEPS=steps, SUB=sub,
                              VEC=plan.unit // plan.elem, num_warps=WARPS)


def _loop(plan: StagePlan, k: int, arena: torch.Tensor, slot: torch.Tensor, gather: bool) -> None:
    c, e = plan.chunks[k], plan.elem
    for a, s, n in plan.table[c.p0 : c.p1].tolist():
        a, s, n = a * e, s * e, n * e
        if gather:
            slot[s : s + n].copy_(arena[a : a + n])
        else:
            arena[a : a + n].copy_(slot[s : s + n])


def _copy(plan: StagePlan, k: int, arena: torch.Tensor, slot: torch.Tensor, gather: bool, kernel: str | None) -> None:
    if plan.table.device != arena.device:
        raise ValueError(f"the plan's table is on {plan.table.device}, the arena on {arena.device}: build it there")
    if (kernel or ("triton" if arena.is_cuda else "loop")) == "loop":
        _loop(plan, k, arena, slot, gather)
    else:
        _launch(plan, k, arena, slot, gather, plan.table)  # cpu: the TRITON_INTERPRET=1 tests


def gather_chunk(plan: StagePlan, k: int, arena: torch.Tensor, slot: torch.Tensor, kernel: str | None = None) -> None:
    """Copy chunk ``k``'s pieces of ``arena`` (uint8) into ``slot`` (uint8, on the current stream).

    ``kernel``: ``"triton"`` (default on cuda) or ``"loop"`` (default on cpu)."""
    _copy(plan, k, arena, slot, True, kernel)


def scatter_chunk(plan: StagePlan, k: int, slot: torch.Tensor, arena: torch.Tensor, kernel: str | None = None) -> None:
    """Copy chunk ``k``'s pieces from ``slot`` to their places in ``arena`` (on the current stream)."""
    _copy(plan, k, arena, slot, False, kernel)


class StagingRing:
    """``slots`` staging buffers of ``slot_bytes`` in one allocation (one engine registration)."""

    def __init__(self, slots: int, slot_bytes: int, device: torch.device | str, buffer: torch.Tensor | None = None) -> None:
        if slot_bytes % _ALIGN:
            raise ValueError(f"slot_bytes must be a multiple of {_ALIGN}")
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
    """A side stream that first waits for the current one (the arena and the plan's table were made there)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


Writer = Callable[[int, int, int], Callable[[], bool]]
"""``post(k, local_address, nbytes)`` -> ``done()``: write a slot's first bytes to the peer's slot ``k``."""
def send(plan: StagePlan, arena: torch.Tensor, ring: StagingRing, post: Writer, signals: Signals,
         base: int = 0, *, timeout_s: float = 30.0, engine_stream: Any = None, lookahead: int = 2,
         trace: list[tuple[int, str, float]] | None = None, abort: Callable[[], bool] | None = None) -> int:
    """Sender side: gather, write and publish every chunk of ``plan`` (chunks ``base + k`` on the counters).

    A slot is refilled only when the receiver freed it (``freed() > base + k - slots``); ``landed`` is
    published in order, each after its write reported done. ``engine_stream``: the stream the engine
    queues its copies on (Mooncake ``nvlink_intra``: the legacy default stream); it is then made to
    wait for each gather on the device and the chunk is posted at once, instead of after the host saw
    the gather end. At most ``lookahead`` chunks are gathered and not yet posted, and one chunk is
    posted per turn of the loop: chunk k+1's gather is queued before chunk k's post, which may block
    for the copy (Mooncake), so the GPU gathers while the link copies. ``trace`` collects
    ``(chunk, step, perf_counter)``: gather queued, post, posted, done (write seen done), landed
    (signalled). ``freed()`` is read only when the ring looks full (across nodes it
    is a remote read). ``abort()`` true stops the send (``Aborted``) between chunks: what landed
    stays landed, nothing more is posted. Returns the number of chunks.
    """
    device = arena.device
    stream = _stream(device)
    n, slots = len(plan.chunks), ring.slots
    gathered: deque[tuple[int, Marker]] = deque()
    inflight: deque[tuple[int, Callable[[], bool]]] = deque()
    k_gather = k_landed = 0
    freed = base  # the receiver's count as last read
    deadline = time.monotonic() + timeout_s
    while k_landed < n:
        if abort is not None and abort():
            while inflight and time.monotonic() < deadline:  # posted writes end before the caller fences
                if inflight[0][1]():
                    inflight.popleft()
            raise Aborted(f"staged send: aborted after {k_landed} of {n} chunks landed"
                          + (f", {len(inflight)} still posted at the deadline" if inflight else ""))
        progressed = False
        while (k_gather < n and len(gathered) < lookahead and len(gathered) + len(inflight) < slots
               and (k_gather - (freed - base) < slots or k_gather - ((freed := signals.freed()) - base) < slots)):
            with _on(stream):
                if trace is not None:
                    trace.append((k_gather, "gather", time.perf_counter()))
                gather_chunk(plan, k_gather, arena, ring.slot(k_gather))
                gathered.append((k_gather, Marker(stream)))
            k_gather += 1
            progressed = True
        if gathered and (engine_stream is not None or gathered[0][1].done()):
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
            if trace is not None:
                trace.append((k, "done", time.perf_counter()))
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
            timeout_s: float = 30.0, trace: list[tuple[int, str, float]] | None = None,
            abort: Callable[[], bool] | None = None) -> None:
    """Receiver side: scatter each chunk once it landed; free its slot when the scatter ended; return when all did.

    Only whole chunks are scattered (a chunk is scattered once its landed count arrived, never before),
    so a request that fails mid-way (``abort()`` true: ``Aborted``) leaves no chunk half-applied."""
    device = arena.device
    stream = _stream(device)
    n = len(plan.chunks)
    pending: deque[tuple[int, Marker]] = deque()
    k_next = freed = 0
    deadline = time.monotonic() + timeout_s
    while freed < n:
        if abort is not None and abort():
            if stream is not None:
                stream.synchronize()  # the chunks queued so far end whole
            raise Aborted(f"staged receive: aborted after {freed} of {n} chunks scattered")
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
