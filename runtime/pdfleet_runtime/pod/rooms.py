"""A prefill pod's rooms: requests the router sent it (by ``bootstrap_room``), held for the decode that claims them.

SGLang's router sends one body to a prefill and a decode worker at once, with a random 63-bit
``bootstrap_room``. The prefill pod holds the room's state description (its seed and token count,
and the bytes they occupy) until a decode's ``TransferRequest`` claims it: a request of kind
``RequestKind.ROOM`` naming it in ``TransferRequest.room`` (never read from the request's id). The
prefill ranks then fill exactly that state (the claim's ``SyntheticFill`` is replaced by the
room's), so the state is the prefill's, and the decode's byte check compares it with what the
decode derived from the same body. Bounded in count, bytes (the pool capacity of the pod) and time:
an unclaimed room expires (``expired`` counts them) and its reservation is freed.

A room ends once, with a ``RoomOutcome``: the bytes its legs moved and a typed failure (``LegFailed``:
the ``FailureReason`` a source rank reported, or ``Expired``). It ends when every decode rank's claim
ended (the bootstrap tells ``settle``, ``BootstrapState.settled``) or when its time ran out
(``expire``); ``Room.changed`` wakes the one request that awaits it (the worker API).

Pure but for that event: an injected clock, no I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdfleet_runtime.protocol.auth import ProtocolError
from pdfleet_runtime.protocol.messages import (
    PromptFill,
    RefusalCode,
    RequestKind,
    StatusReport,
    SyntheticFill,
    TransferRequest,
)
from pdfleet_runtime.protocol.states import FailureReason

__all__ = ["Expired", "LegFailed", "Room", "RoomError", "RoomFailure", "RoomOutcome", "RoomTable", "room_request_id"]


def room_request_id(room: int) -> str:
    """The transfer's request id for a room (both pods derive it, and the state's seed, from the body): a name,
    never parsed (a claim names its room in ``TransferRequest.room``)."""
    return f"room-{room}"


@dataclass(frozen=True)
class Expired:
    """The room's time ran out: no decode claimed it within the ttl (``claimed`` False), or the legs of its
    claim did not all end within twice the ttl plus a minute."""

    claimed: bool
    after_s: float


@dataclass(frozen=True)
class LegFailed:
    """A leg of the room's transfer failed: the kind and the reason a source rank (or the bootstrap) reported."""

    failure: FailureReason
    reason: str


RoomFailure = Expired | LegFailed


@dataclass(frozen=True)
class RoomOutcome:
    """How a room ended: the bytes the prefill ranks reported written for it (over its legs) and its failure."""

    moved: int
    failure: RoomFailure | None = None


class RoomError(Exception):
    """A room cannot be held or claimed; ``code`` is the OpenAI error code, ``status`` the HTTP status."""

    def __init__(self, message: str, *, code: str, status: int) -> None:
        super().__init__(message)
        self.code, self.status = code, status


@dataclass
class Room:
    room: int
    seed: int
    tokens: int
    bytes: int
    created: float
    claimed: float | None = None
    source: str = ""
    """The address the body came from (a router): unclaimed rooms are bounded per source."""
    claimant: str = ""
    """The decode instance that claimed it (its every rank may claim; another decode may not)."""
    request_id: str = ""
    """The claiming transfer's request id (every rank of the decode claims under the one id)."""
    outcome: RoomOutcome | None = None
    """How it ended; None while it waits for its claim or its legs."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the room is claimed and when it ends (whoever awaits it clears it)."""
    claims_ended: int = 0
    """Decode ranks whose claim ended (every source reported its leg)."""
    moved: int = 0
    failed: LegFailed | None = None
    """The first failure a leg reported."""
    prompt: tuple[int, ...] = ()
    """A model pod's room: the prompt's ids, which the prefill ranks compute (``PromptFill``); empty: seeded."""

    @property
    def done(self) -> bool:
        return self.outcome is not None


class RoomTable:
    """The rooms of one prefill pod (pure; the pod server owns one). ``legs``: the decode ranks that claim each
    room (the decode replica's ranks); a room ends when the last of their claims did."""

    def __init__(self, *, max_rooms: int, max_bytes: int, ttl_s: float, legs: int, max_per_source: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_rooms, self.max_bytes, self.ttl_s, self.legs, self._clock = max_rooms, max_bytes, ttl_s, legs, clock
        self.max_per_source = max_per_source if max_per_source is not None else max(1, max_rooms // 2)
        """Unclaimed rooms one source may hold: a caller alone cannot take every room (two routers each half)."""
        self.rooms: dict[int, Room] = {}
        self.expired = 0
        """Rooms no decode claimed in time (the ``pdfleet_rooms_expired_total`` metric)."""

    @property
    def held_bytes(self) -> int:
        return sum(r.bytes for r in self.rooms.values() if not r.done)

    def hold(self, room: int, seed: int, tokens: int, nbytes: int, source: str = "", prompt: tuple[int, ...] = ()
             ) -> Room:
        """Hold a room for its decode; ``RoomError`` when it is held already or the bounds are reached (the
        pod's rooms and bytes, and the unclaimed rooms of ``source``)."""
        self.expire()
        if room in self.rooms:
            raise RoomError(f"bootstrap_room {room} is already held on this prefill pod: send a new room",
                            code="room_conflict", status=409)
        live = [r for r in self.rooms.values() if not r.done]
        if len(live) >= self.max_rooms:
            raise RoomError(f"{len(live)} rooms are held (the limit): retry later", code="busy", status=503)
        if self.held_bytes + nbytes > self.max_bytes:
            raise RoomError(f"holding {nbytes} more bytes would exceed this pod's {self.max_bytes} bytes of pools "
                            f"({self.held_bytes} held): retry later", code="busy", status=503)
        mine = sum(1 for r in live if r.source == source and r.claimed is None)
        if mine >= self.max_per_source:
            raise RoomError(f"{mine} rooms sent from {source or 'this source'} wait for their decode (the limit per "
                            "source): retry later", code="busy", status=503)
        r = self.rooms[room] = Room(room, seed, tokens, nbytes, self._clock(), source=source, prompt=prompt)
        return r

    def claim(self, room: int, instance: str = "", request_id: str = "") -> Room:
        """A decode asks for the room's state (every decode rank claims; the first one marks it)."""
        self.expire()
        r = self.rooms.get(room)
        if r is None or (r.done and r.claimed is None):
            raise RoomError(f"bootstrap_room {room} is not held here (never sent to this prefill pod, or expired "
                            f"after {self.ttl_s:g}s)", code="room_not_found", status=404)
        if r.claimed is None:
            r.claimed, r.claimant, r.request_id = self._clock(), instance, request_id
            r.changed.set()
        elif (r.claimant, r.request_id) != (instance, request_id):
            raise RoomError(f"bootstrap_room {room} was claimed by decode {r.claimant}", code="room_conflict",
                            status=409)
        return r

    def admit(self, msg: TransferRequest) -> TransferRequest:
        """The bootstrap's say on a decode rank's request (``BootstrapState.admit``): a room's claim gets the
        room's state (seed, tokens; a model pod's room, its prompt) as its fill; a refused claim is
        ``ProtocolError`` (``unexpected``), and so is a claim whose prompt is not the room's (the two roles
        encoded different bodies: their state would not match). Requests of the other kinds pass as they are."""
        if msg.kind is not RequestKind.ROOM or msg.room is None:
            return msg
        held = self.rooms.get(msg.room)
        if held is not None and held.prompt and (not isinstance(msg.fill, PromptFill) or msg.fill.prompt != held.prompt):
            got = len(msg.fill.prompt) if isinstance(msg.fill, PromptFill) else "no"
            raise ProtocolError(RefusalCode.UNEXPECTED, f"bootstrap_room {msg.room}: the claim's prompt ({got} ids) is "
                                f"not the room's ({len(held.prompt)} ids): prefill and decode got different bodies")
        try:
            room = self.claim(msg.room, msg.instance, msg.request_id)
        except RoomError as e:
            raise ProtocolError(RefusalCode.UNEXPECTED, str(e)) from e
        fill = PromptFill(prompt=room.prompt) if room.prompt else SyntheticFill(seed=room.seed, tokens=room.tokens)
        return msg.model_copy(update={"fill": fill})

    def settle(self, msg: TransferRequest, reports: tuple[StatusReport, ...]) -> None:
        """``BootstrapState.settled``: one decode rank's request ended (every source reported). For a room's claim,
        its bytes and first failure count; the room ends with the last of its ``legs`` claims."""
        if msg.kind is not RequestKind.ROOM or msg.room is None:
            return
        r = self.rooms.get(msg.room)
        if r is None or r.done or (r.claimant, r.request_id) != (msg.instance, msg.request_id):
            return
        r.claims_ended += 1
        r.moved += sum(rep.bytes for rep in reports)
        failed = next((rep for rep in reports if rep.failure is not None), None)
        if r.failed is None and failed is not None and failed.failure is not None:
            r.failed = LegFailed(failed.failure, failed.reason)
        if r.claims_ended >= self.legs:
            self._end(r, RoomOutcome(r.moved, r.failed))

    def drop(self, room: int) -> None:
        """Forget a room (its prefill answer went out, or its request is gone)."""
        self.rooms.pop(room, None)

    def deadline(self, r: Room) -> float:
        """When an unended room expires: the ttl after it was held; claimed, twice the ttl plus a minute."""
        return r.created + (self.ttl_s if r.claimed is None else 2 * self.ttl_s + 60)

    def remaining(self, r: Room) -> float:
        """Seconds until ``deadline`` (0 once it passed)."""
        return max(0.0, self.deadline(r) - self._clock())

    def expire(self) -> int:
        """End every room past its deadline (``Expired``); how many."""
        now, n = self._clock(), 0
        for r in list(self.rooms.values()):
            if r.done or now < self.deadline(r):
                continue
            self._end(r, RoomOutcome(r.moved, Expired(r.claimed is not None, now - r.created)))
            if r.claimed is None:
                self.expired += 1
            n += 1
        return n

    def _end(self, r: Room, outcome: RoomOutcome) -> None:
        r.outcome = outcome
        r.changed.set()
