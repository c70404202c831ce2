"""Issue 25 item 3 and the recipient half of item 5: what a holder of the deployment secret could forge.

Each test is an attack through a real ``BootstrapServer`` on 127.0.0.1 by a party that holds the
deployment secret but is not one of the pod's ranks (another pod of the deployment): a forged
``PrefillPoll`` that acknowledges (and so discards) a rank's queued requests, a forged
``StatusReports`` that tells a decode "success" with no byte written, a forged ``PrefillRegister``
that fails in-flight requests; and a decode's own message captured on the wire (a recording proxy)
and replayed to another prefill pod or to the same pod after it restarted. The pod's ranks sign
with the pod's rank key (``pod_codec``/``rank_codec``); the attacker only with the deployment secret.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from pdfleet_runtime.protocol.auth import Codec, ProtocolError
from pdfleet_runtime.protocol.bootstrap import BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.messages import (
    WIRE,
    Hello,
    PrefillPoll,
    PrefillWork,
    RankKey,
    Role,
    StatusQuery,
    StatusReply,
    StatusReport,
    StatusReports,
)
from pdfleet_runtime.protocol.states import RequestState
from pdfleet_runtime.records import ParallelShape
from tests.unit.protocol.helpers import RANK_KEY, SECRET, decode_register, prefill_register, transfer_request

S1 = ParallelShape(1, 1)
HELLO = Hello(role=Role.DECODE, runtime_version="0.1.0", wire=str(WIRE), instance="dec")
QUERY = StatusQuery(instance="dec", dst=RankKey(tp=0, pp=0), request_ids=("r1",))


def pod_codec(name: str) -> Codec:
    return Codec(SECRET, name, rank_key=RANK_KEY)


def rank_codec(name: str) -> Codec:
    return Codec(SECRET, name, rank_key=RANK_KEY)


async def start_pod(name: str = "prefill-0", port: int = 0) -> BootstrapServer:
    server = BootstrapServer(BootstrapState(S1), pod_codec(name), port=port)
    await server.start()
    return server


async def ready(ep: Endpoint) -> tuple[BootstrapClient, BootstrapClient]:
    """The pod's own rank registered, and a decode rank (instance ``dec``) handshaken and registered."""
    rank = BootstrapClient(ep, rank_codec("prefill-0-0-0"))
    await rank.call(prefill_register(S1, 0, 0), timeout_s=5)
    dec = BootstrapClient(ep, Codec(SECRET, "dec-0-0"))
    await dec.call(HELLO, timeout_s=5)
    await dec.call(decode_register(S1, 0, 0), timeout_s=5)
    return rank, dec


async def attempt(call: Awaitable[object]) -> str:
    """What the pod answered the attacker: ``ok`` or the refusal's code."""
    try:
        await call
    except ProtocolError as e:
        return e.code.value
    return "ok"


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_forged_prefill_poll_does_not_discard_the_ranks_queued_requests() -> None:
    async def body() -> None:
        server = await start_pod()
        rank, dec = await ready(server.endpoint)
        forger = BootstrapClient(server.endpoint, Codec(SECRET, "decode-pod-with-the-secret"))
        try:
            await dec.call(transfer_request("r1"), timeout_s=5)
            said = await attempt(forger.call(PrefillPoll(rank=RankKey(tp=0, pp=0), ack=10**9), timeout_s=5))
            work = (await rank.call(PrefillPoll(rank=RankKey(tp=0, pp=0), ack=0), timeout_s=5)).body
            assert isinstance(work, PrefillWork)
            got = [e.request.request_id for e in work.events if e.request is not None]
            assert got == ["r1"], f"the forged poll ({said}) discarded the rank's queued request"
            assert said == "forbidden"
        finally:
            for c in (rank, dec, forger):
                await c.close()
            await server.stop()

    run(body)


def test_forged_status_reports_do_not_make_a_decode_accept_success_with_no_byte_written() -> None:
    async def body() -> None:
        server = await start_pod()
        rank, dec = await ready(server.endpoint)
        forger = BootstrapClient(server.endpoint, Codec(SECRET, "decode-pod-with-the-secret"))
        try:
            await dec.call(transfer_request("r1"), timeout_s=5)
            lie = StatusReport(request_id="r1", instance="dec", src=RankKey(tp=0, pp=0), dst=RankKey(tp=0, pp=0),
                               state=RequestState.SUCCESS)
            said = await attempt(forger.call(StatusReports(reports=(lie,)), timeout_s=5))
            reply = (await dec.call(QUERY, timeout_s=5)).body
            assert isinstance(reply, StatusReply)
            assert [r.state for r in reply.reports] == [], f"the decode was told {reply.reports} ({said})"
            assert said == "forbidden"
        finally:
            for c in (rank, dec, forger):
                await c.close()
            await server.stop()

    run(body)


def test_a_forged_prefill_register_does_not_fail_in_flight_requests() -> None:
    async def body() -> None:
        server = await start_pod()
        rank, dec = await ready(server.endpoint)
        forger = BootstrapClient(server.endpoint, Codec(SECRET, "decode-pod-with-the-secret"))
        try:
            await dec.call(transfer_request("r1"), timeout_s=5)
            said = await attempt(forger.call(prefill_register(S1, 0, 0, name="forged-engine"), timeout_s=5))
            reply = (await dec.call(QUERY, timeout_s=5)).body
            assert isinstance(reply, StatusReply)
            assert [r.failure for r in reply.reports] == [], f"in-flight request failed by a forgery ({said})"
            assert said == "forbidden"
        finally:
            for c in (rank, dec, forger):
                await c.close()
            await server.stop()

    run(body)


class Recorder:
    """A TCP proxy in front of a pod that keeps every request's bytes (what an on-path observer sees)."""

    def __init__(self, target: Endpoint) -> None:
        self.target, self.requests = target, []  # type: ignore[var-annotated]
        self._server: asyncio.Server | None = None

    async def start(self) -> Endpoint:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        return Endpoint("127.0.0.1", self._server.sockets[0].getsockname()[1])

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self.target.host, self.target.port)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bool) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(1 << 16):
                    if keep:
                        self.requests.append(data)
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_w, True), copy(up_r, writer, False))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


async def replay(ep: Endpoint, request: bytes) -> int:
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    writer.write(request)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    writer.close()
    return status


async def captured_transfer_request(ep: Endpoint) -> bytes:
    """A decode's TransferRequest to the pod at ``ep``, as it went over the wire (through a recorder)."""
    rec = Recorder(ep)
    via = await rec.start()
    dec = BootstrapClient(via, Codec(SECRET, "dec-0-0"))
    try:
        await dec.call(HELLO, timeout_s=5)
        await dec.call(decode_register(S1, 0, 0), timeout_s=5)
        await dec.call(transfer_request("r1"), timeout_s=5)
    finally:
        await dec.close()
        await rec.stop()
    [request] = [r for r in rec.requests if b'"transfer_request"' in r]
    return request


def test_a_message_captured_on_the_way_to_one_prefill_pod_is_refused_by_another() -> None:
    async def body() -> None:
        a, b = await start_pod("prefill-a"), await start_pod("prefill-b")
        rank_a, dec_a = await ready(a.endpoint)
        rank_b, dec_b = await ready(b.endpoint)  # the same decode rank is registered with both pods
        try:
            request = await captured_transfer_request(a.endpoint)
            assert len(a.state.pending) == 1
            status = await replay(b.endpoint, request)
            assert len(b.state.pending) == 0, f"pod b took a request the decode sent to pod a (HTTP {status})"
            assert status == 421
        finally:
            for c in (rank_a, dec_a, rank_b, dec_b):
                await c.close()
            await a.stop()
            await b.stop()

    run(body)


def test_a_message_captured_before_a_restart_is_refused_by_the_new_incarnation() -> None:
    async def body() -> None:
        old = await start_pod("prefill-0")
        rank, dec = await ready(old.endpoint)
        request = await captured_transfer_request(old.endpoint)
        port = old.port
        for c in (rank, dec):
            await c.close()
        await old.stop()
        new = await start_pod("prefill-0", port=port)  # same name, same address: a restarted pod
        rank, dec = await ready(new.endpoint)
        try:
            status = await replay(new.endpoint, request)
            assert len(new.state.pending) == 0, f"the restarted pod took a replayed request (HTTP {status})"
            assert status == 421
        finally:
            for c in (rank, dec):
                await c.close()
            await new.stop()

    run(body)


@pytest.mark.parametrize("body_kind", ["poll", "register", "reports"])
def test_the_pods_own_rank_is_still_heard(body_kind: str) -> None:
    """The rank key and loopback let the pod's rank through for each rank-only message."""
    async def body() -> None:
        server = await start_pod()
        rank, dec = await ready(server.endpoint)
        try:
            await dec.call(transfer_request("r1"), timeout_s=5)
            report = StatusReport(request_id="r1", instance="dec", src=RankKey(tp=0, pp=0), dst=RankKey(tp=0, pp=0),
                                  state=RequestState.SUCCESS)
            msg = {"poll": PrefillPoll(rank=RankKey(tp=0, pp=0), ack=0), "register": prefill_register(S1, 0, 0),
                   "reports": StatusReports(reports=(report,))}[body_kind]
            assert await attempt(rank.call(msg, timeout_s=5)) == "ok"
        finally:
            for c in (rank, dec):
                await c.close()
            await server.stop()

    run(body)
