"""Issue 25 item 5: the bootstrap's HTTP server under unauthenticated load.

The issue measured 40 unauthenticated 4 MiB posts plus 60 half-sent bodies taking a bootstrap from
61 to 309 MiB: bodies were read whole before any signature was checked, with no read timeout and
no connection cap. Here the same attack runs against a bootstrap in its own process (its memory is
read from /proc) while an honest decode rank handshakes; then, in process, the per-peer cap, the
idle deadline (headers that never finish) and the body deadline (a key holder's half-sent body).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path

import aiohttp

from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import MESSAGES_PATH, BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.client import BootstrapClient
from pdfleet_runtime.protocol.discovery import Endpoint
from pdfleet_runtime.protocol.messages import WIRE, Hello, Role
from pdfleet_runtime.records import ParallelShape
from tests.unit.protocol.helpers import SECRET

HELLO = Hello(role=Role.DECODE, runtime_version="0.1.0", wire=str(WIRE), instance="dec")
BODY = 4 << 20


def _serve(conn: Connection) -> None:
    async def main() -> None:
        server = BootstrapServer(BootstrapState(ParallelShape(1, 1)), Codec(SECRET, "pod"))
        ep = await server.start()
        conn.send(ep.port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until the test says stop
        await server.stop()

    asyncio.run(main())


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _head(port: int, length: int) -> bytes:
    return (f"POST {MESSAGES_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nX-Pdfleet-Signature: {'0' * 64}\r\n\r\n").encode()


async def _post(port: int, send: int, hold: list[asyncio.StreamWriter]) -> None:
    """An unauthenticated post declaring 4 MiB and sending ``send`` bytes of it; the connection is kept."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    hold.append(writer)
    with contextlib.suppress(ConnectionError):
        writer.write(_head(port, BODY))
        for off in range(0, send, 1 << 18):
            writer.write(b"x" * min(1 << 18, send - off))
            await writer.drain()


async def _honest(port: int) -> float:
    client = BootstrapClient(Endpoint("127.0.0.1", port), Codec(SECRET, "dec-0-0"))
    try:
        t0 = time.monotonic()
        reply = await client.call(HELLO, timeout_s=10)
        assert reply.body.type == "welcome"
        return time.monotonic() - t0
    finally:
        await client.close()


def test_unauthenticated_large_and_half_sent_posts_neither_grow_memory_nor_block_an_honest_rank() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(30), "bootstrap did not start"
        port = parent.recv()

        async def attack() -> tuple[float, float, float]:
            await _honest(port)  # warm: the first message's imports and caches are not the attack's
            base = _rss_mib(proc.pid)
            hold: list[asyncio.StreamWriter] = []
            try:
                await asyncio.gather(*(_post(port, BODY, hold) for _ in range(40)),
                                     *(_post(port, BODY // 2, hold) for _ in range(60)))
                await asyncio.sleep(0.5)
                during = await _honest(port)
                peak = _rss_mib(proc.pid)
            finally:
                for w in hold:
                    w.close()
            return base, peak, during

        base, peak, latency = asyncio.run(asyncio.wait_for(attack(), 120))
        print(f"bootstrap RSS {base:.0f} MiB before, {peak:.0f} MiB with 40 x 4 MiB unauthenticated posts and 60 "
              f"half-sent bodies open; an honest Hello took {latency * 1000:.1f} ms")
        assert peak - base < 48, f"RSS grew from {base:.0f} to {peak:.0f} MiB"
        assert latency < 2.0
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_per_peer_cap_idle_deadline_and_body_deadline() -> None:
    from pdfleet_runtime.protocol.auth import AUTH_HEADER, SIGNATURE_HEADER
    from pdfleet_runtime.protocol.http_guard import HttpLimits

    async def main() -> None:
        limits = HttpLimits(per_peer=8, idle_s=1.0, read_s=1.0, exempt_loopback=False)
        server = BootstrapServer(BootstrapState(ParallelShape(1, 1)), Codec(SECRET, "pod"), http=limits)
        ep = await server.start()
        assert server.guard is not None
        conns = []
        try:
            for _ in range(20):  # connect and say nothing (or trickle headers that never end)
                r, w = await asyncio.open_connection("127.0.0.1", ep.port)
                w.write(b"POST /v1/messages HTTP/1.1\r\n")
                conns.append((r, w))
            await asyncio.sleep(0.2)
            assert server.guard.connections == 8 and server.guard.refused == 12
            # An honest rank from another address is not blocked by this peer's connections.
            signer = Codec(SECRET, "dec-0-0")
            raw, headers, _ = signer.seal_http(HELLO)
            connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=connector) as s, \
                    s.post(ep.url(MESSAGES_PATH), data=raw, headers=headers) as resp:
                assert resp.status == 200
            await asyncio.sleep(1.5)  # the idle deadline cuts the silent connections (the guard's or aiohttp's
            for r, _ in conns[:8]:  # keep-alive timer, both at idle_s: whichever runs first)
                assert await asyncio.wait_for(r.read(), 1) == b""
            assert server.guard.idle_closed >= 1
            # A key holder's body that stops half way is cut at the body deadline, not waited on.
            raw, headers, _ = signer.seal_http(HELLO)
            r, w = await asyncio.open_connection(ep.host, ep.port, local_addr=("127.0.0.3", 0))
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            w.write(f"POST {MESSAGES_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n{head}\r\n".encode()
                    + raw[: len(raw) // 2])
            t0 = time.monotonic()
            status = (await asyncio.wait_for(r.readline(), 5)).split()[1]
            assert status == b"400" and 0.8 < time.monotonic() - t0 < 3.0
            assert headers[SIGNATURE_HEADER] and headers[AUTH_HEADER]
        finally:
            for _, w in conns:
                w.close()
            await server.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_unsigned_oversized_and_chunked_posts_are_refused_before_the_body() -> None:
    """Issue 39 held, kept as a regression test: the bootstrap refuses an unsigned post (401), an oversized one
    (413, its body never read: the answer comes while the body is still unsent) and a chunked one (400)."""
    async def main() -> list[tuple[bytes, float]]:
        server = BootstrapServer(BootstrapState(ParallelShape(1, 1)), Codec(SECRET, "pod"))
        ep = await server.start()
        out = []
        try:
            for head in (
                f"POST {MESSAGES_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 17\r\n\r\n",  # no signature at all: 17 bytes follow
                f"POST {MESSAGES_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {5 << 20}\r\n"
                f"X-Pdfleet-Signature: {'0' * 64}\r\n\r\n",  # 5 MiB declared, none sent
                f"POST {MESSAGES_PATH} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                f"X-Pdfleet-Signature: {'0' * 64}\r\n\r\n",
            ):
                reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
                writer.write(head.encode() + (b'{"type": "hello"}' if "Length: 17" in head else b""))
                await writer.drain()
                t0 = time.monotonic()
                status = (await asyncio.wait_for(reader.readline(), 5)).split()[1]
                out.append((status, time.monotonic() - t0))
                writer.close()
        finally:
            await server.stop()
        return out

    got = asyncio.run(main())
    assert [s for s, _ in got] == [b"401", b"413", b"400"], got
    assert all(t < 1.0 for _, t in got), got
