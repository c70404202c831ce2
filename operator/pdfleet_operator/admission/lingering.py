"""Answer a request whose body is left unread, then close its connection without losing the answer.

(The runtime's ports get the same from aiohttp's own ``lingering_time``, bounded by ``HttpLimits.linger_s``;
kopf builds the webhook's runner with a 10 s linger, too long for a refused sender, so the webhook closes
in stages here.)

A server that closes a socket with received bytes it never read makes the kernel send a reset instead
of a FIN, and the reset can take the answer with it: the peer's stack drops what it has not yet handed
to the client, and asyncio's ``StreamReader`` raises the reset before the bytes it holds (RFC 9112
section 9.6 describes the hazard). A sender still trickling its body when it is refused (408, 413, 429)
hits exactly that: seen in CI, a slow sender's 408 from the admission webhook arrived as an empty read
(``tests/unit/admission/test_lingering.py`` loses 18 of 40 such answers without it).

``answer_and_close`` closes in stages, as HTTP servers do ("lingering close"): the answer is sent
with ``Connection: close``, what the peer still sends is read and dropped for at most ``linger_s`` (or
until the peer closes, or ``max_bytes`` were dropped), and only then is the connection closed. A
sender cannot stretch it: the time and the bytes are both bounded.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

__all__ = ["LINGER_S", "answer_and_close"]

LINGER_S = 1.0
"""Long enough for an answer to reach a peer on a loaded host; short enough that a refused sender
holds its connection only this much past its refusal."""
_MAX_DROPPED = 1 << 20
_CHUNK = 1 << 16


async def answer_and_close(request: web.Request, response: web.StreamResponse, *, linger_s: float = LINGER_S,
                           max_bytes: int = _MAX_DROPPED) -> web.StreamResponse:
    """Send ``response`` (marked ``Connection: close``), drop the rest of the body for up to ``linger_s``,
    close the connection; returns ``response`` for the handler to return (aiohttp sends nothing more)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    dropped = 0
    with contextlib.suppress(TimeoutError, ConnectionError, asyncio.IncompleteReadError, web.HTTPException):
        async with asyncio.timeout(linger_s):
            while dropped < max_bytes and (chunk := await request.content.readany()):
                dropped += len(chunk)
    request.protocol.force_close()  # closes the transport, and aiohttp lingers no more on its own
    return response
