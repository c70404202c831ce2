"""Chunk links: the three operations the staged path needs from an engine, per backend.

A staged transfer (``protocol/staged.py``) moves a request as a few large contiguous chunks between
staging regions and signals each chunk with one 8-byte word, both through the engine, so it works
between pods on different nodes (no shared memory). Per peer it needs:

- ``post(local, remote, nbytes)``: start one contiguous write; returns ``done()`` (raises on failure);
- ``write_word(local, remote)``: write 8 bytes and return when they are written (a landed count);
- ``read_word(local, remote)``: read 8 bytes of the peer into ``local`` and return when they are there
  (the receiver's freed count, read only when the sender's ring is full).

Per backend, the fastest calls measured in ``bench/gpu_transfer.py`` (docs/gpu.md, issue 15):

- Mooncake: ``transfer_sync_write`` blocks for the copy (``nvlink_intra`` queues it on the legacy
  default stream): chunk posts run in order on one worker thread bound to the GPU (``_Poster``), each
  done when an event after the queued copy is reached (its ``stamps``: when the worker's blocking
  write started and returned, for the timeline); words are written and read synchronously.
- NIXL: chunks through prepared slot lists (one ``prep_xfer_dlist`` per ring cut and chunk size on each
  side, ``make_prepped_xfer`` per chunk); words and odd-sized last chunks through ``initialize_xfer``.
- Local (tests, CPU): ``memmove`` in this process, through the engine's checked ``submit`` for posts.

Remote addresses are checked against the peer's registered regions when the link is made
(``check_remote``), since the raw calls below skip the adapter's per-write checks.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pdfleet_runtime.engines.base import PeerId, TransferEngine
from pdfleet_runtime.engines.errors import TransferFailed, TransferStatus
from pdfleet_runtime.engines.settings import LOCAL_BACKEND
from pdfleet_runtime.links import Backend
from pdfleet_runtime.planner import Blocks

__all__ = ["ChunkLink", "chunk_link"]

Done = Callable[[], bool]


class ChunkLink:
    """Base: posts through the engine's checked ``submit``; words by the subclass."""

    def __init__(self, engine: TransferEngine, peer: PeerId) -> None:
        self.engine, self.peer = engine, peer

    def check_remote(self, address: int, nbytes: int) -> None:
        """Raise unless ``[address, address + nbytes)`` lies in one region the peer registered."""
        state = self.engine._peers.get(self.peer)
        if state is None:
            raise TransferFailed(f"peer {self.peer} is not connected")
        state.regions.check(np.array([address], dtype=np.int64), np.array([nbytes], dtype=np.int64))

    def post(self, local: int, remote: int, nbytes: int) -> Done:
        transfer = self.engine.submit(self.peer, _one(local, remote, nbytes))
        return lambda: transfer.poll() is TransferStatus.DONE  # a failed poll raises its typed error

    def write_word(self, local: int, remote: int) -> None:
        self.engine.write(self.peer, _one(local, remote, 8))

    def read_word(self, local: int, remote: int) -> None:
        raise NotImplementedError(f"{type(self.engine).__name__} cannot read a peer's word")

    def close(self) -> None:
        pass


def _one(local: int, remote: int, nbytes: int) -> Blocks:
    a = np.array
    return Blocks(a([local], dtype=np.int64), a([remote], dtype=np.int64), a([nbytes], dtype=np.int64))


class _LocalLink(ChunkLink):
    """The in-process engine: the peer's memory is this process's, so a read is a ``memmove``."""

    def read_word(self, local: int, remote: int) -> None:
        ctypes.memmove(local, remote, 8)


class _Poster:
    """Mooncake's blocking chunk writes, in order, on one worker thread bound to the GPU."""

    def __init__(self, gpu: str | None) -> None:
        sys.setswitchinterval(1e-4)  # the worker takes the GIL back soon after each write, not after 5 ms
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._gpu = gpu
        self._thread = threading.Thread(target=self._run, name="mooncake-poster", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._gpu:
            import torch

            torch.cuda.set_device(torch.device(self._gpu))
        while (item := self._q.get()) is not None:
            fn, posted = item
            posted.stamps["write"] = time.perf_counter()
            try:
                posted.box["done"] = fn()
            except BaseException as e:  # handed to the sender's done()
                posted.box["error"] = e
            posted.stamps["written"] = time.perf_counter()

    def submit(self, fn: Callable[[], Done]) -> Done:
        posted = _Posted()
        self._q.put((fn, posted))
        return posted

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5)


class _Posted:
    """A chunk write queued on the poster: ``done()``, and ``stamps`` (perf_counter) of when the worker
    started the blocking write and when it returned, for the leg's timeline (``staged_timeline``)."""

    __slots__ = ("box", "stamps")

    def __init__(self) -> None:
        self.box: dict[str, Any] = {}
        self.stamps: dict[str, float] = {}

    def __call__(self) -> bool:
        if "error" in self.box:
            raise self.box["error"]
        return "done" in self.box and bool(self.box["done"]())


def _after_queued(gpu: str | None) -> Done:
    """Done when the legacy default stream (where ``nvlink_intra`` queues its copies) reaches this point."""
    if gpu is None:
        return lambda: True
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.default_stream(torch.device(gpu)))
    return lambda: bool(event.query())


class _MooncakeLink(ChunkLink):
    def __init__(self, engine: TransferEngine, peer: PeerId) -> None:
        super().__init__(engine, peer)
        self._raw = engine.raw  # type: ignore[attr-defined]
        self._gpu: str | None = engine._gpu  # type: ignore[attr-defined]
        self._poster = _Poster(self._gpu)

    def _write(self, local: int, remote: int, nbytes: int) -> Done:
        rc = self._raw.transfer_sync_write(self.peer, local, remote, nbytes)
        if rc != 0:
            raise TransferFailed(f"mooncake write of {nbytes} bytes to {self.peer} returned {rc}")
        return _after_queued(self._gpu)

    def post(self, local: int, remote: int, nbytes: int) -> Done:
        return self._poster.submit(lambda: self._write(local, remote, nbytes))

    def write_word(self, local: int, remote: int) -> None:
        self.engine._bind()  # type: ignore[attr-defined]  # nvlink_intra copies on the thread's current GPU
        _wait(self._write(local, remote, 8))

    def read_word(self, local: int, remote: int) -> None:
        self.engine._bind()  # type: ignore[attr-defined]
        rc = self._raw.transfer_sync_read(self.peer, local, remote, 8)
        if rc != 0:
            raise TransferFailed(f"mooncake read of a word from {self.peer} returned {rc}")
        _wait(_after_queued(self._gpu))

    def close(self) -> None:
        self._poster.close()


def _wait(done: Done) -> None:
    while not done():
        pass


class _NixlLink(ChunkLink):
    def __init__(self, engine: TransferEngine, peer: PeerId) -> None:
        super().__init__(engine, peer)
        self._agent = engine.raw  # type: ignore[attr-defined]
        self._mem, self._dev = engine._mem  # type: ignore[attr-defined]
        state = engine._peers[peer]
        self._rmem, self._rdev = state.handle.mem, _peer_device(state)
        self._lists: dict[tuple[int, int, int, int, int], tuple[Any, Any]] = {}
        self._rings: list[tuple[int, int, int, int]] = []
        self._words: dict[tuple[str, int], Any] = {}

    def ring(self, local: int, remote: int, slots: int, slot_bytes: int) -> None:
        """Declare a ring pair (slot ``i`` at ``base + i * slot_bytes`` on both sides): full-slot-size
        chunk posts to it go through prepared lists."""
        if (local, remote, slots, slot_bytes) not in self._rings:
            self._rings.append((local, remote, slots, slot_bytes))

    def _prepared(self, local: int, remote: int, nbytes: int) -> Any:
        for lb, rb, slots, sb in self._rings:
            i, off = divmod(local - lb, sb)
            if 0 <= i < slots and off == 0 and (remote - rb) == i * sb and nbytes == sb:
                key = (lb, rb, slots, sb, nbytes)
                if key not in self._lists:
                    lo = [(lb + j * sb, nbytes, self._dev) for j in range(slots)]
                    ro = [(rb + j * sb, nbytes, self._rdev) for j in range(slots)]
                    self._lists[key] = (self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", lo, self._mem),
                                        self._agent.prep_xfer_dlist(self.peer, ro, self._rmem))
                lo_list, ro_list = self._lists[key]
                return self._agent.make_prepped_xfer("WRITE", lo_list, [i], ro_list, [i])
        return None

    def _word_lists(self, local: int, remote: int) -> tuple[Any, Any]:
        """Single-entry prepared lists for a signal word pair (made once each: a word's post is then
        ``make_prepped_xfer``, no descriptors built per signal)."""
        if (lo := self._words.get(("l", local))) is None:
            lo = self._words[("l", local)] = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", [(local, 8, self._dev)], self._mem)
        if (ro := self._words.get(("r", remote))) is None:
            ro = self._words[("r", remote)] = self._agent.prep_xfer_dlist(self.peer, [(remote, 8, self._rdev)],
                                                                         self._rmem)
        return lo, ro

    def _start(self, op: str, local: int, remote: int, nbytes: int) -> Done:
        agent = self._agent
        if nbytes == 8 and len(self._words) < 4 * 8192:
            lo, ro = self._word_lists(local, remote)
            handle = agent.make_prepped_xfer(op, lo, [0], ro, [0])
        else:
            handle = self._prepared(local, remote, nbytes) if op == "WRITE" else None
        if handle is None:
            loc = np.array([[local, nbytes, self._dev]], dtype=np.uint64)
            rem = np.array([[remote, nbytes, self._rdev]], dtype=np.uint64)
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(loc, self._mem),
                                           agent.get_xfer_descs(rem, self._rmem), self.peer)
        state = agent.transfer(handle)
        if state == "ERR":
            agent.release_xfer_handle(handle)
            raise TransferFailed(f"NIXL refused a {nbytes}-byte {op} with {self.peer}")
        box = {"state": state}

        def done() -> bool:
            if box["state"] != "DONE":
                box["state"] = agent.check_xfer_state(handle)
                if box["state"] == "ERR":
                    agent.release_xfer_handle(handle)
                    raise TransferFailed(f"NIXL {op} of {nbytes} bytes with {self.peer} reported ERR")
                if box["state"] != "DONE":
                    return False
            if "released" not in box:
                box["released"] = "yes"
                agent.release_xfer_handle(handle)
            return True
        return done

    def post(self, local: int, remote: int, nbytes: int) -> Done:
        return self._start("WRITE", local, remote, nbytes)

    def write_word(self, local: int, remote: int) -> None:
        _wait(self._start("WRITE", local, remote, 8))

    def read_word(self, local: int, remote: int) -> None:
        _wait(self._start("READ", local, remote, 8))

    def close(self) -> None:
        for dl in [d for pair in self._lists.values() for d in pair] + list(self._words.values()):
            with contextlib.suppress(Exception):
                dl.release()
        self._lists.clear()
        self._words.clear()


def _peer_device(state: Any) -> int:
    from pdfleet_runtime.engines.nixl import memory_type

    return memory_type(state.info.regions[0].device)[1]


def chunk_link(engine: TransferEngine, peer: PeerId) -> ChunkLink:
    """The link for ``engine``'s backend (``local``, ``mooncake``, ``nixl``)."""
    backend = engine.settings.backend
    if backend is Backend.MOONCAKE:
        return _MooncakeLink(engine, peer)
    if backend is Backend.NIXL:
        return _NixlLink(engine, peer)
    if backend is LOCAL_BACKEND:
        return _LocalLink(engine, peer)
    return ChunkLink(engine, peer)
