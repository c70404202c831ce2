"""The client side of the bootstrap endpoint: one signed request, one signed reply, typed errors.

Replies are authenticated like requests (same secret) and must answer this request's nonce, so a
rogue or replayed reply is refused. Every message names its recipient (``Envelope.to``): the pod
and incarnation this client learnt from its first reply (a ``Hello``'s ``Welcome``, or the pod's
``wrong_recipient`` refusal of a first message sent unaddressed, which is then sent again,
addressed). Once learnt it is kept: a pod that restarted refuses what is addressed to its
predecessor, and that refusal reaches the caller (``wrong_recipient``). A ``Refusal`` becomes ``ProtocolError`` with its code; a
connection failure or timeout becomes ``BootstrapUnreachable``. The reply's ``boot`` id is
returned so callers notice a prefill pod that restarted at the same address.
"""

from __future__ import annotations

import aiohttp

from .auth import SIGNATURE_HEADER, Codec, Opened, ProtocolError
from .bootstrap import MESSAGES_PATH
from .discovery import Endpoint
from .messages import Body, Recipient, Refusal, RefusalCode

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
        self.recipient: Recipient | None = None
        """The pod (name and incarnation) this client's messages are addressed to, once learnt."""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, body: Body, *, timeout_s: float) -> Reply:
        """Send ``body``; the authenticated reply, or ``ProtocolError`` / ``BootstrapUnreachable``."""
        first = self.recipient is None
        opened = await self._send(body, timeout_s)
        if first and self.recipient is None:
            self.recipient = Recipient(name=opened.envelope.sender, boot=opened.envelope.boot)
            if isinstance(opened.body, Refusal) and opened.body.code is RefusalCode.WRONG_RECIPIENT:
                opened = await self._send(body, timeout_s)  # refused unread: now addressed
        if isinstance(opened.body, Refusal):
            raise ProtocolError(opened.body.code, opened.body.reason)
        return Reply(opened.body, opened.envelope.boot)

    async def _send(self, body: Body, timeout_s: float) -> Opened:
        if self._session is None:
            # Idle connections are dropped before the bootstrap's own idle deadline (10 s) would cut them.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64, force_close=False,
                                                                                  keepalive_timeout=5.0))
        raw, headers, nonce = self.codec.seal_http(body, to=self.recipient)
        try:
            async with self._session.post(self.endpoint.url(MESSAGES_PATH), data=raw, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                data = await resp.read()
                reply_sig = resp.headers.get(SIGNATURE_HEADER)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise BootstrapUnreachable(f"bootstrap {self.endpoint} unreachable: {type(e).__name__}: {e}",
                                       connect_failed=isinstance(e, aiohttp.ClientConnectorError)) from e
        try:
            return self.codec.open(data, reply_sig, reply_to=nonce)
        except ProtocolError as e:
            if status != 200 and e.code is RefusalCode.REPLAYED:  # a refusal of an unopened request has no reply_to
                return self.codec.open(data, reply_sig)
            raise ProtocolError(e.code, f"reply from {self.endpoint} (HTTP {status}) refused: {e.reason}") from None
