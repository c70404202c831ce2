"""The engine contract every backend implements, and the checks they share.

An adapter is driven in this order (``EngineState``)::

    engine = create_engine(config)          # registry: imports the adapter, not the engine
    engine.start()                          # settings applied, engine library imported and created
    info = engine.register(regions, buffers)  # once: memory registered, descriptors prepared
    peer = engine.connect(remote_info)      # remote info travels over the bootstrap protocol
    report = engine.write(peer, blocks, timeout_s=30)   # or submit(...).poll()/.wait()
    engine.forget(peer); engine.close()

``write`` refuses any block outside the local or remote registration before the engine sees it
(vectorized), splits batches to the engine's safe size, and maps engine codes to the typed errors
in ``errors``. ``PeerInfo`` is the named, versioned record a peer publishes; its wire form is a
JSON-safe dict, never a pickle.
"""

from __future__ import annotations

import base64
import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NewType

from pdfleet_runtime.engines.blocks import Granule, GranuleTable, RegionTable, checked, granules_of
from pdfleet_runtime.engines.errors import (
    EngineState,
    EngineStateError,
    EngineUnavailable,
    HandshakeError,
    Side,
    TransferStatus,
    TransferTimeout,
    UnknownPeer,
)
from pdfleet_runtime.engines.settings import PROCESS_ENV, EngineConfig, ResolvedSettings, resolve
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.planner import Blocks
from pdfleet_runtime.records import BufferRecord, RankRegistration, RegionRecord

__all__ = [
    "PEER_INFO_VERSION",
    "EngineCapabilities",
    "PeerId",
    "PeerInfo",
    "PeerState",
    "Transfer",
    "TransferEngine",
    "TransferReport",
    "TransportReport",
    "import_first",
    "poll_interval",
]

PeerId = NewType("PeerId", str)
"""A connected peer, as ``connect`` names it (the engine's own peer name)."""

PEER_INFO_VERSION = 1
POLL_MIN_S = 0.0001
POLL_MAX_S = 0.002
POLL_FRACTION = 1 / 32
"""``wait`` sleeps ``POLL_FRACTION`` of the time a batch has taken so far between polls, within
[``POLL_MIN_S``, ``POLL_MAX_S``]: a batch is seen done at most ~3% (and 2 ms) after it ended, and a
long batch is polled about a third as often as with a fixed 0.2 ms sleep (each poll is an engine
call that takes the engine's locks; fewer cost ~5% less CPU per 32k-token NIXL tcp request)."""


def poll_interval(elapsed_s: float) -> float:
    """Seconds ``wait`` sleeps before the next poll of a batch ``elapsed_s`` old."""
    return min(POLL_MAX_S, max(POLL_MIN_S, elapsed_s * POLL_FRACTION))


def import_first(modules: Sequence[str], library: str) -> Any:
    """The first importable module of ``modules`` (GPU and CPU builds name them differently).

    ``EngineUnavailable`` names ``library`` and every import error when none imports.
    """
    errors = []
    for name in modules:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # includes a missing shared library (libibverbs, libamdhip64)
            errors.append(f"{name}: {e}")
    raise EngineUnavailable(f"{library} is not importable on this host ({'; '.join(errors)})")


@dataclass(frozen=True)
class EngineCapabilities:
    """What a backend can do, declared without importing its engine (the capability matrix reads this).

    ``prepared_descriptors``: descriptor lists are prepared at registration and addressed by index.
    ``reports_transport``: the engine can say which transport it used; otherwise settings are pinned.
    ``publishes_layer_ids``: its handshake carries per-buffer layer ids (MORI's does not).
    """

    backend: str
    protocols: frozenset[LinkProtocol]
    memory: frozenset[str]
    library: str
    prepared_descriptors: bool = False
    reports_transport: bool = False
    publishes_layer_ids: bool = True
    recovers_engine: bool = False


@dataclass(frozen=True)
class TransportReport:
    """What was asked for and what the engine runs; ``pinned`` where the engine cannot report it."""

    requested: LinkProtocol | None
    engine_protocol: str
    effective: str
    pinned: bool
    env: Mapping[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerInfo:
    """What a rank publishes so a peer can write to it: engine name, regions, granules, engine metadata."""

    backend: str
    name: str
    protocol: LinkProtocol | None
    regions: tuple[RegionRecord, ...]
    granules: tuple[Granule, ...] = ()
    metadata: bytes = b""
    version: int = PEER_INFO_VERSION

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": "pdfleet.engine.peer-info",
            "version": self.version,
            "backend": self.backend,
            "name": self.name,
            "protocol": None if self.protocol is None else self.protocol.value,
            "regions": [{"address": r.address, "totalBytes": r.total_bytes, "device": r.device} for r in self.regions],
            "granules": [[g.address, g.item_bytes, g.count] for g in self.granules],
            "metadata": base64.b64encode(self.metadata).decode("ascii"),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> PeerInfo:
        """Parse and check a wire dict; ``HandshakeError`` names what is wrong."""
        if data.get("kind") != "pdfleet.engine.peer-info":
            raise HandshakeError(f"not a peer-info message: kind {data.get('kind')!r}")
        if data.get("version") != PEER_INFO_VERSION:
            raise HandshakeError(f"peer-info version {data.get('version')!r}, this runtime speaks {PEER_INFO_VERSION}")
        try:
            return cls(
                backend=str(data["backend"]),
                name=str(data["name"]),
                protocol=None if data["protocol"] is None else LinkProtocol(data["protocol"]),
                regions=tuple(RegionRecord(int(r["address"]), int(r["totalBytes"]), str(r["device"]))
                              for r in data["regions"]),
                granules=tuple(Granule(int(a), int(b), int(c)) for a, b, c in data["granules"]),
                metadata=base64.b64decode(data["metadata"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HandshakeError(f"malformed peer-info: {e!r}") from e


@dataclass(frozen=True)
class TransferReport:
    """One completed batch: planned blocks, what the engine got, time, and recoveries taken."""

    peer: PeerId
    blocks: int
    bytes: int
    engine_calls: int
    engine_descriptors: int
    seconds: float
    recoveries: int = 0
    prepared_descriptors: int = 0
    adhoc_descriptors: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class Transfer(ABC):
    """One submitted batch. ``poll`` advances it without blocking for long; ``wait`` polls to the end.

    ``wait`` sleeps ``poll_interval`` between polls, except after a poll that took longer than that
    (Mooncake waits for a chunk, the local engine copies one: the next poll follows at once). An
    adapter whose polls only ask the engine sets ``sleep_after_every_poll``: a NIXL status check
    can take milliseconds of UCX progress, and checking back to back competes with the engine's own
    progress thread (over tcp: 40-60% more checks and 3-12% slower writes than the raw engine, measured).
    """

    sleep_after_every_poll: ClassVar[bool] = False

    def __init__(self, peer: PeerId, batch: Blocks) -> None:
        self.peer = peer
        self.batch = batch
        self.status = TransferStatus.PENDING
        self.started = time.perf_counter()
        self._report: TransferReport | None = None

    @abstractmethod
    def _advance(self) -> TransferReport | None:
        """Do the next bounded step; the report when done. Raises typed errors."""

    def cancel(self) -> None:  # noqa: B027 - optional hook
        """Release engine handles; chunks already written stay written."""

    def poll(self) -> TransferStatus:
        if self.status is TransferStatus.PENDING:
            try:
                self._report = self._advance()
            except BaseException:
                self.status = TransferStatus.FAILED
                self.cancel()
                raise
            if self._report is not None:
                self.status = TransferStatus.DONE
        return self.status

    def wait(self, timeout_s: float) -> TransferReport:
        """Poll until done; ``TransferTimeout`` (after cancelling) when ``timeout_s`` passes first."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            polled = time.monotonic()
            if self.poll() is not TransferStatus.PENDING:
                break
            now = time.monotonic()
            if now > deadline:
                self.status = TransferStatus.FAILED
                self.cancel()
                raise TransferTimeout(f"batch of {self.batch.descriptors} blocks to {self.peer} not done "
                                      f"after {timeout_s:.1f}s")
            pause = poll_interval(now - start)
            if self.sleep_after_every_poll or now - polled < pause:
                time.sleep(pause)
        assert self._report is not None
        return self._report


@dataclass
class PeerState:
    """A connected peer: its info, range tables and the adapter's handle for it."""

    info: PeerInfo
    regions: RegionTable
    granules: GranuleTable
    handle: Any = None


class TransferEngine(ABC):
    """Base of every adapter: lifecycle, settings, registration records and the pre-engine checks."""

    capabilities: ClassVar[EngineCapabilities]

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.settings: ResolvedSettings = resolve(config)
        self.state = EngineState.NEW
        self._regions: tuple[RegionRecord, ...] = ()
        self._granules: tuple[Granule, ...] = ()
        self._local: RegionTable = RegionTable((), Side.LOCAL)
        self._local_granules = GranuleTable(())
        self._peers: dict[PeerId, PeerState] = {}
        self.batches_to_engine = 0
        """Batches that passed every check and were handed to the engine (refused ones never count)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Apply the settings to this process's environment, then import and create the engine."""
        self._require(EngineState.NEW)
        PROCESS_ENV.apply(self.settings.env)
        self._start()
        self.state = EngineState.STARTED

    def register(self, regions: Sequence[RegionRecord], buffers: Sequence[BufferRecord] = ()) -> PeerInfo:
        """Register every region once; ``buffers`` (inside them) become granules for prepared descriptors."""
        self._require(EngineState.STARTED)
        table = RegionTable(regions, Side.LOCAL)
        granules = granules_of(buffers)
        if granules:
            g = GranuleTable(granules)
            table.check(g.base, g.end - g.base)
            self._local_granules = g
        self._regions, self._granules, self._local = table.regions, granules, table
        self._register(table.regions)
        self.state = EngineState.REGISTERED
        return self.local_info()

    def register_rank(self, registration: RankRegistration) -> PeerInfo:
        """``register`` for a rank's pools: its arena region and its buffers."""
        return self.register((registration.region,), registration.buffers)

    def connect(self, info: PeerInfo) -> PeerId:
        """Accept a peer's info (checked against ours) and connect; ``PeerUnreachable`` if it is gone."""
        self._require(EngineState.REGISTERED)
        if info.backend != self.settings.backend:
            raise HandshakeError(f"peer {info.name} runs backend {info.backend}, this engine {self.settings.backend}")
        if info.protocol != self.settings.protocol:
            raise HandshakeError(f"peer {info.name} pinned protocol {info.protocol}, this engine "
                                 f"{self.settings.protocol}: asking for one transport and getting another is an error")
        peer = PeerState(info, RegionTable(info.regions, Side.REMOTE), GranuleTable(info.granules))
        peer_id = PeerId(info.name)
        peer.handle = self._connect(info)
        self._peers[peer_id] = peer
        return peer_id

    def forget(self, peer: PeerId) -> None:
        """Drop a peer (it restarted or left); later writes to it raise ``UnknownPeer``."""
        state = self._peers.pop(peer, None)
        if state is not None:
            self._forget(state)

    def close(self) -> None:
        for peer in list(self._peers):
            self.forget(peer)
        if self.state is not EngineState.CLOSED and self.state is not EngineState.NEW:
            self._close()
        self.state = EngineState.CLOSED

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writes

    def submit(self, peer: PeerId, blocks: Blocks) -> Transfer:
        """Check and start a write of ``blocks`` to ``peer``."""
        self._require(EngineState.REGISTERED)
        state = self._peers.get(peer)
        if state is None:
            raise UnknownPeer(f"peer {peer!r} is not connected (connected: {sorted(self._peers)})")
        batch = checked(blocks)
        self._local.check(batch.src, batch.length)
        state.regions.check(batch.dst, batch.length)
        self.batches_to_engine += 1
        return self._submit(peer, state, batch)

    def write(self, peer: PeerId, blocks: Blocks, *, timeout_s: float = 60.0) -> TransferReport:
        """``submit`` then ``wait``: returns when every byte is written, or raises a typed error."""
        return self.submit(peer, blocks).wait(timeout_s)

    # ------------------------------------------------------------------ reports

    def local_info(self) -> PeerInfo:
        self._require(EngineState.REGISTERED)
        return PeerInfo(self.settings.backend, self._name(), self.settings.protocol, self._regions,
                        self._granules, self._metadata())

    def transport(self) -> TransportReport:
        """The transport this engine runs, checked at start against the protocol (see adapters)."""
        s = self.settings
        effective = s.engine_protocol if s.pinned else "unpinned"
        return TransportReport(s.protocol, s.engine_protocol, effective, s.pinned, s.env)

    @property
    def peers(self) -> tuple[PeerId, ...]:
        return tuple(self._peers)

    def _require(self, *states: EngineState) -> None:
        if self.state not in states:
            raise EngineStateError(f"{type(self).__name__} is {self.state.value}, needs "
                                   f"{' or '.join(s.value for s in states)}")

    # ------------------------------------------------------------------ adapter hooks

    @abstractmethod
    def _start(self) -> None: ...

    @abstractmethod
    def _register(self, regions: tuple[RegionRecord, ...]) -> None: ...

    @abstractmethod
    def _name(self) -> str: ...

    def _metadata(self) -> bytes:
        return b""

    @abstractmethod
    def _connect(self, info: PeerInfo) -> Any: ...

    def _forget(self, peer: PeerState) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    def _submit(self, peer_id: PeerId, peer: PeerState, batch: Blocks) -> Transfer: ...

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass
