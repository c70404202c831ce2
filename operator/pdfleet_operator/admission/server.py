"""kopf's ``WebhookServer`` with pdfleet's request handling in front.

kopf's own request path answers 400 on bad JSON and can answer 500 on wrong types, and runs the
whole handler machinery (memos, diffs, per-handler logging) for each request. This subclass keeps
kopf's listener, TLS set-up, certificate reloading and the managed configuration (so the URL and
CA bundle kopf publishes stay right), and replaces only ``_serve``:

- a route table maps webhook ids (the last URL segment, which kopf appends to the URL it publishes)
  to pure ``bytes -> AdmissionReview`` functions (``review.review``); ids of other kopf webhook
  handlers are passed to kopf's function, with every failure turned into a denial;
- the body is read with a size limit of our own, so a huge request gets a denial, not a 413;
- the whole body is read first, within ``read_s`` (a slow sender is denied and cut at that deadline),
  and only then does a large one wait for a turn: a sender trickling bytes holds only its own
  connection, never a turn another review needs (issue 39: two slow senders made a normal large
  review wait 5 s for a 429). Bodies being read or waiting are bounded in bytes (``buffer_bytes``,
  counted as they arrive; past it a request is denied 429);
- requests larger than ``inline_bytes`` are judged at most ``max_concurrent`` at a time (others wait
  up to ``wait_s``, then get a denial), so a burst of large bodies cannot take the operator past its
  memory limit: the webhook is ``failurePolicy: Fail``, an OOM-killed operator blocks every
  PDDeployment write;
- every answer is HTTP 200 with a well-formed AdmissionReview, whatever came in;
- on stop it drains (``draining``, set by the admission process for ``drain_s``): it still answers, and
  closes each connection after its answer, so the apiserver retires its kept-alive connections one use at a
  time instead of meeting one closed under a review it just sent;
- the listener runs on a thread with its own event loop, so a review never waits behind the watch
  events and reconcile passes of kopf's loop (a fleet of a thousand pods kept it busy enough to
  triple the p99); only delegated ids hop back to kopf's loop, where its handler machinery lives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import json
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from pdfleet_operator.admission.lingering import answer_and_close
from pdfleet_operator.admission.review import deny, response_problems, scan_uid
from pdfleet_operator.settings import AdmissionSettings, WebhookMode

__all__ = ["AdmissionServer", "Route", "WebhookSetupError", "build_server", "server_kwargs"]

Route = Callable[[bytes], dict[str, Any]]
_CHUNK = 1 << 16
# A review waking on the webhook's thread waits for the GIL at most this long (CPython's default
# is 5 ms, paid at every wake-up of a request while kopf's thread runs Python).
_SWITCH_INTERVAL_S = 1e-3
_STOP_S = 10.0
_KOPF_SERVE = kopf.WebhookServer.__call__.__wrapped__  # type: ignore[attr-defined]


class _TooLarge(Exception):
    def __init__(self, prefix: bytes) -> None:
        super().__init__("request body too large")
        self.prefix = prefix


class _Slow(Exception):
    """The body did not arrive within the read deadline."""

    def __init__(self, message: str, prefix: bytes) -> None:
        super().__init__(message)
        self.prefix = prefix


class _Busy(Exception):
    """No turn for a large request within the wait, or no room in the body budget."""

    def __init__(self, message: str, prefix: bytes) -> None:
        super().__init__(message)
        self.prefix = prefix


class AdmissionServer(kopf.WebhookServer):
    """A kopf WebhookServer whose requests go to pure review functions by webhook id.

    ``routes``: webhook id -> pure function; ``delegate``: ids left to kopf's handler machinery;
    ``inline_bytes``: bodies up to this size are judged on the webhook's loop (they take well under a
    millisecond), larger ones in a worker thread, ``max_concurrent`` at a time.
    """

    def __init__(
        self,
        *,
        routes: Mapping[str, Route],
        delegate: Collection[str] = (),
        max_body_bytes: int = 4 << 20,
        inline_bytes: int = 256 << 10,
        max_concurrent: int = 2,
        wait_s: float = 5.0,
        read_s: float = 3.0,
        buffer_bytes: int = 64 << 20,
        drain_s: float = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.routes = dict(routes)
        self.delegate = frozenset(delegate)
        self.max_body_bytes = max_body_bytes
        self.inline_bytes = inline_bytes
        self.wait_s = wait_s
        self.read_s = read_s
        self.buffer_bytes = buffer_bytes
        self.drain_s = drain_s
        self.draining = False
        """Set on stop: every answer closes its connection (read on the webhook's loop, set from any thread)."""
        self.buffered = 0
        """Bytes of request bodies read and not yet answered (the webhook's loop only)."""
        self._large = asyncio.Semaphore(max_concurrent)  # bound to the webhook's loop at first use

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        """kopf's server loop (TLS, certificate reloads, client configs) on a thread of its own;
        client configs come back to kopf's loop, and kopf's ``fn`` is run there."""
        kopf_loop = asyncio.get_running_loop()

        async def on_kopf_loop(data: Any, **kwargs: Any) -> Any:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(data, **kwargs), kopf_loop))

        configs: asyncio.Queue[Any] = asyncio.Queue()
        stopped = threading.Event()

        async def serve() -> None:
            try:
                # kopf's unwrapped generator: its wrapper would record it for ``async with server``
                # to close from kopf's loop, while it runs on this one (it closes with this task).
                async for config in _KOPF_SERVE(self, on_kopf_loop):
                    kopf_loop.call_soon_threadsafe(configs.put_nowait, config)
            finally:  # kopf's generator has closed its listener by now
                stopped.set()

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="pdfleet-admission", daemon=True)
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
        thread.start()
        task = asyncio.run_coroutine_threadsafe(serve(), loop)
        task.add_done_callback(lambda done: kopf_loop.call_soon_threadsafe(configs.put_nowait, done))
        try:
            while not isinstance(item := await configs.get(), concurrent.futures.Future):
                yield item
            item.result()  # the listener's failure (a port in use, bad certificates) raised on kopf's loop
        finally:
            task.cancel()
            await asyncio.shield(asyncio.to_thread(_stop, loop, thread, stopped))

    async def _serve(  # type: ignore[override]  # kopf declares it static; an instance method reads settings
        self, fn: Any, request: aiohttp.web.Request
    ) -> aiohttp.web.Response:
        webhook = request.match_info.get("id", "")
        turn: asyncio.Semaphore | None = None
        parts: list[bytes] = []
        cut = False  # the body was not read to its end: the connection is closed, never drained
        try:
            await self._read_all(request, parts)
            body = b"".join(parts)
            if len(body) > self.inline_bytes:  # a large request is judged only with a turn
                turn = await self._turn(parts)
            resp = await self._answer(fn, webhook, body, request)
        except _TooLarge as exc:
            cut = True
            resp = deny(f"the request exceeds {self.max_body_bytes} bytes", scan_uid(exc.prefix), code=413)
        except _Slow as exc:
            cut = True
            resp = deny(str(exc), scan_uid(exc.prefix), code=408)
        except _Busy as exc:
            cut = True
            resp = deny(str(exc), scan_uid(exc.prefix), code=429)
        except Exception as exc:  # a broken stream: still an answer (CancelledError is not an Exception)
            cut = True
            resp = deny(f"the request body could not be read: {type(exc).__name__}: {exc}")
        finally:
            self.buffered -= sum(map(len, parts))
            if turn is not None:
                turn.release()
        out = aiohttp.web.Response(body=json.dumps(resp).encode(), content_type="application/json")
        if cut:  # answered now; what the sender still sends is dropped for a second, then the connection closed
            return await answer_and_close(request, out)
        if self.draining:
            out.force_close()
        return out

    async def _read_all(self, request: aiohttp.web.Request, parts: list[bytes]) -> None:
        """The whole body into ``parts`` within ``read_s``, each chunk counted in ``buffered`` as it comes
        (the caller gives it back); ``_Slow``, ``_TooLarge`` or ``_Busy`` (the body budget is spent)."""
        if (request.content_length or 0) > self.max_body_bytes:  # denied on its first chunk (the uid is there)
            prefix = b""
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(1.0, self.read_s)):
                    prefix = await request.content.read(_CHUNK)
            raise _TooLarge(prefix)
        try:
            async with asyncio.timeout(self.read_s):
                size = 0
                while chunk := await request.content.read(_CHUNK):
                    parts.append(chunk)
                    size += len(chunk)
                    self.buffered += len(chunk)
                    if size > self.max_body_bytes:
                        raise _TooLarge(b"".join(parts[:2]))
                    if self.buffered > self.buffer_bytes and size > self.inline_bytes:
                        raise _Busy(f"the webhook holds {self.buffered} bytes of request bodies (limit "
                                    f"{self.buffer_bytes}); retry", b"".join(parts[:2]))
        except TimeoutError:
            raise _Slow(f"the request body did not arrive within {self.read_s:g}s ({sum(map(len, parts))} bytes "
                        "came)", b"".join(parts[:2])) from None

    async def _turn(self, parts: list[bytes]) -> asyncio.Semaphore:
        try:
            await asyncio.wait_for(self._large.acquire(), self.wait_s)
        except TimeoutError:
            raise _Busy(f"the webhook is judging other large requests; none finished within {self.wait_s:g}s "
                        "(retry; large requests are judged a few at a time)", b"".join(parts[:2])) from None
        return self._large

    async def _answer(
        self, fn: Any, webhook: str, body: bytes, request: aiohttp.web.Request
    ) -> dict[str, Any]:
        route = self.routes.get(webhook)
        if route is not None:
            if len(body) <= self.inline_bytes:
                return route(body)
            return await asyncio.to_thread(route, body)
        if webhook in self.delegate:
            return await self._delegate(fn, webhook, body, request)
        known = ", ".join(sorted({*self.routes, *self.delegate})) or "none"
        return deny(f"no webhook is served at /{webhook}; known: {known}", scan_uid(body), code=404)

    @staticmethod
    async def _delegate(fn: Any, webhook: str, body: bytes, request: aiohttp.web.Request) -> dict[str, Any]:
        """kopf's own machinery for other handlers, with its exceptions and odd answers made denials."""
        uid = scan_uid(body)
        try:
            data = json.loads(body)
            peer = request.transport.get_extra_info("peercert") if request.transport else None
            resp = await fn(data, webhook=webhook, sslpeer=peer, headers=dict(request.headers))
        except Exception as exc:  # never a 500 to the apiserver
            return deny(f"webhook {webhook} failed: {type(exc).__name__}: {exc}", uid)
        if response_problems(resp):
            return deny(f"webhook {webhook} gave a malformed answer: {response_problems(resp)}", uid)
        return dict(resp)


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, stopped: threading.Event) -> None:
    """Wait for the listener to close, then end the webhook's loop and thread."""
    stopped.wait(_STOP_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(_STOP_S)
    if not thread.is_alive():
        loop.close()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def build_server(settings: AdmissionSettings, routes: Mapping[str, Route], delegate: Collection[str] = ()) -> (
    AdmissionServer
):
    """The server for ``serve`` (certificate files from a mounted Secret) or ``dev`` (a throw-away CA)."""
    return AdmissionServer(routes=routes, delegate=delegate, **server_kwargs(settings))


def server_kwargs(settings: AdmissionSettings) -> dict[str, Any]:
    """``AdmissionServer``'s arguments but the routes, plain values only (the admission process gets
    them as JSON): the limits, the listener and the certificate files, checked (serve) or issued (dev)."""
    common: dict[str, Any] = {
        "max_body_bytes": settings.max_body_bytes,
        "inline_bytes": settings.inline_body_bytes,
        "max_concurrent": settings.max_concurrent_reviews,
        "wait_s": settings.review_wait_seconds,
        "read_s": settings.body_read_seconds,
        "buffer_bytes": settings.body_buffer_bytes,
        "drain_s": settings.drain_seconds,
        "addr": settings.host,
        "port": settings.port or None,
        "path": settings.path or None,
    }
    if settings.mode is WebhookMode.SERVE:
        if settings.cert_dir is None:
            raise WebhookSetupError("--webhook-listen needs --webhook-cert-dir with tls.crt and tls.key")
        cert, key = settings.cert_dir / "tls.crt", settings.cert_dir / "tls.key"
        missing = [str(p) for p in (cert, key) if not p.is_file()]
        if missing:
            raise WebhookSetupError(f"webhook certificate files missing: {', '.join(missing)}")
        ca = settings.cert_dir / "ca.crt"
        return {"certfile": str(cert), "pkeyfile": str(key), "cafile": str(ca) if ca.is_file() else None, **common}
    if settings.mode is WebhookMode.DEV:
        from pdfleet_operator.certs import CertificateAuthority

        directory = settings.cert_dir or Path(tempfile.mkdtemp(prefix="pdfleet-webhook-"))
        host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        ca = CertificateAuthority(directory, name="pdfleet-dev-webhook-ca")
        pair = ca.issue(
            "webhook",
            common_name=host,
            ips=tuple({host, "127.0.0.1"}) if _is_ip(host) else ("127.0.0.1",),
            dns=("localhost",) if _is_ip(host) else (host, "localhost"),
        )
        return {"certfile": str(pair.cert_path), "pkeyfile": str(pair.key_path), "cafile": str(ca.cert_path),
                "host": host, **common}
    raise WebhookSetupError(f"no webhook server in mode {settings.mode}")


class WebhookSetupError(RuntimeError):
    """The webhook cannot start as configured; the message names the missing piece."""
