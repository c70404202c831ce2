"""A loopback TCP balancer: the local cluster's STAND-IN for a Service in front of several webhook replicas.

In a real cluster the chart's webhook Service spreads the apiserver's connections over the operator
replicas, and endpoints drop a replica that stops being ready. The local cluster has no pod network the
apiserver can reach, so two operator processes listen on loopback ports and this balancer listens on one
more: each new connection goes to the next backend that accepts it (a dead replica refuses, so the next
one is tried, as endpoints without the dead pod would do). A connection whose backend dies (or closes it) ends
too, and the apiserver dials again for its next call; a call in flight at that instant fails (client-go retries
no webhook POST), as through a real Service. TLS passes through untouched (one serving certificate for both).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Sequence

__all__ = ["Balancer"]


class Balancer(threading.Thread):
    """``Balancer([port_a, port_b]).start()``; ``port`` is where it listens; ``stop()`` ends it."""

    def __init__(self, backends: Sequence[int], host: str = "127.0.0.1") -> None:
        super().__init__(daemon=True, name="webhook-balancer")
        self.backends, self.host = list(backends), host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port: int = self._sock.getsockname()[1]
        self._next = 0
        self.connections: dict[int, int] = {p: 0 for p in self.backends}  # backend port -> connections
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()

    def run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.run_until_complete(server.wait_closed())
            self._loop.close()

    def start(self) -> None:
        super().start()
        self._ready.wait(10)

    def stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self.join(timeout=10)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for _ in range(len(self.backends)):
            port = self.backends[self._next % len(self.backends)]
            self._next += 1
            try:
                pair = await asyncio.wait_for(asyncio.open_connection(self.host, port), 2.0)
            except (OSError, TimeoutError):
                continue
            self.connections[port] += 1
            return pair
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backend = await self._connect()
        if backend is None:
            _reset(writer)
            return
        b_reader, b_writer = backend
        up = asyncio.ensure_future(_pipe(reader, b_writer))
        down = asyncio.ensure_future(_pipe(b_reader, writer))
        done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        if down in done and up not in done:
            _reset(writer)  # the backend went (or closed an idle connection): a reset the caller retries
        for t in pending:
            t.cancel()
        for w in (writer, b_writer):
            with contextlib.suppress(Exception):
                w.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while chunk := await src.read(1 << 16):
            dst.write(chunk)
            await dst.drain()
    with contextlib.suppress(Exception):
        dst.write_eof()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0) rather than FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
