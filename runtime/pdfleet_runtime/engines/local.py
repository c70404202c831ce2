"""In-process copies: ``RegionCopier`` (the one copier of blocks within a process) and the ``local`` engine.

The engine has the contract's semantics with no network: peers must live in this process (unit
tests hold both sides in one process); it is also the per-block copy baseline of
``bench/engines.py``. Every check of the contract (ranges, states, peers) runs exactly as for the
real engines. The in-process parity run (``verify.arena.LocalCopyExecutor``) copies through the same
``RegionCopier``, over torch views that also reach GPU memory.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pdfleet_runtime.engines.base import (
    EngineCapabilities,
    PeerId,
    PeerInfo,
    PeerState,
    Transfer,
    TransferEngine,
    TransferReport,
)
from pdfleet_runtime.engines.blocks import RegionTable
from pdfleet_runtime.engines.errors import HandshakeError, Side
from pdfleet_runtime.engines.settings import LOCAL_BACKEND
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import RegionRecord

__all__ = ["LocalEngine", "RegionCopier"]

_DEFAULT_CHUNK = 4096


class RegionCopier:
    """Copies blocks between memory regions of this process.

    Every block is checked first against the source and destination regions (``RegionTable``: one
    vectorized lookup; ``BlockRangeError`` for a block outside every region), then copied per block
    through ``views``: a 1-D byte view of each region by its address (numpy for host memory; torch
    tensors also reach GPU memory). ``host`` builds numpy views of host regions from their addresses.
    """

    def __init__(self, src: RegionTable, dst: RegionTable, views: Mapping[int, Any]) -> None:
        self._src, self._dst = src, dst
        self._src_views = [views[r.address] for r in src.regions]
        self._dst_views = [views[r.address] for r in dst.regions]

    @classmethod
    def within(cls, regions: Sequence[RegionRecord], views: Sequence[Any]) -> RegionCopier:
        """Blocks from any of ``regions`` to any of them (``views`` in the same order)."""
        by_address = {r.address: v for r, v in zip(regions, views, strict=True)}
        return cls(RegionTable(regions, Side.LOCAL), RegionTable(regions, Side.REMOTE), by_address)

    @classmethod
    def host(cls, src: RegionTable, dst: RegionTable) -> RegionCopier:
        views = {r.address: np.ctypeslib.as_array((ctypes.c_ubyte * r.total_bytes).from_address(r.address))
                 for r in (*src.regions, *dst.regions)}
        return cls(src, dst, views)

    def copy(self, blocks: Blocks) -> None:
        if not blocks.descriptors:
            return
        sr = self._src.check(blocks.src, blocks.length)
        dr = self._dst.check(blocks.dst, blocks.length)
        so = (blocks.src - self._src.bases[sr]).tolist()
        do = (blocks.dst - self._dst.bases[dr]).tolist()
        src, dst = self._src_views, self._dst_views
        for s_reg, d_reg, s, d, n in zip(sr.tolist(), dr.tolist(), so, do, blocks.length.tolist(), strict=True):
            dst[d_reg][d : d + n] = src[s_reg][s : s + n]


class _LocalTransfer(Transfer):
    def __init__(self, peer: PeerId, batch: Blocks, chunk: int, copier: RegionCopier) -> None:
        super().__init__(peer, batch)
        self._chunks = list(batch.chunks(chunk))
        self._copier = copier
        self._next = 0

    def _advance(self) -> TransferReport | None:
        self._copier.copy(self._chunks[self._next])
        self._next += 1
        if self._next < len(self._chunks):
            return None
        b = self.batch
        return TransferReport(self.peer, b.descriptors, b.bytes, len(self._chunks), b.descriptors,
                              time.perf_counter() - self.started)


class LocalEngine(TransferEngine):
    """Copies between regions of this process; refuses peers of another process."""

    capabilities = EngineCapabilities(
        backend=LOCAL_BACKEND, protocols=frozenset(LinkProtocol), memory=frozenset({"cpu"}), library="(none)",
    )

    def _start(self) -> None:
        self._pid = os.getpid()

    def _register(self, regions: tuple[RegionRecord, ...]) -> None:
        if any(r.device != "cpu" for r in regions):
            raise HandshakeError("the local engine copies host memory only")

    def _name(self) -> str:
        return f"local:{self._pid}:{id(self):x}"

    def _connect(self, info: PeerInfo) -> Any:
        if not info.name.startswith(f"local:{os.getpid()}:"):
            raise HandshakeError(f"local peer {info.name} lives in another process")
        return None

    def _submit(self, peer_id: PeerId, peer: PeerState, batch: Blocks) -> Transfer:
        copier = RegionCopier.host(self._local, peer.regions)
        return _LocalTransfer(peer_id, batch, self.settings.max_batch_entries or _DEFAULT_CHUNK, copier)
