"""In-process copy engine: the contract's semantics with ``memmove`` and no network.

Peers must live in this process (the parity harness and unit tests hold both sides in one
process); it is also the per-block memcpy baseline of ``bench/engines.py``. Every check of the
contract (ranges, states, peers) runs exactly as for the real engines.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from pdfleet_runtime.engines.base import (
    EngineCapabilities,
    PeerId,
    PeerInfo,
    PeerState,
    Transfer,
    TransferEngine,
    TransferReport,
)
from pdfleet_runtime.engines.errors import HandshakeError
from pdfleet_runtime.engines.settings import LOCAL_BACKEND
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import RegionRecord

__all__ = ["LocalEngine"]

_DEFAULT_CHUNK = 4096


class _LocalTransfer(Transfer):
    def __init__(self, peer: PeerId, batch: Blocks, chunk: int) -> None:
        super().__init__(peer, batch)
        self._chunks = list(batch.chunks(chunk))
        self._next = 0

    def _advance(self) -> TransferReport | None:
        part = self._chunks[self._next]
        move = ctypes.memmove
        for s, d, n in zip(part.src.tolist(), part.dst.tolist(), part.length.tolist(), strict=True):
            move(d, s, n)
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
        return _LocalTransfer(peer_id, batch, self.settings.max_batch_entries or _DEFAULT_CHUNK)
