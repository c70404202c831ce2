"""The group channel: one replica's pods (``nodesPerReplica`` > 1) talk over it, signed with the role's group key.

A member (``PDFLEET_GROUP_MEMBER`` m > 0) opens one TCP connection to its leader's group port and
keeps it for its life; the leader drives the member's rank processes over it (the rank pipe's typed
operations, ``pod.group``) and the member relays its ranks' results and reports back. Each frame
is one envelope of ``auth`` (sender, incarnation, nonce, timestamp, recipient), sealed and opened by
a ``Codec`` holding the group key (``group.secretPath``: a Secret of this role only), so a pod of the
other role, which holds the deployment key, can neither join nor speak for a rank; replays, stale
and misdirected frames are refused as on the bootstrap. Only ``GroupJoin``, and the refusal of a frame
that could not be read, may be unaddressed.

Frame: a 4-byte big-endian length, the 64 hex characters of the envelope's signature, the envelope.
A length over ``messages.MAX_MESSAGE_BYTES`` (over ``JOIN_BYTES`` for the first frame of a connection,
which no key has vouched for yet) is refused before a byte of the body is read, and a body must arrive
within ``read_s`` once its header did. Both sides send ``GroupBeat`` every ``beat_s``; a side
that hears nothing valid for ``lease_s`` (or sees the connection close, or a frame refused) takes
the other as gone: the leader fails what it waits for from that member and reports
``GroupMemberLost``, a member exits non-zero.

The leader's rank key (``keys``) is handed to members in ``GroupWelcome``, masked with an HMAC of
the group key (``mask_rank_key``): it never crosses the network in clear, and only a holder of the
group key recovers it. Pure (asyncio streams, pydantic, hashlib): the pod process imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import struct
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from pdfleet_runtime.roles import Role

from .auth import Codec, Opened, ProtocolError
from .keys import Keyring
from .messages import Recipient, Refusal, RefusalCode, _Msg

__all__ = [
    "GROUP_BODY",
    "JOIN_BYTES",
    "GroupBeat",
    "GroupBody",
    "GroupCall",
    "GroupClosed",
    "GroupEvent",
    "GroupJoin",
    "GroupLink",
    "GroupReply",
    "GroupWelcome",
    "frame",
    "group_codec",
    "mask_rank_key",
    "unmask_rank_key",
]

Name = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/@+=-]+$")]
Hex = Annotated[str, Field(min_length=32, max_length=64, pattern=r"^[0-9a-f]+$")]
Kind = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z]+$")]
_HEAD = struct.Struct("!I64s")
JOIN_BYTES = 16 << 10
"""The most a connection's first frame (a join, some hundred bytes) may declare."""


class GroupJoin(_Msg):
    """A member's first frame: who it is and what it runs (the leader refuses a member of another config)."""

    type: Literal["group_join"] = "group_join"
    member: int = Field(ge=1, lt=64)
    role: Role
    ranks: int = Field(ge=1, le=1024)
    """Its local ranks (``RuntimeConfig.local_world``)."""
    config_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of the role's runtime config as this member read it."""
    wire: str = Field(max_length=16)


class GroupWelcome(_Msg):
    """The leader's answer: what the member's ranks need from it."""

    type: Literal["group_welcome"] = "group_welcome"
    instance: Name
    """The replica's name in the protocol (the leader's): decode ranks register under it."""
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    """Prefill: the leader's bootstrap port (the member's ranks register and poll there)."""
    rank_key: Hex | None = None
    """Prefill: the leader's rank key, masked (``mask_rank_key``)."""
    salt: Hex
    key_check: Hex
    beat_s: float = Field(gt=0, le=60)
    lease_s: float = Field(gt=0, le=600)


class GroupCall(_Msg):
    """Leader -> member: one rank operation (``op`` names a ``rank.pipe`` op, ``args`` its fields)."""

    type: Literal["group_call"] = "group_call"
    call_id: int = Field(ge=1, lt=2**62)
    rank: int = Field(ge=0, lt=4096)
    """The replica's global rank index (``pp * tp + tp_rank``)."""
    op: Kind
    args: dict[str, Any]
    timeout_s: float = Field(gt=0, le=7200)


class GroupReply(_Msg):
    """Member -> leader: a call's typed result (``kind`` names a ``rank.pipe`` result)."""

    type: Literal["group_reply"] = "group_reply"
    call_id: int = Field(ge=1, lt=2**62)
    kind: Kind
    data: dict[str, Any]


class GroupEvent(_Msg):
    """Member -> leader: something a rank said unasked (``RankReady``, ``LegReport``) or ``RankDied``."""

    type: Literal["group_event"] = "group_event"
    rank: int = Field(ge=0, lt=4096)
    kind: Kind
    data: dict[str, Any]


class GroupBeat(_Msg):
    type: Literal["group_beat"] = "group_beat"


GroupBody = Annotated[GroupJoin | GroupWelcome | GroupCall | GroupReply | GroupEvent | GroupBeat | Refusal,
                      Field(discriminator="type")]
GROUP_BODY: TypeAdapter[Any] = TypeAdapter(GroupBody)


def group_codec(keys: Keyring, sender: str) -> Codec:
    """A codec that signs with the group key and opens group frames only (never a bootstrap message)."""
    return Codec(keys, sender, bodies=GROUP_BODY)


def _mask(key: bytes, salt: str, boot: str) -> bytes:
    return hmac.new(key, f"pdfleet-rank-key:{salt}:{boot}".encode(), hashlib.sha256).digest()


def _check(rank_key: bytes) -> str:
    return hmac.new(rank_key, b"pdfleet-rank-key-check", hashlib.sha256).hexdigest()[:32]


def mask_rank_key(group_key: bytes, rank_key: bytes, boot: str) -> tuple[str, str, str]:
    """(masked key, salt, check): the rank key XOR an HMAC-SHA256 of the group key over a fresh salt and the
    leader's incarnation; ``check`` lets the member tell a key it unmasked right (a rotated group key)."""
    if len(rank_key) != 32:
        raise ValueError("a rank key is 32 bytes")
    salt = secrets.token_hex(16)
    masked = bytes(a ^ b for a, b in zip(rank_key, _mask(group_key, salt, boot), strict=True))
    return masked.hex(), salt, _check(rank_key)


def unmask_rank_key(keys: tuple[bytes, ...], welcome: GroupWelcome, boot: str) -> bytes:
    """The leader's rank key from a welcome; ``ProtocolError`` when no group key held unmasks it."""
    if welcome.rank_key is None or len(welcome.rank_key) != 64:
        raise ProtocolError(RefusalCode.MALFORMED, "the welcome carries no rank key")
    masked = bytes.fromhex(welcome.rank_key)
    for key in keys:
        rank_key = bytes(a ^ b for a, b in zip(masked, _mask(key, welcome.salt, boot), strict=True))
        if hmac.compare_digest(_check(rank_key), welcome.key_check):
            return rank_key
    raise ProtocolError(RefusalCode.BAD_SIGNATURE, "no group key held unmasks the leader's rank key")


class GroupClosed(ConnectionError):
    """The other side closed the connection, or it broke."""


class GroupLink:
    """One group connection: framed, signed envelopes both ways; ``peer`` is learnt from the join."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: Codec, *,
                 read_s: float = 10.0) -> None:
        self.reader, self.writer, self.codec, self.read_s = reader, writer, codec, read_s
        self.peer: Recipient | None = None
        peer = writer.get_extra_info("peername")
        self.remote = str(peer[0]) if peer else "?"
        self._lock = asyncio.Lock()

    async def send(self, body: _Msg, *, reply_to: str | None = None, timeout_s: float = 10.0) -> str:
        """Seal ``body`` for the peer and write it; the envelope's nonce. ``GroupClosed`` when it cannot."""
        raw, sig, nonce = self.codec.seal(body, reply_to=reply_to, to=self.peer)
        try:
            async with self._lock, asyncio.timeout(timeout_s):
                self.writer.write(_HEAD.pack(len(raw), sig.encode()) + raw)
                await self.writer.drain()
        except (OSError, TimeoutError, RuntimeError) as e:
            raise GroupClosed(f"cannot write to {self.remote}: {type(e).__name__}: {e}") from None
        return nonce

    async def recv(self, *, limit: int | None = None) -> Opened:
        """The next authenticated frame, at most ``limit`` bytes (default the codec's). ``ProtocolError`` when it
        is refused (the link is then unusable), ``GroupClosed`` when the connection ended."""
        limit = min(limit or self.codec.max_bytes, self.codec.max_bytes)
        try:
            head = await self.reader.readexactly(_HEAD.size)
            length, sig = _HEAD.unpack(head)
            if length > limit:
                raise ProtocolError(RefusalCode.TOO_LARGE, f"frame of {length} bytes, limit {limit}")
            async with asyncio.timeout(self.read_s):
                raw = await self.reader.readexactly(length)
        except TimeoutError:
            raise ProtocolError(RefusalCode.MALFORMED, f"frame body not received within {self.read_s:g}s") from None
        except (asyncio.IncompleteReadError, OSError) as e:
            raise GroupClosed(f"{self.remote} closed the group connection ({type(e).__name__})") from None
        opened = self.codec.open(raw, sig.decode("ascii", "replace"))
        env = opened.envelope
        if self.peer is not None and (env.to is None or Recipient(name=env.sender, boot=env.boot) != self.peer):
            raise ProtocolError(RefusalCode.WRONG_RECIPIENT, f"frame from {env.sender} (boot {env.boot}) on the link "
                                f"of {self.peer.name} (boot {self.peer.boot}), or not addressed")
        if self.peer is None and env.to is None and not isinstance(opened.body, GroupJoin | Refusal):
            raise ProtocolError(RefusalCode.WRONG_RECIPIENT, f"a {opened.body.type} frame must name its recipient")
        return opened

    async def refuse(self, e: ProtocolError, reply_to: str | None = None) -> None:
        """Say why (best effort), then close."""
        with contextlib.suppress(GroupClosed):
            await self.send(e.refusal(), reply_to=reply_to, timeout_s=2.0)
        self.close()

    def close(self) -> None:
        self.writer.close()


def frame(raw: bytes, signature: str) -> bytes:
    """One frame's bytes (tests build frames signed with other keys with it)."""
    return _HEAD.pack(len(raw), signature.encode()) + raw

