"""The ranks of one decode claim a room the prefill holds only between their claims (a group's race), and the
room ends with their legs.

SGLang's router sends the body to the prefill and the decode at once, so a decode rank's claim may
reach the prefill before it holds the room; in a replica group the member's ranks claim later (the
relay hop). Real parts: the prefill pod's ``BootstrapServer`` on 127.0.0.1 with its ``RoomTable`` as
the admit, one ``PrefillRank`` filling from ``SyntheticSource``, two decode ranks' ``DecodeRequests``
(tp 2) and the decode pod's ``RequestRouter.pull``, the ``local`` engine. One stand-in: ``OneDecode``
plays the launcher (``GroupRanks``): it runs one rank's op at once and the other's once the first was
refused and the room is held, so the race happens every time, in either order. The room's outcome is set by
the bootstrap's ``settled`` hook once both claims ended, with the bytes both moved.
"""

from __future__ import annotations

import asyncio

import pytest

from pdfleet_runtime.engines import EngineConfig, create_engine
from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.pod.metrics import ServerMetrics
from pdfleet_runtime.pod.readiness import Readiness
from pdfleet_runtime.pod.rooms import RoomError, RoomOutcome, RoomTable, room_request_id
from pdfleet_runtime.pod.routing import RequestRouter
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec, ProtocolError
from pdfleet_runtime.protocol.bootstrap import BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.messages import TransferRequest
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.rank.pipe import RankSpec, TransferOp, TransferResult
from pdfleet_runtime.rank.requests import DecodeRequests, SyntheticSource
from pdfleet_runtime.records import ParallelShape
from tests.server.harness import config

SECRET = b"room-claims-secret-0123456789abcd"
RANK_KEY = b"room-claims-rank-key-0123456789ab"
LAYOUT = PRESETS["llama-dense"]
TOKENS, SEED, ROOM = 32, 4242, 7


class OneDecode:
    """Stand-in for the launcher of one decode (two ranks): rank ``early`` claims at once; the other only
    after the prefill refused a claim and then held the room (``hold``)."""

    def __init__(self, works: list[DecodeRequests], early: int, refused: asyncio.Event, hold: asyncio.Event) -> None:
        self.works, self.early, self.refused, self.hold = works, early, refused, hold
        self.results: list[TransferResult] = []

    async def call_all(self, op: TransferOp, *, timeout_s: float) -> list[TransferResult]:
        async def late() -> TransferResult:
            await self.refused.wait()
            await self.hold.wait()
            return await self.works[1 - self.early].transfer(op)

        first, second = await asyncio.wait_for(asyncio.gather(self.works[self.early].transfer(op), late()), timeout_s)
        self.results = [first, second] if self.early == 0 else [second, first]
        return self.results


@pytest.mark.parametrize("early", [0, 1])
def test_a_claim_before_the_hold_and_one_after_it_both_take_the_room(early: int) -> None:
    async def main() -> None:
        server = BootstrapServer(BootstrapState(ParallelShape(1)), Codec(SECRET, "pod", rank_key=RANK_KEY))
        ep = await server.start()
        table = RoomTable(max_rooms=4, max_bytes=1 << 30, ttl_s=30.0, legs=2)
        refused, held = asyncio.Event(), asyncio.Event()
        claims: list[tuple[int, str, bool]] = []

        def admit(msg: TransferRequest) -> TransferRequest:
            try:
                out = table.admit(msg)
            except ProtocolError:
                claims.append((msg.dst.tp, msg.request_id, False))
                refused.set()
                raise
            claims.append((msg.dst.tp, msg.request_id, True))
            return out

        server.state.admit = admit
        server.state.settled = table.settle
        src = RankPools(LAYOUT, ParallelShape(1), 0, 0, Capacity(2, 512))
        dsts = [RankPools(LAYOUT, ParallelShape(2), tp, 0, Capacity(2, 512)) for tp in (0, 1)]
        regs = []
        for pools in (src, *dsts):
            eng = create_engine(EngineConfig("local"))
            eng.start()
            regs.append((eng, eng.register_rank(pools.registration())))
        source = SyntheticSource(src, RequestAllocator(LAYOUT, Capacity(2, 512)))
        prefill = PrefillRank(src.registration(), regs[0][0], regs[0][1],
                              BootstrapClient(ep, Codec(SECRET, "p", rank_key=RANK_KEY)),
                              settings=PrefillSettings(poll_wait_s=0.1, write_timeout_s=5.0),
                              release=source.release, synthetic=source.fill)
        works = [DecodeRequests(RankSpec(config("decode", tp=2), tp, 0, SECRET, "dec", "127.0.0.1", ("127.0.0.1", 0),
                                         request_timeout_s=10.0, write_timeout_s=5.0, fence_timeout_s=6.0),
                                dsts[tp], RequestAllocator(LAYOUT, Capacity(2, 512)), regs[1 + tp][1])
                 for tp in (0, 1)]
        launcher = OneDecode(works, early, refused, held)
        router = RequestRouter(Readiness("decode", floor_gbps=0.0, clock=lambda: 0.0, ranks_total=2, ranks_up=2),
                               ServerMetrics("decode"), asyncio.Event())
        router.launcher = launcher  # type: ignore[assignment]
        stop = asyncio.Event()
        await prefill.register()
        loop = asyncio.create_task(prefill.run(stop))
        try:
            for w in works:  # handshakes first: the early rank's claim goes out at once
                await w._coord(ep).connect(timeout_s=5.0)
            rid = room_request_id(ROOM)
            pull = asyncio.create_task(router.pull(ep, ROOM, TOKENS, rid, SEED, 10.0, retry_refused_s=2.0))
            await asyncio.wait_for(refused.wait(), 10)
            room = table.hold(ROOM, SEED, TOKENS, 1)  # the prefill's body arrives between the two claims
            held.set()
            res = await asyncio.wait_for(pull, 30)
            assert claims[0] == (early, rid, False), claims  # the race happened: refused before the hold
            assert res.ok, (res, claims)
            assert [r.ok for r in launcher.results] == [True, True], launcher.results
            assert {c[1] for c in claims} == {rid}, claims  # every rank, every send: the room's own id
            assert (room.claimant, room.request_id) == ("dec", rid)
            assert sorted(tp for tp, _, ok in claims if ok) == [0, 1], claims  # each rank accepted once
            assert res.bytes == sum(r.bytes for r in launcher.results) > 0
            assert sorted(k[2] for k in server.state.pending if k[1] == rid) == [(0, 0), (1, 0)]
            assert {p.request.room for p in server.state.pending.values()} == {ROOM}  # the claims' room, typed
            # The decode learns of each leg from the bootstrap, which ended the room with the last one.
            assert room.outcome == RoomOutcome(res.bytes), room.outcome
            with pytest.raises(RoomError) as e:  # another decode still cannot claim it
                table.claim(ROOM, "other", rid)
            assert e.value.code == "room_conflict"
        finally:
            stop.set()
            await loop
            for w in works:
                await w.close()
            await prefill.client.close()
            await server.stop()

    asyncio.run(main())
