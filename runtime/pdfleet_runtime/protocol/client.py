"""The client side of the bootstrap endpoint: one signed request, one signed reply, typed errors.

Replies are authenticated like requests (same secret) and must answer this request's nonce, so a
rogue or replayed reply is refused. A ``Refusal`` becomes ``ProtocolError`` with its code; a
connection failure or timeout becomes ``BootstrapUnreachable``. The reply's ``boot`` id is
returned so callers notice a prefill pod that restarted at the same address.
"""

from __future__ import annotations

import aiohttp

from .auth import SIGNATURE_HEADER, Codec, ProtocolError
from .bootstrap import MESSAGES_PATH
from .discovery import Endpoint
from .messages import Body, Refusal, RefusalCode

__all__ = ["BootstrapClient", "BootstrapUnreachable", "Reply"]


class BootstrapUnreachable(ConnectionError):
    """The bootstrap endpoint did not answer (refused, reset, timed out). ``connect_failed``: no connection
    was made, so the message never reached the pod (a reset or a timeout may come after it did)."""

    def __init__(self, message: str, *, connect_failed: bool = False) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed


class Reply:
    __slots__ = ("body", "boot")

    def __init__(self, body: Body, boot: str) -> None:
        self.body, self.boot = body, boot


class BootstrapClient:
    """Talks to one prefill pod's bootstrap endpoint over one aiohttp session (created lazily, in the loop)."""

    def __init__(self, endpoint: Endpoint, codec: Codec) -> None:
        self.endpoint, self.codec = endpoint, codec
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, body: Body, *, timeout_s: float) -> Reply:
        """Send ``body``; the authenticated reply, or ``ProtocolError`` / ``BootstrapUnreachable``."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64, force_close=False))
        raw, sig, nonce = self.codec.seal(body)
        try:
            async with self._session.post(
                self.endpoint.url(MESSAGES_PATH), data=raw,
                headers={SIGNATURE_HEADER: sig, "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                data = await resp.read()
                reply_sig = resp.headers.get(SIGNATURE_HEADER)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise BootstrapUnreachable(f"bootstrap {self.endpoint} unreachable: {type(e).__name__}: {e}",
                                       connect_failed=isinstance(e, aiohttp.ClientConnectorError)) from e
        try:
            opened = self.codec.open(data, reply_sig, reply_to=nonce)
        except ProtocolError as e:
            if status != 200 and e.code is RefusalCode.REPLAYED:  # a refusal of an unopened request has no reply_to
                opened = self.codec.open(data, reply_sig)
            else:
                raise ProtocolError(e.code, f"reply from {self.endpoint} (HTTP {status}) refused: {e.reason}") from None
        if isinstance(opened.body, Refusal):
            raise ProtocolError(opened.body.code, opened.body.reason)
        return Reply(opened.body, opened.envelope.boot)
