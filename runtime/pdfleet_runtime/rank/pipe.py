"""The rank pipe: typed messages between the pod process and its rank processes (pickled by ``multiprocessing``).

Pure (no torch, no engine), so the pod process can import it. As ``protocol/messages`` does on the
wire, every message is a named, frozen type; a rank dispatches on the operation's type and answers
with the result's type, and failures keep their ``FailureReason`` from the prefill rank to readiness.

- pod -> rank, at start: ``RankSpec`` (what the process needs);
- pod -> rank: ``Call(call_id, op)`` with ``op`` a ``TransferOp`` or ``StatsOp``; ``Exit()``;
- rank -> pod: ``RankReady`` once the engine is up (prefill: registered with the pod's bootstrap),
  ``Reply(call_id, result)`` with a ``TransferResult``, ``RankStats`` or ``CallFailed``, ``LegReport``
  per status a prefill rank sends (metrics and readiness), ``RankFailed(traceback)`` before dying.
- the parity harness (``verify.group``) drives the same ranks with three more ops: ``SeededArenaOp``
  (seeded background and allocations, as ``verify.parity.run_parity`` builds them), ``ArenaCheckOp``
  (decode: every byte of the arena, answered by ``ArenaCheck``) and ``RequestStatesOp`` (prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.model.state import ModelFault, RankShare
from pdfleet_runtime.protocol.messages import RequestKind, StatusReport
from pdfleet_runtime.protocol.states import FailureReason, RequestState

__all__ = [
    "ArenaCheck",
    "ArenaCheckOp",
    "Call",
    "CallFailed",
    "Exit",
    "FaultOptions",
    "GenerateOp",
    "Generated",
    "GeneratedToken",
    "LegReport",
    "Mismatch",
    "RankFailed",
    "RankOp",
    "RankReady",
    "RankResult",
    "RankSpec",
    "RankStats",
    "Reply",
    "RequestOutcome",
    "RequestStates",
    "RequestStatesOp",
    "SeededArenaOp",
    "StatsOp",
    "TransferOp",
    "TransferResult",
    "Transport",
]


# --------------------------------------------------------------------------- pod -> rank

@dataclass(frozen=True)
class FaultOptions:
    """Fault injection for tests only (flags hidden from ``--help``): never set in a pod.

    ``write_delay_s``: every engine write of this prefill pod sleeps first (a slow link);
    ``wire``: speak another wire version (an incompatible peer);
    ``corrupt_received``: a decode pod flips a byte of every request's state once it arrived, before the
    byte check (an image that mangles what it receives: its canaries fail with ``BytesMismatched``);
    ``corrupt_sent``: a prefill pod flips a byte of every request's state after filling it, before the
    engine write (the wire carries a wrong byte; the decode's byte check finds it);
    ``scatter_pages``: a seed: each request's pages are drawn at random, as in a long-running pod's
    fragmented pools (benchmarks: fresh pools hand out contiguous pages the planner coalesces);
    ``fill_delay_s``: every synthetic fill of this prefill pod sleeps first (the request's input is late:
    the parity fault tests, which set it directly; no flag);
    ``model``: a reference-engine negative control (``model.state.ModelFault``; ``parity --model --fault``).
    """

    write_delay_s: float = 0.0
    wire: str | None = None
    corrupt_received: bool = False
    corrupt_sent: bool = False
    scatter_pages: int | None = None
    fill_delay_s: float = 0.0
    model: ModelFault | None = None


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
    engine_env: dict[str, str | None] = field(default_factory=dict)
    """Overrides of the protocol table's engine environment (``EngineConfig.env``; the GPU probe's ``UCX_TLS``)."""
    gpu: int | None = None
    """The GPU of this rank's pools (parity's placement, ``verify.cases.gpu_of``); None: its local index."""
    rank_key: bytes | None = field(default=None, repr=False)
    """Prefill: the pod's rank key (``protocol.keys``), what only this pod's ranks sign with."""

    @property
    def name(self) -> str:
        return f"{self.config.role.value}[{self.tp},{self.pp}]"

    @property
    def index(self) -> int:
        """The replica's global rank index."""
        return self.pp * self.config.shape.tp + self.tp

    @property
    def local_index(self) -> int:
        """This rank's index in its pod (a group member holds ``local_world`` consecutive global ranks)."""
        return self.index % self.config.local_world


@dataclass(frozen=True)
class TransferOp:
    """Decode: one synthetic request into this rank (allocate, transfer, verify every byte, free).

    ``kind`` and ``room`` go on the wire as they are (``TransferRequest``): the prefill pod tells a canary and a
    room's claim from a client's request by them, never by ``request_id``."""

    request_id: str
    host: str
    port: int
    tokens: int
    seed: int
    timeout_s: float
    verify: bool = True
    wait_refused_s: float = 0.0
    """A room request: how long the rank sends a refused claim again, same id (the prefill may not hold it yet)."""
    prompt: tuple[int, ...] = ()
    """A reference-engine request (``tokens`` == its length): the prefill computes the model's state; the decode
    answers its share of it (``TransferResult.share``) instead of checking seeded bytes."""
    kind: RequestKind = field(kw_only=True)
    room: int | None = field(default=None, kw_only=True)
    """The room a ``RequestKind.ROOM`` request claims."""
    expect: int = field(default=0, kw_only=True)
    """A model canary: tokens of the prompt's aggregate continuation the prefill computes and sends back."""


@dataclass(frozen=True)
class GenerateOp:
    """Decode, reference engine: rebuild a request's state from every decode rank's share (each read from that
    rank's own pools) and continue greedily from ``first_token`` for ``steps`` tokens; answers ``Generated``.
    ``stop_ids``: a generated id among them ends the continuation early (a model pod's end of sequence; parity
    runs give none: exactly ``steps``)."""

    request_id: str
    length: int
    first_token: int
    steps: int
    shares: tuple[RankShare, ...]
    stop_ids: frozenset[int] = frozenset()
    stream: bool = False
    """Send each token as it is computed (``GeneratedToken``) before the answer: a model pod's streaming answer."""


@dataclass(frozen=True)
class StatsOp:
    """Either role: this rank's in-flight count, held and free items (and, decode, its fences)."""


@dataclass(frozen=True)
class SeededArenaOp:
    """Parity: start a seeded case on this rank while it holds no request; answers ``RankStats``.

    Fills the arena with ``seeded.background(background_seed, side, rank)`` (side 1 prefill, 2 decode),
    restarts the allocator from ``allocator_seed`` and allocates ``reserve`` (request id, tokens) in
    order, so the rank holds the items ``verify.parity.run_parity`` allocates; the synthetic request of a
    reserved id (the prefill's fill, the decode's ``TransferOp``) takes them. From then on a decode rank
    keeps what each request left in its arena, for ``ArenaCheckOp``.
    """

    background_seed: int
    allocator_seed: int
    reserve: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ArenaCheckOp:
    """Decode, after a ``SeededArenaOp``: compare every byte of the arena with the background plus each
    succeeded request's seeded state at its items (a failed request's items may hold anything); ``ArenaCheck``."""


@dataclass(frozen=True)
class RequestStatesOp:
    """Prefill: the protocol state of each request (``bootstrapping`` when not seen yet); ``RequestStates``."""

    request_ids: tuple[str, ...]


RankOp = TransferOp | StatsOp | SeededArenaOp | ArenaCheckOp | RequestStatesOp | GenerateOp


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
    device: str = "cpu"


@dataclass(frozen=True)
class RequestOutcome:
    """How one request ended on one rank (or one leg of it): its state, the typed failure and the bytes moved."""

    request_id: str
    state: RequestState
    failure: FailureReason | None = None
    reason: str = ""
    bytes: int = 0
    write_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state is RequestState.SUCCESS


@dataclass(frozen=True)
class TransferResult(RequestOutcome):
    """One synthetic request's outcome on one decode rank.

    ``failure`` and ``cause`` as in ``protocol.decode.TransferOutcome``; ``mismatched`` is -1 when the
    bytes were not checked; ``released``: no source can still write the items (another pod may take it).
    """

    cause: FailureReason | None = None
    seconds: float = 0.0
    mismatched: int = -1
    released: bool = False
    mismatched_buffers: tuple[str, ...] = ()
    """The buffers (``BufferSpec.describe``) whose bytes differ, when ``mismatched`` > 0."""
    reports: tuple[StatusReport, ...] = ()
    """The sources' status reports of a request that succeeded (parity sums their bytes and descriptors)."""
    share: RankShare | None = None
    """A prompt request that succeeded: this rank's items of it, read from its pools before they were freed."""


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
    held_by: dict[str, int] = field(default_factory=dict)
    """Held requests by why: ``running``, ``fencing`` (decode: failed, waiting for the sources' fence),
    ``orphaned`` (neither: given back by the rank's reconcile after its grace)."""
    reclaimed: int = 0
    """Orphaned requests the rank's reconcile gave back since it started."""


@dataclass(frozen=True)
class CallFailed:
    """The operation raised in the rank (the rank lives on); ``error`` is ``Type: message``."""

    error: str


@dataclass(frozen=True)
class Mismatch:
    """The first differing byte of a decode arena."""

    rank: int
    state_type: str
    field: str
    layer_id: int
    item: int
    offset: int

    def describe(self) -> str:
        return (f"decode rank {self.rank}: {self.state_type}/{self.field} layer {self.layer_id} item {self.item} "
                f"byte offset {self.offset}")


@dataclass(frozen=True)
class ArenaCheck:
    """The answer to ``ArenaCheckOp``: bytes of the arena that differ from what it must hold, and the first."""

    mismatched: int
    first: Mismatch | None = None


@dataclass(frozen=True)
class RequestStates:
    states: dict[str, RequestState]


@dataclass(frozen=True)
class Generated:
    """The answer to ``GenerateOp``: the decode's tokens and the logits of each step (``[steps][vocab]``, the
    float32 values as Python floats: exact, and JSON for the group channel)."""

    tokens: tuple[int, ...]
    logits: tuple[tuple[float, ...], ...]
    seconds: float


@dataclass(frozen=True)
class GeneratedToken:
    """Decode rank 0, while it answers a streaming ``GenerateOp`` (call ``call_id``): token ``index`` of the
    continuation, as soon as it is computed. The ``Generated`` answer that follows holds them all."""

    call_id: int
    index: int
    token: int


RankResult = TransferResult | RankStats | ArenaCheck | RequestStates | CallFailed | Generated


@dataclass(frozen=True)
class Reply:
    call_id: int
    result: RankResult


@dataclass(frozen=True)
class LegReport(RequestOutcome):
    """A prefill rank's status of one leg of a request (what it sent the decode), and the request's kind (metrics
    and readiness count canaries apart)."""

    kind: RequestKind = field(kw_only=True)


@dataclass(frozen=True)
class RankFailed:
    traceback: str
