"""Connection bounds for the bootstrap's HTTP server: a per-peer and total connection cap, and an idle deadline.

aiohttp reads request headers before any handler runs and keeps idle keep-alive connections for an
hour by default; neither has a bound an unauthenticated peer cannot stretch. ``GuardedServer`` wraps
aiohttp's protocol factory: a connection beyond ``per_peer`` from one address (or ``total``) is
closed at accept, and a connection that spends ``idle_s`` outside a handler (headers trickling in,
or kept alive with nothing to say) is closed. A handler marks its connection busy (``busy``) while
it runs; a long poll is busy, so it is never cut. Body reads inside a handler have their own
deadline (``BootstrapServer``).

A request's first bytes after an idle stretch start its own ``idle_s`` for the rest of its headers (once
per request, so trickling cannot stretch it further). Without that, a server whose loop stalled a few
seconds (a loaded host) ran the idle deadline of a kept-alive connection before the handler of the
request that had meanwhile arrived on it, and reset a request the client had rightly sent.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["GuardedServer", "HttpLimits", "is_loopback"]


@dataclass(frozen=True)
class HttpLimits:
    """Bounds per bootstrap HTTP server. ``per_peer`` fits a TP 8 decode pod with 64 connections per rank;
    ``exempt_loopback``: the pod's own ranks (and, on a dev machine, every local pod) are not capped."""

    per_peer: int = 512
    total: int = 8192
    idle_s: float = 10.0
    """Longest a connection may spend outside a handler: sending its headers, or idle between requests."""
    read_s: float = 10.0
    """Longest a handler waits for a request's body once its headers were authenticated."""
    linger_s: float = 1.0
    """How long the rest of a body left unread (a refusal: 401, 408, 413) is read and dropped after the
    answer, before the connection is closed (aiohttp's ``lingering_time``). Closing at once, with the
    peer's bytes unread, makes the kernel send a reset that can take the answer with it (RFC 9112 9.6)."""
    exempt_loopback: bool = True


class _Guarded(asyncio.Protocol):
    """Forwards to aiohttp's handler; counts the peer and enforces the idle deadline."""

    def __init__(self, guard: GuardedServer, inner: Any) -> None:
        self._guard, self._inner = guard, inner
        self._peer: str | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._between = True  # no byte of a request yet since the last arming

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer = transport.get_extra_info("peername")
        self._peer, self._transport = (str(peer[0]) if peer else "?"), transport
        if not self._guard._admit(self._peer):
            self._guard.refused += 1
            transport.abort()
            return
        self._counted = True
        self._guard.accepted_at = time.monotonic()
        self._guard._conns[transport] = self
        self._arm(between=True)
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._counted:
            return
        self._counted = False
        self._disarm()
        assert self._transport is not None and self._peer is not None
        self._guard._conns.pop(self._transport, None)
        self._guard._release(self._peer)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if self._between and self._timer is not None:  # a request begins: its headers get their own deadline
            self._arm()
            self._between = False
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._counted else None

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _arm(self, between: bool = False) -> None:
        self._disarm()
        self._between = between
        self._timer = asyncio.get_running_loop().call_later(self._guard.limits.idle_s, self._idle)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle(self) -> None:
        self._guard.idle_closed += 1
        if self._transport is not None:
            self._transport.abort()


class GuardedServer:
    """A protocol factory around aiohttp's ``web.Server`` (``AppRunner.server``) with ``HttpLimits``."""

    def __init__(self, factory: Callable[[], Any], limits: HttpLimits) -> None:
        self._factory, self.limits = factory, limits
        self._per_peer: dict[str, int] = {}
        self._conns: dict[asyncio.BaseTransport, _Guarded] = {}
        self.refused = 0
        self.idle_closed = 0
        self.accepted_at = 0.0
        """``time.monotonic()`` of the last connection admitted (0: none yet): a draining server waits for quiet."""

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self, self._factory())

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _admit(self, peer: str) -> bool:
        if len(self._conns) >= self.limits.total:
            return False
        n = self._per_peer.get(peer, 0)
        if n >= self.limits.per_peer and not (self.limits.exempt_loopback and is_loopback(peer)):
            return False
        self._per_peer[peer] = n + 1
        return True

    def _release(self, peer: str) -> None:
        n = self._per_peer.get(peer, 1) - 1
        if n > 0:
            self._per_peer[peer] = n
        else:
            self._per_peer.pop(peer, None)

    @contextmanager
    def busy(self, transport: asyncio.BaseTransport | None) -> Iterator[None]:
        """While a handler runs on ``transport``: no idle deadline; re-armed when it returns."""
        conn = self._conns.get(transport) if transport is not None else None
        if conn is not None:
            conn._disarm()
        try:
            yield
        finally:
            if conn is not None and conn._counted:
                conn._arm(between=True)


def is_loopback(peer: str) -> bool:
    try:
        return ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except ValueError:
        return False
