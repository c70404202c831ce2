"""The rank pipe: typed messages between the pod process and its rank processes (pickled by ``multiprocessing``).

Pure (no torch, no engine), so the pod process can import it. As ``protocol/messages`` does on the
wire, every message is a named, frozen type; a rank dispatches on the operation's type and answers
with the result's type, and failures keep their ``FailureReason`` from the prefill rank to readiness.

- pod -> rank, at spawn: ``RankSpec`` (what the process needs);
- pod -> rank: ``Call(call_id, op)`` with ``op`` a ``TransferOp`` or ``StatsOp``; ``Exit()``;
- rank -> pod: ``RankReady`` once the engine is up (prefill: registered with the pod's bootstrap),
  ``Reply(call_id, result)`` with a ``TransferResult``, ``RankStats`` or ``CallFailed``, ``LegReport``
  per status a prefill rank sends (metrics and readiness), ``RankFailed(traceback)`` before dying.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.protocol.states import FailureReason, RequestState

from .options import FaultOptions

__all__ = [
    "Call",
    "CallFailed",
    "Exit",
    "LegReport",
    "RankFailed",
    "RankOp",
    "RankReady",
    "RankResult",
    "RankSpec",
    "RankStats",
    "Reply",
    "StatsOp",
    "TransferOp",
    "TransferResult",
    "Transport",
]


# --------------------------------------------------------------------------- pod -> rank

@dataclass(frozen=True)
class RankSpec:
    """What one rank process needs (pickled to the spawned process)."""

    config: RuntimeConfig
    tp: int
    pp: int
    secret: bytes = field(repr=False)
    instance: str
    host: str
    bootstrap: tuple[str, int]
    """Prefill: this pod's own bootstrap endpoint (loopback)."""
    request_timeout_s: float = 60.0
    write_timeout_s: float = 30.0
    fence_timeout_s: float = 35.0
    log_level: str = "INFO"
    faults: FaultOptions = field(default_factory=FaultOptions)
    rank_key: bytes | None = field(default=None, repr=False)
    """Prefill: the pod's rank key (``protocol.keys``), what only this pod's ranks sign with."""

    @property
    def name(self) -> str:
        return f"{self.config.role.value}[{self.tp},{self.pp}]"

    @property
    def index(self) -> int:
        return self.pp * self.config.shape.tensor + self.tp



@dataclass(frozen=True)
class TransferOp:
    """Decode: one synthetic request into this rank (allocate, transfer, verify every byte, free)."""

    request_id: str
    host: str
    port: int
    tokens: int
    seed: int
    timeout_s: float
    verify: bool = True


@dataclass(frozen=True)
class StatsOp:
    """Either role: this rank's in-flight count, held and free items (and, decode, its fences)."""


RankOp = TransferOp | StatsOp


@dataclass(frozen=True)
class Call:
    call_id: int
    op: RankOp


@dataclass(frozen=True)
class Exit:
    """Stop serving and exit (EOF of the pipe ends the rank at once)."""


# --------------------------------------------------------------------------- rank -> pod


@dataclass(frozen=True)
class Transport:
    """The transport a rank's engine ended up with (``EngineTransport``, as plain values)."""

    requested: str | None
    engine_protocol: str | None
    effective: str | None
    pinned: bool | None


@dataclass(frozen=True)
class RankReady:
    rank: tuple[int, int]
    pid: int
    engine: str
    transport: Transport
    pool_bytes: int


@dataclass(frozen=True)
class TransferResult:
    """One synthetic request's outcome on one decode rank.

    ``failure`` and ``cause`` as in ``protocol.decode.TransferOutcome``; ``mismatched`` is -1 when the
    bytes were not checked; ``released``: no source can still write the items (another pod may take it).
    """

    request_id: str
    state: RequestState
    failure: FailureReason | None = None
    cause: FailureReason | None = None
    reason: str = ""
    bytes: int = 0
    write_s: float = 0.0
    seconds: float = 0.0
    mismatched: int = -1
    released: bool = False
    mismatched_buffers: tuple[str, ...] = ()
    """The buffers (``BufferSpec.describe``) whose bytes differ, when ``mismatched`` > 0."""

    @property
    def ok(self) -> bool:
        return self.state is RequestState.SUCCESS


@dataclass(frozen=True)
class RankStats:
    in_flight: int
    held: int
    free: dict[str, int]
    fenced: dict[str, int] = field(default_factory=dict)
    fences_pending: int = 0
    handshakes: int = 0
    staged: dict[str, Any] = field(default_factory=dict)
    """``protocol.staged.StagedMetrics.to_dict()``: bytes and requests per path, chunk and signal times."""


@dataclass(frozen=True)
class CallFailed:
    """The operation raised in the rank (the rank lives on); ``error`` is ``Type: message``."""

    error: str


RankResult = TransferResult | RankStats | CallFailed


@dataclass(frozen=True)
class Reply:
    call_id: int
    result: RankResult


@dataclass(frozen=True)
class LegReport:
    """A prefill rank's status of one leg of a request (what it sent the decode)."""

    request_id: str
    state: RequestState
    failure: FailureReason | None
    reason: str
    bytes: int
    write_s: float

    @property
    def ok(self) -> bool:
        return self.state is RequestState.SUCCESS


@dataclass(frozen=True)
class RankFailed:
    traceback: str
