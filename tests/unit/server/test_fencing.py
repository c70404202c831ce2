"""The late-write hazard, in one process: a decode that gave up must not reuse its items while a prefill
write into them may still land. A real bootstrap server on 127.0.0.1, the coordinators, the ``local``
engine wrapped so that each write takes a second (a write still in flight when the decode fails).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pdfleet_runtime.engines import EngineConfig, create_engine
from pdfleet_runtime.layouts import PRESETS
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.decode import DecodeRank, DecodeSettings
from pdfleet_runtime.protocol.discovery import Endpoint, StaticResolver
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.protocol.states import FailureReason, RequestState
from pdfleet_runtime.rank.synthetic import fill_request, verify_request
from pdfleet_runtime.records import ParallelShape

SECRET = b"fencing-test-secret-0123456789"
RANK_KEY = b"fencing-test-rank-key-0123456789"
WRITE_S = 1.0


class SlowEngine:
    """The local engine, with every write taking ``WRITE_S`` first; records when each write ended."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.ended: list[float] = []

    def write(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(WRITE_S)
        try:
            return self.engine.write(*args, **kwargs)
        finally:
            self.ended.append(time.monotonic())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


@dataclass
class Rig:
    prefill: PrefillRank
    decode: DecodeRank
    slow: SlowEngine
    dst: RankPools
    dst_idx: Any
    stop: asyncio.Event
    released: list[tuple[str, float]] = field(default_factory=list)
    server: BootstrapServer | None = None


def run(body: Callable[[Rig], Awaitable[None]], *, fence_timeout_s: float = 10.0, write_timeout_s: float = 30.0,
        fence_margin_s: float | None = None) -> None:
    async def main() -> None:
        lay, shape, cap = PRESETS["llama-dense"], ParallelShape(1), Capacity(2, 64)
        server = BootstrapServer(BootstrapState(shape), Codec(SECRET, "pod", rank_key=RANK_KEY))
        ep = await server.start()
        src, dst = RankPools(lay, shape, 0, 0, cap), RankPools(lay, shape, 0, 0, cap)
        src_idx = RequestAllocator(lay, cap).allocate(40)
        dst_idx = RequestAllocator(lay, cap, seed=3).allocate(40)
        fill_request(src, 11, src_idx)
        engines = []
        for pools in (src, dst):
            eng = create_engine(EngineConfig("local"))
            eng.start()
            engines.append((eng, eng.register_rank(pools.registration())))
        slow = SlowEngine(engines[0][0])
        margin = {} if fence_margin_s is None else {"fence_margin_s": fence_margin_s}
        stop = asyncio.Event()
        prefill = PrefillRank(src.registration(), slow, engines[0][1],  # type: ignore[arg-type]
                              BootstrapClient(ep, Codec(SECRET, "p", rank_key=RANK_KEY)),
                              settings=PrefillSettings(poll_wait_s=0.2, write_timeout_s=write_timeout_s))
        rig = Rig(prefill, None, slow, dst, dst_idx, stop, server=server)  # type: ignore[arg-type]
        rig.decode = DecodeRank(dst.registration(), engines[1][1], StaticResolver([ep]), Codec(SECRET, "d"),
                                instance="dec", release=lambda rid: rig.released.append((rid, time.monotonic())),
                                settings=DecodeSettings(fence_timeout_s=fence_timeout_s, **margin))
        await prefill.register()
        prefill.add_request("q0", src_idx)
        loop = asyncio.create_task(prefill.run(stop))
        try:
            await asyncio.wait_for(body(rig), 60)
        finally:
            stop.set()
            await loop
            await rig.decode.close()
            await prefill.client.close()
            await server.stop()

    asyncio.run(main())


def test_items_are_held_until_the_prefill_confirms_its_write_ended() -> None:
    async def body(r: Rig) -> None:
        out = await r.decode.transfer("q0", r.dst_idx, timeout_s=0.4)  # gives up while the write runs
        failed_at = time.monotonic()
        assert out.state is RequestState.FAILED and out.failure is FailureReason.TIMEOUT, out
        assert r.released == [] and r.decode.fences_pending == 1  # the items are not reused yet
        assert await r.decode.wait_fenced(10)
        assert r.decode.fenced == {"at_once": 0, "ack": 1, "deadline": 0}
        [(rid, released_at)] = r.released
        assert rid == "q0" and r.slow.ended and released_at >= r.slow.ended[0] > failed_at
        # The late write really landed after the decode gave up: without the fence it would have
        # overwritten whatever request the decode had put in these pages meanwhile.
        assert verify_request(r.dst, 11, r.dst_idx) == 0
        assert released_at - failed_at < WRITE_S + 1.0  # the ack, not the 10 s deadline

    run(body)


def test_items_of_a_silent_prefill_come_back_at_the_fence_deadline_not_before() -> None:
    async def body(r: Rig) -> None:
        while not r.prefill._requests or not any(leg.writing for req in r.prefill._requests.values()
                                                  for leg in req.legs.values()):
            await asyncio.sleep(0.01)  # wait until the decode sent its indices and the write is in flight
        r.stop.set()  # the prefill stops polling: it will never see the cancel

    async def both(r: Rig) -> None:
        transfer = asyncio.create_task(r.decode.transfer("q0", r.dst_idx, timeout_s=0.5))
        await body(r)
        out = await transfer
        failed_at = time.monotonic()
        assert out.state is RequestState.FAILED
        assert r.released == []
        assert await r.decode.wait_fenced(10)
        assert r.decode.fenced["deadline"] == 1 and r.decode.fenced["ack"] == 0
        assert r.released[0][1] - failed_at >= 1.5 - 0.1

    run(both, fence_timeout_s=1.5, write_timeout_s=1.2, fence_margin_s=0.25)


def test_the_fence_waits_for_the_write_timeout_the_prefill_announced_when_the_decode_flag_is_shorter() -> None:
    """Issue 25 item 5: the decode's fence flag (0.5 s) and the prefill's write timeout (0.5 s here, plus the
    default 5 s margin) are flags of different pods; the prefill announces its own at registration and the
    decode waits for the longer, so a write still running can never land in reused items."""
    async def both(r: Rig) -> None:
        transfer = asyncio.create_task(r.decode.transfer("q0", r.dst_idx, timeout_s=0.5))
        while not r.prefill._requests or not any(leg.writing for req in r.prefill._requests.values()
                                                  for leg in req.legs.values()):
            await asyncio.sleep(0.01)
        r.stop.set()  # a silent prefill: only the deadline releases the items
        out = await transfer
        failed_at = time.monotonic()
        assert out.state is RequestState.FAILED and r.released == []
        assert await r.decode.wait_fenced(15)
        assert r.released[0][1] - failed_at >= 5.5 - 0.5 - 0.1, r.released[0][1] - failed_at  # not the 0.5 s flag

    run(both, fence_timeout_s=0.5, write_timeout_s=0.5)


def test_a_failure_before_any_request_was_sent_releases_at_once() -> None:
    async def body(r: Rig) -> None:
        r.decode.resolver = StaticResolver([])  # no prefill pod to send to
        r.decode._link = None
        out = await r.decode.transfer("q1", r.dst_idx, timeout_s=0.3)
        assert out.state is RequestState.FAILED and out.failure is FailureReason.PEER_UNREACHABLE
        assert [rid for rid, _ in r.released] == ["q1"] and r.decode.fenced["at_once"] == 1

    run(body)


def test_a_prefill_pod_that_does_not_answer_fails_after_the_grace_not_the_deadline() -> None:
    """A deleted pod DNS still names: the request fails within the unreachable grace (2 s), releasing its
    items at once, so the caller can try another pod within the same request budget."""

    async def body(r: Rig) -> None:
        import socket

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = Endpoint("127.0.0.1", s.getsockname()[1])
        r.decode.resolver = StaticResolver([dead])
        r.decode._link = None
        t0 = time.monotonic()
        out = await r.decode.transfer("q3", r.dst_idx, timeout_s=20)
        assert out.state is RequestState.FAILED and out.failure is FailureReason.PEER_UNREACHABLE, out
        assert time.monotonic() - t0 < 2.0 + 1.0 and "unreachable for" in out.reason
        assert [rid for rid, _ in r.released] == ["q3"] and r.decode.fenced["at_once"] == 1

    run(body)


def test_a_kept_link_to_a_pod_that_went_away_fails_fast_and_releases_at_once() -> None:
    """The pod behind a kept link is gone (deleted after its drain; DNS still names it): the request never
    reaches it (no connection), so its items come back at once and the caller may try another pod."""

    async def body(r: Rig) -> None:
        await r.decode.connect(timeout_s=5)
        assert r.server is not None
        await r.server.stop()
        # Gone a moment ago: the kept connection's close has arrived (a connection that drops during the send
        # is ambiguous, the pod may have read the request, and is fenced as before).
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        out = await r.decode.transfer("q4", r.dst_idx, timeout_s=20)
        assert out.state is RequestState.FAILED and out.failure is FailureReason.PEER_UNREACHABLE, out
        assert time.monotonic() - t0 < 2.0 + 1.0
        assert [rid for rid, _ in r.released] == ["q4"] and r.decode.fenced["at_once"] == 1, out.reason

    run(body)


def test_a_request_a_draining_prefill_refused_releases_at_once() -> None:
    """A refusal of the request itself (the bootstrap changes nothing when it refuses) means no source will
    ever write: the items come back at once, so the caller can send the same request to another prefill."""

    async def body(r: Rig) -> None:
        await r.decode.connect(timeout_s=5)  # a kept link, as after earlier requests
        assert r.server is not None
        r.server.state.drain(True)
        out = await r.decode.transfer("q2", r.dst_idx, timeout_s=5)
        assert out.state is RequestState.FAILED and out.failure is FailureReason.REFUSED, out
        assert "draining" in out.reason
        assert [rid for rid, _ in r.released] == ["q2"] and r.decode.fenced["at_once"] == 1
        assert r.decode.fences_pending == 0

    run(body)
