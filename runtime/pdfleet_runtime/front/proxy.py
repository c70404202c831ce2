"""``pdfleet-runtime router-front``: what clients of a deployment's endpoint reach, in front of its router.

sglang-router 0.3.2 holds a connection whatever the client sends and however slowly (1,500 half-sent
connections were held 30 s, a body trickling in 24 s), labels its metrics with the ``model`` a client
names (64 random names took its ``/metrics`` from 474 to 735 series), and, once its worker key is set,
wants that key from its clients too. vllm-router 0.1.17 serves its worker API (``/remove_worker``,
``/workers``, ...) on its serving port without a key. The front, on the router port, with the router
(either kind: ``routers.FrontedRouter``) on the pod's loopback:

- caps connections per source address and in all, closes a connection that spends ``idle_s`` outside a
  request (headers trickling in, idle keep-alive), and wants a body within ``read_s`` and ``max_body``;
- forwards only the router kind's serving routes (``routers.SURFACES``); the router's worker and control
  endpoints stay on its loopback (404 here);
- refuses (404 ``model_not_found``, OpenAI's shape) a request whose ``model`` is not the served name,
  and a body that is not JSON (400), before the router sees it: the router's labels take only the
  served name (or the router's own value for a request without one);
- adds ``Authorization: Bearer <worker key>`` to what it forwards where the router kind wants it
  (sglang-router; never the client's own header), and streams the router's answer back as it comes
  (server-sent events included);
- on SIGTERM drains (``Front.drain``): it keeps serving, each answer closing its connection, so clients move to
  another router pod; it stops listening once ``drain_s`` passed and no connection came for ``quiet_s`` (kube-proxy
  may send new ones here a while after the endpoint went) with none open, at most ``drain_max_s``; the router
  container's preStop sleep keeps the router up until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from pdfleet_runtime.front.routers import (
    FRONT_DRAIN_MAX_S,
    FRONT_DRAIN_S,
    FRONT_QUIET_S,
    SURFACES,
    FrontedRouter,
    RouterSurface,
)
from pdfleet_runtime.pod.worker_api import ApiError, load_json
from pdfleet_runtime.protocol.http_guard import GuardedServer, HttpLimits

__all__ = ["FRONT_LIMITS", "Front", "FrontSettings", "serve_front"]

log = logging.getLogger("pdfleet_runtime.front")

FRONT_LIMITS = HttpLimits(per_peer=256, total=8192, idle_s=10.0, read_s=10.0, exempt_loopback=False)
_PASS_HEADERS = ("Content-Type", "Accept", "X-Request-Id", "User-Agent")
_BACK_HEADERS = ("Content-Type", "Content-Encoding", "Cache-Control", "X-Request-Id", "Retry-After")


@dataclass(frozen=True)
class FrontSettings:
    router: FrontedRouter
    """The router behind the front: its serving routes and whether it wants the worker key."""
    served_model: str
    """The one model name the deployment serves (``spec.model.servedName``, else the deployment's name)."""
    upstream: str
    """The router on the pod's loopback, ``http://127.0.0.1:<port>``."""
    api_key: str | None
    """The worker key the router was started with, where it wants it from its clients; None for a router
    that wants none (``ValueError`` when this does not match the router kind)."""
    limits: HttpLimits = FRONT_LIMITS
    max_body: int = 4 << 20
    """A worker takes bodies up to 1 MiB; the router's own limit is 256 MiB."""
    upstream_timeout_s: float = 600.0
    """Longest wait for the router's next bytes of an answer (its own request timeout ends it sooner)."""
    drain_s: float = FRONT_DRAIN_S
    """After SIGTERM: how long it keeps serving at least, each answer closing its connection, before it stops
    listening; then until ``quiet_s`` passed with no new connection and none open, at most ``drain_max_s``."""
    quiet_s: float = FRONT_QUIET_S
    drain_max_s: float = FRONT_DRAIN_MAX_S

    def __post_init__(self) -> None:
        if self.surface.worker_key != (self.api_key is not None):
            raise ValueError(f"{self.router} router: " + ("it wants the worker key from its clients; give its file"
                             if self.surface.worker_key else "it takes no worker key; give none"))

    @property
    def surface(self) -> RouterSurface:
        return SURFACES[self.router]


@dataclass
class Front:
    settings: FrontSettings
    refused: dict[str, int] = field(default_factory=dict)
    """Requests answered here, by why (``route``, ``model``, ``body``, ``too_large``, ``slow_body``, ...)."""
    guard: GuardedServer | None = None
    _runner: web.AppRunner | None = None
    _server: asyncio.Server | None = None
    _session: aiohttp.ClientSession | None = None
    port: int = 0
    draining: bool = False
    """Set on SIGTERM: every answer closes its connection (``serve_front``)."""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); the port."""
        app = web.Application(client_max_size=self.settings.max_body)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0,
                                     keepalive_timeout=self.settings.limits.idle_s, lingering_time=self.settings.limits.linger_s)
        await self._runner.setup()
        assert self._runner.server is not None
        self.guard = GuardedServer(self._runner.server, self.settings.limits)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        self._server = await asyncio.get_running_loop().create_server(self.guard, sock=sock, backlog=1024)
        timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=self.settings.upstream_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        return self.port

    @property
    def connections(self) -> int:
        return self.guard.connections if self.guard is not None else 0

    async def drain(self) -> float:
        """Serve on (``draining``: each answer closes its connection) until ``drain_s`` passed, then until no
        connection came for ``quiet_s`` and none is open, at most ``drain_max_s``; the seconds it took."""
        s, began = self.settings, time.monotonic()
        while (waited := time.monotonic() - began) < s.drain_max_s:
            last = max(began, self.guard.accepted_at if self.guard is not None else 0.0)
            if waited >= s.drain_s and time.monotonic() - last >= s.quiet_s and self.connections == 0:
                break
            await asyncio.sleep(0.05)
        return time.monotonic() - began

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _refuse(self, why: str, status: int, message: str, *, code: str, param: str | None = None) -> web.Response:
        self.refused[why] = self.refused.get(why, 0) + 1
        resp = web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                            else "server_error", "param": param, "code": code}}, status=status)
        if why in ("too_large", "slow_body", "route") or self.draining:
            resp.force_close()  # a body left unread: closed after the answer (and ``linger_s`` of dropping it)
        return resp

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self.guard is not None
        with self.guard.busy(request.transport):
            return await self._request(request)

    async def _request(self, request: web.Request) -> web.StreamResponse:
        s = self.settings
        routes = s.surface.routes
        if request.path not in routes.get(request.method, frozenset()):
            served = ", ".join(f"{m} {p}" for m in sorted(routes) for p in sorted(routes[m]))
            return self._refuse("route", 404, f"{request.method} {request.path} is not served here (the endpoint "
                                f"serves {served})", code="not_found")
        body = b""
        if request.method == "POST":
            if request.content_length is None:
                return self._refuse("length", 411, "send the body with a Content-Length", code="length_required")
            if request.content_length > s.max_body:
                return self._refuse("too_large", 413, f"the body has {request.content_length} bytes, more than "
                                    f"{s.max_body}", code="request_too_large")
            try:
                async with asyncio.timeout(s.limits.read_s):
                    body = await request.content.readexactly(request.content_length)
            except TimeoutError:
                return self._refuse("slow_body", 408, f"the body did not arrive within {s.limits.read_s:g}s",
                                    code="request_timeout")
            except (asyncio.IncompleteReadError, ConnectionError):
                return self._refuse("slow_body", 400, "the body was cut short", code="invalid_request")
            try:
                data = load_json(body)
            except ApiError as e:
                return self._refuse("body", 400, e.message, code=e.code or "invalid_json")
            model = data.get("model") if isinstance(data, dict) else None
            if model is not None and model != s.served_model:
                shown = str(model)[:80]
                return self._refuse("model", 404, f"The model `{shown}` does not exist: this endpoint serves "
                                    f"`{s.served_model}`", code="model_not_found", param="model")
        return await self._forward(request, body)

    async def _forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        s = self.settings
        assert self._session is not None
        headers = {h: v for h in _PASS_HEADERS if (v := request.headers.get(h)) is not None}
        if s.api_key is not None:
            headers["Authorization"] = f"Bearer {s.api_key}"
        try:
            upstream = await self._session.request(request.method, s.upstream + request.path_qs, data=body or None,
                                                   headers=headers, allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError) as e:
            return self._refuse("upstream", 503, f"the router does not answer: {type(e).__name__}",
                                code="router_unavailable")
        async with upstream:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers={h: v for h in _BACK_HEADERS if (v := upstream.headers.get(h)) is not None})
            if upstream.headers.get("Content-Length") is not None and "text/event-stream" not in (
                    upstream.headers.get("Content-Type") or ""):
                resp.content_length = int(upstream.headers["Content-Length"])
            if self.draining:
                resp.force_close()  # the client's next request opens a connection: to another router pod
            await resp.prepare(request)
            with contextlib.suppress(aiohttp.ClientError, ConnectionError, TimeoutError):
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            await resp.write_eof()
        return resp


async def serve_front(settings: FrontSettings, host: str, port: int, stop: asyncio.Event | None = None) -> None:
    """Run the front until ``stop`` (or SIGTERM/SIGINT)."""
    import signal

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    front = Front(settings)
    bound = await front.start(host, port)
    log.info("router front on %s:%d -> %s (%s), serving model %s", host, bound, settings.upstream, settings.router,
             settings.served_model)
    try:
        await stop.wait()
        front.draining = True
        log.info("router front draining (%gs, then until %gs without a new connection and none open, at most %gs):"
                 " answers close their connections", settings.drain_s, settings.quiet_s, settings.drain_max_s)
        waited = await front.drain()
        log.info("router front drained after %.1fs; %d connection(s) still open", waited, front.connections)
    finally:
        await front.stop()
        log.info("router front stopped; refused %s", front.refused or "nothing")
