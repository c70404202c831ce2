"""The protocol end to end in one process: a real bootstrap server on 127.0.0.1, prefill and decode
coordinators, the in-process ``local`` engine. Fast, so the flow, versions, timeouts, releases and
the HTTP surface's refusals are covered without spawning; tests/verify repeats the flow with
one process per rank and the real engines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfleet_runtime.engines import EngineConfig, create_engine
from pdfleet_runtime.layouts import PRESETS, DType, layout_digest
from pdfleet_runtime.pools import Capacity, RankPools, RequestAllocator
from pdfleet_runtime.protocol.auth import AUTH_HEADER, SIGNATURE_HEADER, Codec
from pdfleet_runtime.protocol.bootstrap import MESSAGES_PATH, BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.decode import DecodeRank, DecodeSettings
from pdfleet_runtime.protocol.discovery import StaticResolver
from pdfleet_runtime.protocol.messages import WIRE, Hello, Role, Welcome
from pdfleet_runtime.protocol.prefill import PrefillRank, PrefillSettings
from pdfleet_runtime.protocol.states import FailureReason, RequestState, StateTimeouts
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.records import ParallelShape as S
from pdfleet_runtime.seeded import request_lengths
from pdfleet_runtime.verify.arena import compare, fill_background, write_requests
from tests.unit.protocol.helpers import RANK_KEY, SECRET, snapshot

LAYOUT_NAME = "llama-dense"
REQUESTS, TOKENS, SEED = 2, 40, 5


@dataclass
class Rig:
    """Pools, allocations and coordinators of one prefill pod and one decode instance, in this process."""

    server: BootstrapServer
    prefill: list[PrefillRank]
    decode: list[DecodeRank]
    src_pools: list[RankPools]
    dst_pools: list[RankPools]
    src_reqs: list[Any]
    dst_reqs: list[Any]
    backgrounds: list[np.ndarray]
    released: dict[str, list[str]] = field(default_factory=lambda: {"prefill": [], "decode": []})

    def verify(self) -> int:
        expected = [b.copy() for b in self.backgrounds]
        write_requests(self.dst_pools, SEED, self.dst_reqs, expected)
        return sum(compare(p, e)[0] for p, e in zip(self.dst_pools, expected, strict=True))


async def rig(p: ParallelShape, d: ParallelShape, *, decode_timeouts: StateTimeouts | None = None,
              prefill_timeouts: StateTimeouts | None = None, wire: str = str(WIRE), layout: str = LAYOUT_NAME,
              models: tuple[str, str] = ("", ""), digests: tuple[str, str] = ("", "")) -> Rig:
    lay = PRESETS[layout]
    cap = Capacity(REQUESTS, TOKENS)
    server = BootstrapServer(BootstrapState(p, model=models[0], layout=digests[0]),
                             Codec(SECRET, "pod", rank_key=RANK_KEY))
    ep = await server.start()
    src = [RankPools(lay, p, t, k, cap) for t, k in p.coords()]
    dst = [RankPools(lay, d, t, k, cap) for t, k in d.coords()]
    for pools in src:
        fill_background(pools, SEED, 1)
    backgrounds = [fill_background(pools, SEED, 2) for pools in dst]
    lengths = request_lengths(TOKENS, REQUESTS, SEED)
    sa, da = RequestAllocator(lay, cap, seed=SEED * 2 + 1), RequestAllocator(lay, cap, seed=SEED * 2 + 2)
    src_reqs, dst_reqs = [sa.allocate(n) for n in lengths], [da.allocate(n) for n in lengths]
    write_requests(src, SEED, src_reqs, None)
    r = Rig(server, [], [], src, dst, src_reqs, dst_reqs, backgrounds)
    for pools in src:
        eng = create_engine(EngineConfig("local"))
        eng.start()
        info = eng.register_rank(pools.registration())
        coord = PrefillRank(pools.registration(), eng, info, BootstrapClient(ep, Codec(SECRET, "p", rank_key=RANK_KEY)),
                            settings=PrefillSettings(timeouts=prefill_timeouts or StateTimeouts(), poll_wait_s=0.2),
                            release=r.released["prefill"].append)
        await coord.register()
        r.prefill.append(coord)
    for pools in dst:
        eng = create_engine(EngineConfig("local"))
        eng.start()
        info = eng.register_rank(pools.registration())
        r.decode.append(DecodeRank(pools.registration(), info, StaticResolver([ep]), Codec(SECRET, "d"),
                                   instance="dec", release=r.released["decode"].append, wire=wire, model=models[1],
                                   layout=digests[1],
                                   settings=DecodeSettings(timeouts=decode_timeouts or StateTimeouts())))
    return r


def run(p: ParallelShape, d: ParallelShape, body: Callable[[Rig], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        r = await rig(p, d, **kw)
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
            await r.server.stop()

    asyncio.run(main())


def test_every_request_arrives_byte_exact_and_every_source_reports() -> None:
    async def body(r: Rig) -> None:
        for c in r.prefill:
            for q, idx in enumerate(r.src_reqs):
                c.add_request(f"q{q}", idx)
        outs = await asyncio.gather(*(dec.transfer(f"q{q}", r.dst_reqs[q], timeout_s=20)
                                      for dec in r.decode for q in range(REQUESTS)))
        assert all(o.state is RequestState.SUCCESS for o in outs), [o.reason for o in outs]
        # tp 2 pp 2 -> tp 1 with MLA (replicated): the decode rank hears all four sources, and the two that
        # were not elected (tp rank 1) report Success with nothing sent.
        assert all(len(o.reports) == 4 for o in outs)
        assert all((rep.bytes == 0) == (rep.src.tp == 1) for o in outs for rep in o.reports)
        assert r.verify() == 0
        await asyncio.sleep(0.3)
        assert sorted(r.released["prefill"]) == sorted(f"q{q}" for q in range(REQUESTS) for _ in range(4))
        assert r.released["decode"] == []

    run(S(2, 2), S(1), body, layout="deepseek-mla")


def test_incompatible_wire_version_refuses_the_handshake_naming_both() -> None:
    async def body(r: Rig) -> None:
        out = await r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=5)
        assert out.state is RequestState.FAILED and out.failure is FailureReason.REFUSED
        assert f"{WIRE.major + 1}.0" in out.reason and str(WIRE) in out.reason
        assert r.released["decode"] == ["q0"]
        assert r.server.state.decodes == {}

    run(S(1), S(1), body, wire=f"{WIRE.major + 1}.0")


A, B = "dir:sha256:" + "a" * 64, "hf:org/m@" + "b" * 40


def _refused(*named: str) -> Callable[[Rig], Awaitable[None]]:
    """A rig step: the decode's request fails as refused at the handshake, its reason naming ``named``, and
    nothing is registered."""
    async def body(r: Rig) -> None:
        out = await r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=5)
        assert out.state is RequestState.FAILED and out.failure is FailureReason.REFUSED, out
        assert all(n in out.reason for n in named), (named, out.reason)
        assert r.released["decode"] == ["q0"] and r.server.state.decodes == {}
    return body


async def _pairs(r: Rig) -> None:
    """A rig step: the pair moves a request."""
    r.prefill[0].add_request("q0", r.src_reqs[0])
    out = await r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=10)
    assert out.state is RequestState.SUCCESS, out


def test_pods_of_two_model_generations_refuse_each_other_at_the_handshake() -> None:
    """RuntimeConfig.model_identity (wire 1.2): a decode of model A and a prefill of model B never pair; the
    request fails as refused, naming both, and nothing is registered; the same model pairs."""
    refused = _refused(A, B, "two model generations")
    run(S(1), S(1), refused, models=(B, A))
    run(S(1), S(1), refused, models=(A, B))
    run(S(1), S(1), _pairs, models=(A, A))


def test_pods_of_two_layouts_refuse_each_other_at_the_handshake() -> None:
    """The layout digest (wire 1.3): a bfloat16 decode and a float16 prefill (a KV dtype rolled) never pair, on
    either side's check; the request fails as refused before anything is written; one digest pairs; a pod from
    before wire 1.3 ('' digest) is not held to it."""
    bf16 = layout_digest(PRESETS[LAYOUT_NAME])
    f16 = layout_digest(PRESETS[LAYOUT_NAME].model_copy(update={"dtype": DType.FLOAT16}))
    assert bf16 != f16

    run(S(1), S(1), _refused(bf16, f16, "two layout generations"), digests=(f16, bf16))
    run(S(1), S(1), _pairs, digests=(bf16, bf16))
    run(S(1), S(1), _pairs, digests=("", bf16))


def test_an_older_prefill_pod_is_refused_by_the_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill pod that does not check (wire 1.1: its welcome names no model) is refused by a pinned decode."""
    def older(self: BootstrapState, msg: Hello) -> Welcome:
        return Welcome(runtime_version="0.1.0", wire="1.1", prefill_tp=self.prefill.tp, prefill_pp=self.prefill.pp,
                       ready=self.ready)

    monkeypatch.setattr(BootstrapState, "hello", older)

    async def body(r: Rig) -> None:
        out = await r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=5)
        assert out.state is RequestState.FAILED and out.failure is FailureReason.REFUSED, out
        assert "prefill pod" in out.reason and "(not pinned)" in out.reason and A in out.reason
        assert r.server.state.decodes == {}

    run(S(1), S(1), body, models=(A, A))


def test_missing_prefill_input_fails_both_sides_within_their_timeouts_and_frees_items() -> None:
    async def body(r: Rig) -> None:
        t0 = asyncio.get_running_loop().time()
        out = await r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=1.5)
        # The prefill gave up first (0.8 s waiting for input) and said so: the decode fails with its reason.
        assert out.state is RequestState.FAILED and out.failure is FailureReason.SOURCE_FAILED, out
        assert "timeout" in out.reason and "waiting_for_input" in out.reason
        assert asyncio.get_running_loop().time() - t0 < 2.5
        assert r.released["decode"] == ["q0"]
        await asyncio.sleep(0.5)  # the prefill never had input: it times out waiting, nothing to free
        assert r.prefill[0].outcome("q0") is RequestState.FAILED and r.released["prefill"] == []

    run(S(1), S(1), body, prefill_timeouts=StateTimeouts(waiting_for_input_s=0.8))


def test_failed_decode_cancels_and_prefill_frees_its_items() -> None:
    async def body(r: Rig) -> None:
        out = await r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=0.8)  # prefill input arrives too late
        assert out.state is RequestState.FAILED
        await asyncio.sleep(0.5)
        assert r.prefill[0].outcome("q0") is RequestState.FAILED  # cancelled by the decode
        assert r.prefill[0].add_request("q0", r.src_reqs[0]) is RequestState.FAILED
        assert r.released["prefill"] == ["q0"] and r.prefill[0].in_flight == 0  # its items are freed at once

    run(S(1), S(1), body)


def test_http_surface_refuses_bad_input_and_keeps_serving() -> None:
    async def body(r: Rig) -> None:
        url = r.server.endpoint.url(MESSAGES_PATH)
        before = snapshot(r.server.state)
        good = Codec(SECRET, "x")
        raw, sig, _ = good.seal(Hello(role=Role.DECODE, runtime_version="0.1.0", wire=str(WIRE), instance="d"))
        async with aiohttp.ClientSession() as s:
            cases = [(b"not json", None, 401), (raw, None, 401), (raw, "f" * 64, 401),
                     (b"x" * (r.server.codec.max_bytes + 10), sig, 413), (b"{}", good.sign(b"{}"), 400)]
            for data, signature, status in cases:
                headers = {SIGNATURE_HEADER: signature,
                           AUTH_HEADER: good.auth_header(len(data), signature)} if signature else {}
                async with s.post(url, data=data, headers=headers) as resp:
                    assert resp.status == status, (data[:20], resp.status)
            ok = {SIGNATURE_HEADER: sig, AUTH_HEADER: good.auth_header(len(raw), sig)}
            async with s.post(url, data=raw, headers={SIGNATURE_HEADER: sig}) as resp:  # no header MAC
                assert resp.status == 401
            async with s.post(url, data=raw, headers=ok) as resp:
                assert resp.status == 200
            async with s.post(url, data=raw, headers=ok) as resp:  # replayed
                assert resp.status == 409 and json.loads(await resp.read())["body"]["code"] == "replayed"
        after = snapshot(r.server.state)
        before.pop("last_seen"), after.pop("last_seen")  # the prefill rank keeps polling meanwhile
        assert after == before

    run(S(1), S(1), body)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blobs=st.lists(st.binary(max_size=300) | st.text(max_size=300).map(str.encode), min_size=1, max_size=5),
       signed=st.booleans())
def test_fuzzed_posts_never_crash_the_server_or_change_its_state(blobs: list[bytes], signed: bool) -> None:
    async def main() -> None:
        server = BootstrapServer(BootstrapState(S(1)), Codec(SECRET, "pod", rank_key=RANK_KEY))
        await server.start()
        before = snapshot(server.state)
        signer = Codec(SECRET, "fuzz")
        try:
            async with aiohttp.ClientSession() as s:
                for blob in blobs:
                    headers = {SIGNATURE_HEADER: signer.sign(blob)} if signed else {}
                    async with s.post(server.endpoint.url(MESSAGES_PATH), data=blob, headers=headers) as resp:
                        assert 400 <= resp.status < 500
                hello = Hello(role=Role.DECODE, runtime_version="0.1.0", wire=str(WIRE), instance="d")
                reply = await BootstrapClient(server.endpoint, signer).call(hello, timeout_s=5)
                assert reply.body.type == "welcome"  # still serving
        finally:
            await server.stop()
        assert snapshot(server.state) == before

    asyncio.run(main())


def test_a_status_the_pod_refuses_for_good_is_dropped_not_retried_forever() -> None:
    from pdfleet_runtime.protocol.messages import RankKey, StatusReport

    async def body(r: Rig) -> None:
        pre = r.prefill[0]
        ghost = StatusReport(request_id="ghost", instance="dec", src=RankKey(tp=0, pp=0), dst=RankKey(tp=0, pp=0),
                             state=RequestState.SUCCESS)
        pre._outbox.append(ghost)  # a status for a request the pod never had (or already purged)
        pre._outbox_event.set()
        pre.add_request("q0", r.src_reqs[0])
        out = await r.decode[0].transfer("q0", r.dst_reqs[0], timeout_s=10)
        assert out.state is RequestState.SUCCESS, out.reason
        await asyncio.sleep(0.2)
        assert pre._outbox == []

    run(S(1), S(1), body)
