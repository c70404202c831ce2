"""Wire messages between prefill and decode ranks: named, versioned, schema-checked pydantic models.

Every message travels inside an :class:`Envelope` (``version``, ``sender``, ``boot``, ``nonce``,
``timestamp``, ``reply_to``, ``to``: the recipient and its incarnation) whose ``body`` is one of the models below, told apart by its
``type`` field (a discriminated union: never a positional frame, never a pickle). Field names are
the wire names. Numbers that the planner trusts (addresses, counts, layer ids, indices) carry
bounds here, so a malformed value is refused at parsing and never reaches a plan.

Versions follow ``versions.WireProtocol``: peers talk iff the majors match; a minor adds optional
fields only, so a body from a newer minor is parsed with unknown fields dropped (``decode_body``
with ``lenient``), and a body from the same minor must match the schema exactly.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pdfleet_runtime.engines.base import PeerInfo  # a pure module: it imports no engine library
from pdfleet_runtime.ids import LayerId, RowId, SlotId
from pdfleet_runtime.layouts import (
    LAYOUT_DIGEST_LEN,
    BufferSpec,
    DType,
    EntryField,
    IndexKind,
    Sharding,
    StateType,
)
from pdfleet_runtime.records import (
    BufferRecord,
    ParallelShape,
    RankRegistration,
    RegionRecord,
    RequestIndices,
)
from pdfleet_runtime.roles import Role
from pdfleet_runtime.versions import RUNTIME_RELEASES, WireProtocol

from .states import FailureReason, RequestState

__all__ = [
    "MAX_BUFFERS",
    "MAX_INDICES",
    "MAX_MESSAGE_BYTES",
    "WIRE",
    "Ack",
    "Body",
    "BufferModel",
    "Cancel",
    "DecodeRegister",
    "DecodeRegistered",
    "Envelope",
    "Hello",
    "IndicesModel",
    "PrefillPoll",
    "PrefillRegister",
    "PrefillWork",
    "PromptFill",
    "RankKey",
    "RankModel",
    "Recipient",
    "Refusal",
    "RefusalCode",
    "RequestKind",
    "Role",
    "StagingModel",
    "StatusQuery",
    "StatusReply",
    "StatusReport",
    "StatusReports",
    "SyntheticFill",
    "TransferRequest",
    "Welcome",
    "WorkEvent",
    "parse_wire",
]

WIRE: WireProtocol = RUNTIME_RELEASES["0.1.0"].wire
MODEL_IDENTITY_MAX = 200
"""Bound of a model identity on the wire (``hf:ORG/NAME@COMMIT`` or ``dir:sha256:...``)."""
"""The wire protocol this runtime speaks (from the release table, so the operator's check and the
handshake agree)."""
MAX_MESSAGE_BYTES = 4 << 20
"""Largest envelope accepted (default 4 MiB): a 1M-token request's page list is ~100 KiB."""
MAX_BUFFERS = 16384
MAX_INDICES = 1 << 20
_U64 = 2**64
_U32 = 2**32

Name = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/@+=-]+$")]
RequestId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/@+=-]+$")]
Reason = Annotated[str, Field(max_length=4000)]
Count = Annotated[int, Field(ge=0, lt=_U64)]


def parse_wire(text: str) -> WireProtocol:
    """``"1.0"`` -> ``WireProtocol(1, 0)``; ``ValueError`` otherwise."""
    major, sep, minor = text.partition(".")
    if not sep or not major.isdigit() or not minor.isdigit() or len(text) > 16:
        raise ValueError(f"wire version must look like MAJOR.MINOR, got {text!r}")
    return WireProtocol(int(major), int(minor))


class _Msg(BaseModel):
    """Strict by default; ``context={"lenient": True}`` drops unknown fields (a newer minor's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown(cls, data: Any, info: ValidationInfo) -> Any:
        if info.context and info.context.get("lenient") and isinstance(data, dict):
            return {k: v for k, v in data.items() if k in cls.model_fields}
        return data


class RefusalCode(StrEnum):
    """Why a peer refused a message; ``NOT_READY`` and ``BUSY`` are worth a retry, the rest are not."""

    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    REPLAYED = "replayed"
    STALE = "stale"
    VERSION = "version"
    NOT_READY = "not_ready"
    UNKNOWN_PEER = "unknown_peer"
    CONFLICT = "conflict"
    BUSY = "busy"
    UNEXPECTED = "unexpected"
    DRAINING = "draining"
    """The prefill pod is draining: it finishes what it accepted and takes nothing new (try another pod)."""
    WRONG_RECIPIENT = "wrong_recipient"
    """The envelope names another pod, another incarnation of this one, or none (only ``Hello`` may)."""
    FORBIDDEN = "forbidden"
    """A message only the pod's own ranks may send (signed with its rank key, over loopback)."""

    @property
    def retryable(self) -> bool:
        return self in (RefusalCode.NOT_READY, RefusalCode.BUSY)


# --------------------------------------------------------------------------- records on the wire


class RankKey(_Msg):
    """A rank's place in its role's shape."""

    tp: int = Field(ge=0, lt=1024)
    pp: int = Field(ge=0, lt=1024)

    @property
    def pair(self) -> tuple[int, int]:
        return (self.tp, self.pp)


class BufferModel(_Msg):
    """A ``BufferRecord``: the spec's metadata, the buffer's address and its item count."""

    state_type: StateType
    field: EntryField
    layer_id: int = Field(ge=0, lt=_U32)
    index: IndexKind
    item_shape: tuple[Annotated[int, Field(ge=1, lt=_U32)], ...] = Field(min_length=1, max_length=8)
    dtype: DType
    sharding: Sharding
    dim: int = Field(ge=0, lt=_U32)
    outer_count: int = Field(ge=1, lt=_U32)
    unit_bytes: int = Field(ge=0, lt=_U32)
    shard_groups: tuple[Annotated[int, Field(ge=1, lt=_U32)], ...] | None = Field(None, max_length=16)
    total_heads: int = Field(0, ge=0, lt=_U32)
    group_heads: tuple[Annotated[int, Field(ge=1, lt=_U32)], ...] | None = Field(None, max_length=16)
    address: Count
    count: int = Field(ge=0, lt=_U32)

    @classmethod
    def of(cls, rec: BufferRecord) -> BufferModel:
        s = rec.spec
        return cls(state_type=s.state_type, field=s.field, layer_id=int(s.layer_id), index=s.index,
                   item_shape=s.item_shape, dtype=s.dtype, sharding=s.sharding, dim=s.dim, outer_count=s.outer_count,
                   unit_bytes=s.unit_bytes, shard_groups=s.shard_groups, total_heads=s.total_heads,
                   group_heads=s.group_heads, address=rec.address, count=rec.count)

    def record(self) -> BufferRecord:
        spec = BufferSpec(self.state_type, self.field, LayerId(self.layer_id), self.index, self.item_shape, self.dtype,
                          self.sharding, self.dim, self.outer_count, self.unit_bytes, self.shard_groups,
                          self.total_heads, self.group_heads)
        return BufferRecord(spec, self.address, self.count)


class RankModel(_Msg):
    """A ``RankRegistration``: shape, rank, the registered region and every buffer inside it."""

    tp_size: int = Field(ge=1, le=1024)
    pp_size: int = Field(ge=1, le=1024)
    rank: RankKey
    region_address: Count
    region_bytes: int = Field(ge=1, lt=_U64)
    device: str = Field(min_length=1, max_length=32)
    buffers: tuple[BufferModel, ...] = Field(max_length=MAX_BUFFERS)
    publishes_layer_ids: bool = True

    @model_validator(mode="after")
    def _inside(self) -> RankModel:
        if self.rank.tp >= self.tp_size or self.rank.pp >= self.pp_size:
            raise ValueError(f"rank {self.rank.pair} outside shape tp={self.tp_size},pp={self.pp_size}")
        end = self.region_address + self.region_bytes
        for b in self.buffers:
            item = b.record().item_bytes
            if b.address < self.region_address or b.address + b.count * item > end:
                raise ValueError(f"buffer {b.state_type.value}/{b.field.value} layer {b.layer_id} leaves the region")
        return self

    @property
    def shape(self) -> ParallelShape:
        return ParallelShape(self.tp_size, self.pp_size)

    @classmethod
    def of(cls, reg: RankRegistration) -> RankModel:
        return cls(tp_size=reg.shape.tp, pp_size=reg.shape.pp, rank=RankKey(tp=reg.tp_rank, pp=reg.pp_rank),
                   region_address=reg.region.address, region_bytes=reg.region.total_bytes, device=reg.region.device,
                   buffers=tuple(BufferModel.of(b) for b in reg.buffers), publishes_layer_ids=reg.publishes_layer_ids)

    def registration(self) -> RankRegistration:
        return RankRegistration(self.shape, self.rank.tp, self.rank.pp,
                                RegionRecord(self.region_address, self.region_bytes, self.device),
                                tuple(b.record() for b in self.buffers), self.publishes_layer_ids)


IndexList = Annotated[tuple[Annotated[int, Field(ge=0, lt=_U32)], ...], Field(max_length=MAX_INDICES)]


class IndicesModel(_Msg):
    """A request's items on one instance (``RequestIndices``)."""

    pages: IndexList = ()
    swa_pages: IndexList = ()
    slot: int | None = Field(None, ge=0, lt=_U32)
    row: int | None = Field(None, ge=0, lt=_U32)

    @classmethod
    def of(cls, idx: RequestIndices) -> IndicesModel:
        return cls(pages=tuple(idx.pages.tolist()), swa_pages=tuple(idx.swa_pages.tolist()),
                   slot=None if idx.slot is None else int(idx.slot), row=None if idx.row is None else int(idx.row))

    def indices(self) -> RequestIndices:
        return RequestIndices(np.asarray(self.pages, dtype=np.int64), np.asarray(self.swa_pages, dtype=np.int64),
                              None if self.slot is None else SlotId(self.slot),
                              None if self.row is None else RowId(self.row))


def _check_engine_info(value: dict[str, Any]) -> dict[str, Any]:
    PeerInfo.from_wire(value)  # HandshakeError is a ValueError: pydantic reports it as a field error
    return value


# --------------------------------------------------------------------------- bodies


class Hello(_Msg):
    """Handshake: who speaks which wire protocol. The answer is ``Welcome`` or a ``Refusal`` naming both versions."""

    type: Literal["hello"] = "hello"
    role: Role
    runtime_version: str = Field(max_length=64)
    wire: str = Field(max_length=16)
    instance: Name
    model: str = Field("", max_length=MODEL_IDENTITY_MAX)
    """The model the decode serves (``RuntimeConfig.model_identity``; wire 1.2): a prefill pod of another one
    refuses it, so pods of two model generations never pair. '' = not pinned."""
    layout: str = Field("", max_length=LAYOUT_DIGEST_LEN)
    """The digest of the decode's layout (``layouts.layout_digest``; wire 1.3): a prefill pod of another layout
    refuses it, so pods of two layout generations (a KV dtype rolled) never pair. '' = an older pod."""


class Welcome(_Msg):
    type: Literal["welcome"] = "welcome"
    runtime_version: str = Field(max_length=64)
    wire: str = Field(max_length=16)
    prefill_tp: int = Field(ge=1, le=1024)
    prefill_pp: int = Field(ge=1, le=1024)
    ready: bool
    """True once every prefill rank of the pod has registered."""
    model: str = Field("", max_length=MODEL_IDENTITY_MAX)
    """The model this prefill pod serves (wire 1.2; '' from an older pod, or not pinned)."""
    layout: str = Field("", max_length=LAYOUT_DIGEST_LEN)
    """The digest of this prefill pod's layout (wire 1.3; '' from an older pod)."""


class PrefillRegister(_Msg):
    """A prefill rank of this pod registers its buffers and engine info (once per process)."""

    type: Literal["prefill_register"] = "prefill_register"
    rank: RankModel
    engine: dict[str, Any]
    write_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Longest one engine write of this rank may run: the decode's fence waits at least this long."""

    _engine = field_validator("engine")(_check_engine_info)


class StagingModel(_Msg):
    """A decode rank's staging region (``protocol/staged.py``): ``lanes`` rings of ``slots`` x ``slot_bytes``,
    each followed by a block table of ``table_bytes``, then three signal words per lane."""

    address: Count
    slots: int = Field(ge=1, le=64)
    slot_bytes: int = Field(ge=256, lt=_U64, multiple_of=256)
    lanes: int = Field(ge=1, le=64)
    table_bytes: int = Field(ge=256, lt=_U64, multiple_of=256)
    min_chunks: int = Field(4, ge=1, le=64)


class DecodeRegister(_Msg):
    """A decode rank registers its destination buffers and engine info with one prefill pod."""

    type: Literal["decode_register"] = "decode_register"
    instance: Name
    rank: RankModel
    engine: dict[str, Any]
    staging: StagingModel | None = None
    """Its staging region, when it takes staged requests (inside a region of ``engine``)."""

    _engine = field_validator("engine")(_check_engine_info)


class DecodeRegistered(_Msg):
    type: Literal["decode_registered"] = "decode_registered"
    sources: tuple[RankKey, ...] = Field(max_length=4096)
    """The prefill ranks this decode rank must hear a status from, for every request."""
    write_timeout_s: float = Field(30.0, gt=0, le=3600)
    """The longest write timeout those ranks announced (``PrefillRegister``): the decode's fence is derived
    from it, so the two sides' flags cannot disagree unnoticed."""


class SyntheticFill(_Msg):
    """A synthetic request (smoke tests, canaries, benchmarks): the prefill allocates its own items and fills
    ``tokens`` tokens of state drawn from ``seed``, which the decode re-derives to verify every byte."""

    seed: int = Field(ge=0, lt=2**63)
    tokens: int = Field(ge=1, le=1 << 22)


MAX_EXPECTED_TOKENS = 64
"""Most tokens of aggregate continuation a canary asks the prefill for."""


class PromptFill(_Msg):
    """A reference-engine request (docs/reference-engine.md): the prefill computes the prompt's forward, writes
    the model's cache into its pools and carries the first generated token in its status."""

    type: Literal["prompt"] = "prompt"
    prompt: tuple[Annotated[int, Field(ge=0, lt=2**31)], ...] = Field(min_length=1, max_length=1 << 16)
    expect: int = Field(0, ge=0, le=MAX_EXPECTED_TOKENS)
    """A canary: the prefill also computes this many tokens of the prompt's aggregate continuation and sends
    them with its status (``StatusReport.expected_tokens``); the decode's continuation must equal them."""


class RequestKind(StrEnum):
    """What a request is for, said by the decode that sends it: the prefill pod counts, judges and serves a
    request by its kind, never by its id (ids are opaque names)."""

    REQUEST = "request"
    """A client's synthetic request (``POST /v1/synthetic``): the decode pod's fill, verified."""
    CANARY = "canary"
    """The decode pod's own check of a prefill pod: readiness on both sides, the ``canary`` metric label."""
    ROOM = "room"
    """A worker request (the router's ``bootstrap_room``): it claims the room the prefill pod holds, whose state
    replaces the claim's fill; ``TransferRequest.room`` names it."""


class TransferRequest(_Msg):
    """Per request: the decode rank's destination indices; every source rank it pairs with answers."""

    type: Literal["transfer_request"] = "transfer_request"
    request_id: RequestId
    kind: RequestKind = RequestKind.REQUEST
    """Wire 1.1 (a 1.0 decode's requests are plain requests)."""
    room: int | None = Field(None, ge=0, lt=2**63)
    """The room a ``ROOM`` request claims (the router's ``bootstrap_room``); None for the other kinds."""
    instance: Name
    dst: RankKey
    indices: IndicesModel
    timeout_s: float = Field(gt=0, le=3600)
    fill: SyntheticFill | PromptFill | None = None
    """Set for synthetic and prompt requests only: there is no local scheduler, the prefill rank makes the state."""
    lanes: tuple[Annotated[int, Field(ge=0, lt=64)], ...] = Field((), max_length=1024)
    """Staged path: the decode's staging lane of each of its sources, in their order; empty: direct writes."""

    @model_validator(mode="after")
    def _room_of_a_room_request(self) -> TransferRequest:
        if (self.room is not None) != (self.kind is RequestKind.ROOM):
            raise ValueError(f"a {self.kind.value} request {'needs' if self.room is None else 'names no'} room")
        return self


class Cancel(_Msg):
    """Decode gave up on a request (it failed or timed out there): prefill drops it and frees its items."""

    type: Literal["cancel"] = "cancel"
    request_id: RequestId
    instance: Name
    reason: Reason = ""


class StatusReport(_Msg):
    """One source rank's status of one request towards one decode rank (also for ranks that send nothing)."""

    type: Literal["status_report"] = "status_report"
    request_id: RequestId
    instance: Name
    src: RankKey
    dst: RankKey
    state: RequestState
    failure: FailureReason | None = None
    reason: Reason = ""
    bytes: Count = 0
    descriptors: Count = 0
    bytes_by_state: dict[StateType, Count] = Field(default_factory=dict, max_length=16)
    descriptors_by_state: dict[StateType, Count] = Field(default_factory=dict, max_length=16)
    plan_seconds: float = Field(0.0, ge=0)
    write_seconds: float = Field(0.0, ge=0)
    first_token: int | None = Field(None, ge=0, lt=2**31)
    """A prompt request (``PromptFill``): the first generated token, carried with the state as SGLang's prefill
    carries it; None for seeded state (and for a prefill that lost it: the decode then fails the request)."""
    expected_tokens: tuple[Annotated[int, Field(ge=0, lt=2**31)], ...] = Field((), max_length=MAX_EXPECTED_TOKENS)
    """A canary's prompt (``PromptFill.expect``): the prefill's own aggregate continuation, the first token first."""
    fenced: bool = False
    """No write of this source to this destination is in flight or will start: the decode may reuse the
    destination items. A Failed status sent while a write still runs is followed by the same status fenced."""

    @model_validator(mode="after")
    def _reason_on_failure(self) -> StatusReport:
        if self.state is RequestState.FAILED and (self.failure is None or not self.reason):
            raise ValueError("a Failed status needs a failure kind and a reason")
        return self


class StatusReports(_Msg):
    type: Literal["status_reports"] = "status_reports"
    reports: tuple[StatusReport, ...] = Field(max_length=4096)


class StatusQuery(_Msg):
    """Decode asks for the statuses of its requests; the pod answers when something is new or after ``wait_s``."""

    type: Literal["status_query"] = "status_query"
    instance: Name
    dst: RankKey
    request_ids: tuple[RequestId, ...] = Field(min_length=1, max_length=4096)
    wait_s: float = Field(0.0, ge=0, le=30)


class StatusReply(_Msg):
    type: Literal["status_reply"] = "status_reply"
    reports: tuple[StatusReport, ...] = Field(max_length=65536)


class PrefillPoll(_Msg):
    """A prefill rank's heartbeat and work fetch; it acknowledges events up to ``ack``."""

    type: Literal["prefill_poll"] = "prefill_poll"
    rank: RankKey
    ack: int = Field(ge=0, lt=2**62)
    wait_s: float = Field(0.0, ge=0, le=30)
    siblings_tag: str = Field("", max_length=64)
    """The ``PrefillWork.siblings_tag`` the rank holds: siblings are sent again only when they changed."""


class WorkEvent(_Msg):
    """One event for a prefill rank: exactly one of the fields is set."""

    seq: int = Field(ge=1, lt=2**62)
    decode: DecodeRegister | None = None
    request: TransferRequest | None = None
    cancel: Cancel | None = None

    @model_validator(mode="after")
    def _one(self) -> WorkEvent:
        if sum(x is not None for x in (self.decode, self.request, self.cancel)) != 1:
            raise ValueError("a work event holds exactly one of decode, request, cancel")
        return self


class PrefillWork(_Msg):
    type: Literal["prefill_work"] = "prefill_work"
    siblings: tuple[PrefillRegister, ...] = Field(max_length=4096)
    """Every prefill rank of the pod registered so far (the sources a decode rank's plan needs); empty
    when the poll's ``siblings_tag`` is already current."""
    siblings_tag: str = Field("", max_length=64)
    """A digest of the current siblings."""
    events: tuple[WorkEvent, ...] = Field(max_length=65536)
    """One page of the unacknowledged events (bounded by count and bytes, ``BootstrapLimits``)."""
    more: bool = False
    """More events wait beyond this page: poll again at once."""


class Ack(_Msg):
    type: Literal["ack"] = "ack"


class Refusal(_Msg):
    type: Literal["refusal"] = "refusal"
    code: RefusalCode
    reason: Reason


Body = Annotated[
    Hello | Welcome | PrefillRegister | DecodeRegister | DecodeRegistered | TransferRequest | Cancel | StatusReport
    | StatusReports | StatusQuery | StatusReply | PrefillPoll | PrefillWork | Ack | Refusal,
    Field(discriminator="type"),
]


class Recipient(_Msg):
    """Whom an envelope is for: a process's name and its incarnation (``boot``)."""

    name: Name
    boot: str = Field(min_length=8, max_length=64, pattern=r"^[0-9a-f]+$")


class Envelope(_Msg):
    """What is signed: the body plus who sent it, when, a one-time nonce, and (for replies) the request's nonce.

    ``boot`` is the sender process's incarnation: a new value from the same address means the peer
    restarted and everything agreed with the old one is void. ``to`` names the recipient and its
    incarnation, so a message does not replay to another pod or to the same pod after a restart.
    """

    version: str = Field(max_length=16)
    sender: Name
    boot: str = Field(min_length=8, max_length=64, pattern=r"^[0-9a-f]+$")
    nonce: str = Field(min_length=16, max_length=64, pattern=r"^[0-9a-f]+$")
    timestamp: float = Field(ge=0, lt=1e11)
    reply_to: str | None = Field(None, min_length=16, max_length=64, pattern=r"^[0-9a-f]+$")
    to: Recipient | None = None
    body: dict[str, Any]
