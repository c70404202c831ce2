"""A peer refused before its body was read (401, 413) gets the answer even if it keeps sending: the port reads
and drops the rest for ``HttpLimits.linger_s`` before it closes (aiohttp's ``lingering_time``). Closed at once
(``lingering_time=0``, as before), the peer's next bytes made the kernel reset the connection: a client that
sends its whole body before reading (``requests``, ``http.client``) got ``BrokenPipeError``, never the answer."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import MESSAGES_PATH, BootstrapServer, BootstrapState
from pdfleet_runtime.protocol.http_guard import HttpLimits
from pdfleet_runtime.records import ParallelShape
from tests.unit.protocol.helpers import SECRET


def _refused_then_writing(port: int, head: str) -> tuple[bytes, float]:
    """A blocking client as most are (``http.client``, ``requests``): it sends its body in pieces and reads the
    answer only once the body is sent; the refusal came after its first piece."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head.encode() + b"x" * 1000)
        t0 = time.monotonic()
        try:
            for _ in range(2):
                time.sleep(0.2)  # the refusal is here by now
                s.sendall(b"y" * 4096)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        except OSError as e:  # closed at once, the port's reset ends the client with BrokenPipeError
            answer = f"<{type(e).__name__}>".encode()
        return answer, time.monotonic() - t0


@pytest.mark.parametrize(("head", "status"), [
    (f"POST {MESSAGES_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {1 << 20}"
     "\r\n\r\n", b"401"),  # unsigned
    (f"POST {MESSAGES_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {5 << 20}\r\nX-Pdfleet-Signature: {'0' * 64}"
     "\r\n\r\n", b"413"),  # larger than any message
], ids=["unsigned", "oversized"])
def test_a_refused_peer_still_sending_reads_its_answer(head: str, status: bytes) -> None:
    async def main() -> list[tuple[bytes, float]]:
        server = BootstrapServer(BootstrapState(ParallelShape(1, 1)), Codec(SECRET, "pod"),
                                 http=HttpLimits(exempt_loopback=False, linger_s=1.0))
        ep = await server.start()
        try:
            return await asyncio.gather(*[asyncio.to_thread(_refused_then_writing, ep.port, head) for _ in range(8)])
        finally:
            await server.stop()

    results = asyncio.run(asyncio.wait_for(main(), 60))
    lost = [a[-40:] for a, _ in results if not a.startswith(b"HTTP/1.1 " + status)]
    assert not lost, f"{len(lost)} of 8 refused peers lost their answer: {lost[:3]}"
    assert max(took for _, took in results) < 1.0 + 1.5  # the linger is bounded: then the connection closes
