"""A hung engine status call to one decode must not stall the prefill rank's writes to another decode.

A real bootstrap server on 127.0.0.1, one prefill rank, nine decode instances, the ``local`` engine wrapped by a
fault hook: writes to decodes ``a0``..``a7`` hang inside the engine (as Mooncake's
``get_batch_transfer_status`` does until its batch ends) until the test lets them go; the write to
decode ``b`` must complete meanwhile. Eight hung writes are more than asyncio's default executor has
threads on a small host (cores + 4), so a design that parks waiting writes on worker threads fails too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from pdfleet_runtime.engines import EngineConfig, create_engine
from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.decode import DecodeRank, DecodeSettings
from pdfleet_runtime.protocol.discovery import StaticResolver
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.protocol.states import FailureReason, RequestState
from pdfleet_runtime.rank.synthetic import fill_request, verify_request
from pdfleet_runtime.records import ParallelShape

SECRET = b"hung-status-test-secret-0123456789"
RANK_KEY = b"hung-status-test-rank-key-01234567"
WRITE_TIMEOUT_S = 1.0


class HungStatus:
    """Fault hook: writes to ``hung_peer`` block inside the engine call until ``release`` is set."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.hung_peers: set[str] = set()
        self.release = threading.Event()
        self.hung: set[str] = set()
        self.ended: dict[str, float] = {}

    def write(self, peer: str, *args: Any, **kwargs: Any) -> Any:
        if peer in self.hung_peers:
            self.hung.add(peer)
            self.release.wait(30)
        try:
            return self.engine.write(peer, *args, **kwargs)
        finally:
            self.ended[peer] = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def test_a_hung_status_call_to_one_decode_does_not_stall_writes_to_another() -> None:
    async def main() -> None:
        lay, shape, cap = PRESETS["llama-dense"], ParallelShape(1), Capacity(2, 64)
        server = BootstrapServer(BootstrapState(shape), Codec(SECRET, "pod", rank_key=RANK_KEY))
        ep = await server.start()
        src = RankPools(lay, shape, 0, 0, cap)
        hung = [f"a{i}" for i in range(8)]
        dsts = {name: RankPools(lay, shape, 0, 0, cap) for name in [*hung, "b"]}
        src_idx = {rid: RequestAllocator(lay, cap, seed=s).allocate(40) for rid, s in (("qa", 1), ("qb", 2))}
        dst_idx = {name: RequestAllocator(lay, cap, seed=3).allocate(40) for name in dsts}
        fill_request(src, 11, src_idx["qa"])
        fill_request(src, 12, src_idx["qb"])
        engine = create_engine(EngineConfig("local"))
        engine.start()
        info = engine.register_rank(src.registration())
        hook = HungStatus(engine)
        decodes: dict[str, DecodeRank] = {}
        for name, pools in dsts.items():
            eng = create_engine(EngineConfig("local"))
            eng.start()
            dinfo = eng.register_rank(pools.registration())
            if name in hung:
                hook.hung_peers.add(dinfo.name)
            decodes[name] = DecodeRank(pools.registration(), dinfo,
                                       StaticResolver([ep]), Codec(SECRET, f"d{name}"), instance=name,
                                       settings=DecodeSettings(fence_timeout_s=10.0, fence_margin_s=0.5))
        stop = asyncio.Event()
        prefill = PrefillRank(src.registration(), hook, info,  # type: ignore[arg-type]
                              BootstrapClient(ep, Codec(SECRET, "p", rank_key=RANK_KEY)),
                              settings=PrefillSettings(poll_wait_s=0.2, write_timeout_s=WRITE_TIMEOUT_S))
        await prefill.register()
        loop = asyncio.create_task(prefill.run(stop))
        try:
            tas = []
            for name in hung:
                prefill.add_request(f"q{name}", src_idx["qa"])
                tas.append(asyncio.create_task(decodes[name].transfer(f"q{name}", dst_idx[name], timeout_s=20)))
            until = time.monotonic() + 10
            while len(hook.hung) < len(hung) and time.monotonic() < until:
                await asyncio.sleep(0.01)
            assert len(hook.hung) == len(hung), \
                f"only {len(hook.hung)} of {len(hung)} hung writes reached the engine: the rest wait behind them"
            t0 = time.monotonic()
            prefill.add_request("qb", src_idx["qb"])
            ob = await asyncio.wait_for(decodes["b"].transfer("qb", dst_idx["b"], timeout_s=20), 20)
            b_took = time.monotonic() - t0
            assert ob.state is RequestState.SUCCESS, ob
            assert verify_request(dsts["b"], 12, dst_idx["b"]) == 0
            assert b_took < WRITE_TIMEOUT_S, f"the write to decode b waited {b_took:.2f}s behind the hung ones"
            # Each hung write has a deadline: the write timeout (plus a margin), then a typed failure,
            # sent unfenced (the engine may still write), and the items stay held.
            outs = await asyncio.wait_for(asyncio.gather(*tas), 20)
            failed_after = time.monotonic() - t0
            assert failed_after < 3 * WRITE_TIMEOUT_S + 1, failed_after
            for name, oa in zip(hung, outs, strict=True):
                assert oa.state is RequestState.FAILED and oa.cause is FailureReason.TIMEOUT, oa
                assert "engine call has not returned" in oa.reason, oa.reason
                [report] = oa.reports
                assert not report.fenced  # the engine may still write into this decode's items
                assert decodes[name].fences_pending == 1
                assert prefill.outcome(f"q{name}") is RequestState.FAILED
            hook.release.set()  # the status calls return at last: the prefill confirms each fence
            for name in hung:
                assert await decodes[name].wait_fenced(10)
                assert decodes[name].fenced["ack"] == 1
        finally:
            hook.release.set()
            stop.set()
            await loop
            for d in decodes.values():
                await d.close()
            await prefill.client.close()
            await server.stop()

    asyncio.run(main())
