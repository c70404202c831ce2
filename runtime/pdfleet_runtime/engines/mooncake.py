"""Mooncake Transfer Engine adapter (P2P handshake; ``tcp``, ``rdma``, ``nvlink_intra``).

Hazards of 0.3.13 (shared/engines.md) and how this adapter makes them impossible:

* More than 2,048 entries queued to one TCP peer fail with "queue-full" and may leave every later
  write to that peer failing. Batches are split to half the per-peer queue
  (``settings.resolve``), and a failed call is recovered once: if the peer still answers a probe
  the engine is rebuilt (new engine, memory re-registered) and the chunk retried; writes are
  idempotent, so a retry never corrupts.
* A write from an unregistered address returned success without moving data: every block is
  range-checked against both registrations before the call (``TransferEngine.submit``).
* ``initialize`` returns 0 for any protocol string, even ``rdma`` on a host without RDMA devices:
  the adapter checks the engine's topology for ``rdma`` and the build for ``nvlink`` and raises
  ``TransportMismatch`` instead of running over TCP.
* A dead peer returns -1 at once; a failed probe turns that into ``PeerUnreachable`` at once.
* GPU memory (``nvlink_intra``, 0.3.14): the peer maps our IPC handle to the start of the allocation,
  so whole allocations are registered (``cuda.allocation_range``), never a carved region; each
  entry is a plain ``cudaMemcpy`` queued in the calling thread's current device, which returns
  before a device-to-device copy ends, so calls bind the thread to the region's GPU and a
  transfer is done only after that GPU is synchronized (``cuda.synchronize``).

Writes to several peers run from several threads at once (the prefill rank's writes to different
decodes): Mooncake's engine is thread-safe, and the adapter keeps that true across a rebuild: each
batch's status is asked of the engine that took the batch, and threads that saw the same engine fail
rebuild it once (``_rebuild_lock``, by generation).

Rebuilding changes the engine's RPC port, so ``local_info`` changes: the runtime writes from
prefill (the initiator, which rebuilds) to decode (the target, which never does).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from enum import StrEnum
from typing import Any

from pdfleet_runtime.engines import cuda
from pdfleet_runtime.engines.base import (
    EngineCapabilities,
    PeerId,
    PeerInfo,
    PeerState,
    Transfer,
    TransferEngine,
    TransferReport,
    TransportReport,
    import_first,
)
from pdfleet_runtime.engines.errors import (
    EngineStartError,
    PeerUnreachable,
    TransferFailed,
    TransportMismatch,
)
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import RegionRecord

__all__ = ["LIBRARY", "MODULES", "InjectedFault", "MooncakeEngine", "map_write_failure"]

MODULES = ("mooncake.engine",)
LIBRARY = ("Mooncake Transfer Engine (pip mooncake-transfer-engine-non-cuda with the Debian package libibverbs1 "
           "on CPU hosts, mooncake-transfer-engine-cuda13 on GPU hosts)")
_NON_CUDA_DIST = "mooncake-transfer-engine-non-cuda"


class InjectedFault(StrEnum):
    """Test-only faults, injected above the engine so the recovery path runs deterministically."""

    POISON = "poison"
    """Every engine call fails until the engine is rebuilt, as after a queue-full."""


def map_write_failure(peer: PeerId, rc: int, probe_rc: int, *, after_recovery: bool) -> Exception:
    """The typed error for a failed write: ``rc`` of the write, ``probe_rc`` of ``send_probe`` to the peer."""
    if probe_rc != 0:
        return PeerUnreachable(f"peer {peer} is unreachable: write returned {rc}, probe returned {probe_rc}")
    stage = "after rebuilding the engine" if after_recovery else "before recovery"
    return TransferFailed(f"write to {peer} returned {rc} {stage}; the peer answers probes")


def _location(device: str) -> str:
    return device if device.startswith("cuda") else "*"


class _MooncakeTransfer(Transfer):
    """Pipelined chunks: up to ``depth`` async batches in flight (never more entries than the peer queues).

    The engine's status call blocks until its batch ends, so one ``poll`` submits what fits and
    waits for the oldest batch. After any failure the rest goes one synchronous chunk per ``poll``
    through ``_write_chunk`` (probe, rebuild once, retry): writes are idempotent, so a chunk that
    may have landed partly is simply written again.
    """

    def __init__(self, engine: MooncakeEngine, peer: PeerId, batch: Blocks, chunk: int, depth: int) -> None:
        super().__init__(peer, batch)
        self._engine = engine
        self._chunks = list(batch.chunks(chunk))
        self._depth = depth
        self._inflight: deque[tuple[Any, int]] = deque()  # (the engine that took the batch, its batch id)
        self._submitted = 0
        self._confirmed = 0
        self._sync = False
        self._calls = 0
        self._recoveries = 0

    def _advance(self) -> TransferReport | None:
        if self._sync:
            calls, recovered = self._engine._write_chunk(self.peer, self._chunks[self._confirmed])
            self._calls += calls
            self._recoveries += recovered
            self._confirmed += 1
        else:
            self._pipeline()
        if self._confirmed < len(self._chunks):
            return None
        self._engine._fence()
        b = self.batch
        return TransferReport(self.peer, b.descriptors, b.bytes, self._calls, b.descriptors,
                              time.perf_counter() - self.started, self._recoveries, 0, b.descriptors)

    def _pipeline(self) -> None:
        eng = self._engine
        failed = False
        while self._submitted < len(self._chunks) and len(self._inflight) < self._depth:
            raw = eng._engine
            bid = eng._call_async(self.peer, self._chunks[self._submitted], raw)
            self._calls += 1
            if bid <= 0:
                failed = True
                break
            self._inflight.append((raw, bid))
            self._submitted += 1
        if not failed and self._inflight:
            failed = eng._batch_status(*self._inflight.popleft()) != 0
            self._confirmed += not failed
        if failed:
            while self._inflight:  # let the engine finish what it holds before any rebuild
                eng._batch_status(*self._inflight.popleft())
            self._sync = True

    def cancel(self) -> None:
        while self._inflight:
            self._engine._batch_status(*self._inflight.popleft())


class MooncakeEngine(TransferEngine):
    """Mooncake behind the contract; one engine per process, rebuilt in place on a wedged peer."""

    capabilities = EngineCapabilities(
        backend="mooncake",
        protocols=frozenset({LinkProtocol.TCP, LinkProtocol.RDMA, LinkProtocol.NVLINK}),
        memory=frozenset({"cpu", "cuda"}),
        library=LIBRARY,
        recovers_engine=True,
    )

    # ------------------------------------------------------------------ start and registration

    def _start(self) -> None:
        self._module = import_first(MODULES, LIBRARY)
        if self.settings.protocol is LinkProtocol.NVLINK and self._non_cuda_build():
            raise TransportMismatch("nvlink asked for, but the installed Mooncake is the non-CUDA build: its "
                                    "initialize accepts nvlink_intra and then moves data over TCP")
        self.generation = 0
        self.recoveries = 0
        self.engine_calls = 0
        self._poisoned = False
        self._gpu: str | None = None
        self._rebuild_lock = threading.Lock()
        self._engine = self._new_engine()

    @staticmethod
    def _non_cuda_build() -> bool:
        from importlib import metadata

        try:
            metadata.distribution(_NON_CUDA_DIST)
        except metadata.PackageNotFoundError:
            return False
        return True

    def _new_engine(self) -> Any:
        engine = self._module.TransferEngine()
        rc = engine.initialize(self.config.host, "P2PHANDSHAKE", self.settings.engine_protocol,
                               self.settings.device_names)
        if rc != 0:
            raise EngineStartError(f"mooncake initialize({self.config.host!r}, {self.settings.engine_protocol!r}) "
                                   f"returned {rc}")
        if self.settings.protocol is LinkProtocol.RDMA and not self._has_rdma_device(engine):
            raise TransportMismatch("rdma asked for, but the engine's topology lists no RDMA device: it would "
                                    "silently move data over TCP")
        return engine

    @staticmethod
    def _has_rdma_device(engine: Any) -> bool:
        try:
            topology = json.loads(engine.get_local_topology())
        except (ValueError, TypeError):
            return False
        return any(any(lists) for lists in topology.values() if isinstance(lists, list))

    def _register(self, regions: tuple[RegionRecord, ...]) -> None:
        self._gpu = next((r.device for r in regions if cuda.is_cuda(r.device)), None)
        spans: dict[int, tuple[int, str]] = {}
        for r in regions:
            if cuda.is_cuda(r.device):  # whole allocations: the peer maps IPC handles to their start
                base, size = cuda.allocation_range(r.address, r.device)
                spans[base] = (size, r.device)
            else:
                spans[r.address] = (r.total_bytes, r.device)
        for address, (nbytes, device) in sorted(spans.items()):
            rc = self._engine.register_memory(address, nbytes, _location(device))
            if rc != 0:
                raise EngineStartError(f"mooncake register_memory({address:#x}, {nbytes}) returned {rc}")

    def _bind(self) -> None:
        if self._gpu is not None:
            cuda.bind_thread(self._gpu)

    def _fence(self) -> None:
        """GPU copies are queued, not done, when the engine says success: wait for the local GPU."""
        if self._gpu is not None:
            cuda.synchronize(self._gpu)

    def _name(self) -> str:
        return f"{self.config.host}:{self._engine.get_rpc_port()}"

    def _connect(self, info: PeerInfo) -> Any:
        rc = self._engine.send_probe(info.name)
        if rc != 0:
            raise PeerUnreachable(f"peer {info.name} does not answer the handshake probe (returned {rc})")
        return None

    def _submit(self, peer_id: PeerId, peer: PeerState, batch: Blocks) -> Transfer:
        limit = self.settings.max_batch_entries
        # Two chunks of half the per-peer queue keep the link busy without ever filling the queue.
        return _MooncakeTransfer(self, peer_id, batch, limit or batch.descriptors or 1, 2 if limit else 1)

    def _close(self) -> None:
        self._engine = None

    def transport(self) -> TransportReport:
        """Pinned: Mooncake does not report its transport; start verified rdma devices and the nvlink build."""
        s = self.settings
        return TransportReport(s.protocol, s.engine_protocol, s.engine_protocol, True, s.env)

    # ------------------------------------------------------------------ writes and recovery

    @property
    def raw(self) -> Any:
        """The engine itself, for the benchmark's baseline and fault-injection tests: no checks at all."""
        return self._engine

    def inject_fault(self, fault: InjectedFault) -> None:
        """Test-only: make the engine look wedged (``POISON``) until the adapter rebuilds it."""
        if fault is InjectedFault.POISON:
            self._poisoned = True

    def _call(self, peer: str, chunk: Blocks, raw: Any) -> int:
        self.engine_calls += 1
        if self._poisoned:
            return -1
        self._bind()
        return int(raw.batch_transfer_sync_write(peer, chunk.src.tolist(), chunk.dst.tolist(),
                                                          chunk.length.tolist()))

    def _call_async(self, peer: str, chunk: Blocks, raw: Any) -> int:
        """Submit one chunk to ``raw``; its batch id, or -1 when it refused (or a fault is injected)."""
        self.engine_calls += 1
        if self._poisoned:
            return -1
        self._bind()
        bid = raw.batch_transfer_async_write(peer, chunk.src.tolist(), chunk.dst.tolist(),
                                                      chunk.length.tolist())
        return int(bid) if bid and bid > 0 else -1

    @staticmethod
    def _batch_status(raw: Any, bid: int) -> int:
        """Block until batch ``bid`` (taken by engine ``raw``) ends: 0 when every entry succeeded."""
        return int(raw.get_batch_transfer_status([bid]))

    def _write_chunk(self, peer: PeerId, chunk: Blocks) -> tuple[int, int]:
        """Write one chunk; on failure probe, rebuild once and retry. Returns (engine calls, recoveries)."""
        raw, generation = self._engine, self.generation
        rc = self._call(peer, chunk, raw)
        if rc == 0:
            return 1, 0
        probe = int(raw.send_probe(peer))
        if probe != 0:
            raise map_write_failure(peer, rc, probe, after_recovery=False)
        self._rebuild(generation)
        rc = self._call(peer, chunk, self._engine)
        if rc == 0:
            return 2, 1
        raise map_write_failure(peer, rc, int(self._engine.send_probe(peer)), after_recovery=True)

    def _rebuild(self, generation: int) -> None:
        """Replace a wedged engine: a fresh one with the same regions (cheap over TCP: no pinning).
        Once per ``generation``: a thread whose engine another thread already replaced retries on the new one."""
        with self._rebuild_lock:
            if self.generation != generation:
                return
            new = self._new_engine()
            old, self._engine = self._engine, new
            self._poisoned = False
            self._register(self._regions)
            self.generation += 1
            self.recoveries += 1
            del old
