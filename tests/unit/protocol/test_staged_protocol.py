"""The staged path through the protocol in one process: bootstrap on 127.0.0.1, prefill and decode
coordinators with staging regions on host pools (``onCpu``), the in-process ``local`` engine; every
chunk signal an engine write or read. Byte-exact arenas, the path chosen by size, lanes released only
after a request ends, a failure mid-way fenced (tests/unit/runtime/test_staged.py checks whole chunks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from pdfleet_runtime.engines import EngineConfig, create_engine
from pdfleet_runtime.engines import chunks as chunks_mod
from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.decode import DecodeRank, DecodeSettings
from pdfleet_runtime.protocol.discovery import StaticResolver
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.protocol.staged import DecodeStaging, Layout, PrefillStaging, StagingRegion
from pdfleet_runtime.protocol.states import FailureReason, RequestState
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.seeded import request_lengths
from pdfleet_runtime.verify.arena import compare, fill_background, write_requests
from tests.unit.protocol.helpers import RANK_KEY, SECRET

LAYOUT, REQUESTS, TOKENS, SEED = "llama-dense", 2, 64, 9
SLOT = 8192


@dataclass
class Rig:
    prefill: list[PrefillRank]
    decode: list[DecodeRank]
    dst_pools: list[RankPools]
    src_reqs: list[Any]
    dst_reqs: list[Any]
    backgrounds: list[np.ndarray]
    pre_staging: list[PrefillStaging]
    dec_staging: list[DecodeStaging]
    released: list[str] = field(default_factory=list)

    def verify(self, first: int | None = None) -> int:
        """Mismatched bytes of the decode arenas against the first ``first`` requests (all by default)."""
        expected = [b.copy() for b in self.backgrounds]
        write_requests(self.dst_pools, SEED, self.dst_reqs[:first], expected)
        return sum(compare(p, e)[0] for p, e in zip(self.dst_pools, expected, strict=True))


def run(p: S, d: S, body: Callable[[Rig], Awaitable[None]], *, threshold: int = 1, slots: int = 2) -> None:
    async def main() -> None:
        lay = PRESETS[LAYOUT]
        cap = Capacity(REQUESTS, TOKENS)
        server = BootstrapServer(BootstrapState(p), Codec(SECRET, "pod", rank_key=RANK_KEY))
        ep = await server.start()
        src = [RankPools(lay, p, t, k, cap) for t, k in p.coords()]
        dst = [RankPools(lay, d, t, k, cap) for t, k in d.coords()]
        for pools in src:
            fill_background(pools, SEED, 1)
        backgrounds = [fill_background(pools, SEED, 2) for pools in dst]
        lengths = request_lengths(TOKENS, REQUESTS, SEED)
        sa, da = RequestAllocator(lay, cap, seed=3), RequestAllocator(lay, cap, seed=4)
        src_reqs, dst_reqs = [sa.allocate(n) for n in lengths], [da.allocate(n) for n in lengths]
        write_requests(src, SEED, src_reqs, None)
        r = Rig([], [], dst, src_reqs, dst_reqs, backgrounds, [], [])
        for pools in src:
            region = StagingRegion(Layout(slots, SLOT, 1, 64 << 10), "cpu", extra=PrefillStaging.extra_bytes())
            st = PrefillStaging(region, pools.arena)
            eng = create_engine(EngineConfig("local"))
            eng.start()
            reg = pools.registration()
            info = eng.register((reg.region, region.record()), reg.buffers)
            coord = PrefillRank(reg, eng, info, BootstrapClient(ep, Codec(SECRET, "p", rank_key=RANK_KEY)),
                                settings=PrefillSettings(poll_wait_s=0.2, write_timeout_s=10), staging=st)
            await coord.register()
            r.prefill.append(coord)
            r.pre_staging.append(st)
        for pools in dst:
            region = StagingRegion(Layout(slots, SLOT, 2, 64 << 10), "cpu")
            st = DecodeStaging(region, pools.arena, threshold_bytes=threshold, cpu=True)
            eng = create_engine(EngineConfig("local"))
            eng.start()
            reg = pools.registration()
            info = eng.register((reg.region, region.record()), reg.buffers)

            def release(rid: str, st: DecodeStaging = st) -> None:
                r.released.append(rid)
                st.release(rid)

            r.decode.append(DecodeRank(reg, info, StaticResolver([ep]), Codec(SECRET, "d"), instance="dec",
                                       release=release, staging=st,
                                       settings=DecodeSettings(fence_timeout_s=5)))
            r.dec_staging.append(st)
        stop = asyncio.Event()
        loops = [asyncio.create_task(c.run(stop)) for c in r.prefill]
        try:
            await asyncio.wait_for(body(r), 60)
        finally:
            stop.set()
            await asyncio.gather(*loops)
            for c in r.decode:
                await c.close()
            for c in r.prefill:
                await c.client.close()
            await server.stop()

    asyncio.run(main())


def _bytes_into(r: Rig, q: int) -> int:
    from pdfleet_runtime.rank.synthetic import request_bytes

    return request_bytes(r.dst_pools[0], r.dst_reqs[q])


@pytest.mark.parametrize(("p", "d"), [(S(1), S(1)), (S(2), S(1))])
def test_staged_requests_arrive_byte_exact_through_a_lane_per_source(p: S, d: S) -> None:
    async def body(r: Rig) -> None:
        for c in r.prefill:
            for q, idx in enumerate(r.src_reqs):
                c.add_request(f"q{q}", idx)
        outs = []
        for q in range(REQUESTS):
            outs.append(await r.decode[0].transfer(f"q{q}", r.dst_reqs[q], timeout_s=20,
                                                   staged_bytes=_bytes_into(r, q)))
            assert r.dec_staging[0].lanes_free == 2 - p.tp  # held with the items until the caller releases them
            r.decode[0]._release(f"q{q}")  # type: ignore[misc]
            assert r.dec_staging[0].lanes_free == 2
        assert all(o.state is RequestState.SUCCESS for o in outs), [o.reason for o in outs]
        assert r.verify() == 0
        staged = sum(s.metrics.requests["staged"] for s in r.pre_staging)
        sending = sum(1 for o in outs for rep in o.reports if rep.bytes)  # a source with no block marks its lane
        assert staged == sending >= REQUESTS and all(len(o.reports) == p.tp for o in outs)
        assert sum(s.metrics.bytes["staged"] for s in r.pre_staging) == sum(rep.bytes for o in outs for rep in o.reports)
        assert all(s.metrics.landed_write_s.n > 0 for s in r.pre_staging)
        assert r.dec_staging[0].metrics.requests["staged"] == sending

    run(p, d, body)


def test_lanes_held_by_a_request_send_the_next_one_direct() -> None:
    async def body(r: Rig) -> None:
        for c in r.prefill:
            for q, idx in enumerate(r.src_reqs):
                c.add_request(f"q{q}", idx)
        outs = [await r.decode[0].transfer(f"q{q}", r.dst_reqs[q], timeout_s=20, staged_bytes=_bytes_into(r, q))
                for q in range(REQUESTS)]  # q0's items (and lanes) are not released before q1
        assert all(o.state is RequestState.SUCCESS for o in outs), [o.reason for o in outs]
        assert r.verify() == 0
        assert sum(s.metrics.requests["staged"] for s in r.pre_staging) == 2  # q0 through both lanes
        assert sum(s.metrics.requests["direct"] for s in r.pre_staging) == 2  # q1 direct from both sources

    run(S(2), S(1), body)


def test_requests_below_the_threshold_take_the_direct_write() -> None:
    async def body(r: Rig) -> None:
        for q, idx in enumerate(r.src_reqs):
            r.prefill[0].add_request(f"q{q}", idx)
        outs = [await r.decode[0].transfer(f"q{q}", r.dst_reqs[q], timeout_s=20, staged_bytes=_bytes_into(r, q))
                for q in range(REQUESTS)]
        assert all(o.state is RequestState.SUCCESS for o in outs), [o.reason for o in outs]
        assert r.verify() == 0
        m = r.pre_staging[0].metrics
        assert m.requests == {"direct": REQUESTS, "staged": 0}
        assert r.dec_staging[0].lanes_free == 2  # no lane was granted

    run(S(1), S(1), body, threshold=1 << 40)


def test_a_chunk_write_failing_mid_way_fails_the_request_and_fences_its_lanes(monkeypatch) -> None:
    real = chunks_mod.chunk_link

    def failing(engine, peer):
        link = real(engine, peer)
        posts = [0]
        post = link.post

        def flaky(local: int, remote: int, nbytes: int):
            posts[0] += 1
            if posts[0] == 4:  # the table, then chunks 0 and 1 land; chunk 2 fails
                raise chunks_mod.TransferFailed("injected: chunk write refused")
            return post(local, remote, nbytes)

        link.post = flaky  # type: ignore[method-assign]
        return link

    monkeypatch.setattr(chunks_mod, "chunk_link", failing)

    async def body(r: Rig) -> None:
        r.prefill[0].add_request("q0", r.src_reqs[0])
        out = await r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=20, staged_bytes=_bytes_into(r, 0))
        assert out.state is RequestState.FAILED and out.failure is FailureReason.SOURCE_FAILED
        assert out.cause is FailureReason.ENGINE and "injected" in out.reason
        assert await r.decode[0].wait_fenced(10)
        assert r.released == ["q0"] and r.dec_staging[0].lanes_free == 2  # items and lanes back after the fence

    run(S(1), S(1), body)


def test_plans_are_cut_and_the_table_sent_before_the_state_is_ready() -> None:
    """``PrefillRank.prepare`` (called when the request's items are allocated, before its state is made)
    cuts the leg's plan and writes the decode's table and ready word; the write then uses that plan."""
    from pdfleet_runtime.protocol.staged import READY_STAGED

    async def body(r: Rig) -> None:
        pre, dec_st = r.prefill[0], r.dec_staging[0]
        task = asyncio.ensure_future(r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=20,
                                                          staged_bytes=_bytes_into(r, 0)))
        for _ in range(400):  # the request (with its lane) reached the prefill rank
            req = pre._requests.get("q0")  # type: ignore[attr-defined]
            if req is not None and any(leg.request.lanes for leg in req.legs.values()):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the transfer request never reached the prefill rank")
        (lane,) = next(leg.request.lanes for leg in req.legs.values())
        ready = dec_st.region.words(dec_st.layout.word(lane, 2))
        assert int(ready.item()) == 0  # nothing written before the plan is cut
        pre.prepare("q0", r.src_reqs[0])
        (leg,) = req.legs.values()
        prepared = await asyncio.wait_for(asyncio.shield(leg.prepare), 10)
        assert prepared is not None and prepared.total == _bytes_into(r, 0)
        assert int(ready.item()) == READY_STAGED and not task.done()  # the decode has its table; no state yet
        assert pre.staging.metrics.landed_write_s.n == 0  # no chunk sent before the state is offered
        pre.add_request("q0", r.src_reqs[0])
        out = await task
        assert out.state is RequestState.SUCCESS and out.staged, out.reason
        assert r.verify(1) == 0
        assert pre.staging.metrics.requests["staged"] == 1

    run(S(1), S(1), body)
