"""The leader's side of a replica group: every rank of the replica behind the launcher's interface.

A replica of ``group.nodes`` pods runs ``local_world`` ranks per pod; the leader (member 0) serves
HTTP and, for prefill, the bootstrap of the whole replica. ``GroupRanks`` is what the leader's pod
server holds where a single pod holds a ``RankLauncher``: ``call``/``call_all`` by global rank index,
``up``, ``died``, reports through ``on_report``. Its own ranks go through its launcher's pipe; a
member's through that member's group connection (``protocol.group``), as the same typed pipe
operations (``dump``/``load``: each op and result by its type's name, its fields schema-checked by
pydantic on arrival, never a pickle). The member relays them to its rank processes
(``pod.member``).

A member joins once: its ``GroupJoin`` must be signed with the group key, name a member index not
yet taken, this role, this config (digest) and ``local_world`` ranks. A member that goes away (its
connection closes, a frame is refused, or nothing is heard for ``lease_s``) is *lost* for good: its
pending calls fail (``RankCallError`` with ``GROUP_MEMBER_LOST``), ``lost`` names it (readiness:
``GroupMemberLost``, a failure reason: the operator restarts the group) and ``on_lost`` lets the pod
fail the requests its ranks held at the bootstrap at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pdfleet_runtime.config import RuntimeConfig
from pdfleet_runtime.protocol.auth import Codec, ProtocolError
from pdfleet_runtime.protocol.group import (
    JOIN_BYTES,
    GroupBeat,
    GroupCall,
    GroupClosed,
    GroupEvent,
    GroupJoin,
    GroupLink,
    GroupReply,
    GroupWelcome,
    mask_rank_key,
)
from pdfleet_runtime.protocol.messages import WIRE, Recipient, RefusalCode, parse_wire
from pdfleet_runtime.protocol.states import FailureReason
from pdfleet_runtime.rank.pipe import (
    ArenaCheck,
    ArenaCheckOp,
    CallFailed,
    Generated,
    GenerateOp,
    LegReport,
    RankOp,
    RankReady,
    RankResult,
    RankStats,
    RequestStates,
    RequestStatesOp,
    SeededArenaOp,
    StatsOp,
    TransferOp,
    TransferResult,
)

from .launcher import LaunchError, RankCallError, RankLauncher

__all__ = ["OPS", "RESULTS", "GroupRanks", "GroupSettings", "config_digest", "dump", "load"]

log = logging.getLogger("pdfleet_runtime.server.group")

OPS: tuple[type, ...] = (TransferOp, StatsOp, SeededArenaOp, ArenaCheckOp, RequestStatesOp, GenerateOp)
RESULTS: tuple[type, ...] = (TransferResult, RankStats, ArenaCheck, RequestStates, CallFailed, Generated)
EVENTS: tuple[type, ...] = (RankReady, LegReport)
_ADAPTERS: dict[str, TypeAdapter[Any]] = {t.__name__: TypeAdapter(t) for t in (*OPS, *RESULTS, *EVENTS)}


def dump(obj: object) -> tuple[str, dict[str, Any]]:
    """A pipe message as (its type's name, its fields as JSON values)."""
    name = type(obj).__name__
    return name, _ADAPTERS[name].dump_python(obj, mode="json")


def load(kind: str, data: dict[str, Any], allowed: tuple[type, ...]) -> Any:
    """The pipe message ``kind`` from its fields, if ``kind`` is one of ``allowed``; ``ProtocolError`` otherwise."""
    if kind not in {t.__name__ for t in allowed}:
        raise ProtocolError(RefusalCode.UNEXPECTED, f"{kind!r} is not one of {', '.join(t.__name__ for t in allowed)}")
    try:
        return _ADAPTERS[kind].validate_python(data)
    except (ValidationError, ValueError, TypeError) as e:
        raise ProtocolError(RefusalCode.MALFORMED, f"{kind}: {str(e)[:600]}") from None


def config_digest(cfg: RuntimeConfig) -> str:
    """What leader and member must agree on: the role's runtime config (the ConfigMap both read)."""
    return hashlib.sha256(cfg.to_yaml().encode()).hexdigest()


@dataclass(frozen=True)
class GroupSettings:
    """Timing of the group channel. A member silent for ``lease_s`` is lost; ``join_s`` bounds a join."""

    beat_s: float = 1.0
    lease_s: float = 6.0
    join_s: float = 10.0
    call_margin_s: float = 30.0
    """A member's answer may come this long after the call's own timeout (its relay, its rank's margin)."""
    max_joining: int = 64
    """Connections that have not joined yet, at most (more are closed at accept)."""


@dataclass
class _Member:
    index: int
    link: GroupLink
    ready: dict[int, RankReady] = field(default_factory=dict)
    died: list[str] = field(default_factory=list)
    lost: str = ""
    calls: dict[int, asyncio.Future[RankResult]] = field(default_factory=dict)
    heard: float = field(default_factory=time.monotonic)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class GroupRanks:
    """Every rank of the replica, for the leader: its launcher's and its members' (``RankLauncher``'s interface)."""

    def __init__(self, local: RankLauncher, cfg: RuntimeConfig, codec: Codec, *, host: str, port: int,
                 instance: str, rank_key: bytes | None = None, bootstrap_port: int | None = None,
                 on_report: Callable[[int, LegReport], None] | None = None,
                 on_lost: Callable[[list[tuple[int, int]], str], None] | None = None,
                 settings: GroupSettings | None = None) -> None:
        assert cfg.group is not None
        self.local, self.cfg, self.codec = local, cfg, codec
        self.nodes = cfg.group.nodes
        """Pods of the replica (``group.nodes``): the leader and its members."""
        self.host, self.port, self.instance = host, port, instance
        self._rank_key, self._bootstrap_port = rank_key, bootstrap_port
        self._on_report, self._on_lost = on_report, on_lost
        self.settings = settings or GroupSettings()
        self.members: dict[int, _Member] = {}
        self._server: asyncio.Server | None = None
        self._ids = itertools.count(1)
        self._digest = config_digest(cfg)
        self._joining = 0
        self.refused = 0
        """Connections refused before they joined (bad key, wrong member, another config...)."""

    # ------------------------------------------------------------------ the launcher's interface

    @property
    def handles(self) -> list[Any]:
        return self.local.handles

    @property
    def up(self) -> int:
        return self.local.up + sum(len(m.ready) for m in self.members.values() if not m.lost)

    @property
    def died(self) -> list[str]:
        return [*self.local.died, *(line for m in self.members.values() for line in m.died)]

    @property
    def lost(self) -> list[str]:
        """One line per member that went away."""
        return [f"group member {m.index}: {m.lost}" for m in sorted(self.members.values(), key=lambda m: m.index)
                if m.lost]

    @property
    def waiting(self) -> str:
        """Why the group is not complete yet ('' once every member joined with every rank up)."""
        nodes, local = self.nodes, self.cfg.local_world
        missing = [m for m in range(1, nodes) if m not in self.members or len(self.members[m].ready) < local]
        if not missing:
            return ""
        return (f"group member{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} (of members 1-{nodes - 1}) "
                "not joined with all ranks up yet")

    def member_addresses(self) -> set[str]:
        """The addresses joined members connect from: their ranks may say rank-only things to the bootstrap."""
        return {m.link.remote for m in self.members.values() if not m.lost}

    async def start(self, timeout_s: float = 180.0) -> None:
        """Listen for members, then start the local ranks (members join while they start, and later)."""
        self._server = await asyncio.start_server(self._accept, self.host, self.port, limit=1 << 16)
        log.info("group leader listening on %s:%d for %d members", self.host, self.port,
                 self.nodes - 1)
        try:
            await self.local.start(timeout_s)
        except LaunchError:
            await self._close_server()
            raise

    async def call(self, rank: int, op: RankOp, *, timeout_s: float,
                   on_progress: Callable[[int, int], None] | None = None) -> RankResult:
        """``on_progress``: a streaming ``GenerateOp``'s tokens, from a local rank (the leader's rank 0 computes)."""
        local = self.cfg.local_world
        if rank < local:
            return await self.local.call(rank, op, timeout_s=timeout_s, on_progress=on_progress)
        member = self.members.get(rank // local)
        name = type(op).__name__
        if member is not None and member.lost:
            raise RankCallError(f"rank {rank} on group member {member.index}: lost ({member.lost})",
                                FailureReason.GROUP_MEMBER_LOST)
        if member is None or rank not in member.ready:
            raise RankCallError(f"rank {rank} on group member {rank // local} has not joined yet")
        call_id = next(self._ids)
        fut: asyncio.Future[RankResult] = asyncio.get_running_loop().create_future()
        member.calls[call_id] = fut
        kind, args = dump(op)
        try:
            await member.link.send(GroupCall(call_id=call_id, rank=rank, op=kind, args=args, timeout_s=timeout_s))
            async with asyncio.timeout(timeout_s + self.settings.call_margin_s):
                reply = await fut
        except GroupClosed as e:
            self._lose(member, str(e))
            raise RankCallError(f"rank {rank} on group member {member.index}: {e}",
                                FailureReason.GROUP_MEMBER_LOST) from None
        except TimeoutError:
            raise RankCallError(f"rank {rank} on group member {member.index} did not answer {name} within "
                                f"{timeout_s + self.settings.call_margin_s:.1f}s") from None
        finally:
            member.calls.pop(call_id, None)
        if isinstance(reply, CallFailed):
            failure = FailureReason.GROUP_MEMBER_LOST if member.lost else FailureReason.RANK
            raise RankCallError(f"rank {rank} on group member {member.index}: {name} failed: {reply.error}", failure)
        return reply

    async def call_all(self, op: RankOp, *, timeout_s: float) -> list[RankResult]:
        return list(await asyncio.gather(*(self.call(i, op, timeout_s=timeout_s)
                                           for i in range(self.cfg.shape.world))))

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Close every member's connection (each exits: its leader is gone), then stop the local ranks."""
        await self._close_server()
        for m in self.members.values():
            for t in m.tasks:
                t.cancel()
            m.link.close()
        await asyncio.gather(*(t for m in self.members.values() for t in m.tasks), return_exceptions=True)
        await self.local.stop(timeout_s)

    # ------------------------------------------------------------------ members

    async def _close_server(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = GroupLink(reader, writer, self.codec)
        if self._joining >= self.settings.max_joining:
            self.refused += 1
            link.close()  # more unauthenticated connections than a group has members: closed at accept
            return
        self._joining += 1
        try:
            member = await self._join(link)
        finally:
            self._joining -= 1
        if member is not None:
            await self._read(member)

    async def _join(self, link: GroupLink) -> _Member | None:
        """The connection's join within ``join_s``, answered; the member, or None (refused and closed)."""
        reply_to = None
        try:
            async with asyncio.timeout(self.settings.join_s):
                opened = await link.recv(limit=JOIN_BYTES)
            reply_to = opened.envelope.nonce
            link.peer = Recipient(name=opened.envelope.sender, boot=opened.envelope.boot)
            member = self.members[opened.body.member] = self._admit(opened.body, link)  # taken before any await
            try:
                await link.send(self._welcome(), reply_to=reply_to)
            except GroupClosed:
                del self.members[member.index]  # it never joined: the place is free again
                raise
        except ProtocolError as e:
            self.refused += 1
            log.warning("group connection from %s refused: %s", link.remote, e)
            await link.refuse(e, reply_to)
            return None
        except (TimeoutError, GroupClosed) as e:
            self.refused += 1
            log.warning("group connection from %s dropped before it joined: %s", link.remote,
                        type(e).__name__ if isinstance(e, TimeoutError) else e)
            link.close()
            return None
        log.info("group member %d joined from %s (%s)", member.index, link.remote, opened.envelope.sender)
        member.tasks = [asyncio.get_running_loop().create_task(self._beat(member))]
        return member

    def _admit(self, body: Any, link: GroupLink) -> _Member:
        group = self.cfg.group
        assert group is not None
        if not isinstance(body, GroupJoin):
            raise ProtocolError(RefusalCode.UNEXPECTED, f"the first group frame must be group_join, not {body.type}")
        if not WIRE.talks_to(parse_wire(body.wire)):
            raise ProtocolError(RefusalCode.VERSION, f"member speaks wire protocol {body.wire}, the leader {WIRE}")
        if body.member >= group.nodes:
            raise ProtocolError(RefusalCode.CONFLICT, f"member {body.member} outside the group of {group.nodes}")
        if body.role is not self.cfg.role or body.ranks != self.cfg.local_world or body.config_digest != self._digest:
            raise ProtocolError(RefusalCode.CONFLICT, f"member {body.member} runs another config ({body.role.value}, "
                                f"{body.ranks} ranks, digest {body.config_digest[:12]}) than the leader "
                                f"({self.cfg.role.value}, {self.cfg.local_world} ranks, {self._digest[:12]})")
        have = self.members.get(body.member)
        if have is not None:
            state = f"was lost ({have.lost}); the group restarts as a unit" if have.lost else "is joined already"
            raise ProtocolError(RefusalCode.CONFLICT, f"member {body.member} {state}")
        return _Member(body.member, link)

    def _welcome(self) -> GroupWelcome:
        s = self.settings
        if self._rank_key is not None:
            masked, salt, check = mask_rank_key(self.codec.keys.signing, self._rank_key, self.codec.boot)
        else:
            masked, salt, check = None, "0" * 32, "0" * 32
        return GroupWelcome(instance=self.instance, bootstrap_port=self._bootstrap_port, rank_key=masked, salt=salt,
                            key_check=check, beat_s=s.beat_s, lease_s=s.lease_s)

    async def _read(self, m: _Member) -> None:
        local = self.cfg.local_world
        first = m.index * local
        try:
            while not m.lost:
                opened = await m.link.recv()
                m.heard = time.monotonic()
                body = opened.body
                match body:
                    case GroupReply():
                        fut = m.calls.get(body.call_id)
                        if fut is not None and not fut.done():
                            fut.set_result(load(body.kind, body.data, RESULTS))
                    case GroupEvent() if not first <= body.rank < first + local:
                        raise ProtocolError(RefusalCode.CONFLICT, f"member {m.index} speaks for rank {body.rank}")
                    case GroupEvent(kind="RankReady"):
                        m.ready[body.rank] = load(body.kind, body.data, EVENTS)
                        log.info("group member %d: rank %d ready (%d of %d)", m.index, body.rank, len(m.ready), local)
                    case GroupEvent(kind="LegReport"):
                        if self._on_report is not None:
                            self._on_report(body.rank, load(body.kind, body.data, EVENTS))
                    case GroupEvent(kind="RankDied"):
                        m.died.append(f"group member {m.index}: {str(body.data.get('line', 'a rank died'))[:500]}")
                    case GroupBeat():
                        pass
                    case _:
                        raise ProtocolError(RefusalCode.UNEXPECTED, f"a member does not send {body.type} "
                                            f"({getattr(body, 'kind', '')})")
        except ProtocolError as e:
            self._lose(m, f"sent a frame the leader refused: {e}")
            await m.link.refuse(e)
        except GroupClosed as e:
            self._lose(m, str(e))
        finally:
            m.link.close()

    async def _beat(self, m: _Member) -> None:
        s = self.settings
        while not m.lost:
            await asyncio.sleep(s.beat_s)
            if time.monotonic() - m.heard > s.lease_s:
                self._lose(m, f"silent for more than {s.lease_s:g}s")
                m.link.close()
                return
            try:
                await m.link.send(GroupBeat(), timeout_s=s.lease_s)
            except GroupClosed as e:
                self._lose(m, str(e))
                return

    def _lose(self, m: _Member, why: str) -> None:
        if m.lost:
            return
        m.lost = why or "went away"
        log.error("group member %d lost: %s", m.index, m.lost)
        for fut in m.calls.values():
            if not fut.done():
                fut.set_result(CallFailed(f"group member {m.index} lost: {m.lost}"))
        local = self.cfg.local_world
        ranks = [(i % self.cfg.shape.tp, i // self.cfg.shape.tp) for i in range(m.index * local, (m.index + 1) * local)]
        m.ready.clear()
        if self._on_lost is not None:
            self._on_lost(ranks, f"group member {m.index} lost: {m.lost}")
