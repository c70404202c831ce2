"""The group channel (``protocol.group``) and the leader's side of it (``pod.group.GroupRanks``), in one process.

Real sockets on 127.0.0.1 and the real codec; the leader's ``GroupRanks`` holds a real ``RankLauncher``
with no local rank (the member's ranks are what is under test), and the member is a ``GroupLink`` driven
by the test, speaking as ``pod.member`` does. Covers: the rank key's mask, the refusals (deployment
key, replay, recipient, size, another config, a member joined twice), a call relayed as typed pipe
operations, and a member that goes away failing the calls it held with ``GROUP_MEMBER_LOST``.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from pdfleet_runtime.config import GroupConfig
from pdfleet_runtime.pod.group import GroupRanks, GroupSettings, config_digest, dump, load
from pdfleet_runtime.pod.launcher import RankCallError, RankLauncher
from pdfleet_runtime.protocol.auth import Codec, ProtocolError
from pdfleet_runtime.protocol.bootstrap import BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.group import (
    GroupCall,
    GroupClosed,
    GroupEvent,
    GroupJoin,
    GroupLink,
    GroupReply,
    GroupWelcome,
    frame,
    group_codec,
    mask_rank_key,
    unmask_rank_key,
)
from pdfleet_runtime.protocol.keys import Keyring
from pdfleet_runtime.protocol.messages import Recipient, Refusal, RefusalCode
from pdfleet_runtime.protocol.states import FailureReason, RequestState
from pdfleet_runtime.rank.pipe import RankReady, RankStats, StatsOp, TransferResult, Transport
from pdfleet_runtime.records import ParallelShape
from tests.server.harness import config

GROUP_KEY = b"the-role-group-key-0123456789abcdef"
DEPLOYMENT_KEY = b"the-deployment-key-0123456789abcdef"
RANK_KEY = bytes(range(32))


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 30))


def test_the_rank_key_is_masked_with_the_group_key_and_only_it_unmasks() -> None:
    masked, salt, check = mask_rank_key(GROUP_KEY, RANK_KEY, "ab" * 8)
    assert bytes.fromhex(masked) != RANK_KEY
    welcome = GroupWelcome(instance="dec", rank_key=masked, salt=salt, key_check=check, beat_s=1, lease_s=5)
    assert unmask_rank_key((DEPLOYMENT_KEY, GROUP_KEY), welcome, "ab" * 8) == RANK_KEY  # rotated: any held key
    with pytest.raises(ProtocolError) as e:
        unmask_rank_key((DEPLOYMENT_KEY,), welcome, "ab" * 8)
    assert e.value.code is RefusalCode.BAD_SIGNATURE
    with pytest.raises(ProtocolError):
        unmask_rank_key((GROUP_KEY,), welcome, "cd" * 8)  # bound to the leader's incarnation


async def _pair(server_codec: Codec, client_codec: Codec) -> tuple[GroupLink, GroupLink, asyncio.Server]:
    got: asyncio.Future[GroupLink] = asyncio.get_running_loop().create_future()

    async def accept(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        got.set_result(GroupLink(r, w, server_codec, read_s=0.5))

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    r, w = await asyncio.open_connection("127.0.0.1", port)
    return await got, GroupLink(r, w, client_codec), server


def _join() -> GroupJoin:
    return GroupJoin(member=1, role="decode", ranks=1, config_digest="0" * 64, wire="1.0")


def test_the_link_refuses_the_deployment_key_replays_strangers_and_oversize_frames() -> None:
    async def body() -> None:
        leader_codec = group_codec(Keyring(GROUP_KEY), "leader")
        # Signed with the deployment key: refused before it is parsed.
        leader, member, server = await _pair(leader_codec, Codec(DEPLOYMENT_KEY, "intruder"))
        await member.send(_join())
        with pytest.raises(ProtocolError) as e:
            await leader.recv()
        assert e.value.code is RefusalCode.BAD_SIGNATURE
        server.close()

        leader, member, server = await _pair(leader_codec, group_codec(Keyring(GROUP_KEY), "member"))
        # A first frame other than the join must be addressed.
        await member.send(GroupEvent(rank=1, kind="RankReady", data={}))
        with pytest.raises(ProtocolError) as e:
            await leader.recv()
        assert e.value.code is RefusalCode.WRONG_RECIPIENT
        # The same frame twice: the second is a replay.
        raw, sig, _ = member.codec.seal(_join())
        member.writer.write(frame(raw, sig) * 2)
        opened = await leader.recv()
        assert isinstance(opened.body, GroupJoin)
        with pytest.raises(ProtocolError) as e:
            await leader.recv()
        assert e.value.code is RefusalCode.REPLAYED
        # Once joined, a frame from another sender on this link is refused.
        leader.peer = Recipient(name="member", boot=member.codec.boot)
        other = group_codec(Keyring(GROUP_KEY), "someone-else")
        raw, sig, _ = other.seal(GroupEvent(rank=1, kind="RankReady", data={}), to=leader.codec.me)
        member.writer.write(frame(raw, sig))
        with pytest.raises(ProtocolError) as e:
            await leader.recv()
        assert e.value.code is RefusalCode.WRONG_RECIPIENT
        # A declared length over the limit: refused before a byte of the body is read.
        member.writer.write(struct.pack("!I64s", (4 << 20) + 1, b"0" * 64))
        with pytest.raises(ProtocolError) as e:
            await leader.recv()
        assert e.value.code is RefusalCode.TOO_LARGE
        # A body that never comes: cut after read_s.
        member.writer.write(struct.pack("!I64s", 100, b"0" * 64) + b"{")
        with pytest.raises(ProtocolError) as e:
            await leader.recv()
        assert e.value.code is RefusalCode.MALFORMED and "not received" in e.value.reason
        server.close()

    run(body)


def _group_config(tmp_path: Path) -> Any:
    key = tmp_path / "group-key"
    key.write_bytes(GROUP_KEY)
    return config("decode", tp=2, group=GroupConfig(nodes=2, service="srv-group", secret_path=key))


async def _member(port: int, join: GroupJoin) -> tuple[GroupLink, Any]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    link = GroupLink(r, w, group_codec(Keyring(GROUP_KEY), "dec-1"))
    await link.send(join)
    opened = await link.recv()
    link.peer = Recipient(name=opened.envelope.sender, boot=opened.envelope.boot)
    return link, opened


def test_a_leader_admits_one_member_of_its_config_relays_typed_calls_and_fails_them_when_it_goes(
        tmp_path: Path) -> None:
    cfg = _group_config(tmp_path)
    lost: list[tuple[list[tuple[int, int]], str]] = []

    async def body() -> None:
        ranks = GroupRanks(RankLauncher([]), cfg, group_codec(Keyring(GROUP_KEY), "dec"), host="127.0.0.1", port=0,
                           instance="dec", rank_key=RANK_KEY, on_lost=lambda r, why: lost.append((r, why)))
        await ranks.start()
        assert ranks._server is not None
        port = ranks._server.sockets[0].getsockname()[1]
        good = GroupJoin(member=1, role="decode", ranks=1, config_digest=config_digest(cfg), wire="1.0")

        r, w = await asyncio.open_connection("127.0.0.1", port)  # a first frame bigger than any join: refused unread
        w.write(struct.pack("!I64s", 1 << 20, b"0" * 64))
        data = await r.read()
        assert b'"too_large"' in data, data
        link, opened = await _member(port, good.model_copy(update={"config_digest": "1" * 64}))
        assert isinstance(opened.body, Refusal) and opened.body.code is RefusalCode.CONFLICT, opened.body
        link.close()
        link, opened = await _member(port, good)
        welcome = opened.body
        assert isinstance(welcome, GroupWelcome) and welcome.instance == "dec"
        assert unmask_rank_key((GROUP_KEY,), welcome, opened.envelope.boot) == RANK_KEY
        again, refused = await _member(port, good)  # a second member 1 while the first is joined
        assert isinstance(refused.body, Refusal) and refused.body.code is RefusalCode.CONFLICT
        again.close()
        assert ranks.waiting and ranks.up == 0

        kind, data = dump(RankReady((1, 0), 42, "mooncake", Transport("tcp", "tcp", "tcp", True), 1024))
        await link.send(GroupEvent(rank=1, kind=kind, data=data))
        while ranks.up < 1:
            await asyncio.sleep(0.01)
        assert ranks.waiting == "" and ranks.member_addresses() == {"127.0.0.1"}

        call = asyncio.create_task(ranks.call(1, StatsOp(), timeout_s=5))
        opened = await link.recv()
        got = opened.body
        assert isinstance(got, GroupCall) and got.rank == 1 and isinstance(load(got.op, got.args, (StatsOp,)), StatsOp)
        kind, data = dump(RankStats(0, 0, {"pages": 7}))
        await link.send(GroupReply(call_id=got.call_id, kind=kind, data=data))
        assert await call == RankStats(0, 0, {"pages": 7})

        # The member goes away with a call pending: the call fails at once, typed.
        pending = asyncio.create_task(ranks.call(1, StatsOp(), timeout_s=5))
        await link.recv()
        link.close()  # the member goes away with the call pending
        with pytest.raises(RankCallError) as e:
            await pending
        assert e.value.failure is FailureReason.GROUP_MEMBER_LOST
        assert ranks.lost and "group member 1" in ranks.lost[0] and ranks.up == 0
        assert lost and lost[0][0] == [(1, 0)]
        with pytest.raises(RankCallError) as e:
            await ranks.call(1, StatsOp(), timeout_s=1)
        assert e.value.failure is FailureReason.GROUP_MEMBER_LOST
        await ranks.stop()

    run(body)


def test_pipe_results_cross_the_channel_typed_and_a_wrong_kind_is_refused() -> None:
    res = TransferResult("r1", RequestState.SUCCESS, bytes=10, reports=())
    kind, data = dump(res)
    assert load(kind, data, (TransferResult,)) == res
    with pytest.raises(ProtocolError) as e:
        load("RankSpec", {}, (TransferResult,))  # never a spec (it holds the secret), never anything unlisted
    assert e.value.code is RefusalCode.UNEXPECTED
    with pytest.raises(ProtocolError) as e:
        load("TransferResult", {**data, "bytes": "many"}, (TransferResult,))
    assert e.value.code is RefusalCode.MALFORMED


def test_the_bootstrap_takes_rank_only_messages_from_loopback_or_a_joined_member_only() -> None:
    server = BootstrapServer(BootstrapState(ParallelShape(1, 2)), Codec(DEPLOYMENT_KEY, "pre", rank_key=RANK_KEY))
    assert server.rank_peer("127.0.0.1") and not server.rank_peer("10.0.0.7")
    server.rank_peers = lambda: {"10.0.0.7"}
    assert server.rank_peer("10.0.0.7") and not server.rank_peer("10.0.0.8")


def test_a_member_joins_during_a_connection_flood(tmp_path: Path) -> None:
    """Issue 39 held (a regression test): a member still joined during a 3,136-connection flood of the group
    port. 1,500 connections that never finish a frame are opened at once and kept: past ``max_joining`` they
    are closed at accept, the rest are dropped at the join deadline, and a member that keeps trying (as
    ``pod.member`` does) is welcomed by then; the flood costs no memory beyond those few connections."""
    cfg = _group_config(tmp_path)

    async def body() -> None:
        settings = GroupSettings(join_s=3.0)
        ranks = GroupRanks(RankLauncher([]), cfg, group_codec(Keyring(GROUP_KEY), "dec"), host="127.0.0.1", port=0,
                           instance="dec", rank_key=RANK_KEY, settings=settings)
        await ranks.start()
        assert ranks._server is not None
        port = ranks._server.sockets[0].getsockname()[1]
        flood: list[asyncio.StreamWriter] = []
        for i in range(1500):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            if i % 2:
                w.write(b"\x00\x00")  # half a length prefix, never the rest
            flood.append(w)
        good = GroupJoin(member=1, role="decode", ranks=1, config_digest=config_digest(cfg), wire="1.0")
        t0 = time.monotonic()
        while True:
            try:
                link, opened = await asyncio.wait_for(_member(port, good), 5)
                break
            except (GroupClosed, OSError, TimeoutError):
                assert time.monotonic() - t0 < settings.join_s + 5
                await asyncio.sleep(0.2)
        took = time.monotonic() - t0
        assert isinstance(opened.body, GroupWelcome), opened.body
        assert took < settings.join_s + 5, took
        assert ranks.refused >= 1500 - settings.max_joining  # closed at accept, never read
        link.close()
        for w in flood:
            w.close()
        await ranks.stop()

    asyncio.run(asyncio.wait_for(body(), 60))
