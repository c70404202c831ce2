"""A kept-alive connection's next request survives a stalled server loop (``http_guard``).

Seen in a full CI run: four chat completions through the router front failed at once with a connection
error. A front whose loop stalled past ``idle_s`` (a loaded host) ran the idle deadline of each kept-alive
connection before the handler of the request that had meanwhile arrived on it, and aborted the
connection under the request. The first bytes of a request now start its own deadline; a connection
that stays silent, or whose headers never end, is still closed.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from pdfleet_runtime.protocol.http_guard import GuardedServer, HttpLimits

LIMITS = HttpLimits(per_peer=8, idle_s=0.5, read_s=0.5, exempt_loopback=False)
REQUEST = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"


async def _serve() -> tuple[GuardedServer, asyncio.Server, web.AppRunner]:
    guard: GuardedServer | None = None

    async def ping(request: web.Request) -> web.Response:
        assert guard is not None
        with guard.busy(request.transport):
            return web.Response(text="pong")

    app = web.Application()
    app.router.add_get("/ping", ping)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=LIMITS.idle_s)
    await runner.setup()
    assert runner.server is not None
    guard = GuardedServer(runner.server, LIMITS)
    server = await asyncio.get_running_loop().create_server(guard, "127.0.0.1", 0)
    return guard, server, runner


async def _answer(r: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return head.split(b" ")[1] + b" " + await asyncio.wait_for(r.readexactly(length), 2)


def test_a_request_that_arrived_while_the_loop_stalled_is_answered_not_reset() -> None:
    async def main() -> None:
        guard, server, runner = await _serve()
        port = server.sockets[0].getsockname()[1]
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(REQUEST)
            assert await _answer(r) == b"200 pong"
            await asyncio.sleep(0.3)  # kept alive, inside the idle deadline: the client rightly reuses it
            w.write(REQUEST)  # on the wire at once; then the whole loop (the server's too) stalls past idle_s
            time.sleep(0.8)
            assert await _answer(r) == b"200 pong"
            assert guard.idle_closed == 0
            w.close()
        finally:
            server.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_silent_and_trickling_connections_are_still_closed_within_two_deadlines() -> None:
    async def main() -> None:
        guard, server, runner = await _serve()
        port = server.sockets[0].getsockname()[1]
        try:
            silent = await asyncio.open_connection("127.0.0.1", port)
            trickle = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            for part in (b"GET /ping HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: 1\r\n", b"X-B: 2\r\n", b"X-C: 3\r\n"):
                trickle[1].write(part)  # a byte every 0.3 s: the headers never end
                await asyncio.sleep(0.3)
                if trickle[0].at_eof():
                    break
            assert await asyncio.wait_for(silent[0].read(), 2) == b""
            assert await asyncio.wait_for(trickle[0].read(), 2) == b""
            assert time.monotonic() - t0 < 2 * LIMITS.idle_s + 0.5
            assert guard.connections == 0  # closed by the guard or aiohttp's keep-alive timer (both at idle_s)
        finally:
            server.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 20))
