"""A prefill pod's rooms: requests the router sent it (by ``bootstrap_room``), held for the decode that claims them.

SGLang's router sends one body to a prefill and a decode worker at once, with a random 63-bit
``bootstrap_room``. The prefill pod holds the room's state description (its seed and token count,
and the bytes they occupy) until a decode's ``TransferRequest`` for ``room-<n>`` claims it; the
prefill ranks then fill exactly that state (the claim's ``SyntheticFill`` is replaced by the
room's), so the state is the prefill's, and the decode's byte check compares it with what the
decode derived from the same body. Bounded in count, bytes (the pool capacity of the pod) and time:
an unclaimed room expires (``expired`` counts them) and its reservation is freed.

Pure: an injected clock, no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdfleet_runtime.protocol.auth import ProtocolError
from pdfleet_runtime.protocol.messages import RefusalCode, SyntheticFill, TransferRequest

__all__ = ["ROOM_PREFIX", "Room", "RoomError", "RoomTable", "room_of", "room_request_id"]

ROOM_PREFIX = "room-"


def room_request_id(room: int) -> str:
    """The transfer's request id for a room (both pods derive it from the body)."""
    return f"{ROOM_PREFIX}{room}"


def room_of(request_id: str) -> int | None:
    """The room a transfer's request id names (``room-<n>``), else None."""
    if not request_id.startswith(ROOM_PREFIX):
        return None
    head = request_id[len(ROOM_PREFIX):]
    return int(head) if head.isdigit() and len(head) <= 19 else None


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
    """The claiming transfer's request id (``room-<n>``: every rank of the decode claims under it)."""
    moved: int = 0
    """Bytes the prefill ranks reported written for this room (sum over legs)."""
    done: bool = False
    failure: str = ""


class RoomTable:
    """The rooms of one prefill pod (pure; the pod server owns one)."""

    def __init__(self, *, max_rooms: int, max_bytes: int, ttl_s: float, max_per_source: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_rooms, self.max_bytes, self.ttl_s, self._clock = max_rooms, max_bytes, ttl_s, clock
        self.max_per_source = max_per_source if max_per_source is not None else max(1, max_rooms // 2)
        """Unclaimed rooms one source may hold: a caller alone cannot take every room (two routers each half)."""
        self.rooms: dict[int, Room] = {}
        self.expired = 0
        """Rooms no decode claimed in time (the ``pdfleet_rooms_expired_total`` metric)."""

    @property
    def held_bytes(self) -> int:
        return sum(r.bytes for r in self.rooms.values() if not r.done)

    def hold(self, room: int, seed: int, tokens: int, nbytes: int, source: str = "") -> Room:
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
        r = self.rooms[room] = Room(room, seed, tokens, nbytes, self._clock(), source=source)
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
        elif (r.claimant, r.request_id) != (instance, request_id):
            raise RoomError(f"bootstrap_room {room} was claimed by decode {r.claimant}", code="room_conflict",
                            status=409)
        return r

    def admit(self, msg: TransferRequest) -> TransferRequest:
        """The bootstrap's say on a decode rank's request (``BootstrapState.admit``): a room's claim gets the
        room's state (seed, tokens) as its fill; a refused claim is ``ProtocolError`` (``unexpected``)."""
        n = room_of(msg.request_id)
        if n is None:
            return msg
        try:
            room = self.claim(n, msg.instance, msg.request_id)
        except RoomError as e:
            raise ProtocolError(RefusalCode.UNEXPECTED, str(e)) from e
        return msg.model_copy(update={"fill": SyntheticFill(seed=room.seed, tokens=room.tokens)})

    def finish(self, room: int, moved: int, failure: str = "") -> None:
        r = self.rooms.get(room)
        if r is not None and not r.done:
            r.moved, r.failure, r.done = moved, failure, True

    def drop(self, room: int) -> None:
        """Forget a finished room (its prefill answer went out)."""
        r = self.rooms.pop(room, None)
        if r is not None and not r.done:
            r.done = True

    def expire(self) -> int:
        """Expire unclaimed rooms older than the ttl (and claimed ones stuck past twice it); how many."""
        now, n = self._clock(), 0
        for r in list(self.rooms.values()):
            if r.done:
                continue
            age = now - r.created
            if (r.claimed is None and age > self.ttl_s) or age > 2 * self.ttl_s + 60:
                r.done, r.failure = True, "expired"
                if r.claimed is None:
                    self.expired += 1
                n += 1
        return n
